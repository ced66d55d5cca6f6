"""Query projections split over ranks that do not divide the heads: the rows of a ``[H*D, E]``
weight split 11, 11, 10 (8 heads of 4 over 3 ranks) are gathered before the reshape into
heads, which the build reports (a warning, once, and ``explain``); the head-aligned form, a
``[H, D, E]`` weight split on its heads given to ``linear``, keeps the heads sharded 3, 3, 2
forward and backward with no communication in the forward.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from mesh_helpers import mesh_1d, shard

from meshfuse import DataType, FusionDefinition, shard_tensor
from meshfuse.passes.head_alignment import HeadSplitWarning
from meshfuse.runtime.comm.collectives import record_communications

pytestmark = pytest.mark.mpi

H, D, B, S, E = 8, 4, 2, 3, 6


def _merged_projection():
    with FusionDefinition() as fd:
        x = fd.define_tensor([B, S, E], dtype=DataType.Float)
        w = fd.define_tensor([H * D, E], dtype=DataType.Float)
        q = fd.ops.reshape(fd.ops.linear(x, w), [B, S, H, D])
        fd.add_output(fd.ops.exp(fd.ops.permute(q, [0, 2, 1, 3])))
    return fd, x, w


def test_split_off_the_head_boundaries_is_reported_once(multidevice_test):
    d = multidevice_test.size
    fd, x, w = _merged_projection()
    shard(w, 0, mesh_1d(multidevice_test))
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, S, E, generator=gen), torch.randn(H * D, E, generator=gen)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        local = [shard_tensor(t, tv) for t, tv in zip(inputs, (x, w))]
        (out,) = fd.execute(local)
        fd.execute(local)
        text = fd.explain()
    expected = torch.nn.functional.linear(*inputs).unflatten(2, (H, D)).transpose(1, 2).exp()
    torch.testing.assert_close(out, shard_tensor(expected, fd.fusion.outputs()[0]))
    reported = [str(c.message) for c in caught if issubclass(c.category, HeadSplitWarning)]
    if H % d == 0:
        assert reported == [] and "notes:" not in text
        return
    rows = -(-H * D // d)
    assert len(reported) == 1, reported  # once, whatever was built and run
    assert f"T2 axis 2 (32 = 8 x 4) is split over {d} ranks as {rows}, " in reported[0]
    assert "a weight [8, 4, ...] sharded on its first axis" in reported[0]
    assert "notes:" in text and reported[0] in text


def test_head_aligned_weights_keep_the_heads_sharded(multidevice_test):
    """``linear(x, w[H, D, E])`` with w split on its heads (3, 3, 2 at 3 ranks): no
    communication in the forward, the gradients equal torch's, x's reduced once."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([B, S, E], dtype=DataType.Float)
        w = fd.define_tensor([H, D, E], dtype=DataType.Float)
        q = fd.ops.linear(x, w)  # [H, B, S, D]
        fd.add_output(fd.ops.exp(fd.ops.permute(q, [1, 0, 2, 3])))
    shard(w, 0, mesh_1d(multidevice_test))
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(B, S, E, generator=gen), torch.randn(H, D, E, generator=gen)]
    function = fd.as_autograd_function()
    local = [shard_tensor(t, tv).requires_grad_() for t, tv in zip(inputs, (x, w))]
    with warnings.catch_warnings():
        warnings.simplefilter("error", HeadSplitWarning)
        with record_communications() as forward:
            (out,) = function(local)
    grad = torch.randn(B, H, S, D, generator=gen)
    with record_communications() as backward:
        out.backward(shard_tensor(grad, fd.fusion.outputs()[0]))
    ref = [t.clone().requires_grad_() for t in inputs]
    expected = torch.einsum("bse,hde->bhsd", *ref).exp()
    expected.backward(grad)
    torch.testing.assert_close(out, shard_tensor(expected.detach(), fd.fusion.outputs()[0]))
    for t, r, tv in zip(local, ref, (x, w)):
        torch.testing.assert_close(t.grad, shard_tensor(r.grad, tv), rtol=1e-5, atol=1e-5)
    assert [c for c in forward if len(c.ranks) > 1] == []
    assert [c.kind for c in backward if len(c.ranks) > 1] == \
        (["allreduce"] if multidevice_test.size > 1 else [])
