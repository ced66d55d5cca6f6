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
