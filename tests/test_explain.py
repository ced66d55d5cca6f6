"""``fd.explain()``: golden texts of the compact view, and the communications it lists (from
the definition alone) against those the program runs (``record_communications``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mesh_helpers import MY, shard

from meshfuse import DataType, DeviceMesh, FusionDefinition, shard_tensor
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention
from meshfuse.explain import explain, planned_communications
from meshfuse.passes.pipeline import compile as compile_fusion
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device


def _explained(fusion, world_size: int, rank: int) -> str:
    """The compact view of ``fusion`` compiled for ``world_size`` ranks, as ``rank`` sees it
    (in this one process: explaining needs no communicator)."""
    compiled = compile_fusion(fusion, world_size)
    return explain(compiled.fusion, compiled.allocations, rank, world_size)


def _mlp(mesh: DeviceMesh, tokens: int = 8) -> FusionDefinition:
    """The README's Megatron MLP: column- then row-parallel weights over ``mesh_x``."""
    with FusionDefinition() as fd:
        fd.x = fd.define_tensor([tokens, 16], dtype=DataType.Float)
        fd.w1 = fd.define_tensor([32, 16], dtype=DataType.Float)
        fd.w2 = fd.define_tensor([16, 32], dtype=DataType.Float)
        fd.h = fd.ops.gelu(fd.ops.linear(fd.x, fd.w1), approximate="tanh")
        fd.y = fd.ops.linear(fd.h, fd.w2)
        fd.add_output(fd.y)
    shard(fd.w1, 0, mesh)
    shard(fd.w2, 1, mesh)
    return fd


def _dp_tp(mesh: DeviceMesh, tokens: int = 8) -> FusionDefinition:
    """The MLP on a 2-D mesh: tokens split over ``mesh_y`` (data parallel), weights over
    ``mesh_x``; the output is wanted whole on every rank."""
    fd = _mlp(mesh, tokens)
    shard(fd.x, 0, mesh, MY)
    fd.y.set_device_mesh(mesh)
    return fd


def _sequence_parallel(mesh: DeviceMesh) -> FusionDefinition:
    """The MLP with its output split by tokens (a reduce-scatter, not an allreduce)."""
    fd = _mlp(mesh)
    shard(fd.y, 0, mesh)
    return fd


def _transpose_shards(mesh: DeviceMesh, shape: list[int] | None = None) -> FusionDefinition:
    """An input split by rows, its negation split by columns (an all-to-all)."""
    with FusionDefinition() as fd:
        fd.x = fd.define_tensor(shape or [8, 12], dtype=DataType.Float)
        fd.y = fd.ops.neg(fd.x)
        fd.add_output(fd.y)
    shard(fd.x, 0, mesh)
    shard(fd.y, 1, mesh)
    return fd


def _uneven_gather(mesh: DeviceMesh) -> FusionDefinition:
    """5 rows split over the ranks (3, 2 on two ranks; 2, 2, 1, 0 on four), gathered."""
    with FusionDefinition() as fd:
        fd.x = fd.define_tensor([5, 4], dtype=DataType.Float)
        fd.y = fd.ops.neg(fd.x)
        fd.add_output(fd.y)
    shard(fd.x, 0, mesh)
    fd.y.set_device_mesh(mesh)
    return fd


def _uneven_reduce_scatter(mesh: DeviceMesh) -> FusionDefinition:
    """A sum over 6 split columns, reduce-scattered into 5 split rows."""
    with FusionDefinition() as fd:
        fd.x = fd.define_tensor([5, 6], dtype=DataType.Float)
        fd.y = fd.ops.sum(fd.x, [1])
        fd.add_output(fd.y)
    shard(fd.x, 1, mesh)
    shard(fd.y, 0, mesh)
    return fd


def _from_one_device(mesh: DeviceMesh) -> FusionDefinition:
    """An input held by rank 0 alone, doubled as row shards over ``mesh``."""
    with FusionDefinition() as fd:
        fd.x = fd.define_tensor([8, 4], dtype=DataType.Float)
        fd.y = fd.ops.mul(fd.x, 2.0)
        fd.add_output(fd.y)
    fd.x.set_device_mesh(DeviceMesh([0]))
    shard(fd.y, 0, mesh)
    return fd


# ----- golden texts (one process; no program runs) -----------------------------------------

def test_the_seed_in_bshe_on_four_ranks():
    model = SeedAttention(QkvFormat.BSHE, DeviceMesh(range(4)), 2, 12, 1024, 768)
    model.define()
    assert _explained(model.fusion, 4, 1) == "\n".join([
        "rank 1 of 4, extents from the definition",
        "  placements: S(a) sharded on axis a (c: cyclic), P partial, R replicated; memory: axes outermost first",
        "  tensor  global             dtype     mesh          placements  local             memory        defined by",
        "  T0      [2, 12, 1024, 64]  BFloat16  [0, 1, 2, 3]  [S(1)]      [2, 3, 1024, 64]  [0, 2, 1, 3]  input",
        "  T1      [2, 12, 1024, 64]  BFloat16  [0, 1, 2, 3]  [S(1)]      [2, 3, 1024, 64]  [0, 2, 1, 3]  input",
        "  T2      [2, 12, 1024, 64]  BFloat16  [0, 1, 2, 3]  [S(1)]      [2, 3, 1024, 64]  [0, 2, 1, 3]  input",
        "  T3      [2, 12, 1024, 64]  BFloat16  [0, 1, 2, 3]  [S(1)]      [2, 3, 1024, 64]  [0, 2, 1, 3]  input",
        "  T4      [2, 12, 1024, 64]  BFloat16  [0, 1, 2, 3]  [S(1)]      [2, 3, 1024, 64]  [0, 2, 1, 3]  sdpfa_fwd(T0, T1, T2, is_causal=True)",
        "  T5      [2, 12, 1024]      Float     [0, 1, 2, 3]  [S(1)]      [2, 3, 1024]      [0, 2, 1]     sdpfa_fwd(...)[1]",
        "  T6      [2]                UInt64    [0, 1, 2, 3]  [R]         [2]               [0]           sdpfa_fwd(...)[2]",
        "  T7      []                 UInt64    [0, 1, 2, 3]  [R]         []                []            sdpfa_fwd(...)[3]",
        "  T8      [2, 12, 1024, 64]  BFloat16  [0, 1, 2, 3]  [S(1)]      [2, 3, 1024, 64]  [0, 2, 1, 3]  sdpfa_bwd(T3, T0, T1, T2, T4, T5, is_causal=True, seed=T6, offset=T7)",
        "  T9      [2, 12, 1024, 64]  BFloat16  [0, 1, 2, 3]  [S(1)]      [2, 3, 1024, 64]  [0, 2, 1, 3]  sdpfa_bwd(...)[1]",
        "  T10     [2, 12, 1024, 64]  BFloat16  [0, 1, 2, 3]  [S(1)]      [2, 3, 1024, 64]  [0, 2, 1, 3]  sdpfa_bwd(...)[2]",
        "outputs: T4, T8, T9, T10",
        "communications on rank 1: none",
    ])


def test_the_megatron_mlp_on_two_ranks():
    fd = _mlp(DeviceMesh(range(2)))
    assert _explained(fd.fusion, 2, 0) == "\n".join([
        "rank 0 of 2, extents from the definition",
        "  placements: S(a) sharded on axis a (c: cyclic), P partial, R replicated; memory: axes outermost first",
        "  tensor  global    dtype  mesh    placements  local     memory  defined by",
        "  T0      [8, 16]   Float  [0, 1]  [R]         [8, 16]   [0, 1]  input",
        "  T1      [32, 16]  Float  [0, 1]  [S(0)]      [16, 16]  [0, 1]  input",
        "  T2      [16, 32]  Float  [0, 1]  [S(1)]      [16, 16]  [0, 1]  input",
        "  T3      [8, 32]   Float  [0, 1]  [S(1)]      [8, 16]   [0, 1]  linear(T0, T1)",
        "  T4      [8, 32]   Float  [0, 1]  [S(1)]      [8, 16]   [0, 1]  gelu(T3, approximate='tanh')",
        "  T6      [8, 16]   Float  [0, 1]  [P]         [8, 16]   [0, 1]  linear(T4, T2)",
        "  T5      [8, 16]   Float  [0, 1]  [R]         [8, 16]   [0, 1]  reshard(T6)",
        "outputs: T5",
        "communications on rank 0:",
        "  T5 = reshard(T6): allreduce(sum) over mesh axis 0, ranks [0, 1], 512 B",
    ])


def test_the_readme_shows_what_explain_prints():
    # The quick start's own definition and schedule, for 2 ranks, previewed here: its
    # explain, overlap lines included, is the README's sample line for line.
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shown = readme.split("`print(fd.explain())` on rank 0 of the quick start's 2 ranks:")[1]
    shown = shown.split("```\n")[1]
    quick_start = readme.split("## Quick start")[1].split("```python\n")[1]
    definition = quick_start.split("torch.manual_seed(0)")[0]
    sized = "d = Communicator.instance().size"
    assert sized in definition, "the quick start no longer reads its world size so"
    namespace: dict = {}
    exec(definition.replace(sized, "d = 2"), namespace)  # noqa: S102 (the README's code)
    fd = namespace["fd"]
    assert shown.rstrip("\n") == fd.explain(world_size=2)
    assert shown.rstrip("\n").startswith(_explained(fd.fusion, 2, 0))


def test_a_2x2_mesh_with_symbolic_tokens():
    fd = _dp_tp(DeviceMesh(torch.arange(4).reshape(2, 2)), tokens=-1)
    assert _explained(fd.fusion, 4, 3) == "\n".join([
        "rank 3 of 4, extents from the definition",
        "  placements: S(a) sharded on axis a (c: cyclic), P partial, R replicated; memory: axes outermost first",
        "  tensor  global    dtype  mesh              placements    local       memory  defined by",
        "  T0      [s0, 16]  Float  [[0, 1], [2, 3]]  [S(0), R]     [s0/2, 16]  [0, 1]  input",
        "  T1      [32, 16]  Float  [[0, 1], [2, 3]]  [R, S(0)]     [16, 16]    [0, 1]  input",
        "  T2      [16, 32]  Float  [[0, 1], [2, 3]]  [R, S(1)]     [16, 16]    [0, 1]  input",
        "  T3      [s0, 32]  Float  [[0, 1], [2, 3]]  [S(0), S(1)]  [s0/2, 16]  [0, 1]  linear(T0, T1)",
        "  T4      [s0, 32]  Float  [[0, 1], [2, 3]]  [S(0), S(1)]  [s0/2, 16]  [0, 1]  gelu(T3, approximate='tanh')",
        "  T6      [s0, 16]  Float  [[0, 1], [2, 3]]  [S(0), P]     [s0/2, 16]  [0, 1]  linear(T4, T2)",
        "  T5      [s0, 16]  Float  [[0, 1], [2, 3]]  [R, R]        [s0, 16]    [0, 1]  reshard(T6)",
        "outputs: T5",
        "  s0 = axis 0 of T0 (symbolic)",
        "communications on rank 3:",
        "  T5 = reshard(T6): allreduce(sum) over mesh axis 1, ranks [2, 3], 32*s0 B",
        "  T5 = reshard(T6): allgather of axis 0 over mesh axis 0, ranks [1, 3], 32*s0 B",
    ])


# ----- what explain lists is what runs --------------------------------------------------

def _mesh_2d(size: int) -> DeviceMesh:
    return DeviceMesh(torch.arange(size).reshape(2 if size >= 4 else 1, -1))


PROGRAMS = {
    "megatron_mlp": lambda size: _mlp(DeviceMesh(range(size))),
    "dp_tp_2d_mesh": lambda size: _dp_tp(_mesh_2d(size)),
    "sequence_parallel": lambda size: _sequence_parallel(DeviceMesh(range(size))),
    "transpose_shards": lambda size: _transpose_shards(DeviceMesh(range(size))),
    "from_one_device": lambda size: _from_one_device(DeviceMesh(range(size))),
    # Extents the ranks do not divide: the collectives pad the shards, and explain says so.
    "uneven_gather": lambda size: _uneven_gather(DeviceMesh(range(size))),
    "uneven_reduce_scatter": lambda size: _uneven_reduce_scatter(DeviceMesh(range(size))),
    "uneven_all_to_all": lambda size: _transpose_shards(DeviceMesh(range(size)), [5, 7]),
}


@pytest.mark.mpi
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_listed_communications_are_those_that_run(multidevice_test, program):
    fd = PROGRAMS[program](multidevice_test.size)
    rank = multidevice_test.rank
    gen = torch.Generator().manual_seed(0)
    globals_ = [torch.randn([i.extent for i in tv.materialized()], generator=gen)
                for tv in fd.fusion.inputs()]
    inputs = [shard_tensor(t, tv, rank).to(current_device()) if tv.mesh is None or rank in tv.mesh
              else None for t, tv in zip(globals_, fd.fusion.inputs())]
    text = fd.explain()
    runner = fd._get_runner()
    planned = [p for p in planned_communications(runner.fusion, rank) if p.moves_data]
    with record_communications() as ran:
        fd.execute(inputs)
    assert [p.communication() for p in planned] == ran
    for p in planned:
        assert f"  {p}" in text.splitlines()
    if multidevice_test.size > 1 and program != "from_one_device":
        assert planned, text  # every case communicates once it has two ranks


@pytest.mark.mpi
def test_symbolic_extents_bound_by_the_inputs(multidevice_test):
    size, rank = multidevice_test.size, multidevice_test.rank
    fd = _dp_tp(_mesh_2d(size), tokens=-1)
    x, w1, w2 = (torch.randn(*s) for s in ((4 * size, 16), (32, 16), (16, 32)))
    inputs = [shard_tensor(t, tv, rank).to(current_device())
              for t, tv in zip((x, w1, w2), (fd.x, fd.w1, fd.w2))]
    without = fd.explain()
    assert "T0      [s0, 16]" in without
    text = fd.explain(inputs)
    assert f"T0      [{4 * size}, 16]" in text.splitlines()[3]
    assert "extents from the inputs" in text.splitlines()[0]
    with record_communications() as ran:
        fd.execute(inputs)
    listed = [line for line in text.splitlines() if line.startswith("  T5 = reshard(T6): ")]
    assert [line.split(": ", 1)[1].split(",")[0] for line in listed] == \
        [f"{c.kind}({c.reduce_op}) over mesh axis {c.mesh_axis}" if c.reduce_op
         else f"{c.kind} of axis 0 over mesh axis {c.mesh_axis}" for c in ran]
    assert [int(line.rsplit(", ", 1)[1].split(" ")[0]) for line in listed] == \
        [c.bytes for c in ran]


def test_verbose_adds_the_domains_and_the_program():
    fd = _mlp(DeviceMesh([0]))
    compact, verbose = fd.explain(), fd.explain(verbose=True)
    assert verbose.startswith(compact + "\n")
    assert "outer_split(" in verbose and "outer_split(" not in compact
    inputs = [torch.randn(8, 16), torch.randn(32, 16), torch.randn(16, 32)]
    text = fd.explain(inputs, verbose=True)
    assert "slot" not in text
    assert text.splitlines()[-1] == "  output T5: local shape [8, 16], strides [16, 1]"
