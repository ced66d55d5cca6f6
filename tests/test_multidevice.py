"""Sharded fusions against their unsharded runs, at world sizes 1, 2 and 4 (real gloo ranks).

Every test defines a fusion twice: once unsharded (the reference, run on the global tensors)
and once with a mesh and a schedule on *every* tensor (so that nothing depends on sharding
propagation), run on each rank's shards. Each rank checks its outputs against the reference sliced
with ``shard_tensor(ref, tv, rank)``, checks that its input shards are the slices the schedule
means (computed independently of meshfuse), and gathers every rank's output shards to check
that they put the whole reference back together. No schedule here needs communication, and
each execution asserts that none ran.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import meshfuse.engine.runner
from meshfuse import (
    DataType,
    DeviceMesh,
    FusionDefinition,
    ParallelType,
    shard_tensor,
    unshard_tensor,
)
from meshfuse.examples.seed_sdpa import QkvFormat, random_inputs, reference
from meshfuse.passes.pipeline import compiled_for
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

pytestmark = pytest.mark.mpi

BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}
STRIDE_ORDER = {QkvFormat.BHSE: [3, 2, 1, 0], QkvFormat.BSHE: [3, 1, 2, 0]}


# ----- helpers ---------------------------------------------------------------------------

def _execute_locally(fd: FusionDefinition, inputs: list) -> list[torch.Tensor]:
    """``fd.execute(inputs)``, checking that no communication ran: every schedule in this
    file keeps each op local."""
    with record_communications() as comms:
        outputs = fd.execute(inputs)
    assert comms == [], f"expected no communication, got {comms}"
    return outputs


def _randn(*shape, seed=0, dtype=torch.float32):
    """The same global tensor on every rank, on this rank's device."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=current_device())


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of values, wherever each tensor lives."""
    return torch.equal(a.cpu(), b.cpu())


def _block(n: int, d: int, c: int) -> slice:
    """Block ``c`` of ``n`` indices split into ``d`` blocks as ``torch.chunk`` splits them
    (``ceil(n / d)`` each, shorter or empty at the end), computed independently of meshfuse."""
    size = -(-n // d)
    return slice(min(c * size, n), min((c + 1) * size, n))


def _close(a: torch.Tensor, b: torch.Tensor, **tol) -> None:
    torch.testing.assert_close(a.cpu(), b.cpu(), **tol)


def _tensors(fd: FusionDefinition):
    """The tensors of ``fd`` that need a schedule (0-d tensors, and attention's RNG state, a
    uint64 pair, are replicated anyway)."""
    return [tv for tv in fd.fusion.tensors() if tv.logical and tv.dtype is not DataType.UInt64]


def _schedule_all(fd: FusionDefinition, mesh: DeviceMesh, schedule: Callable) -> None:
    for tv in _tensors(fd):
        tv.set_device_mesh(mesh)
        schedule(tv)


def _position(tv, extent: int) -> int:
    """The loop position of the (unsplit) logical ID of ``tv`` with static ``extent``."""
    (id_,) = [i for i in tv.logical if i.extent == extent and not i.is_reduction]
    return tv.loop.index(id_)


def _did_split(tv, extent: int, parallel_type: ParallelType, factor: int, inner=False) -> None:
    """Splits the logical axis of ``extent`` by ``factor`` and parallelizes the part of
    extent ``factor`` (the outer one for a block shard, the inner one for a cyclic shard)."""
    pos = _position(tv, extent)
    tv.split(pos, factor, inner_split=inner)
    tv.axis(pos + 1 if inner else pos).parallelize(parallel_type)


def _gather(multidevice_test, local: torch.Tensor, tv) -> torch.Tensor:
    """The global tensor from every rank's ``local`` shard of ``tv`` (a collective)."""
    shards = multidevice_test.communicator.allgather_object(local.cpu())
    mesh = compiled_for(tv.fusion)[tv].mesh  # propagation may have given tv its mesh
    return unshard_tensor([shards[d] for d in mesh.device_ids], tv)


def _assert_shard(out: torch.Tensor, ref: torch.Tensor, tv, rank: int, **tol) -> None:
    """``out`` is ``rank``'s shard of ``ref`` under ``tv``: values, shape and memory order."""
    expected = shard_tensor(ref, tv, rank)
    _close(out.cpu(), expected, **tol)
    strides = [s for s, n in zip(out.stride(), out.shape) if n > 1]
    expected_strides = [s for s, n in zip(expected.stride(), expected.shape) if n > 1]
    assert strides == expected_strides, f"{tv.name}: strides {out.stride()}, expected " \
        f"{expected.stride()}"


def _run(multidevice_test, build: Callable, mesh: DeviceMesh, schedule: Callable,
         inputs: list, torch_ref: Callable | None = None):
    """Runs the fusion ``build`` defines unsharded on ``inputs`` and sharded by ``schedule``
    on this rank's shards; checks the sharded outputs against the unsharded ones.

    Args:
        build: ``build(fd)`` defines the fusion (inputs in the order of ``inputs``).
        schedule: ``schedule(tv)`` schedules one tensor (its mesh is set already).
        inputs: global tensors and scalars, the same on every rank.
        torch_ref: optional plain-PyTorch function of ``inputs`` giving the outputs, to check
            the unsharded run too.

    Returns:
        the sharded FusionDefinition, this rank's local inputs and its outputs.
    """
    inputs = [x.to(multidevice_test.device) if isinstance(x, torch.Tensor) else x
              for x in inputs]
    with FusionDefinition() as ref_fd:
        build(ref_fd)
    ref_outs = ref_fd.execute(inputs)
    if torch_ref is not None:
        for got, want in zip(ref_outs, torch_ref(*inputs)):
            _close(got, want)

    with FusionDefinition() as fd:
        build(fd)
    _schedule_all(fd, mesh, schedule)
    rank = multidevice_test.rank
    local = [multidevice_test.shard_tensor(x, tv) if isinstance(x, torch.Tensor) else x
             for x, tv in zip(inputs, fd.fusion.inputs())]
    outs = _execute_locally(fd, local)
    assert len(outs) == len(ref_outs)
    for out, ref, tv in zip(outs, ref_outs, fd.fusion.outputs()):
        _assert_shard(out, ref, tv, rank)
        _close(_gather(multidevice_test, out, tv), ref.cpu())
    return fd, local, outs


def _pointwise_and_reduction(shape):
    """``x`` and ``y`` of ``shape``: ``z = relu(x) * y + x``, ``sum(z, last axis)``,
    ``amax(z, last axis, keepdim)``."""
    def build(fd):
        x = fd.define_tensor(shape)
        y = fd.define_tensor(shape)
        z = fd.ops.add(fd.ops.mul(fd.ops.relu(x), y), x)
        fd.add_output(z)
        fd.add_output(fd.ops.sum(z, dims=[len(shape) - 1]))
        fd.add_output(fd.ops.max(z, dims=[len(shape) - 1], keepdim=True))

    def torch_ref(x, y):
        z = torch.relu(x) * y + x
        return [z, z.sum(-1), z.amax(-1, keepdim=True)]

    return build, torch_ref


def _require_size(multidevice_test, size: int) -> None:
    if multidevice_test.size != size:
        pytest.skip(f"needs world size {size} (a 2x2 mesh)")


# ----- the seed program: attention forward and backward --------------------------------

def _define_sdpa(fd, shape, stride_order):
    q, k, v, out_grad = [fd.define_tensor(shape, dtype=DataType.BFloat16,
                                          stride_order=stride_order) for _ in range(4)]
    dropout_p = fd.define_scalar(0.0, dtype=DataType.Double)
    is_causal = fd.define_scalar(True, dtype=DataType.Bool)
    attn, log_sumexp, seed, offset = fd.ops.sdpfa_fwd(q, k, v, dropout_p, is_causal, scale=None)
    grads = fd.ops.sdpfa_bwd(out_grad, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed,
                             offset, scale=None)
    for t in (attn, *grads):
        fd.add_output(t)
    return q, k, v, out_grad


def _check_sdpa(multidevice_test, fd, qkv_format, global_inputs, local_inputs):
    outputs = _execute_locally(fd, local_inputs)
    expected = reference(*global_inputs)
    for out, ref, tv in zip(outputs, expected, fd.fusion.outputs()):
        _assert_shard(out, ref, tv, multidevice_test.rank, **BF16_TOL)
        if qkv_format is QkvFormat.BSHE:
            assert out.transpose(1, 2).is_contiguous(), f"{out.stride()} is not BSHE"
        else:
            assert out.is_contiguous(), f"{out.stride()} is not BHSE"
    return outputs


@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
def test_sdpa_direct_style_loop_split(multidevice_test, qkv_format):
    """The seed with ``with FusionDefinition() as fd`` and tensor methods: heads split."""
    d, b, h, s, e = multidevice_test.size, 2, 4, 128, 64
    rank = multidevice_test.rank
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        q, k, v, out_grad = _define_sdpa(fd, [b, h, s, e // h], STRIDE_ORDER[qkv_format])
    for t in _tensors(fd):
        t.set_device_mesh(mesh)
        t.outer_split(1, d)
        t.axis(1).parallelize(ParallelType.mesh_x)
        if qkv_format is QkvFormat.BSHE:
            t.reorder({2: 3, 3: 2})
        t.set_allocation_as_loop()

    global_inputs = random_inputs(b, h, s, e)
    if qkv_format is QkvFormat.BSHE:
        global_inputs = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in global_inputs]
    local = [multidevice_test.shard_tensor(t, tv)
             for t, tv in zip(global_inputs, (q, k, v, out_grad))]
    heads = _block(h, d, rank)
    for x, t in zip(local, global_inputs):
        assert _equal(x, t[:, heads])
        assert (x if qkv_format is QkvFormat.BHSE else x.transpose(1, 2)).is_contiguous()
    _check_sdpa(multidevice_test, fd, qkv_format, global_inputs, local)


def _require_logical_device_axis(multidevice_test):
    if multidevice_test.size == 1:
        pytest.skip("a static extent d = 1 declares a broadcast axis, which cannot be "
                    "parallelized; test_logical_device_axis_symbolic covers world size 1")


@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
def test_sdpa_batch_as_logical_device_axis(multidevice_test, qkv_format):
    """Attention needs 4-D tensors, so the logical-DID-axis style shards its batch axis: the
    batch extent *is* the number of devices and axis 0 is parallelized without a split
    (local extent 1)."""
    _require_logical_device_axis(multidevice_test)
    d, h, s, e = multidevice_test.size, 2, 128, 32
    rank = multidevice_test.rank
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        q, k, v, out_grad = _define_sdpa(fd, [d, h, s, e // h], STRIDE_ORDER[qkv_format])
    for t in _tensors(fd):
        t.set_device_mesh(mesh)
        t.axis(0).parallelize(ParallelType.mesh_x)

    global_inputs = random_inputs(d, h, s, e, seed=1)
    if qkv_format is QkvFormat.BSHE:
        global_inputs = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in global_inputs]
    local = [multidevice_test.shard_tensor(t, tv)
             for t, tv in zip(global_inputs, (q, k, v, out_grad))]
    for x, t in zip(local, global_inputs):
        assert x.shape == (1, h, s, e // h)
        assert _equal(x, t[rank:rank + 1])
    _check_sdpa(multidevice_test, fd, qkv_format, global_inputs, local)


# ----- the logical DID axis style -------------------------------------------------------

def _logical_device_axis_fusion(first_extent):
    """``x, w`` of ``[first_extent, 3, 8]``: ``z = x * w + 1``, ``sum(z, 2)``,
    ``mean(z, 1, keepdim)``."""
    def build(fd):
        x = fd.define_tensor([first_extent, 3, 8])
        w = fd.define_tensor([first_extent, 3, 8])
        z = fd.ops.add(fd.ops.mul(x, w), 1.0)
        fd.add_output(z)
        fd.add_output(fd.ops.sum(z, dims=[2]))
        fd.add_output(fd.ops.mean(z, dims=[1], keepdim=True))

    def torch_ref(x, w):
        z = x * w + 1.0
        return [z, z.sum(2), z.mean(1, keepdim=True)]

    return build, torch_ref


def _check_logical_device_axis(multidevice_test, first_extent):
    d, rank = multidevice_test.size, multidevice_test.rank
    build, torch_ref = _logical_device_axis_fusion(first_extent)

    def schedule(tv):
        tv.axis(0).parallelize(ParallelType.mesh_x)

    inputs = [_randn(d, 3, 8, seed=2), _randn(d, 3, 8, seed=3)]
    _, local, outs = _run(multidevice_test, build, DeviceMesh(range(d)), schedule, inputs,
                          torch_ref)
    for x, t in zip(local, inputs):
        assert _equal(x, t[rank:rank + 1])
    assert [tuple(o.shape) for o in outs] == [(1, 3, 8), (1, 3), (1, 1, 8)]


def test_logical_device_axis_static(multidevice_test):
    """Tensors declared ``[d, 3, 8]`` with axis 0 on mesh_x: each rank holds ``[1, 3, 8]``;
    reductions over axes 1 and 2 (unsharded) run locally."""
    _require_logical_device_axis(multidevice_test)
    _check_logical_device_axis(multidevice_test, multidevice_test.size)


def test_logical_device_axis_symbolic(multidevice_test):
    """nvFuser's own ``test_pointwise`` form: axis 0 declared ``-1`` and parallelized on
    mesh_x without a split; its global extent is the mesh axis size, its local extent 1."""
    _check_logical_device_axis(multidevice_test, -1)


# ----- pointwise and reductions on 1-D meshes --------------------------------------------

def test_block_shard_outer_split(multidevice_test):
    d, rank = multidevice_test.size, multidevice_test.rank
    n = 8
    build, torch_ref = _pointwise_and_reduction([n, 6])
    inputs = [_randn(n, 6, seed=4), _randn(n, 6, seed=5)]
    _, local, outs = _run(
        multidevice_test, build, DeviceMesh(range(d)),
        lambda tv: _did_split(tv, n, ParallelType.mesh_x, d), inputs, torch_ref,
    )
    block = _block(n, d, rank)
    assert _equal(local[0], inputs[0][block])
    assert _equal(local[1], inputs[1][block])
    assert outs[1].shape == (len(range(n)[block]),)


def test_cyclic_shard_inner_split(multidevice_test):
    d, rank = multidevice_test.size, multidevice_test.rank
    n = 8

    def build_t(fd):  # reduce over axis 0 so that the sharded axis 1 survives
        x = fd.define_tensor([6, n])
        y = fd.define_tensor([6, n])
        z = fd.ops.sub(fd.ops.exp(x), y)
        fd.add_output(z)
        fd.add_output(fd.ops.sum(z, dims=[0]))
        fd.add_output(fd.ops.max(z, dims=[0], keepdim=True))

    def torch_ref_t(x, y):
        z = torch.exp(x) - y
        return [z, z.sum(0), z.amax(0, keepdim=True)]

    inputs = [_randn(6, n, seed=6), _randn(6, n, seed=7)]
    _, local, outs = _run(
        multidevice_test, build_t, DeviceMesh(range(d)),
        lambda tv: _did_split(tv, n, ParallelType.mesh_x, d, inner=True), inputs, torch_ref_t,
    )
    assert _equal(local[0], inputs[0][:, rank::d])
    _close(outs[1].cpu(), torch_ref_t(*inputs)[1][rank::d])


def test_two_splits_of_one_axis_on_a_1d_mesh(multidevice_test):
    """``[16]`` split by 2 (serial outer), then the inner ``8`` split by d on mesh_x: rank c
    holds ``{i : (i % 8) // ceil(8 / d) == c}``, two blocks (empty at 3 ranks' last)."""
    d, rank = multidevice_test.size, multidevice_test.rank

    def schedule(tv):
        pos = _position(tv, 16)
        tv.outer_split(pos, 2)        # [2, 8]
        tv.outer_split(pos + 1, d)    # [2, d, 8/d]
        tv.axis(pos + 1).parallelize(ParallelType.mesh_x)

    build, torch_ref = _pointwise_and_reduction([16, 3])
    inputs = [_randn(16, 3, seed=8), _randn(16, 3, seed=9)]
    _, local, _ = _run(multidevice_test, build, DeviceMesh(range(d)), schedule, inputs,
                       torch_ref)
    rows = [i for i in range(16) if (i % 8) // -(-8 // d) == rank]
    assert _equal(local[0], inputs[0][rows])


def test_mesh_listed_in_reverse_rank_order(multidevice_test):
    """``DeviceMesh([d-1, ..., 0])``: rank r sits at coordinate d-1-r, so it holds block
    d-1-r."""
    d, rank = multidevice_test.size, multidevice_test.rank
    n = 8
    build, torch_ref = _pointwise_and_reduction([n, 6])
    inputs = [_randn(n, 6, seed=29), _randn(n, 6, seed=30)]
    _, local, _ = _run(
        multidevice_test, build, DeviceMesh(list(reversed(range(d)))),
        lambda tv: _did_split(tv, n, ParallelType.mesh_x, d), inputs, torch_ref,
    )
    c = d - 1 - rank
    assert _equal(local[0], inputs[0][_block(n, d, c)])


def test_non_contiguous_local_view_is_accepted(multidevice_test):
    """Without a declared contiguity, a local shard that is a strided view of the global
    tensor (columns of a row-major tensor) is a valid input."""
    d, rank = multidevice_test.size, multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4 * d])
        fd.add_output(fd.ops.mul(fd.ops.relu(x), 2.0))
    _schedule_all(fd, DeviceMesh(range(d)),
                  lambda tv: _did_split(tv, 4 * d, ParallelType.mesh_x, d))
    t = _randn(3, 4 * d, seed=31)
    view = t[:, 4 * rank:4 * rank + 4]
    assert not view.is_contiguous() or d == 1
    (out,) = _execute_locally(fd, [view])
    _assert_shard(out, torch.relu(t) * 2.0, fd.fusion.outputs()[0], rank)


def test_unscheduled_tensor_next_to_a_sharded_one_is_propagated(multidevice_test):
    """Only the input is scheduled: the output inherits its sharding (DESIGN 3.2)."""
    d = multidevice_test.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([4 * d, 3])
        y = fd.ops.relu(x)
        fd.add_output(y)
    x.set_device_mesh(DeviceMesh(range(d)))
    _did_split(x, 4 * d, ParallelType.mesh_x, d)
    t = _randn(4 * d, 3, seed=32)
    (out,) = _execute_locally(fd, [multidevice_test.shard_tensor(t, x)])
    assert out.shape == (4, 3)
    _assert_shard(out, torch.relu(t), y, multidevice_test.rank)
    _close(_gather(multidevice_test, out, y), torch.relu(t))


# ----- 2-D meshes (world size 4 only) -----------------------------------------------------

MESH_2X2 = [[0, 1], [2, 3]]


def test_2x2_mesh_shards_two_axes(multidevice_test):
    """Axis 0 over mesh_y (mesh rows), axis 1 over mesh_x (mesh columns)."""
    _require_size(multidevice_test, 4)
    rank = multidevice_test.rank
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))

    def schedule(tv):
        _did_split(tv, 4, ParallelType.mesh_y, 2)
        _did_split(tv, 6, ParallelType.mesh_x, 2)

    def build(fd):  # reduce over a third, unsharded axis
        x = fd.define_tensor([4, 6, 5])
        y = fd.define_tensor([4, 6, 5])
        z = fd.ops.mul(fd.ops.tanh(x), y)
        fd.add_output(z)
        var, mean = fd.ops.var_mean(z, dims=[2])
        fd.add_output(var)
        fd.add_output(mean)

    inputs = [_randn(4, 6, 5, seed=10), _randn(4, 6, 5, seed=11)]
    _, local, outs = _run(multidevice_test, build, mesh, schedule, inputs)
    y, x = divmod(rank, 2)
    assert _equal(local[0], inputs[0][2 * y:2 * y + 2, 3 * x:3 * x + 3])
    assert outs[1].shape == (2, 3)


def test_2x2_mesh_only_mesh_y_used_is_replicated_along_mesh_x(multidevice_test):
    _require_size(multidevice_test, 4)
    rank = multidevice_test.rank
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    build, torch_ref = _pointwise_and_reduction([8, 6])
    inputs = [_randn(8, 6, seed=12), _randn(8, 6, seed=13)]
    _, local, outs = _run(
        multidevice_test, build, mesh, lambda tv: _did_split(tv, 8, ParallelType.mesh_y, 2),
        inputs, torch_ref,
    )
    y = rank // 2  # ranks 0, 1 hold rows 0..3; ranks 2, 3 rows 4..7
    assert _equal(local[0], inputs[0][4 * y:4 * y + 4])
    replicas = multidevice_test.communicator.allgather_object(outs[0].cpu())
    assert _equal(replicas[0], replicas[1]) and _equal(replicas[2], replicas[3])


def test_2x2_mesh_two_splits_of_one_axis(multidevice_test):
    """``[8]`` split by 2 on mesh_y, its inner part split by 2 on mesh_x (dp then tp): the
    rank at (y, x) holds rows ``4y + 2x + {0, 1}``."""
    _require_size(multidevice_test, 4)
    rank = multidevice_test.rank
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))

    def schedule(tv):
        pos = _position(tv, 8)
        tv.outer_split(pos, 2)
        tv.axis(pos).parallelize(ParallelType.mesh_y)
        tv.outer_split(pos + 1, 2)
        tv.axis(pos + 1).parallelize(ParallelType.mesh_x)

    build, torch_ref = _pointwise_and_reduction([8, 3])
    inputs = [_randn(8, 3, seed=14), _randn(8, 3, seed=15)]
    _, local, _ = _run(multidevice_test, build, mesh, schedule, inputs, torch_ref)
    y, x = divmod(rank, 2)
    assert _equal(local[0], inputs[0][4 * y + 2 * x:4 * y + 2 * x + 2])


# ----- reductions, broadcasts, symbolic extents, scalars ----------------------------------

@pytest.mark.parametrize("keepdim", [False, True], ids=["dropdim", "keepdim"])
@pytest.mark.parametrize("op", ["sum", "mean", "var_mean", "max"])
def test_reduction_over_unsharded_axis(multidevice_test, op, keepdim):
    """``[8, 6]`` sharded on axis 0 (block), reduced over axis 1; ``[6, 8]`` sharded on axis 1
    (cyclic), reduced over axis 0."""
    d = multidevice_test.size
    torch_fns = {"sum": lambda t, a: [t.sum(a, keepdim=keepdim)],
                 "mean": lambda t, a: [t.mean(a, keepdim=keepdim)],
                 "var_mean": lambda t, a: list(torch.var_mean(t, a, keepdim=keepdim)),
                 "max": lambda t, a: [t.amax(a, keepdim=keepdim)]}

    for shape, axis, inner in (([8, 6], 1, False), ([6, 8], 0, True)):
        def build(fd, shape=shape, axis=axis):
            x = fd.define_tensor(shape)
            outs = getattr(fd.ops, op)(x, dims=[axis], keepdim=keepdim)
            for o in outs if isinstance(outs, tuple) else (outs,):
                fd.add_output(o)

        x = _randn(*shape, seed=16)
        _, local, outs = _run(
            multidevice_test, build, DeviceMesh(range(d)),
            lambda tv, inner=inner: _did_split(tv, 8, ParallelType.mesh_x, d, inner=inner),
            [x], lambda x, axis=axis: torch_fns[op](x, axis),
        )
        rank = multidevice_test.rank
        assert _equal(local[0], x[:, rank::d] if inner else x[_block(8, d, rank)])
        held = len(range(rank, 8, d)) if inner else len(range(8)[_block(8, d, rank)])
        expected = [held if n == 8 else n for n in shape]
        expected[axis] = 1
        if not keepdim:
            del expected[axis]
        assert all(tuple(o.shape) == tuple(expected) for o in outs)


def test_sharded_tensor_against_replicated_broadcast(multidevice_test):
    """``x [8, 6]`` block-sharded on axis 0 plus ``b [1, 6]`` and times ``c [8, 1]``:
    ``b``'s broadcast axis stays replicated; ``c`` is sharded like ``x`` on axis 0."""
    d = multidevice_test.size

    def build(fd):
        x = fd.define_tensor([8, 6])
        b = fd.define_tensor([1, 6])
        c = fd.define_tensor([8, 1])
        fd.add_output(fd.ops.mul(fd.ops.add(x, b), c))

    def schedule(tv):
        if tv.logical[0].extent == 8:
            _did_split(tv, 8, ParallelType.mesh_x, d)

    rank = multidevice_test.rank
    inputs = [_randn(8, 6, seed=17), _randn(1, 6, seed=18), _randn(8, 1, seed=19)]
    _, local, _ = _run(multidevice_test, build, DeviceMesh(range(d)), schedule, inputs,
                       lambda x, b, c: [(x + b) * c])
    block = _block(8, d, rank)
    assert _equal(local[0], inputs[0][block]) and _equal(local[2], inputs[2][block])
    assert _equal(local[1], inputs[1])  # replicated: every rank holds all of b


def test_symbolic_extents_bound_from_local_sizes(multidevice_test):
    """``[-1, -1]``: the sharded axis's global extent is the local extent times the number of
    shards; block (outer) and cyclic (inner) splits of a symbolic axis."""
    d, rank = multidevice_test.size, multidevice_test.rank

    def build(fd):
        x = fd.define_tensor([-1, -1])
        y = fd.define_tensor([-1, -1])
        z = fd.ops.mul(fd.ops.sigmoid(x), y)
        fd.add_output(z)
        fd.add_output(fd.ops.sum(z, dims=[1]))

    def torch_ref(x, y):
        z = torch.sigmoid(x) * y
        return [z, z.sum(1)]

    for inner in (False, True):
        def schedule(tv, inner=inner):
            tv.split(0, d, inner_split=inner)
            tv.axis(1 if inner else 0).parallelize(ParallelType.mesh_x)

        inputs = [_randn(3 * d, 5, seed=20), _randn(3 * d, 5, seed=21)]
        _, local, outs = _run(multidevice_test, build, DeviceMesh(range(d)), schedule, inputs,
                              torch_ref)
        assert local[0].shape == (3, 5)
        assert _equal(local[0], inputs[0][rank::d] if inner else inputs[0][3 * rank:3 * rank + 3])
        assert outs[0].shape == (3, 5) and outs[1].shape == (3,)


def test_scalar_input(multidevice_test):
    d = multidevice_test.size

    def build(fd):
        x = fd.define_tensor([8, 4])
        alpha = fd.define_scalar(dtype=DataType.Double)
        fd.add_output(fd.ops.add(fd.ops.mul(x, alpha), x))

    rank = multidevice_test.rank
    x = _randn(8, 4, seed=22)
    _, local, _ = _run(multidevice_test, build, DeviceMesh(range(d)),
                       lambda tv: _did_split(tv, 8, ParallelType.mesh_x, d),
                       [x, 2.5], lambda x, a: [x * a + x])
    assert _equal(local[0], x[_block(8, d, rank)]) and local[1] == 2.5


# ----- the program cache ----------------------------------------------------------------------

def test_program_cache_reused_for_the_same_signature(multidevice_test, monkeypatch):
    d, rank = multidevice_test.size, multidevice_test.rank
    built = []
    original = meshfuse.engine.runner.build_program

    def counting(*args, **kwargs):
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(meshfuse.engine.runner, "build_program", counting)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 4])
        fd.add_output(fd.ops.mul(x, 3.0))
    _schedule_all(fd, DeviceMesh(range(d)), lambda tv: (
        tv.outer_split(0, d), tv.axis(0).parallelize(ParallelType.mesh_x)))
    (out_tv,) = fd.fusion.outputs()

    def run(rows, seed):
        t = _randn(rows * d, 4, seed=seed)
        local = multidevice_test.shard_tensor(t, x)
        assert _equal(local, t[rows * rank:rows * (rank + 1)])
        (out,) = _execute_locally(fd, [local])
        _assert_shard(out, t * 3.0, out_tv, multidevice_test.rank)

    run(2, 23)
    run(2, 24)  # same dtypes, shapes, strides: the cached program
    assert len(built) == 1
    run(3, 25)  # another local shape: a new program
    assert len(built) == 2
    run(2, 26)
    run(3, 27)
    assert len(built) == 2


# ----- the fixture's helpers ------------------------------------------------------------------

def test_fixture_unshard_tensor_with_a_tensorview(multidevice_test):
    """``multidevice_test.unshard_tensor(local, tv)`` is documented as a collective that
    returns the global tensor whose shards the ranks hold."""
    d = multidevice_test.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 3])
        fd.add_output(fd.ops.neg(x))
    _schedule_all(fd, DeviceMesh(range(d)), lambda tv: _did_split(tv, 8, ParallelType.mesh_x, d))
    t = _randn(8, 3, seed=28)
    local = multidevice_test.shard_tensor(t, x)
    _close(multidevice_test.unshard_tensor(local, x), t)
