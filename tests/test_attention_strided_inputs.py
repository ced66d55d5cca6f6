"""Attention on inputs whose head dim is not innermost (a layout uneven gathers produce).

The first call of ``sdpfa_fwd``/``sdpfa_bwd`` in a program is checked and binds the raw
kernel; later calls go straight to it. The raw kernels need unit innermost strides, which the
checked call ensured but the bound calls did not: from the second call on, the CPU flash
kernel misread such inputs (found at 3 ranks, where a 4-head training stack's gathered q, k, v
had the sequence innermost: its losses drifted from PyTorch's after the first step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshfuse import DataType, FusionDefinition

B, H, S, E = 2, 4, 16, 8
SEQUENCE_INNERMOST = [3, 2, 0, 1]  # nvFuser's stride_order: 0 marks the innermost axis


def _fusion() -> FusionDefinition:
    with FusionDefinition() as fd:
        q, k, v, grad = (fd.define_tensor([B, H, S, E], dtype=DataType.Float,
                                          stride_order=SEQUENCE_INNERMOST) for _ in range(4))
        dropout_p = fd.define_scalar(0.0, dtype=DataType.Double)
        causal = fd.define_scalar(True, dtype=DataType.Bool)
        attn, lse, seed, offset = fd.ops.sdpfa_fwd(q, k, v, dropout_p, causal, scale=None)
        for t in (attn, *fd.ops.sdpfa_bwd(grad, q, k, v, attn, lse, dropout_p, causal, seed,
                                          offset, scale=None)):
            fd.add_output(t)
    return fd


def _sequence_innermost(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(2, 3).contiguous().transpose(2, 3)


def _reference(q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return [attn, *torch.autograd.grad(attn, (q, k, v), grad)]


def test_every_call_reads_inputs_whose_head_dim_is_strided():
    fd = _fusion()
    gen = torch.Generator().manual_seed(0)
    inputs = [_sequence_innermost(torch.randn(B, H, S, E, generator=gen)) for _ in range(4)]
    assert inputs[0].stride(-1) != 1
    expected = _reference(*inputs)
    for _ in range(3):  # the first call is checked; the later ones run the bound kernels
        for got, want in zip(fd.execute(inputs), expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_log_sumexp_is_laid_out_as_the_kernels_write_it():
    """q, k, v laid out [B, S, H, E] (a linear's output split into heads): attn follows q,
    the log-sum-exp is [B, H, S] row-major whatever q's layout (what the CUDA kernels write
    and what cuDNN's backward reads; laid out as q, it was copied on the way out of a
    forward and back on the way into its backward)."""
    bshe = [0, 2, 1, 3]  # axes outermost first: B, S, H, E
    with FusionDefinition() as fd:
        q, k, v = (fd.define_tensor([B, H, S, E], dtype=DataType.Float,
                                    stride_order=[3, 1, 2, 0]) for _ in range(3))
        attn, lse, _, _ = fd.ops.sdpfa_fwd(q, k, v, is_causal=True)
        fd.add_output(attn)
        fd.add_output(lse)
    assert "[0, 1, 2]" in next(line for line in fd.explain().splitlines()
                               if "sdpfa_fwd(...)[1]" in line)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, S, H, E, generator=gen).transpose(1, 2) for _ in range(3)]
    got_attn, got_lse = fd.execute(inputs)
    assert [got_attn.stride().index(s) for s in sorted(got_attn.stride(), reverse=True)] == bshe
    assert got_lse.is_contiguous()
    ref = F.scaled_dot_product_attention(*inputs, is_causal=True)
    torch.testing.assert_close(got_attn, ref, atol=1e-5, rtol=1e-5)
    scores = (inputs[0] @ inputs[1].transpose(-1, -2)) / E ** 0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(got_lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
