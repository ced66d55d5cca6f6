"""Pipeline x tensor parallelism: each pipeline stage's module is itself tensor parallel over
its stage's sub-mesh (a Megatron plan over the two devices of a row of a pp x tp mesh), the
activations cross stages device by device (coordinate c of one stage to coordinate c of the
next); the losses are those of the one-device model.

The stages are made tensor parallel by torch's ``parallelize_module``: a stage of meshfuse
fusions (``meshfuse.parallelize``) does not run on a sub-mesh yet, as every fusion call
agrees on its inputs with every rank of the world (docs/pipeline_parallel.md)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from meshfuse.examples.llama import LlamaConfig
from meshfuse.examples.llama_stages import batches, llama_pieces, lm_loss, model, train_single
from meshfuse.parallel.stages import PipelineRunner, schedule, split_pieces
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
    rank, batch, steps = multidevice_test.rank, 8, 3
    stage_ranks = [[0, 1], [2, 3]]
    plan = schedule(name, 2, 4)
    stages = split_pieces(llama_pieces(model(CFG)), 2)
    # the stages' sub-meshes are the rows of a pp x tp mesh: every rank builds it alike
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    mine = rank // 2
    module = parallelize_module(stages[mine], mesh["tp"], PLAN)
    runner = PipelineRunner(plan, {mine: module}, lm_loss, stage_ranks)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    losses = []
    with record_communications() as comms:
        for ids, targets in batches(CFG, batch, steps):
            opt.zero_grad()
            loss = runner.step(ids, targets)
            opt.step()
            losses.append(loss)
    reference = train_single(CFG, batch, steps)
    if mine == 1:
        for got, want in zip(losses, reference):
            assert abs(got.item() - want) <= 1e-5 * abs(want)
    peers = {c.peer for c in comms if c.kind in ("send", "recv")}
    assert peers == {rank + 2 if mine == 0 else rank - 2}
    # the stage is tensor parallel: each device holds half of every projection
    q = module.pieces[1].layer.self_attn.q_proj.weight
    assert tuple(q.to_local().shape) == (CFG.hidden // 2, CFG.hidden)
