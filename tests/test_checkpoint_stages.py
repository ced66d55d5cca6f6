"""Checkpoints of pipeline stages (meshfuse.checkpoint with meshfuse.parallel.stages): a tiny
Llama trained 2 AdamW steps split in two stages (2 ranks: one per rank; 4 ranks: PP2 x FSDP2,
each stage's parameters one flat shard per data-parallel member, ShardedStage; 1 rank: the
whole model as one ShardedStage) is saved and loaded into the model on one device, and the
one-device model's checkpoint into the stages: every tensor (weights and AdamW moments)
equals the saved one exactly, saved under the model's names and shapes (each stage writes
its own, the flat shard as the parameters it holds pieces of), and the next two steps'
losses equal the uninterrupted run's within 1e-6 relative."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from meshfuse import DeviceMesh, checkpoint
from meshfuse.checkpoint.chunks import ShardedValue, flat_piece
from meshfuse.examples.llama import LlamaConfig, LlamaModel
from meshfuse.examples.llama_stages import (
    FusionStage,
    batches,
    create_stage_groups,
    grid_share,
    llama_pieces,
    model,
    sharded_fusion_stage,
)
from meshfuse.parallel.stages import PipelineRunner, schedule, stage_bounds
from meshfuse.runtime.comm.communicator import Communicator

CFG = LlamaConfig(vocab=64, hidden=32, layers=3, heads=4, kv_heads=2, ffn=64, seq=8)
BATCH, M, LR, STEPS = 8, 2, 1e-2, 4


def _shared_dir(test) -> str:
    path = tempfile.mkdtemp(prefix="meshfuse-ckpt-") if test.rank == 0 else None
    return test.communicator.allgather_object(path)[0]


class _Stages:
    """This rank's stages of the model (a module to save) and a step of them: the loss
    averaged over the last stage's data-parallel rows (every rank gets it)."""

    def __init__(self, world: int) -> None:
        rank, params = Communicator.instance().rank, dict(model(CFG).state_dict())
        if world == 1:  # the whole model as one flat shard
            grid = DeviceMesh([[0]])
            self.module = sharded_fusion_stage(CFG, BATCH, params, 0, CFG.layers + 2, grid)
            self.runner = None
        else:
            half = world // 2
            grids = [DeviceMesh(torch.arange(s * half, (s + 1) * half).reshape(half, 1))
                     for s in (0, 1)]
            create_stage_groups(grids)
            plan = schedule("1F1B", 2, M)
            mine = rank // half
            bounds = stage_bounds([n for n, _ in llama_pieces(model(CFG))], 2)
            if half == 1:
                stage = FusionStage(CFG, BATCH // M, params, *bounds[mine],
                                    DeviceMesh([rank]))
                loss = stage.loss
            else:
                stage = sharded_fusion_stage(CFG, BATCH // M, params, *bounds[mine],
                                             grids[mine])
                loss = stage.module.loss
            self.module = stage
            self.runner = PipelineRunner(
                plan, {mine: stage}, loss if mine == 1 else None,
                [g.devices.flatten().tolist() for g in grids],
                data_parallel=grid_share(grids[mine]) if half > 1 else None)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=LR)

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        self.opt.zero_grad()
        if self.runner is None:
            self.module.begin_step()
            loss = self.module.module.loss(self.module(ids), targets)
            loss.backward()
            self.module.end_step().wait()
        else:
            loss = self.runner.step(ids, targets)
        self.opt.step()
        losses = Communicator.instance().allgather_object(
            None if loss is None else loss.item())
        losses = [x for x in losses if x is not None]
        return sum(losses) / len(losses)


def _single() -> tuple[LlamaModel, torch.optim.Optimizer]:
    net = LlamaModel(CFG, BATCH, dict(model(CFG).state_dict()))
    return net, torch.optim.AdamW(net.parameters(), lr=LR)


def _single_step(net, opt, ids, targets) -> float:
    opt.zero_grad()
    loss = net(ids, targets)
    loss.backward()
    opt.step()
    return loss.item()


def _tensors(net, opt) -> dict[str, ShardedValue]:
    """The tensors a checkpoint of ``net`` and ``opt`` holds (copies)."""
    return {k: v.with_local(v.local.clone()) for k, v in checkpoint.state_dict(net, opt).items()
            if isinstance(v, ShardedValue)}


def _same_as_whole(parts: dict[str, ShardedValue], whole: dict[str, ShardedValue]) -> None:
    """Each of this rank's chunks of ``parts`` equals the box of the one-device tensor."""
    for name, value in parts.items():
        assert value.shape == whole[name].shape, name
        for c in value.chunks:
            box = whole[name].local[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))]
            assert torch.equal(value.piece(c.offsets), box), (name, c)


def _close(got: list[float], want: list[float]) -> None:
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (got, want)


@pytest.mark.mpi
def test_stages_save_and_load_into_one_device_and_back(multidevice_test):
    world = multidevice_test.size
    if world not in (1, 2, 4):
        pytest.skip("two stages of one rank or of two (FSDP), or one stage on one rank")
    data = [(i.contiguous(), t.contiguous()) for i, t in batches(CFG, BATCH, STEPS)]
    from_stages, from_single = _shared_dir(multidevice_test), _shared_dir(multidevice_test)

    stages = _Stages(world)
    piped = [stages.step(*b) for b in data[:2]]
    checkpoint.save(from_stages, stages.module, stages.opt)
    saved_stages = _tensors(stages.module, stages.opt)
    piped += [stages.step(*b) for b in data[2:]]

    net, opt = _single()
    single = [_single_step(net, opt, *b) for b in data[:2]]
    checkpoint.save(from_single, net, opt)
    saved_single = _tensors(net, opt)
    single += [_single_step(net, opt, *b) for b in data[2:]]
    _close(piped, single)

    # the stages' names and shapes are the model's; a rank writes its stage's tensors only
    mine = set(saved_stages)
    assert mine <= set(saved_single) and {k for k in saved_single if "exp_avg" not in k
                                          and not k.startswith("optimizer")} <= \
        set().union(*multidevice_test.communicator.allgather_object(mine))
    assert all(saved_stages[k].shape == saved_single[k].shape for k in mine)

    # (a) the stages' checkpoint into one device
    net, opt = _single()
    checkpoint.load(from_stages, net, opt)
    _same_as_whole(saved_stages, _tensors(net, opt))
    _close([_single_step(net, opt, *b) for b in data[2:]], piped[2:])

    # (b) the one-device checkpoint into the stages (strict=False: other stages' tensors)
    stages = _Stages(world)
    checkpoint.load(from_single, stages.module, stages.opt, strict=False)
    _same_as_whole(_tensors(stages.module, stages.opt), saved_single)
    _close([stages.step(*b) for b in data[2:]], single[2:])
    if dist.is_initialized():
        dist.barrier()


def test_a_flat_run_of_elements_is_cut_into_boxes():
    """Every run ``[a, b)`` of a tensor's row-major elements (a flat shard's piece of a
    parameter) becomes boxes that cover it exactly, each a view of the run."""
    for shape in ((3, 4, 5), (7,), (2, 1, 3), ()):
        n = torch.Size(shape).numel()
        full = torch.arange(n, dtype=torch.float32).reshape(shape)
        for a in range(n + 1):
            for b in range(a, n + 1):
                value = flat_piece(full.reshape(-1)[a:b].clone(), shape, a)
                covered = 0
                for c in value.chunks:
                    box = full[tuple(slice(o, o + k) for o, k in zip(c.offsets, c.sizes))]
                    assert torch.equal(value.piece(c.offsets), box), (shape, a, b, c)
                    covered += box.numel()
                assert covered == b - a
                assert len(value.chunks) <= 2 * max(len(shape), 1) - 1 + (b > a)
