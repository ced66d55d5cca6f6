"""Pipeline x fully sharded data parallelism: each stage's module is the Llama example's
fusions as FullyShardedModules over its stage's 2-rank ``dp`` mesh (parameters and each
microbatch's rows split over it); the device at coordinate c of one stage sends its rows to
coordinate c of the next; the losses are those of the one-device model.

The FullyShardedModule gathers its parameters inside each call, so here they are gathered
once per microbatch and its gradients reduce-scattered once per microbatch (not yet once
per step: docs/pipeline_parallel.md)."""

from __future__ import annotations

import pytest
import torch

from meshfuse import DeviceMesh
from meshfuse.examples.llama import LlamaConfig
from meshfuse.examples.llama_stages import (
    FusionStage,
    batches,
    create_stage_groups,
    llama_pieces,
    model,
    train_single,
)
from meshfuse.parallel.fsdp import NamedMesh
from meshfuse.parallel.stages import PipelineRunner, schedule, stage_bounds
from meshfuse.runtime.comm.collectives import record_communications

CFG = LlamaConfig(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, seq=8)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["1F1B", "ZeroBubble"])
def test_pp2_fsdp2_trains_like_one_device(multidevice_test, name):
    if multidevice_test.size != 4:
        pytest.skip("PP2 x FSDP2 on four ranks")
    rank, batch, steps, m = multidevice_test.rank, 8, 2, 4
    stage_ranks = [[0, 1], [2, 3]]
    meshes = [NamedMesh(DeviceMesh(r), ("dp",)) for r in stage_ranks]
    create_stage_groups(meshes)
    mine = rank // 2
    names = [name for name, _ in llama_pieces(model(CFG))]
    start, stop = stage_bounds(names, 2)[mine]
    stage = FusionStage(CFG, batch // m, dict(model(CFG).state_dict()), start, stop,
                        meshes[mine])
    runner = PipelineRunner(schedule(name, 2, m), {mine: stage}, stage.loss, stage_ranks)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
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
    inside = [c for c in comms if c.kind not in ("send", "recv")]
    assert all(set(c.ranks) <= set(stage_ranks[mine]) for c in inside)
    kinds = {c.kind for c in inside}
    assert {"allgather", "reduce_scatter"} <= kinds, kinds
    # each device holds half of every parameter's rows
    q = stage.blocks[0].get_parameter("self_attn_q_proj_weight")
    assert tuple(q.shape) == (CFG.hidden // 2, CFG.hidden)
