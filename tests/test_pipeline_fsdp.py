"""Pipeline x fully sharded data parallelism (x tensor parallelism): each stage's devices
are a ``dp x tp`` grid; each ``dp`` row runs the Llama example's fusions (tensor parallel
over the row) on its share of every microbatch's rows, the stage's parameters sharded over
``dp`` (:class:`~meshfuse.parallel.stages.ShardedStage`): gathered once per step and stage,
gradients reduce-scattered once per step and stage. The device at coordinate c of one stage
sends to coordinate c of the next; the losses are those of the one-device model.

PP2 x FSDP2 runs at 4 ranks, PP2 x FSDP2 x TP2 at 8 (``--world-sizes 8``). The other choice,
fusions that gather their own parameters at every call (a FullyShardedModule per fusion,
once per microbatch), runs at 4 ranks."""

from __future__ import annotations

import pytest
import torch

from meshfuse import DeviceMesh
from meshfuse.errors import InputError
from meshfuse.examples.llama import LlamaConfig
from meshfuse.examples.llama_stages import (
    FusionStage,
    batches,
    create_stage_groups,
    grid_share,
    llama_pieces,
    model,
    sharded_fusion_stage,
    train_pipelined,
    train_single,
)
from meshfuse.parallel.fsdp import NamedMesh
from meshfuse.parallel.stages import PipelineRunner, ShardedStage, schedule, stage_bounds
from meshfuse.runtime.comm.collectives import Group, record_communications
from meshfuse.runtime.comm.communicator import Communicator

CFG = LlamaConfig(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, seq=8)
BATCH, STEPS, M = 8, 10, 4


def _grids(world: int, tp: int) -> list[DeviceMesh]:
    """Two stages, each a 2 x tp grid of the world's halves."""
    half = world // 2
    return [DeviceMesh(torch.arange(s * half, (s + 1) * half).reshape(2, tp)) for s in (0, 1)]


def _train_sharded(name: str, grids: list[DeviceMesh], steps: int):
    """Losses (this rank's rows; None off the last stage) and each step's communications."""
    rank = Communicator.instance().rank
    create_stage_groups(grids)
    plan = schedule(name, 2, M)
    stage_ranks = [g.devices.flatten().tolist() for g in grids]
    mine = next(r for r, ranks in enumerate(stage_ranks) if rank in ranks)
    pieces = llama_pieces(model(CFG))
    bounds = stage_bounds([n for n, _ in pieces], plan.n_stages)
    params = dict(model(CFG).state_dict())
    stages = {s: sharded_fusion_stage(CFG, BATCH // M, params, *bounds[s], grids[mine])
              for s in plan.stages_of(mine)}
    last = stages.get(plan.n_stages - 1)
    runner = PipelineRunner(plan, stages, last.module.loss if last else None, stage_ranks,
                            data_parallel=grid_share(grids[mine]))
    opt = torch.optim.AdamW([p for s in stages.values() for p in s.parameters()], lr=1e-2)
    losses, comms = [], []
    for ids, targets in batches(CFG, BATCH, steps):
        opt.zero_grad()
        with record_communications() as step:
            loss = runner.step(ids, targets)
        opt.step()
        losses.append(None if loss is None else loss.item())
        comms.append(step)
    return losses, comms, stages


def _mean_over_replicas(losses: list[float | None]) -> list[float]:
    """The last stage's per-step losses averaged over its rows (every rank calls this)."""
    every = [x for x in Communicator.instance().allgather_object(losses) if x[0] is not None]
    return [sum(x[step] for x in every) / len(every) for step in range(len(losses))]


def _close(losses, reference, rtol=1e-5):
    assert len(losses) == len(reference)
    for step, (got, want) in enumerate(zip(losses, reference)):
        assert abs(got - want) <= rtol * abs(want), (step, got, want)


def _check_sharded(comms, stages: dict[int, ShardedStage], grid: DeviceMesh, tp: int) -> None:
    """Per step and stage: one allgather of the parameters and one reduce-scatter of the
    gradients over the stage's dp column; the rest stays inside this rank's tp row, and
    the sends go to this rank's coordinate of the other stage."""
    rank = Communicator.instance().rank
    column, row = grid.group_ranks(rank, 0), grid.group_ranks(rank, 1)
    shard_bytes = sum(s.shard.numel() * 4 for s in stages.values())
    for step in comms:
        over_dp = [c for c in step if c.ranks == column]
        assert sorted(c.kind for c in over_dp) == \
            ["allgather"] * len(stages) + ["reduce_scatter"] * len(stages)
        assert sum(c.bytes for c in over_dp if c.kind == "allgather") == shard_bytes
        inside = [c for c in step if c.kind not in ("send", "recv") and c.ranks != column]
        assert all(c.ranks == row for c in inside)
        assert bool(inside) == (tp > 1)  # the fusions' tensor-parallel collectives
        half = grid.size
        assert {c.peer for c in step if c.kind in ("send", "recv")} == \
            {rank + half if rank < half else rank - half}


@pytest.mark.mpi
def test_pp2_fsdp2_gathers_once_per_step(multidevice_test):
    if multidevice_test.size != 4:
        pytest.skip("PP2 x FSDP2 on four ranks")
    for name, steps in (("1F1B", STEPS), ("Interleaved1F1B", 3), ("ZeroBubble", 3)):
        grids = _grids(4, 1)
        losses, comms, stages = _train_sharded(name, grids, steps)
        _close(_mean_over_replicas(losses), train_single(CFG, BATCH, steps))
        grid = grids[multidevice_test.rank // 2]
        _check_sharded(comms, stages, grid, 1)
        # each device holds half of the stage's flat parameters (rounded up)
        for s in stages.values():
            assert s.shard.numel() == -(-s.numel // 2)


@pytest.mark.mpi
def test_pp2_fsdp2_tp2_on_eight_ranks(multidevice_test):
    if multidevice_test.size != 8:
        pytest.skip("PP2 x FSDP2 x TP2 needs 8 ranks (--world-sizes 8)")
    reference = train_single(CFG, BATCH, STEPS)
    for name in ("1F1B", "ZeroBubble"):
        grids = _grids(8, 2)
        losses, comms, stages = _train_sharded(name, grids, STEPS)
        _close(_mean_over_replicas(losses), reference)
        _check_sharded(comms, stages, grids[multidevice_test.rank // 4], 2)
        q = next(iter(stages.values())).module.blocks[0].get_parameter(
            "self_attn_q_proj_weight")
        assert q.numel() == 0  # freed between steps; a tp shard while gathered


@pytest.mark.mpi
def test_pp2_fsdp2_of_fusions_that_gather_per_call(multidevice_test):
    """The per-microbatch choice: each fusion a FullyShardedModule over the stage's dp."""
    if multidevice_test.size != 4:
        pytest.skip("PP2 x FSDP2 on four ranks")
    rank, steps = multidevice_test.rank, 2
    stage_ranks = [[0, 1], [2, 3]]
    meshes = [NamedMesh(DeviceMesh(r), ("dp",)) for r in stage_ranks]
    create_stage_groups(meshes)
    mine = rank // 2
    names = [name for name, _ in llama_pieces(model(CFG))]
    start, stop = stage_bounds(names, 2)[mine]
    stage = FusionStage(CFG, BATCH // M, dict(model(CFG).state_dict()), start, stop,
                        meshes[mine])
    runner = PipelineRunner(schedule("1F1B", 2, M), {mine: stage}, stage.loss, stage_ranks)
    with record_communications() as comms:
        losses = train_pipelined(runner, CFG, BATCH, steps)
    if mine == 1:
        _close(losses, train_single(CFG, BATCH, steps))
    inside = [c for c in comms if c.kind not in ("send", "recv")]
    assert all(set(c.ranks) <= set(stage_ranks[mine]) for c in inside)
    # every fusion gathers its parameters at each microbatch's forward
    fusions = len(stage.blocks) + (stage.embed is not None) + (stage.head is not None)
    gathers = sum(c.kind == "allgather" for c in inside)
    assert gathers >= steps * M * fusions


def test_sharded_stage_of_mixed_dtypes_or_no_parameters():
    group = Group(None, (0,), 0, 0)  # never used: the checks come first
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    with pytest.raises(InputError, match="one dtype"):
        ShardedStage(mixed, group)
    empty = ShardedStage(torch.nn.Tanh(), group)  # no parameters: nothing to gather
    assert empty.shard.numel() == 0 and empty.end_step() is None
    assert torch.equal(empty(torch.zeros(2)), torch.zeros(2))
