"""Pipeline x tensor parallelism: each pipeline stage's module is itself tensor parallel over
its stage's sub-mesh (a Megatron plan over the two devices of a row of a pp x tp mesh), the
activations cross stages device by device (coordinate c of one stage to coordinate c of the
next); the losses are those of the one-device model.

The stages are meshfuse fusions on each stage's 2-rank mesh (the Llama example's embedding,
blocks and head, :mod:`meshfuse.examples.llama_stages`; each fusion agrees on its inputs
among its mesh's ranks only), or torch's ``parallelize_module`` on the rows of a pp x tp
mesh."""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from meshfuse import DeviceMesh
from meshfuse.examples.llama import LlamaConfig
from meshfuse.examples.llama_stages import (
    FusionStage,
    create_stage_groups,
    llama_pieces,
    lm_loss,
    model,
    train_pipelined,
    train_single,
)
from meshfuse.parallel.stages import PipelineRunner, schedule, split_pieces, stage_bounds
from meshfuse.runtime.comm.collectives import record_communications

CFG = LlamaConfig(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, seq=8)
PLAN = {f"pieces.*.layer.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"} | {
    "pieces.*.layer.self_attn.o_proj": RowwiseParallel(),
    "pieces.*.layer.mlp.gate_proj": ColwiseParallel(),
    "pieces.*.layer.mlp.up_proj": ColwiseParallel(),
    "pieces.*.layer.mlp.down_proj": RowwiseParallel()}


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["1F1B", "ZeroBubble"])  # whole and split backward
def test_pp2_tp2_trains_like_one_device(multidevice_test, name):
    if multidevice_test.size != 4:
        pytest.skip("PP2 x TP2 on four ranks")
    rank, batch, steps = multidevice_test.rank, 8, 10
    stage_ranks = [[0, 1], [2, 3]]
    plan = schedule(name, 2, 4)
    stages = split_pieces(llama_pieces(model(CFG)), 2)
    # the stages' sub-meshes are the rows of a pp x tp mesh: every rank builds it alike
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    mine = rank // 2
    module = parallelize_module(stages[mine], mesh["tp"], PLAN)
    runner = PipelineRunner(plan, {mine: module}, lm_loss, stage_ranks)
    with record_communications() as comms:
        losses = train_pipelined(runner, CFG, batch, steps)
    reference = train_single(CFG, batch, steps)
    if mine == 1:
        for got, want in zip(losses, reference):
            assert abs(got - want) <= 1e-5 * abs(want)
    peers = {c.peer for c in comms if c.kind in ("send", "recv")}
    assert peers == {rank + 2 if mine == 0 else rank - 2}
    # the stage is tensor parallel: each device holds half of every projection
    q = module.pieces[1].layer.self_attn.q_proj.weight
    assert tuple(q.to_local().shape) == (CFG.hidden // 2, CFG.hidden)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["1F1B", "ZeroBubble"])
def test_pp2_tp2_of_meshfuse_fusions_trains_like_one_device(multidevice_test, name):
    if multidevice_test.size != 4:
        pytest.skip("PP2 x TP2 on four ranks")
    rank, batch, steps, m = multidevice_test.rank, 8, 10, 4
    stage_ranks = [[0, 1], [2, 3]]
    meshes = [DeviceMesh(r) for r in stage_ranks]
    create_stage_groups(meshes)
    mine = rank // 2
    names = [name for name, _ in llama_pieces(model(CFG))]
    start, stop = stage_bounds(names, 2)[mine]
    params = dict(model(CFG).state_dict())
    stage = FusionStage(CFG, batch // m, params, start, stop, meshes[mine])
    runner = PipelineRunner(schedule(name, 2, m), {mine: stage}, stage.loss, stage_ranks)
    with record_communications() as comms:
        losses = train_pipelined(runner, CFG, batch, steps)
    reference = train_single(CFG, batch, steps)
    if mine == 1:
        for got, want in zip(losses, reference):
            assert abs(got - want) <= 1e-5 * abs(want)
    # activations and gradients go to the same coordinate of the other stage; every other
    # collective stays within the stage (the fusions' tensor-parallel gathers and reductions)
    peers = {c.peer for c in comms if c.kind in ("send", "recv")}
    assert peers == {rank + 2 if mine == 0 else rank - 2}
    inside = [c for c in comms if c.kind not in ("send", "recv")]
    assert inside and all(set(c.ranks) <= set(stage_ranks[mine]) for c in inside)
    # each device holds half of every column-parallel projection
    q = stage.blocks[0].get_parameter("self_attn_q_proj_weight")
    assert tuple(q.shape) == (CFG.hidden // 2, CFG.hidden)
