"""Pipeline parallelism on gloo ranks: a Llama-family model (8 layers) cut into one stage per
rank (two per rank for the interleaved and V schedules) trains 10 AdamW steps under each
schedule, with 4 and 8 microbatches, with per-step losses within 1e-5 relative of the same
model on one device; the point-to-point traffic is the schedule's. At 3 ranks the 10 pieces
do not divide evenly; 7 layers over 2 stages neither."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from meshfuse.examples.llama import LlamaConfig
from meshfuse.examples.llama_stages import (
    batches,
    llama_pieces,
    lm_loss,
    model,
    pipelined,
    train_pipelined,
    train_single,
)
from meshfuse.parallel.stages import (
    StageModule,
    backward,
    parameter_counts,
    split_pieces,
    stage_bounds,
)
from meshfuse.parallel.stages.messages import Layout, pack, unpack
from meshfuse.runtime.comm.collectives import record_communications

CFG = LlamaConfig(vocab=64, hidden=32, layers=8, heads=4, kv_heads=2, ffn=64, seq=8)
BATCH, STEPS = 8, 10
TORCH_SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
TRAINED = ["GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble"]


@functools.cache
def _reference(cfg: LlamaConfig = CFG, steps: int = STEPS) -> tuple[float, ...]:
    return tuple(train_single(cfg, BATCH, steps))


def _close(losses, reference, rtol=1e-5):
    assert len(losses) == len(reference)
    for step, (got, want) in enumerate(zip(losses, reference)):
        assert abs(got - want) <= rtol * abs(want), (step, got, want)


@pytest.mark.mpi
@pytest.mark.parametrize("name", [*TRAINED, "ZBV"])
def test_llama_trains_like_one_device_under_each_schedule(multidevice_test, name):
    d = multidevice_test.size
    # 10 steps at 2 and 4 ranks (the stage counts); 3 at 1 and 3 ranks, and for ZBV
    steps = STEPS if name in TRAINED and d in (2, 4) else 3
    reference = _reference(CFG, steps)
    for microbatches in (4, 8):
        runner = pipelined(CFG, name, d, microbatches)
        losses = train_pipelined(runner, CFG, BATCH, steps)
        last = runner.schedule.placement[-1]
        if runner.pp_rank == last:
            _close(losses, reference)
        else:
            assert losses == [None] * steps


@pytest.mark.mpi
def test_1f1b_sends_each_activation_forward_and_each_gradient_back(multidevice_test):
    d, rank, m = multidevice_test.size, multidevice_test.rank, 4
    runner = pipelined(CFG, "1F1B", d, m)
    train_pipelined(runner, CFG, BATCH, 1)  # the first step also sends shape headers
    with record_communications() as comms:
        train_pipelined(runner, CFG, BATCH, 1)
    activation = (BATCH // m) * CFG.seq * CFG.hidden * 4
    sends = sorted((c.peer, c.bytes) for c in comms if c.kind == "send")
    recvs = sorted((c.peer, c.bytes) for c in comms if c.kind == "recv")
    after = [(rank + 1, activation)] * m if rank < d - 1 else []
    before = [(rank - 1, activation)] * m if rank > 0 else []
    assert sends == sorted(after + before)
    assert recvs == sorted(after + before)
    assert all(c.kind in ("send", "recv") for c in comms)
    # explain: the stage map with devices and pieces, and the bubble from measured times
    text = runner.explain(runner.measured_costs())
    first = "model.embed_tokens .. " if rank == 0 else "(another rank)"
    assert f"stage 0 on pipeline rank 0 devices [0]: {first}" in text
    if d > 1:
        last = ".. lm_head" if rank == d - 1 else ": (another rank)"
        assert f"stage {d - 1} on pipeline rank {d - 1} devices [{d - 1}]" in text
        assert last in text.splitlines()[d]
    assert "predicted bubble: " in text and "B0.0" in text


@pytest.mark.mpi
def test_seven_layers_on_two_stages(multidevice_test):
    if multidevice_test.size != 2:
        pytest.skip("two stages on two ranks")
    cfg = LlamaConfig(vocab=64, hidden=32, layers=7, heads=4, kv_heads=2, ffn=64, seq=8)
    pieces = llama_pieces(model(cfg))
    # by parameters (embedding and head a fifth of a layer each): 4 layers, then 3
    assert stage_bounds([n for n, _ in pieces], 2, costs=parameter_counts(pieces)) == \
        [(0, 5), (5, 9)]
    # every schedule on the balanced cut (9 pieces: 5 and 4; interleaved, 4 stages: 3,2,2,2)
    for name in TRAINED:
        runner = pipelined(cfg, name, 2, 4)
        losses = train_pipelined(runner, cfg, BATCH, STEPS)
        if runner.pp_rank == 1:
            _close(losses, _reference(cfg))
    # cuts by name and by index
    for boundaries in (["model.layers.3"], [2]):
        runner = pipelined(cfg, "ZeroBubble", 2, 4, boundaries=boundaries)
        losses = train_pipelined(runner, cfg, BATCH, 3)
        if runner.pp_rank == 1:
            _close(losses, _reference(cfg, 3))
    n_layers = sum(name.startswith("model.layers") for m in runner.modules.values()
                   for name in m.names)
    assert n_layers == (6 if multidevice_test.rank == 1 else 1)  # stage 1 from piece 2 on


def test_split_backward_defers_the_linear_weight_gradients():
    """I gives the input's gradient and the norms' and leaves every Linear weight for W;
    I then W accumulate the same gradients as one whole backward."""
    net = model(CFG)
    stage = StageModule(llama_pieces(net)[1:4])
    notes = backward.LinearNotes(stage)
    assert len(notes.linears) == 3 * 7  # q, k, v, o, gate, up, down per layer
    x = torch.randn(2, CFG.seq, CFG.hidden, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(2, CFG.seq, CFG.hidden, generator=torch.Generator().manual_seed(4))

    def forward():
        notes.active = linears = []
        xin = x.clone().requires_grad_(True)
        out = stage(xin)
        notes.active = None
        return backward.Saved((xin,), (out,), linears)

    saved = forward()
    (dx_whole,) = backward.full(saved, (grad,))
    whole = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    saved = forward()
    (dx,) = backward.input_half(saved, (grad,), stage)
    torch.testing.assert_close(dx, dx_whole)
    for name, p in stage.named_parameters():
        assert (p.grad is None) == name.endswith("proj.weight"), name
    backward.weight_half(saved)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, whole[name], rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_same_losses_as_torch_pipelining(multidevice_test, name):
    """torch.distributed.pipelining's schedule of the same name on the same stages, ranks
    and microbatches: the same per-step losses (to float32 rounding)."""
    d, rank, m, steps = multidevice_test.size, multidevice_test.rank, 4, 3
    if d < 2:
        pytest.skip("a pipeline needs two ranks")
    ours = train_pipelined(pipelined(CFG, name, d, m), CFG, BATCH, steps)
    stage = split_pieces(llama_pieces(model(CFG)), d)[rank]
    theirs = TORCH_SCHEDULES[name](PipelineStage(stage, rank, d, torch.device("cpu")), m,
                                   loss_fn=lm_loss)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    for step, (ids, targets) in enumerate(batches(CFG, BATCH, steps)):
        opt.zero_grad()
        losses: list = []
        if rank == 0:
            theirs.step(ids)
        elif rank < d - 1:
            theirs.step()
        else:
            theirs.step(target=targets, losses=losses)
            mean = torch.stack(losses).mean().item()
            assert abs(mean - ours[step]) <= 1e-6 * abs(mean), (step, mean, ours[step])
        opt.step()


def test_a_bundle_crosses_as_one_message():
    """Several values of any dtype packed in one buffer and read back; their layout (and
    which carry a gradient) survives its header; a lone tensor is its own message."""
    bundle = (torch.randn(2, 3), torch.tensor([True, False, True]), torch.arange(5),
              torch.randn((), dtype=torch.float64, requires_grad=True),
              torch.randn(3).bfloat16())
    layout = Layout.of(bundle)
    assert Layout.read(layout.header()[1]) == layout
    assert layout.gradients().values == (layout.values[3],)
    message = pack(bundle)
    assert [list(message.shape), message.dtype] == list(layout.buffer_spec())
    assert message.numel() == 32 + 16 + 48 + 16 + 16  # each value aligned to 16 bytes
    for sent, got in zip(bundle, unpack(message.clone(), layout)):
        assert got.dtype == sent.dtype and torch.equal(got, sent.detach())
    lone = torch.randn(4)
    assert pack((lone,)) is lone or torch.equal(pack((lone,)), lone)
    assert unpack(pack(()), Layout(())) == ()
    # complex values (Llama-4's rotary frequencies) travel as bytes, alone too
    for bundle in [(torch.randn(1, 8, 4, dtype=torch.complex64),),
                   (torch.randn(2, 3), torch.randn(3, dtype=torch.complex128))]:
        layout = Layout.of(bundle)
        assert Layout.read(layout.header()[1]) == layout
        message = pack(bundle)
        assert message.dtype == torch.uint8
        for sent, got in zip(bundle, unpack(message.clone(), layout)):
            assert got.dtype == sent.dtype and torch.equal(got, sent)
