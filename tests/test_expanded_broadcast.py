"""Expanded broadcast axes, nvFuser's semantics: a new axis of ``broadcast_in_dim`` with an
extent above 1 has that extent where it is an output or reduced, and broadcasts against any
extent in a pointwise op (AlphaFold's triangle update masks a ``2 c`` channel tensor with a
mask broadcast to ``c`` channels). Values against plain PyTorch, unsharded and sharded at
world sizes 1, 2 and 4."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mesh_helpers import MX, MY, mesh_1d, shard

import meshfuse
from meshfuse import DataType, FusionDefinition
from meshfuse.errors import DefinitionError
from meshfuse.runtime.comm.collectives import record_communications


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_an_expanded_output_has_its_extent_and_repeats():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3], dtype=DataType.Float)
        y = fd.ops.broadcast_in_dim(x, shape=[2, 3, 4], broadcast_dims=[1])
        fd.add_output(y)
        fd.add_output(fd.ops.sum(y, [0, 2]))
        fd.add_output(fd.ops.add(y, y))
    assert [i.is_broadcast for i in y.materialized()] == [True, False, True]
    t = _randn(3)
    out, total, twice = fd.execute([t])
    expected = t[None, :, None].expand(2, 3, 4)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(total, 8 * t)  # summed over 2 x 4 copies
    torch.testing.assert_close(twice, 2 * expected)


def test_expanded_axis_broadcasts_against_another_extent():
    """A mask broadcast to 4 channels selects from a tensor of 8 (and of 1) channels, as
    in nvFuser; unary ops keep the expanded extent."""
    with FusionDefinition() as fd:
        mask = fd.define_tensor([2, 3], dtype=DataType.Bool)
        z = fd.define_tensor([2, 3, 8], dtype=DataType.Float)
        m = fd.ops.broadcast_in_dim(mask, shape=[2, 3, 4], broadcast_dims=[0, 1])
        fd.add_output(fd.ops.where(m, z, 0.0))
        fd.add_output(fd.ops.mul(fd.ops.cast(m, DataType.Float), z))
        fd.add_output(fd.ops.neg(fd.ops.cast(m, DataType.Float)))
    tm, tz = _randn(2, 3) > 0, _randn(2, 3, 8, seed=1)
    selected, product, negated = fd.execute([tm, tz])
    torch.testing.assert_close(selected, torch.where(tm[..., None], tz, 0.0))
    torch.testing.assert_close(product, tm[..., None].float() * tz)
    torch.testing.assert_close(negated, -tm[..., None].float().expand(2, 3, 4))


def test_expanded_extents_that_differ_are_refused():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3], dtype=DataType.Float)
        a = fd.ops.broadcast_in_dim(x, shape=[3, 4], broadcast_dims=[0])
        b = fd.ops.broadcast_in_dim(x, shape=[3, 5], broadcast_dims=[0])
        with pytest.raises(DefinitionError, match="expanded to 4.*expanded to 5"):
            fd.ops.add(a, b)


def test_gradient_through_an_expanded_broadcast():
    """w broadcast to [5, c] (expanded) scales z [7, c]: w's gradient sums over z's 7 rows;
    the 5 does not count."""
    with FusionDefinition() as fd:
        w = fd.define_tensor([4], dtype=DataType.Double)
        z = fd.define_tensor([7, 4], dtype=DataType.Double)
        fd.add_output(fd.ops.mul(fd.ops.broadcast_in_dim(w, shape=[5, 4], broadcast_dims=[1]),
                                 z))
    tw, tz = (t.double().requires_grad_() for t in (_randn(4), _randn(7, 4, seed=1)))
    out, = fd.as_autograd_function()([tw, tz])
    g = _randn(7, 4, seed=2).double()
    out.backward(g)
    rw, rz = (t.detach().clone().requires_grad_() for t in (tw, tz))
    (rw[None] * rz).backward(g)
    torch.testing.assert_close(tw.grad, rw.grad)
    torch.testing.assert_close(tz.grad, rz.grad)


def _triangle_update(n: int, c: int) -> tuple[FusionDefinition, list]:
    """A triangle multiplicative update (outgoing edges), written with fusion ops:
    ``z [b, i, j, c]`` normalized, gated into ``2 c`` channels, masked by ``mask [b, i, j]``
    broadcast to ``c`` channels, then ``out[b, i, j] = sum_k a[b, i, k] b[b, j, k]`` per
    channel."""
    with FusionDefinition() as fd:
        z = fd.define_tensor([2, n, n, c], dtype=DataType.Float)
        w_p = fd.define_tensor([2 * c, c], dtype=DataType.Float)
        w_g = fd.define_tensor([2 * c, c], dtype=DataType.Float)
        mask = fd.define_tensor([2, n, n], dtype=DataType.Bool)
        o = fd.ops
        zn = o.layer_norm(z)
        gated = o.mul(o.linear(zn, w_p), o.sigmoid(o.linear(zn, w_g)))
        m = o.broadcast_in_dim(mask, shape=[2, n, n, c], broadcast_dims=[0, 1, 2])
        gated = o.where(m, gated, 0.0)
        left = o.permute(o.slice(gated, [0, 0, 0, 0], [2, n, n, c]), [0, 3, 1, 2])
        right = o.permute(o.slice(gated, [0, 0, 0, c], [2, n, n, 2 * c]), [0, 3, 2, 1])
        fd.add_output(o.permute(o.matmul(left, right), [0, 2, 3, 1]))
    return fd, [z, w_p, w_g, mask]


def _triangle_reference(z, w_p, w_g, mask):
    zn = F.layer_norm(z, z.shape[-1:])
    gated = torch.where(mask[..., None], F.linear(zn, w_p) * F.linear(zn, w_g).sigmoid(), 0.0)
    c = z.shape[-1]
    return torch.einsum("bikc,bjkc->bijc", gated[..., :c], gated[..., c:])


@pytest.mark.mpi
def test_triangle_update_sharded_on_rows_and_columns(multidevice_test):
    """The update with z and the mask sharded on i over all ranks (1-D), or on i and j over
    a 2 x 2 mesh at 4 ranks, equals PyTorch's on the whole tensors; the expanded mask
    broadcasts against the gated 2 c channels on every rank."""
    d = multidevice_test.size
    n, c = 6, 4
    fd, (z, w_p, w_g, mask) = _triangle_update(n, c)
    if d == 4:
        mesh = meshfuse.DeviceMesh(torch.arange(4).reshape(2, 2))
        for tv in (z, mask):
            shard(tv, 1, mesh, MY)
            shard(tv, 2, mesh, MX)
    else:
        mesh = mesh_1d(multidevice_test)
        for tv in (z, mask):
            shard(tv, 1, mesh)
    for tv in (w_p, w_g):
        tv.set_device_mesh(mesh)
    values = [_randn(2, n, n, c), _randn(2 * c, c, seed=1), _randn(2 * c, c, seed=2),
              _randn(2, n, n, seed=3) > -0.5]
    inputs = [multidevice_test.shard_tensor(t.to(multidevice_test.device), tv)
              for t, tv in zip(values, (z, w_p, w_g, mask))]
    with record_communications() as comms:
        out, = fd.execute(inputs)
    expected = _triangle_reference(*values)
    torch.testing.assert_close(out.cpu(), multidevice_test.shard_tensor(
        expected, fd.fusion.outputs()[0]).cpu(), rtol=1e-5, atol=1e-5)
    assert (len(comms) > 0) == (d > 1)  # the contraction over k needs other ranks' rows


@pytest.mark.parametrize("extents", ["static", "symbolic"])
def test_broadcast_keeping_an_expanded_axis_keeps_its_extent(multidevice_test, extents):
    """``broadcast_in_dim`` with ``-1`` (keep) on an input axis that is an expanded broadcast
    keeps its extent: it made it 1, so the gradient of ``matmul(a, b).sum(0).sum(1)`` (the
    second sum's gradient expands the first's over b's columns, the first's keeps that
    axis) reached the matmul's gradient with a contracted extent of 1 and was refused
    (gradient fuzzer, heads seed 156 at 3 ranks). b's columns sharded, 7 of them (not
    dividing 2 or 4 ranks); gradients against torch's."""
    with FusionDefinition() as fd:
        shape = (lambda s: [-1] * len(s)) if extents == "symbolic" else list
        a = fd.define_tensor(shape([4, 5, 6]), dtype=DataType.Double)
        b = fd.define_tensor(shape([4, 6, 7]), dtype=DataType.Double)
        total = fd.ops.sum(fd.ops.sum(fd.ops.matmul(a, b), dims=[0]), dims=[1])
        fd.add_output(total)
    with FusionDefinition() as probe:  # the rule itself
        x = probe.define_tensor([3], dtype=DataType.Float)
        y = probe.ops.broadcast_in_dim(x, shape=[3, 5], broadcast_dims=[0])
        z = probe.ops.broadcast_in_dim(y, shape=[2, -1, -1], broadcast_dims=[1, 2])
    assert [i.extent for i in z.materialized()] == [2, 3, 5]
    mesh = mesh_1d(multidevice_test)
    shard(b, 2, mesh)
    a.set_device_mesh(mesh)
    rank = multidevice_test.rank
    glob = [torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 6, 7, dtype=torch.float64)]
    local = [meshfuse.shard_tensor(t, tv, rank).requires_grad_() for t, tv in zip(glob, (a, b))]
    (out,) = fd.as_autograd_function()(local)
    cotangent = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out.backward(cotangent)
    leaves = [t.clone().requires_grad_() for t in glob]
    torch.matmul(*leaves).sum(0).sum(1).backward(cotangent)
    for got, ref, tv in zip(local, leaves, (a, b)):
        torch.testing.assert_close(got.grad, meshfuse.shard_tensor(ref.grad, tv, rank))
