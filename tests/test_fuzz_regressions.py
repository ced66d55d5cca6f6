"""Named regressions: each program here once failed (wrong values, an untyped crash or a
refusal of a valid program), found by the fuzzer (``test_fuzz.py``) or reported in issue 11.

Every test runs at world sizes 1, 2 and 4 and compares each rank's outputs with plain torch
on the global tensors, sliced by ``shard_tensor``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from mesh_helpers import MX, mesh_1d, shard

from meshfuse import DataType, FusionDefinition, shard_tensor
from meshfuse.runtime.collectives import record_communications
from meshfuse.testing.utils import current_device

pytestmark = pytest.mark.mpi


def _check(multidevice_test, define: Callable, schedule: Callable, reference: Callable,
           shapes: list[list[int]], **tol) -> FusionDefinition:
    """Defines the fusion with ``define(fd) -> tensors``, pins them with
    ``schedule(tensors)``, runs it on this rank's shards and compares every output with
    ``reference(*global inputs)``."""
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s, generator=gen).to(current_device()) for s in shapes]
    with FusionDefinition() as fd:
        tensors = define(fd)
    schedule(tensors)
    fd.explain()  # builds: every tensor has its mesh
    rank = multidevice_test.rank
    local = [shard_tensor(x, tv, rank) if tv.mesh is None or rank in tv.mesh else None
             for x, tv in zip(inputs, fd.fusion.inputs())]
    outputs = fd.execute(local)
    with torch.no_grad():
        expected = reference(*inputs)
    for out, ref, tv in zip(outputs, expected, fd.fusion.outputs()):
        if tv.mesh is None or rank in tv.mesh:
            torch.testing.assert_close(out, shard_tensor(ref, tv, rank), **tol)
    return fd


def test_reduction_to_0d_then_pointwise(multidevice_test):
    """A sharded input reduced to a 0-d tensor, then more ops (was: AttributeError
    'NoneType' object has no attribute 'mesh' in propagation)."""
    mesh = mesh_1d(multidevice_test)

    def define(fd):
        x = fd.define_tensor([mesh.size], dtype=DataType.Float)
        y = fd.ops.atan(fd.ops.min(x, dims=[0]))
        fd.add_output(y)
        return x, y

    def schedule(t):
        shard(t[0], 0, mesh)

    _check(multidevice_test, define, schedule,
           lambda x: [torch.atan(torch.amin(x, dim=[0]))], [[mesh.size]])


def test_0d_result_on_a_sub_mesh(multidevice_test):
    """A full reduction on a mesh of some ranks: the ranks outside it do not run it."""
    mesh = mesh_1d(multidevice_test)
    half = type(mesh)(range(max(1, mesh.size // 2)))

    def define(fd):
        x = fd.define_tensor([4, 4], dtype=DataType.Float)
        y = fd.ops.exp(fd.ops.sum(x))
        fd.add_output(y)
        return x, y

    def schedule(t):
        shard(t[0], 1, half)

    _check(multidevice_test, define, schedule, lambda x: [torch.exp(torch.sum(x))], [[4, 4]])


def test_parallelize_broadcast_axis_on_a_mesh_axis_of_one_device(multidevice_test):
    """nvFuser's reduce-scatter test at world size 1: a static extent d == 1 is a broadcast
    axis, and parallelizing it over a mesh axis of one device is legal (was: ScheduleError)."""
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)

    def define(fd):
        x = fd.define_tensor([d, 4 * d], dtype=DataType.Float)
        y = fd.ops.sum(x, [0])
        fd.add_output(y)
        return x, y

    def schedule(t):
        x, y = t
        for tv in t:
            tv.set_device_mesh(mesh)
        x.axis(0).parallelize(MX)
        y.outer_split(-1, d)
        y.axis(-2).parallelize(MX)

    with record_communications() as comms:
        _check(multidevice_test, define, schedule, lambda x: [x.sum(0)], [[d, 4 * d]])
    kinds = [c.kind for c in comms if len(c.ranks) > 1]
    assert kinds == ([] if d == 1 else ["reduce_scatter"]), comms


def test_reduction_and_iteration_axis_on_one_mesh_axis_is_a_reduce_scatter(multidevice_test):
    """The reduction axis and an iteration axis of one tensor both on DIDx (nvFuser's way of
    writing a reduce-scatter; was: "DIDx is used twice")."""
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)

    def define(fd):
        x = fd.define_tensor([2 * d, 3, 4 * d], dtype=DataType.Float)
        y = fd.ops.sum(x, [0])
        fd.add_output(y)
        return x, y

    def schedule(t):
        x, y = t
        for tv in t:
            tv.set_device_mesh(mesh)
        x.outer_split(0, d)
        x.axis(0).parallelize(MX)
        y.outer_split(0, d)  # the reduction axis, as the input's
        y.axis(0).parallelize(MX)
        y.outer_split(-1, d)
        y.axis(-2).parallelize(MX)

    with record_communications() as comms:
        fd = _check(multidevice_test, define, schedule, lambda x: [x.sum(0)],
                    [[2 * d, 3, 4 * d]])
    kinds = [c.kind for c in comms if len(c.ranks) > 1]
    assert kinds == ([] if d == 1 else ["reduce_scatter"]), comms
    assert "DIDx" in repr(fd.fusion.outputs()[0])


def _attention_grads(causal: bool):
    def define(fd):
        q, k, v, grad = (fd.define_tensor([2, 4, 128, 32], dtype=DataType.Float)
                         for _ in range(4))
        attn, lse, seed, offset = fd.ops.sdpfa_fwd(q, k, v, 0.0, causal, None)
        grads = fd.ops.sdpfa_bwd(grad, q, k, v, attn, lse, 0.0, causal, seed, offset, None)
        for t in (attn, *grads):
            fd.add_output(t)
        return q, k, v, grad

    def reference(q, k, v, grad):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
            return [out.detach(), *torch.autograd.grad(out, leaves, grad)]

    return define, reference


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_sequence_sharded_attention_gradients(multidevice_test, causal):
    """sdpfa_fwd + sdpfa_bwd with only q, k, v and the output gradient pinned, the sequence
    outer-split over the ranks (was: right output, silently wrong q/k/v gradients: each rank
    used only its own key/value rows). The keys and values are gathered; the key/value
    gradients, sums over the query rows, are reduce-scattered. Causal attention gathers the
    query sequence too (was: a refusal)."""
    mesh = mesh_1d(multidevice_test)
    define, reference = _attention_grads(causal)

    def schedule(t):
        for tv in t:
            shard(tv, 2, mesh)

    with record_communications() as comms:
        _check(multidevice_test, define, schedule, reference, [[2, 4, 128, 32]] * 4,
               rtol=1e-4, atol=1e-4)
    kinds = sorted(c.kind for c in comms if len(c.ranks) > 1)
    if multidevice_test.size == 1:
        assert kinds == []
    elif not causal:
        assert kinds == ["allgather"] * 2 + ["reduce_scatter"] * 2, comms
    else:
        assert "reduce_scatter" not in kinds and "allgather" in kinds, comms
