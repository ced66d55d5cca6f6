"""``meshfuse.parallelize(hf_model, mesh, plan, pipeline=PipelineSpec(...))`` on unmodified
Hugging Face decoders (Llama, Qwen2; tiny random configs): the stages are cut from the
model's graph at ``model.layers.N``, the hidden states cross every boundary (each stage
makes the causal mask and the rotary embeddings again); 3 AdamW steps give the one-device
model's losses and parameters under 1F1B, GPipe, ZeroBubble and Interleaved1F1B at pp2 (2
ranks), under 1F1B at pp3 (3 ranks), pp2 x tp2 and pp2 x fsdp2 (4 ranks); 3 layers over 2
stages; an embedding tied to the head across stages; bad specs and batches are refused on
every rank."""

from __future__ import annotations

import tempfile

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor

import meshfuse
from meshfuse import DeviceMesh, PipelineSpec, checkpoint
from meshfuse.capture.pipeline.cut import cut_graph
from meshfuse.capture.trace import capture
from meshfuse.dtensor import mesh_to_torch
from meshfuse.errors import DefinitionError, InputError
from meshfuse.runtime.comm.collectives import record_communications

BATCH, SEQ, VOCAB, HIDDEN, STEPS = 4, 8, 64, 32, 3
TP_PLAN = {"model.layers.*.self_attn.q_proj": "colwise",
           "model.layers.*.self_attn.k_proj": "colwise",
           "model.layers.*.self_attn.v_proj": "colwise",
           "model.layers.*.self_attn.o_proj": "rowwise",
           "model.layers.*.mlp.gate_proj": "colwise",
           "model.layers.*.mlp.up_proj": "colwise",
           "model.layers.*.mlp.down_proj": "rowwise"}


def _model(family: str = "llama", layers: int = 3) -> torch.nn.Module:
    kinds = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
    config_class, model_class = kinds[family]
    config = config_class(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                          max_position_embeddings=64, use_cache=False,
                          tie_word_embeddings=False)
    torch.manual_seed(0)
    return model_class(config).float()


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def _loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def _reference(family: str):
    model = _model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids, target in _data():
        opt.zero_grad()
        loss = _loss(model(input_ids=ids), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


def _mesh(shape, names):
    n = torch.tensor(shape).prod().item()
    return mesh_to_torch(DeviceMesh(torch.arange(n).reshape(shape)), mesh_dim_names=names)


def _train(pipe):
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    with record_communications() as comms:
        for ids, target in _data():
            opt.zero_grad()
            losses.append(pipe.step({"input_ids": ids}, target))
            opt.step()
    return losses, comms


def _check(pipe, losses, family, last: bool):
    want_losses, want = _reference(family)
    if last:
        got = [x.item() for x in losses]
        assert got == pytest.approx(want_losses, rel=1e-5)
    else:
        assert losses == [None] * STEPS
    (stage,) = pipe.stages.values()
    inner = getattr(stage, "module", stage)
    inner.get_submodule(inner.owners[-1])  # the stage holds its modules under their names
    for name, p in inner.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if full.numel():  # (a sharded stage's own parameters are freed between steps)
            torch.testing.assert_close(full.detach(), want[name].detach(), rtol=1e-4,
                                       atol=1e-5)


@pytest.mark.mpi
@pytest.mark.parametrize("family,schedule,m", [("llama", "1F1B", 2), ("llama", "GPipe", 4),
                                               ("qwen2", "ZeroBubble", 4)])
def test_hf_decoder_pipelined_trains_like_one_device(multidevice_test, family, schedule, m):
    d, rank = multidevice_test.size, multidevice_test.rank
    if d not in (2, 4) or (d == 4 and (schedule, family) != ("1F1B", "llama")):
        pytest.skip("pp2 at 2 ranks, pp2 x tp2 at 4 (1F1B)")
    shape, names = ((2,), ("pp",)) if d == 2 else ((2, 2), ("pp", "tp"))
    spec = PipelineSpec(split_points=["model.layers.2"], loss_fn=_loss, schedule=schedule,
                        microbatches=m)
    pipe = meshfuse.parallelize(_model(family), _mesh(shape, names),
                                TP_PLAN if d == 4 else {}, pipeline=spec)
    losses, comms = _train(pipe)
    width = d // 2
    mine = rank // width
    _check(pipe, losses, family, mine == 1)
    if schedule == "ZeroBubble" and mine == 0:  # its Linears' weight gradients deferred to W
        (stage,) = pipe.stages.values()
        notes = pipe.runner.notes[0]
        notes.active = seen = []
        stage(_data()[0][0][:1])
        notes.active = None
        assert len(seen) == 2 * 7  # q, k, v, o, gate, up, down of layers 0 and 1
    # to the same coordinate of the other stage only: the hidden states forward in one
    # message per microbatch (its layout once: a count, then 9 numbers per value), their
    # gradients back; the causal mask, cos and sin are made again by the second stage
    other = rank + width if mine == 0 else rank - width
    p2p = [c for c in comms if c.kind in ("send", "recv")]
    assert {c.peer for c in p2p} == {other}
    hidden = BATCH // m * SEQ * HIDDEN * 4
    forward = [c for c in p2p if c.kind == ("send" if mine == 0 else "recv")]
    backward = [c for c in p2p if c.kind == ("recv" if mine == 0 else "send")]
    assert sorted(c.bytes for c in forward) == sorted([8, 9 * 8] + [hidden] * m * STEPS)
    assert [c.bytes for c in backward] == [hidden] * m * STEPS
    if d == 4:
        inside = [c for c in comms if c.kind not in ("send", "recv")]
        assert inside and all(set(c.ranks) <= {mine * 2, mine * 2 + 1} for c in inside)


@pytest.mark.mpi
def test_hf_decoder_interleaved(multidevice_test):
    """Interleaved1F1B: four stages on two ranks (0 and 2 on rank 0), 3 layers, the norm and
    the head; every boundary carries the hidden states only."""
    if multidevice_test.size != 2:
        pytest.skip("two ranks")
    spec = PipelineSpec(split_points=["model.layers.1", "model.layers.2", "model.norm"],
                        loss_fn=_loss, schedule="Interleaved1F1B", microbatches=2)
    pipe = meshfuse.parallelize(_model(), _mesh((2,), ("pp",)), {}, pipeline=spec)
    losses, comms = _train(pipe)
    rank = multidevice_test.rank
    assert sorted(pipe.stages) == [rank, rank + 2]
    text = pipe.explain()  # names this rank's stages by their blocks
    mine = ["stage 0 on pipeline rank 0 devices [0]: model.embed_tokens, model.layers.0",
            "stage 2 on pipeline rank 0 devices [0]: model.layers.2"] if rank == 0 else \
        ["stage 1 on pipeline rank 1 devices [1]: model.layers.1",
         "stage 3 on pipeline rank 1 devices [1]: model.norm, lm_head"]
    assert all(line in text.splitlines() for line in mine), text
    want_losses, want = _reference("llama")
    if rank == 1:
        assert [x.item() for x in losses] == pytest.approx(want_losses, rel=1e-5)
    for stage in pipe.stages.values():
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.detach(), want[name].detach(), rtol=1e-4, atol=1e-5)
    hidden = (BATCH // 2) * SEQ * HIDDEN * 4
    from_0 = [c for c in comms if c.kind == ("send" if rank == 0 else "recv")
              and c.bytes == hidden]  # stages 0 to 1 and 2 to 3 forward, 2 to 1 backward
    assert len(from_0) == 3 * 2 * STEPS


@pytest.mark.mpi
def test_hf_decoder_three_stages(multidevice_test):
    """pp3, a layer per stage: the middle stage receives the hidden states and sends its
    own on (the same bytes; each stage makes the mask, cos and sin), the gradients of the
    hidden states flowing back."""
    if multidevice_test.size != 3:
        pytest.skip("three ranks")
    spec = PipelineSpec(split_points=["model.layers.1", "model.layers.2"], loss_fn=_loss,
                        schedule="1F1B", microbatches=2)
    pipe = meshfuse.parallelize(_model(), _mesh((3,), ("pp",)), {}, pipeline=spec)
    losses, comms = _train(pipe)
    rank = multidevice_test.rank
    _check(pipe, losses, "llama", rank == 2)
    p2p = [c for c in comms if c.kind in ("send", "recv")]
    assert {c.peer for c in p2p} == {r for r in (rank - 1, rank + 1) if 0 <= r < 3}
    if rank == 1:
        data = sorted(c.bytes for c in p2p if c.bytes > 8 * 9 * 4)
        received = sorted(c.bytes for c in p2p if c.kind == "recv" and c.peer == 0
                          and c.bytes > 8 * 9 * 4)
        sent = sorted(c.bytes for c in p2p if c.kind == "send" and c.peer == 2
                      and c.bytes > 8 * 9 * 4)
        assert received == sent and len(sent) == 2 * STEPS and len(data) == 8 * STEPS


@pytest.mark.mpi
def test_hf_decoder_pipelined_with_fsdp(multidevice_test):
    """pp2 x dp2: each stage's parameters sharded over its pair, gathered once per step, each
    rank running half of every microbatch's rows."""
    if multidevice_test.size != 4:
        pytest.skip("pp2 x dp2 at 4 ranks")
    spec = PipelineSpec(split_points=["model.layers.2"], loss_fn=_loss, microbatches=2)
    pipe = meshfuse.parallelize(_model(), _mesh((2, 2), ("pp", "dp")), {}, fsdp="dp",
                                pipeline=spec)
    losses, comms = _train(pipe)
    mine = multidevice_test.rank // 2
    _check(pipe, losses, "llama", mine == 1)
    gathers = [c for c in comms if c.kind == "allgather"]
    assert len(gathers) == STEPS  # once per step, not per microbatch
    assert all(set(c.ranks) == {2 * mine, 2 * mine + 1} for c in gathers)


@pytest.mark.mpi
def test_hf_pipeline_errors(multidevice_test):
    if multidevice_test.size != 2:
        pytest.skip("two ranks")
    mesh = _mesh((2,), ("pp",))

    def build(split, m=2):
        spec = PipelineSpec(split_points=split, loss_fn=_loss, microbatches=m)
        return meshfuse.parallelize(_model(), mesh, {}, pipeline=spec)

    with pytest.raises(DefinitionError, match="no module named 'model.layers.7'"):
        build(["model.layers.7"])
    with pytest.raises(DefinitionError, match="increasing"):
        build([99])
    pipe = build(["model.layers.1"], m=3)
    ids, target = _data()[0]
    with pytest.raises(InputError, match=r"input 0 of shape \(4, 8\) does not split into 3"):
        pipe.step({"input_ids": ids}, target)


def _tied() -> torch.nn.Module:
    """The Llama of ``_model`` with its head's weight the embedding's (as
    ``tie_word_embeddings=True`` makes it: Llama-3.2-1B, Gemma, Qwen2-0.5B)."""
    model = _model()
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _tied_reference(accumulate: int = 1):
    """The tied model's losses and parameters (each name) on one device; ``accumulate``
    steps' gradients added before each SGD step; its first step's gradient. (SGD: a
    parameter's error is the step size times its gradient's. Adam divides by the
    gradient's size, and an element whose gradient is near zero moves by float noise: at
    pp2 x tp2 with the head split, untied too, an MLP weight's element by 3e-4 in 3 steps.)"""
    model = _tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, first = [], None
    for i, (ids, target) in enumerate(_data()):
        loss = _loss(model(input_ids=ids), target)
        loss.backward()
        first = model.lm_head.weight.grad.clone() if first is None else first
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, dict(model.named_parameters(remove_duplicate=False)), first


TIED = {  # name -> (ranks, mesh shape, names, schedule, split points, plan[, fsdp])
    "pp2": (2, (2,), ("pp",), "1F1B", ["model.layers.2"], {}),
    "interleaved": (2, (2,), ("pp",), "Interleaved1F1B",
                    ["model.layers.1", "model.layers.2", "model.norm"], {}),
    # the first and last stages on rank 0: one parameter there, no copy
    "zbv": (2, (2,), ("pp",), "ZBV", ["model.layers.1", "model.layers.2", "model.norm"], {}),
    "pp3": (3, (3,), ("pp",), "1F1B", ["model.layers.1", "model.layers.2"], {}),
    # the embedding replicated, the head split over the vocabulary: whole gradients added
    "pp2_tp2": (4, (2, 2), ("pp", "tp"), "1F1B", ["model.layers.2"],
                {**TP_PLAN, "lm_head": "colwise_gather_output"}),
    # both split over the vocabulary: their shards added
    "pp2_tp2_alike": (4, (2, 2), ("pp", "tp"), "1F1B", ["model.layers.2"],
                      {**TP_PLAN, "lm_head": "colwise_gather_output",
                       "model.embed_tokens": "rowwise"}),
    # each stage one flat shard per dp member, the tied weight at other offsets in each
    "pp2_dp2": (4, (2, 2), ("pp", "dp"), "1F1B", ["model.layers.2"], {}, "dp"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(TIED))
@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_weight_tied_across_stages_trains_like_the_tied_model(multidevice_test, case,
                                                                 accumulate):
    """The embedding and the head one parameter, in the first and last stages: each stage's
    rank trains a copy, their gradients added after each step (one allreduce between the
    two stages' ranks at each coordinate), so the losses, the first step's gradient and the
    parameters after SGD are the tied model's on one device; also with three steps'
    gradients accumulated before one SGD step (each step adds only its own)."""
    ranks, shape, names, sched, points, plan, *fsdp = TIED[case]
    d, rank = multidevice_test.size, multidevice_test.rank
    if d != ranks:
        pytest.skip(f"{case} at {ranks} ranks")
    spec = PipelineSpec(split_points=points, loss_fn=_loss, schedule=sched, microbatches=2)
    pipe = meshfuse.parallelize(_tied(), _mesh(shape, names), plan, pipeline=spec,
                                fsdp=fsdp[0] if fsdp else None)
    want_losses, want, first_grad = _tied_reference(accumulate)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses = []
    with record_communications() as comms:
        for i, (ids, target) in enumerate(_data()):
            losses.append(pipe.step({"input_ids": ids}, target))
            if i == 0:
                for name, grad in _tensors(pipe, grads=True):
                    if name in ("lm_head.weight", "model.embed_tokens.weight"):
                        part = first_grad.flatten()[grad.offset:grad.offset + grad.numel()]
                        torch.testing.assert_close(grad.flatten(), part, rtol=1e-5, atol=1e-6)
            if (i + 1) % accumulate == 0:
                opt.step()
                opt.zero_grad()
    last = {"zbv": 0, "pp3": 2}.get(case, 1)
    if rank // (d // shape[0]) == last:
        assert [x.item() for x in losses] == pytest.approx(want_losses, rel=1e-5)
    for name, value in _tensors(pipe):
        part = want[name].detach().flatten()[value.offset:value.offset + value.numel()]
        torch.testing.assert_close(value.detach().flatten(), part, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    width = d // shape[0]
    ends = {rank % width, (shape[0] - 1) * width + rank % width}
    if fsdp:  # every device of the two stages adds its piece
        ends = set(range(d))
    held = rank in ends and case != "zbv"
    added = "piece of the gradient (in its flat shard)" if fsdp else \
        "local shard of the gradient" if width == 1 or "alike" in case else "whole gradient"
    told = [line for line in pipe.explain().splitlines() if line.startswith("tied across")]
    assert told == ([(f"tied across stages: 'model.embed_tokens.weight' (stage 0), "
                      f"'lm_head.weight' (stage {len(points)}); this rank's copy adds its "
                      f"{added} with ranks {sorted(ends)} after each step")] if held else [])
    tie = [c for c in comms if c.kind == "allreduce" and set(c.ranks) == ends]
    if not held:
        assert not tie
    else:
        whole = VOCAB * HIDDEN * 4
        part = whole // width if case == "pp2_tp2_alike" else whole
        if case == "pp2_tp2" and rank // width == shape[0] - 1:
            part = whole  # the head's copy adds its whole gradient, gathered on its stage
        assert [c.bytes for c in tie] == [part] * STEPS


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["pp2", "zbv", "pp3", "pp2_tp2", "pp2_dp2"])
def test_gradients_clipped_over_the_whole_pipeline(multidevice_test, case):
    """``pipe.clip_grad_norm_`` gives the whole model's gradient norm on every rank (each
    element once: a replicated shard once over its devices, the tied weight once over its
    copies, a flat shard's pieces once) and scales as ``torch.nn.utils.clip_grad_norm_``
    on the one-device tied model: three clipped SGD steps reach its parameters."""
    ranks, shape, names, sched, points, plan, *fsdp = TIED[case]
    if multidevice_test.size != ranks:
        pytest.skip(f"{case} at {ranks} ranks")
    spec = PipelineSpec(split_points=points, loss_fn=_loss, schedule=sched, microbatches=2)
    pipe = meshfuse.parallelize(_tied(), _mesh(shape, names), plan, pipeline=spec,
                                fsdp=fsdp[0] if fsdp else None)
    ref = _tied()
    opt, ref_opt = (torch.optim.SGD(params, lr=0.5)
                    for params in (pipe.parameters(), ref.parameters()))
    for ids, target in _data():
        for o in (opt, ref_opt):
            o.zero_grad()
        pipe.step({"input_ids": ids}, target)
        _loss(ref(input_ids=ids), target).backward()
        norm = pipe.clip_grad_norm_(0.5)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert want > 0.5 and norm.item() == pytest.approx(want.item(), rel=1e-5)
        opt.step()
        ref_opt.step()
    want = dict(ref.named_parameters(remove_duplicate=False))
    for name, value in _tensors(pipe):
        part = want[name].detach().flatten()[value.offset:value.offset + value.numel()]
        torch.testing.assert_close(value.detach().flatten(), part, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.mpi
def test_a_tied_pipelines_checkpoint_loads_into_one_device_and_back(multidevice_test):
    """Each stage saves its copy under its own name (the embedding's and the head's): the
    checkpoint loads into the one-device tied model (both names, one parameter, AdamW's
    state included) and into a new pipeline, and the next step's loss is the uninterrupted
    one-device run's."""
    if multidevice_test.size != 2:
        pytest.skip("pp2 at 2 ranks")
    spec = PipelineSpec(split_points=["model.layers.2"], loss_fn=_loss, microbatches=2)
    pipe = meshfuse.parallelize(_tied(), _mesh((2,), ("pp",)), {}, pipeline=spec)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    data = _data()
    for ids, target in data[:2]:
        opt.zero_grad()
        pipe.step({"input_ids": ids}, target)
        opt.step()
    path = multidevice_test.communicator.allgather_object(
        tempfile.mkdtemp(prefix="meshfuse-ckpt-") if multidevice_test.rank == 0 else None)[0]
    (stage,) = pipe.stages.values()
    checkpoint.save(path, stage, opt)
    ref, loaded = _tied(), _tied()
    ref_opt, loaded_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, loaded))
    for ids, target in data[:2]:
        ref_opt.zero_grad()
        _loss(ref(input_ids=ids), target).backward()
        ref_opt.step()
    checkpoint.load(path, loaded, loaded_opt)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids, target = data[2]
    losses = []
    for model, model_opt in ((ref, ref_opt), (loaded, loaded_opt)):
        model_opt.zero_grad()
        loss = _loss(model(input_ids=ids), target)
        loss.backward()
        model_opt.step()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    again = meshfuse.parallelize(_tied(), _mesh((2,), ("pp",)), {}, pipeline=spec)
    again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    checkpoint.load(path, next(iter(again.stages.values())), again_opt, strict=False)
    loss = again.step({"input_ids": ids}, target)
    if multidevice_test.rank == 1:
        assert loss.item() == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.mpi
def test_a_tied_weight_a_pipeline_cannot_keep_equal_is_refused(multidevice_test):
    """Refused on every rank before any stage is laid out: a tie between two stages that
    ZBV puts on one rank laid out over tp or sharded over dp (two copies on the same
    devices)."""
    d = multidevice_test.size
    if d != 4:
        pytest.skip("pp2 x tp2 and pp2 x dp2 at 4 ranks")
    spec = PipelineSpec(split_points=["model.layers.1", "model.layers.2", "model.norm"],
                        loss_fn=_loss, schedule="ZBV", microbatches=2)
    with pytest.raises(DefinitionError, match=r"'model.embed_tokens.weight' \(stage 0\), "
                                              r"'lm_head.weight' \(stage 3\) is one weight "
                                              r"tied .* \(stages \[0, 3\] on ranks \[0, 0\]\)"):
        meshfuse.parallelize(_tied(), _mesh((2, 2), ("pp", "tp")), TP_PLAN, pipeline=spec)
    with pytest.raises(DefinitionError, match=r"stages \[0, 3\] on ranks \[0, 0\]"):
        meshfuse.parallelize(_tied(), _mesh((2, 2), ("pp", "dp")), {}, fsdp="dp",
                             pipeline=spec)


class _Piece(torch.Tensor):
    """A tensor and where its elements start among its parameter's (see ``_tensors``)."""


def _tensors(pipe, grads: bool = False):
    """``(name, piece)`` of each parameter (or gradient) this rank's stages hold: a DTensor's
    whole tensor, a flat shard's piece of each parameter, ``piece.offset`` the first
    element's place in the parameter."""
    for stage in pipe.stages.values():
        if hasattr(stage, "held_pieces"):  # a ShardedStage: one flat shard
            flat = stage.shard.grad if grads else stage.shard
            for held, _, start, stop, at in stage.held_pieces():
                if start < stop:
                    piece = flat[at:at + stop - start].as_subclass(_Piece)
                    piece.offset = start
                    yield held.removeprefix("module."), piece
            continue
        for name, p in stage.named_parameters():
            x = p.grad if grads else p
            piece = (x.full_tensor() if isinstance(x, DTensor) else x).as_subclass(_Piece)
            piece.offset = 0
            yield name, piece


@pytest.mark.mpi
def test_hf_pipeline_bad_batch_on_one_rank(multidevice_test):
    """At the first step rank 1 alone passes a batch of other rows than rank 0's; later a
    batch that does not split into the microbatches, then one of other rows than the first
    step's: every rank raises InputError (rank 0 naming rank 1) before anything is sent, and
    the next good step runs with the ranks in step."""
    if multidevice_test.size != 2:
        pytest.skip("two ranks")
    rank = multidevice_test.rank
    spec = PipelineSpec(split_points=["model.layers.2"], loss_fn=_loss, microbatches=2)
    pipe = meshfuse.parallelize(_model(), _mesh((2,), ("pp",)), {}, pipeline=spec)
    ids, target = _data()[0]
    with pytest.raises(InputError, match=r"ranks disagree on the pipeline step's inputs: rank "
                                         r"1 has \[2, 8\] torch.int64, rank 0 has \[4, 8\]"):
        pipe.step({"input_ids": ids[:2] if rank == 1 else ids}, target)
    pipe.step({"input_ids": ids}, target)
    for rows, message in ((3, r"input 0 of shape \(3, 8\) does not split"),
                          (2, r"\(2, 8\), torch.int64\),\) differ from those of the first")):
        rows = rows if rank == 1 else BATCH
        with pytest.raises(InputError, match=message) as info:
            pipe.step({"input_ids": ids[:rows]}, target[:rows])
        if rank == 0:
            assert str(info.value).startswith("rank 1: "), str(info.value)
    with record_communications() as comms:
        loss = pipe.step({"input_ids": ids}, target)
    assert (loss is not None) == (rank == 1)
    assert any(c.kind in ("send", "recv") for c in comms)

def test_cut_sends_every_value_live_across():
    """Cut at layers 1 and 2 of 3: cos, sin (made before layer 0 from the rotary
    frequencies, read by every layer) and the hidden states cross both boundaries, cos and
    sin passing through stage 1; the causal mask, made from positions alone, is made again
    by each stage. Where every stage holds the rotary frequencies (``shared``: the
    pipeline's rotary embedding module holds buffers only), each stage makes cos and sin
    too, and the hidden states alone cross; the head's boundary carries them alone."""
    model = _model()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    captured = capture(model, (), {"input_ids": ids, "use_cache": False})
    first, middle, last = cut_graph(captured, ["model.layers.1", "model.layers.2"])
    assert first.captured.user_inputs == ("input_ids",)  # the flag is part of the trace
    shapes = [tuple(n.meta["val"].shape) for n in first.captured.graph.nodes
              if n.name in first.sends]
    assert shapes == [(1, SEQ, HIDDEN // 4), (1, SEQ, HIDDEN // 4), (2, SEQ, HIDDEN)]
    assert middle.receives == first.sends and last.receives == middle.sends
    assert middle.sends[:2] == first.sends[:2]  # passed through
    assert set(middle.captured.parameters.values()) == {
        n for n, _ in model.named_parameters() if n.startswith("model.layers.1.")}
    assert first.captured.buffers and not last.captured.buffers  # the rotary frequencies
    shared = {"model.rotary_emb.inv_freq"}
    stages = cut_graph(captured, ["model.layers.1", "model.layers.2"], shared=shared)
    for stage in stages:
        assert set(stage.captured.buffers.values()) == shared
        masks = [n for n in stage.captured.graph.nodes
                 if n.target is torch.ops.aten.scaled_dot_product_attention.default]
        assert masks and all(m.args[3].op == "call_function" for m in masks)  # made here
    assert [len(s.sends) for s in stages] == [1, 1, 0]
    (head,) = cut_graph(captured, ["model.norm"])[0].sends
    assert head.startswith("add")  # the last layer's residual sum
    with pytest.raises(DefinitionError, match="'model.rotary_emb'.*order"):
        cut_graph(captured, ["model.layers.1", "model.rotary_emb"])
