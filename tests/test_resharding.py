"""Resharding: every communication kind against the unsharded run, at world sizes 1, 2 and 4.

Each test defines a fusion twice: unsharded (the reference, run on the global tensors) and
sharded by pinning only what the case is about (propagation fills the rest). Each rank
compares its outputs with the reference sliced by ``shard_tensor(ref, tv, rank)`` and asserts
the communications that ran (``record_communications``): kinds, counts, reduce ops, mesh axes
and group ranks.

At world size 1 every mesh axis has one device: no communication may cross processes. meshfuse
still calls collectives over groups of one rank there (see
``test_a_mesh_axis_of_one_device_communicates_nothing``), so the per-kind tests compare only
the traffic between processes, which must be empty at size 1.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard

from meshfuse import (
    DataType,
    DeviceMesh,
    FusionDefinition,
    ParallelType,
    shard_tensor,
)
from meshfuse.ir.fusion import Reshard
from meshfuse.ir.placement import Replicate, Shard, placements
from meshfuse.parallel.context.explain import planned_context_parallel
from meshfuse.runtime.comm.collectives import Communication, record_communications
from meshfuse.testing.utils import current_device

pytestmark = pytest.mark.mpi



# ----- helpers ---------------------------------------------------------------------------

def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    """The same global tensor on every rank, on this rank's device (NCCL needs GPU tensors)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(current_device())


def _run(multidevice_test, build: Callable, schedule: Callable, inputs: list, **tol):
    """Runs ``build``'s fusion unsharded on ``inputs`` and sharded by ``schedule`` on this
    rank's shards; checks every output against the reference's shard.

    Args:
        build: ``build(fd)`` defines the fusion and returns its named tensors.
        schedule: ``schedule(t)`` pins tensors of the sharded fusion's namespace ``t``.

    Returns:
        The sharded fusion's namespace (with ``t.fd``), and the communications that ran.
    """
    with FusionDefinition() as ref_fd:
        build(ref_fd)
    expected = ref_fd.execute(inputs)
    with FusionDefinition() as fd:
        t = build(fd)
    t.fd = fd
    schedule(t)
    rank = multidevice_test.rank
    local = [shard_tensor(x, tv, rank) for x, tv in zip(inputs, fd.fusion.inputs())]
    with record_communications() as comms:
        outputs = fd.execute(local)
    for out, ref, tv in zip(outputs, expected, fd.fusion.outputs()):
        torch.testing.assert_close(out, shard_tensor(ref, tv, rank), **tol)
    return t, comms


def _traffic(comms: list[Communication]) -> list[tuple]:
    """(kind, reduce_op, mesh_axis, ranks) of each communication between processes."""
    return [(c.kind, c.reduce_op, c.mesh_axis, c.ranks) for c in comms if len(c.ranks) > 1]


def _expect(multidevice_test, comms, *kinds: str | tuple[str, str], mesh=None, pt=MX) -> None:
    """``comms`` are exactly ``kinds`` (a kind, or (kind, reduce_op)) in order, each over this
    rank's group along the mesh axis of ``pt``; none cross processes at size 1."""
    if multidevice_test.size == 1:
        assert _traffic(comms) == [], comms
        return
    mesh = mesh or mesh_1d(multidevice_test)
    axis = mesh.axis_of(pt)
    group = mesh.group_ranks(multidevice_test.rank, axis)
    want = []
    for k in kinds:
        kind, op = k if isinstance(k, tuple) else (k, "sum" if "reduce" in k else None)
        want.append((kind, op, axis, group))
    assert _traffic(comms) == want, comms


def _pointwise(shape: list[int]):
    def build(fd):
        x = fd.define_tensor(shape, dtype=DataType.Float)
        y = fd.ops.neg(x)
        fd.add_output(y)
        return SimpleNamespace(x=x, y=y)
    return build


def _reduction(shape: list[int], op: str, dims):
    def build(fd):
        x = fd.define_tensor(shape, dtype=DataType.Float)
        y = getattr(fd.ops, op)(x, dims=dims)
        fd.add_output(y)
        return SimpleNamespace(x=x, y=y)
    return build


# ----- one kind each, on a 1-D mesh ----------------------------------------------------------

@pytest.mark.parametrize("inner", [False, True], ids=["block", "cyclic"])
@pytest.mark.parametrize("axis", [0, 1])
def test_allgather_sharded_to_replicated(multidevice_test, axis, inner):
    mesh = mesh_1d(multidevice_test)

    def schedule(t):
        shard(t.x, axis, mesh, inner=inner)
        t.y.set_device_mesh(mesh)

    t, comms = _run(multidevice_test, _pointwise([8, 12]), schedule, [_randn(8, 12)])
    _expect(multidevice_test, comms, "allgather")
    assert placements(t.fd.compiled()[t.y]) == (Replicate(),)
    if multidevice_test.size > 1:  # this rank sends its shard (padded to the largest)
        d, shape = multidevice_test.size, [8, 12]
        shape[axis] = -(-shape[axis] // d)
        assert comms[0].bytes == shape[0] * shape[1] * 4


@pytest.mark.parametrize("output", ["pinned", "propagated"])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_allreduce_of_a_reduction_over_a_sharded_axis(multidevice_test, op, output):
    """The output pinned replicated, or left to propagation (a partial fusion output is
    reduced for the user)."""
    mesh = mesh_1d(multidevice_test)

    def schedule(t):
        shard(t.x, 1, mesh)
        if output == "pinned":
            t.y.set_device_mesh(mesh)

    t, comms = _run(multidevice_test, _reduction([8, 12], op, [1]), schedule, [_randn(8, 12)])
    _expect(multidevice_test, comms, ("allreduce", op))
    assert placements(t.fd.compiled()[t.y]) == (Replicate(),)


@pytest.mark.parametrize("dims", [[1], None], ids=["sharded_axis", "all_axes"])
def test_mean_over_a_sharded_axis_is_the_global_mean(multidevice_test, dims):
    mesh = mesh_1d(multidevice_test)
    x = _randn(8, 12)
    with FusionDefinition() as fd:
        xt = fd.define_tensor([8, 12], dtype=DataType.Float)
        fd.add_output(fd.ops.mean(xt, dims=dims))
    shard(xt, 1, mesh)
    with record_communications() as comms:
        out, = fd.execute([shard_tensor(x, xt, multidevice_test.rank)])
    torch.testing.assert_close(out, x.mean(dim=dims))
    _expect(multidevice_test, comms, ("allreduce", "sum"))


def test_var_mean_over_a_sharded_axis_gathers_its_input(multidevice_test):
    """var_mean cannot make partial results: the input is gathered (one allgather) and the
    variance and mean are computed on the whole axis, replicated. (Today propagation makes
    var_mean's outputs partial anyway, and the sharding check refuses the fusion.)"""
    mesh = mesh_1d(multidevice_test)
    x = _randn(8, 12)

    def build(fd):
        xt = fd.define_tensor([8, 12], dtype=DataType.Float)
        var, mean = fd.ops.var_mean(xt, dims=[1])
        fd.add_output(var)
        fd.add_output(mean)
        return SimpleNamespace(x=xt, var=var, mean=mean)

    t, comms = _run(multidevice_test, build, lambda t: shard(t.x, 1, mesh), [x])
    _expect(multidevice_test, comms, "allgather")
    assert placements(t.fd.compiled()[t.var]) == placements(t.fd.compiled()[t.mean]) == (Replicate(),)


@pytest.mark.parametrize("dims", [[1, 2], [0, 1]])
def test_reduction_over_sharded_and_unsharded_axes(multidevice_test, dims):
    mesh = mesh_1d(multidevice_test)
    _, comms = _run(multidevice_test, _reduction([4, 8, 12], "sum", dims),
                    lambda t: shard(t.x, 1, mesh), [_randn(4, 8, 12)])
    _expect(multidevice_test, comms, ("allreduce", "sum"))


def test_reduce_scatter_of_a_partial_sum_into_a_sharded_output(multidevice_test):
    mesh = mesh_1d(multidevice_test)

    def schedule(t):
        shard(t.x, 1, mesh)
        shard(t.y, 0, mesh)

    t, comms = _run(multidevice_test, _reduction([8, 12], "sum", [1]), schedule, [_randn(8, 12)])
    _expect(multidevice_test, comms, "reduce_scatter")
    assert placements(t.fd.compiled()[t.y]) == (Shard(0, None),)


def test_reduce_scatter_is_chosen_over_allreduce_and_slice(multidevice_test):
    """A partial sum feeding a pointwise op whose output is pinned sharded: the partial is
    reduce-scattered once (each rank receives its 8/d rows), not allreduced then sliced."""
    mesh = mesh_1d(multidevice_test)

    def build(fd):
        x = fd.define_tensor([8, 12], dtype=DataType.Float)
        y = fd.ops.mul(fd.ops.sum(x, dims=[1]), 2.0)
        fd.add_output(y)
        return SimpleNamespace(x=x, y=y)

    def schedule(t):
        shard(t.x, 1, mesh)
        shard(t.y, 0, mesh)

    t, comms = _run(multidevice_test, build, schedule, [_randn(8, 12)])
    _expect(multidevice_test, comms, "reduce_scatter")
    program, = t.fd._runner._programs.values()
    assert "allreduce" not in program.describe() and "slice" not in program.describe()


@pytest.mark.parametrize("inner", [False, True], ids=["block", "cyclic"])
def test_all_to_all_moves_a_shard_to_another_axis(multidevice_test, inner):
    mesh = mesh_1d(multidevice_test)

    def schedule(t):
        shard(t.x, 0, mesh, inner=inner)
        shard(t.y, 1, mesh, inner=inner)

    _, comms = _run(multidevice_test, _pointwise([8, 12]), schedule, [_randn(8, 12)])
    _expect(multidevice_test, comms, "all_to_all")


def test_replicated_to_sharded_is_a_local_slice(multidevice_test):
    mesh = mesh_1d(multidevice_test)

    def schedule(t):
        t.x.set_device_mesh(mesh)
        shard(t.y, 1, mesh)

    t, comms = _run(multidevice_test, _pointwise([8, 12]), schedule, [_randn(8, 12)])
    assert comms == []
    if multidevice_test.size > 1:
        program, = t.fd._runner._programs.values()
        assert "slice of axis 1" in program.describe()


def test_no_communication_where_shardings_agree(multidevice_test):
    mesh = mesh_1d(multidevice_test)

    def build(fd):
        x = fd.define_tensor([8, 12], dtype=DataType.Float)
        bias = fd.define_tensor([1, 12], dtype=DataType.Float)
        y = fd.ops.sum(fd.ops.exp(fd.ops.add(x, bias)), dims=[1], keepdim=True)
        fd.add_output(fd.ops.permute(y, [1, 0]))
        return SimpleNamespace(x=x)

    t, comms = _run(multidevice_test, build, lambda t: shard(t.x, 0, mesh),
                    [_randn(8, 12), _randn(1, 12, seed=1)])
    assert comms == []
    assert not any(isinstance(e, Reshard) for e in t.fd.compiled().fusion.exprs), t.fd.explain()


@pytest.mark.parametrize("target", ["replicated", "sharded_axis_0"])
def test_explicit_set_reshards_in_the_middle_of_a_fusion(multidevice_test, target):
    mesh = mesh_1d(multidevice_test)

    def build(fd):
        x = fd.define_tensor([8, 12], dtype=DataType.Float)
        z = fd.ops.set(fd.ops.neg(x))
        fd.add_output(fd.ops.exp(z))
        return SimpleNamespace(x=x, z=z)

    def schedule(t):
        shard(t.x, 1, mesh)
        if target == "replicated":
            t.z.set_device_mesh(mesh)
        else:
            shard(t.z, 0, mesh)

    _, comms = _run(multidevice_test, build, schedule, [_randn(8, 12)])
    _expect(multidevice_test, comms, "allgather" if target == "replicated" else "all_to_all")


def test_one_gather_serves_every_consumer_that_needs_it(multidevice_test):
    """x is sharded on tokens and read by two column-parallel linears that both need it
    whole: one allgather feeds both (not one per consumer)."""
    mesh = mesh_1d(multidevice_test)

    def build(fd):
        x = fd.define_tensor([8, 12], dtype=DataType.Float)
        w1, w2 = (fd.define_tensor([n, 12], dtype=DataType.Float) for n in (4, 8))
        y1, y2 = fd.ops.linear(x, w1), fd.ops.linear(x, w2)
        fd.add_output(y1)
        fd.add_output(y2)
        return SimpleNamespace(x=x, w1=w1, w2=w2, y1=y1, y2=y2)

    def schedule(t):
        shard(t.x, 0, mesh)
        for tv in (t.w1, t.w2):
            shard(tv, 0, mesh)
        for tv in (t.y1, t.y2):
            shard(tv, 1, mesh)

    t, comms = _run(multidevice_test, build, schedule,
                    [_randn(8, 12), _randn(4, 12, seed=1), _randn(8, 12, seed=2)])
    _expect(multidevice_test, comms, "allgather")
    assert sum(isinstance(e, Reshard) for e in t.fd.compiled().fusion.exprs) == 1, t.fd.explain()


# ----- attention -------------------------------------------------------------------------

B, HEADS, S, E = 2, 2, 8, 4


def _attention(is_causal: bool):
    def build(fd):
        q, k, v = (fd.define_tensor([B, HEADS, S, E], dtype=DataType.Float) for _ in range(3))
        attn, _, _, _ = fd.ops.sdpfa_fwd(q, k, v, 0.0, is_causal)
        fd.add_output(attn)
        return SimpleNamespace(q=q, k=k, v=v, attn=attn)
    return build


def _qkv():
    return [_randn(B, HEADS, S, E, seed=i) for i in range(3)]


def test_causal_attention_with_a_sharded_query_sequence_gathers_it(multidevice_test):
    """q, k and v sharded alike on the sequence: causal attention runs context-parallel (it
    used to refuse, then gathered q too): q stays sharded, and the communications are those
    of the strategy the cost estimate picks, as explain plans them (docs/context_parallel.md)."""
    mesh = mesh_1d(multidevice_test)

    def schedule(t):
        for tv in (t.q, t.k, t.v):
            shard(tv, 2, mesh)

    t, comms = _run(multidevice_test, _attention(is_causal=True), schedule, _qkv(),
                    rtol=1e-5, atol=1e-5)
    planned = planned_context_parallel(t.fd.compiled().fusion, multidevice_test.rank)
    assert comms == [c for p in planned for c in p.communications()], comms
    assert len(planned) == (multidevice_test.size > 1)


@pytest.mark.parametrize("q_sharded", [True, False], ids=["q_sharded", "q_replicated"])
def test_non_causal_attention_gathers_sharded_keys_and_values(multidevice_test, q_sharded):
    """K and V sharded on the sequence: with q replicated each is gathered once; with q
    sharded alike the attention runs context-parallel (the communications of the strategy
    the estimate picks, as explain plans them). The output follows q."""
    mesh = mesh_1d(multidevice_test)

    def schedule(t):
        if q_sharded:
            shard(t.q, 2, mesh)
        for tv in (t.k, t.v):
            shard(tv, 2, mesh)

    t, comms = _run(multidevice_test, _attention(is_causal=False), schedule, _qkv(),
                    rtol=1e-5, atol=1e-5)
    planned = planned_context_parallel(t.fd.compiled().fusion, multidevice_test.rank)
    if q_sharded:
        assert comms == [c for p in planned for c in p.communications()], comms
        assert len(planned) == (multidevice_test.size > 1)
    else:
        assert not planned
        _expect(multidevice_test, comms, "allgather", "allgather")
    assert isinstance(placements(t.fd.compiled()[t.attn])[0], Shard if q_sharded else Replicate)


# ----- a 2x2 mesh: each kind along mesh_x and along mesh_y -------------------------------------

def _other(pt: ParallelType) -> ParallelType:
    return MY if pt is MX else MX


def _schedule_2x2(kind: str, mesh: DeviceMesh, pt: ParallelType):
    """Axis 0 of [4, 8, 12] stays sharded on the other mesh axis; ``pt`` does ``kind``."""
    def schedule(t):
        shard(t.x, 0, mesh, _other(pt))
        if kind != "slice":
            shard(t.x, 1 if kind == "all_to_all" else 2, mesh, pt)
        if kind in ("allgather", "reduce_scatter", "all_to_all", "slice"):
            shard(t.y, 0, mesh, _other(pt))
        if kind in ("all_to_all", "slice"):
            shard(t.y, 2, mesh, pt)
        if kind == "reduce_scatter":
            shard(t.y, 1, mesh, pt)
    return schedule


@pytest.mark.parametrize("pt", [MX, MY], ids=["mesh_x", "mesh_y"])
@pytest.mark.parametrize("kind", ["allgather", "allreduce", "reduce_scatter", "all_to_all",
                                  "slice"])
def test_2x2_mesh_each_kind_along_one_mesh_axis(multidevice_test, kind, pt):
    mesh = mesh_2x2(multidevice_test)
    reduces = kind in ("allreduce", "reduce_scatter")
    build = _reduction([4, 8, 12], "sum", [2]) if reduces else _pointwise([4, 8, 12])
    t, comms = _run(multidevice_test, build, _schedule_2x2(kind, mesh, pt), [_randn(4, 8, 12)])
    _expect(multidevice_test, comms, *([] if kind == "slice" else [kind]), mesh=mesh, pt=pt)
    # the other mesh axis keeps its shard of axis 0 throughout
    assert placements(t.fd.compiled()[t.y])[mesh.axis_of(_other(pt))] == Shard(0, None)


# ----- a mesh axis of one device -----------------------------------------------------------

@pytest.mark.parametrize("kind", ["allgather", "allreduce"])
def test_a_mesh_axis_of_one_device_communicates_nothing(multidevice_test, kind):
    """mesh_x of a [d, 1] mesh has one device: a shard on it is the whole axis and a partial
    result on it is complete, so no collective should be called (today one is, over a group
    of one rank: runtime.resharding.plan_resharding keeps steps of size-1 mesh axes)."""
    d = multidevice_test.size
    mesh = DeviceMesh(torch.arange(d).reshape(d, 1))
    build = _pointwise([8, 12]) if kind == "allgather" else _reduction([8, 12], "sum", [1])

    def schedule(t):
        shard(t.x, 1, mesh, MX)
        t.y.set_device_mesh(mesh)

    _, comms = _run(multidevice_test, build, schedule, [_randn(8, 12)])
    assert comms == []


def test_a_reduced_output_read_by_later_ops_is_reduced_once(multidevice_test):
    """A column sum over sharded rows that is both a fusion output and read by a later op
    (``x - sum``): one allreduce serves both (the later op reads the output), where the
    engine used to reduce the same partial value twice. 11 rows: uneven shards."""
    size, rank = multidevice_test.size, multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([11, 6], dtype=DataType.Float)
        total = fd.ops.sum(x, dims=[0])
        centered = fd.ops.sub(x, fd.ops.broadcast_in_dim(total, [11, 6], [1]))
        fd.add_output(total)
        fd.add_output(centered)
    shard(x, 0, mesh_1d(multidevice_test))
    gx = torch.randn(11, 6, generator=torch.Generator().manual_seed(0))
    with record_communications() as comms:
        got_total, got_centered = fd.execute([shard_tensor(gx, x, rank).to(current_device())])
    torch.testing.assert_close(got_total.cpu(), gx.sum(0))
    torch.testing.assert_close(got_centered.cpu(), shard_tensor(gx - gx.sum(0), centered, rank))
    assert [(c.kind, c.reduce_op, c.bytes) for c in comms] == \
        ([("allreduce", "sum", 6 * 4)] if size > 1 else [])
