"""Partial sums added: ``add``/``sub`` of partial sums over one mesh axis stay partial, and
one reduction follows (``TensorMeta.partial_axes``, the ops' shape rules, and propagation's
check that every addend is partial alike). Values against the unsharded program;
communications counted.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard

from meshfuse import DataType, FusionDefinition, shard_tensor
from meshfuse.ir.placement import Partial, placements
from meshfuse.ops.meta import tensor_meta
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

M, K, N = 6, 10, 4  # K = 10: uneven contraction shards at 4 ranks


def _products(fd, count: int = 2):
    """``count`` matmuls ``a_i [M, K] @ b_i [K, N]``: their inputs and results."""
    inputs, products = [], []
    for _ in range(count):
        a = fd.define_tensor([M, K], dtype=DataType.Float)
        b = fd.define_tensor([K, N], dtype=DataType.Float)
        inputs += [a, b]
        products.append(fd.ops.matmul(a, b))
    return inputs, products


def _contract_sharded(inputs, mesh, pt=MX, which=None):
    """Shards the contracted axis of each matmul's operands (``which``: the operand pairs
    to shard, default all): each product is a partial sum over ``pt``'s mesh axis."""
    for i in which if which is not None else range(len(inputs) // 2):
        shard(inputs[2 * i], 1, mesh, pt)
        shard(inputs[2 * i + 1], 0, mesh, pt)


def _run(fd, inputs, rank):
    """This rank's output (on the CPU), the global inputs, and the communications' kinds."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(M, K, generator=gen) if i % 2 == 0 else torch.randn(K, N, generator=gen)
              for i in range(len(inputs))]
    with record_communications() as comms:
        out, = fd.execute(_shards(values, inputs, rank))
    return out.cpu(), values, Counter(c.kind for c in comms)


def _shards(values, tvs, rank):
    """This rank's shards of the global ``values``, on its device (its GPU under NCCL)."""
    return [shard_tensor(v, tv, rank).to(current_device()) for v, tv in zip(values, tvs)]


def test_linear_ops_carry_their_arguments_reduction_axes():
    with FusionDefinition() as fd:
        _, (p, q) = _products(fd)
        x = fd.define_tensor([M, N], dtype=DataType.Float)
        carried = [fd.ops.add(p, q), fd.ops.sub(p, q), fd.ops.add(p, fd.ops.sum(x, [0]))]
        # neg and products with a number are linear too, but carrying saves no reduction
        not_carried = [fd.ops.add(p, x), fd.ops.add(p, 1.0), fd.ops.mul(p, q), fd.ops.neg(p),
                       fd.ops.mul(p, 2.0), fd.ops.exp(p), fd.ops.add(p, fd.ops.sum(x, [0, 1]))]
        fd.add_output(carried[0])
    assert tensor_meta(p).partial_axes == (K,)
    for tv in carried:
        assert len(tensor_meta(tv).partial_axes) == 1, tv
        reduction = [i for i in tv.logical if i.is_reduction]
        assert len(reduction) == 1 and all(s.is_reduction for s in tv.definition.id_map[
            reduction[0]])
    for tv in not_carried:
        assert tensor_meta(tv).partial_axes == (), tv


@pytest.mark.mpi
def test_sum_of_partial_sums_is_reduced_once(multidevice_test):
    """``(a0 @ b0 - a1 @ b1) + a2 @ b2``, each product partial: one allreduce."""
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        inputs, (p, q, r) = _products(fd, 3)
        o = fd.ops
        out = o.add(o.sub(p, q), r)
        fd.add_output(out)
    _contract_sharded(inputs, mesh)
    got, v, comms = _run(fd, inputs, multidevice_test.rank)
    expected = (v[0] @ v[1] - v[2] @ v[3]) + v[4] @ v[5]
    torch.testing.assert_close(got, expected)
    assert comms == (Counter({"allreduce": 1}) if multidevice_test.size > 1 else Counter())
    if multidevice_test.size > 1:
        assert isinstance(placements(fd.compiled()[out.definition.args[0]])[0], Partial)


@pytest.mark.mpi
def test_sum_of_partial_sums_reduce_scattered_into_a_shard(multidevice_test):
    """The sum pinned sharded on rows: one reduce-scatter (uneven rows at 4 ranks)."""
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        inputs, (p, q) = _products(fd)
        out = fd.ops.set(fd.ops.add(p, q))
        fd.add_output(out)
    _contract_sharded(inputs, mesh)
    shard(out, 0, mesh)
    got, v, comms = _run(fd, inputs, multidevice_test.rank)
    expected = v[0] @ v[1] + v[2] @ v[3]
    torch.testing.assert_close(got, shard_tensor(expected, out, multidevice_test.rank))
    assert comms == (Counter({"reduce_scatter": 1}) if multidevice_test.size > 1 else Counter())


@pytest.mark.mpi
def test_partial_sum_plus_complete_value_reduces_the_partial_first(multidevice_test):
    """``a0 @ b0`` partial plus ``a1 @ b1`` complete (its contraction is not sharded), plus a
    number: the complete value and the number are added once, after the one allreduce."""
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        inputs, (p, q) = _products(fd)
        fd.add_output(fd.ops.add(fd.ops.add(p, q), 1.5))
    _contract_sharded(inputs, mesh, which=[0])
    for tv in inputs[2:]:
        tv.set_device_mesh(mesh)
    got, v, comms = _run(fd, inputs, multidevice_test.rank)
    torch.testing.assert_close(got, v[0] @ v[1] + v[2] @ v[3] + 1.5)
    assert comms == (Counter({"allreduce": 1}) if multidevice_test.size > 1 else Counter())


@pytest.mark.mpi
def test_partial_sums_over_different_mesh_axes_are_reduced_apart(multidevice_test):
    """On a 2x2 mesh, one product partial over mesh axis 0 and one over mesh axis 1: not
    partial alike, each is reduced over its own mesh axis before the add."""
    mesh = mesh_2x2(multidevice_test)
    with FusionDefinition() as fd:
        inputs, (p, q) = _products(fd)
        fd.add_output(fd.ops.add(p, q))
    _contract_sharded(inputs, mesh, MY, which=[0])
    _contract_sharded(inputs, mesh, MX, which=[1])
    got, v, comms = _run(fd, inputs, multidevice_test.rank)
    torch.testing.assert_close(got, v[0] @ v[1] + v[2] @ v[3])
    assert comms == Counter({"allreduce": 2})


@pytest.mark.mpi
def test_gradient_of_a_replicated_input_used_by_column_parallel_matmuls(multidevice_test):
    """The backward of ``x @ w0.T`` and ``x @ w1.T`` (weights split by rows, x replicated):
    x's gradient is the sum of two partial sums, allreduced once (not twice)."""
    size = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        x = fd.define_tensor([M, K], dtype=DataType.Float)
        w0 = fd.define_tensor([4 * size, K], dtype=DataType.Float)
        w1 = fd.define_tensor([4 * size, K], dtype=DataType.Float)
        fd.add_output(fd.ops.linear(x, w0))
        fd.add_output(fd.ops.linear(x, w1))
    x.set_device_mesh(mesh)
    for w in (w0, w1):
        shard(w, 0, mesh)
    gen = torch.Generator().manual_seed(1)
    values = [torch.randn(M, K, generator=gen), *(torch.randn(4 * size, K, generator=gen)
                                                  for _ in range(2))]
    leaves = [t.requires_grad_() for t in _shards(values, (x, w0, w1), multidevice_test.rank)]
    y0, y1 = fd.as_autograd_function()(leaves)
    with record_communications() as comms:
        (y0.sum() + 2 * y1.sum()).backward()
    torch.testing.assert_close(leaves[0].grad.cpu(), (values[1].sum(0) + 2 * values[2].sum(0))
                               .expand(M, K))
    assert Counter(c.kind for c in comms) == (Counter({"allreduce": 1}) if size > 1
                                              else Counter())


def _bf16_products_summed(mesh, narrow: bool):
    """``cast(a0 @ b0 + a1 @ b1)``, bf16 operands, contraction sharded: the sum of the two
    bf16 partial products is float (nvFuser's promotion); cast back to bf16 (``narrow``) or
    kept float and the products cast up first. The result is pinned sharded on rows."""
    with FusionDefinition() as fd:
        inputs = [fd.define_tensor(shape, dtype=DataType.BFloat16)
                  for shape in ([M, K], [K, N]) * 2]
        p, q = (fd.ops.matmul(inputs[i], inputs[i + 1]) for i in (0, 2))
        if narrow:
            out = fd.ops.cast(fd.ops.add(p, q), DataType.BFloat16)
        else:
            out = fd.ops.add(fd.ops.cast(p, DataType.Float), fd.ops.cast(q, DataType.Float))
        fd.add_output(out)
    _contract_sharded(inputs, mesh)
    shard(out, 0, mesh)
    return fd, inputs, out


@pytest.mark.mpi
@pytest.mark.parametrize("narrow", [True, False], ids=["cast_down", "cast_up"])
def test_partial_sums_are_reduced_in_the_narrower_float_type(multidevice_test, narrow):
    """A cast to a narrower float carries partial sums (as DTensor's ``to`` keeps a Partial
    placement): bf16 products added in float, cast to bf16, are reduce-scattered in bf16
    (half the bytes of float); a cast up (bf16 to float) does not carry them: the products
    are reduced in bf16, before it. Values as the unsharded program's (bf16 tolerance)."""
    mesh = mesh_1d(multidevice_test)
    fd, inputs, out = _bf16_products_summed(mesh, narrow)
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(t.shape, generator=gen).to(torch.bfloat16) for t in
              (torch.empty(M, K), torch.empty(K, N)) * 2]
    rank = multidevice_test.rank
    with record_communications() as comms:
        got, = fd.execute(_shards(values, inputs, rank))
    products = [values[i].float() @ values[i + 1].float() for i in (0, 2)]
    expected = products[0] + products[1]
    assert got.dtype == (torch.bfloat16 if narrow else torch.float32)
    torch.testing.assert_close(got.float().cpu(), shard_tensor(expected, out, rank), rtol=5e-2,
                               atol=5e-2)
    size = multidevice_test.size
    bf16_sum = ("reduce_scatter", -(-M // size) * size * N * 2)  # rows padded to even shards
    # cast down: one reduce-scatter of the bf16 sum; cast up: one per bf16 product, before
    # its cast (float partial sums would send twice the bytes)
    plan = [bf16_sum] if narrow else [bf16_sum] * 2
    assert [(c.kind, c.bytes) for c in comms] == (plan if size > 1 else [])
