"""A parallelized model called at other batch and sequence lengths than its first call: each
new input signature is captured and built once (cached by shape), an earlier one is reused,
and every call computes what the module computes (sequence lengths that do not divide the
ranks included, under sequence parallelism)."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import meshfuse
from meshfuse import DeviceMesh
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.runtime.comm.collectives import record_communications

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.mpi

VOCAB = 128


def _config(layers: int, kv_heads: int = 2):
    """A small Llama's configuration; the random weights drawn after it are seeded."""
    torch.manual_seed(0)
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        use_cache=False)


def _megatron_sp() -> dict:
    """Megatron's TP+SP layout (as tests/test_capture_models.py's)."""
    seq = Shard(1)
    return {"model.layers.*.self_attn.[qkv]_proj": ColwiseParallel(input_layouts=seq),
            "model.layers.*.mlp.[gu]*_proj": ColwiseParallel(input_layouts=seq),
            "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=seq),
            "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=seq),
            "model.layers.*.*_layernorm": SequenceParallel(),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}


def test_new_batch_and_sequence_lengths_capture_once_each(multidevice_test):
    config = _config(2)
    reference = transformers.LlamaForCausalLM(config)
    model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(
        range(multidevice_test.size)), _megatron_sp())
    g = torch.Generator().manual_seed(1)
    shapes = [(2, 8), (3, 5), (2, 8)]  # 5 splits unevenly over 2-4 ranks
    for i, (batch, seq) in enumerate(shapes):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
        with warnings.catch_warnings():
            warnings.simplefilter("error", GraphBreakWarning)
            out = model(input_ids=ids, labels=labels)
        expected = reference(input_ids=ids, labels=labels)
        logits = out.logits.full_tensor() if isinstance(out.logits, DTensor) else out.logits
        assert logits.shape == (batch, seq, VOCAB)
        torch.testing.assert_close(logits, expected.logits, rtol=1e-5, atol=1e-5)
        loss = out.loss.full_tensor() if isinstance(out.loss, DTensor) else out.loss
        torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        expected.loss.backward()
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, i=i: f"call {i}, {name}: {m}")
        # one program per shape; the third call reuses the first's
        assert len(model._meshfuse.programs) == len(set(shapes[:i + 1]))


def test_hf_plan_with_a_vocab_parallel_head_computes_the_loss_without_gathering_logits(
        multidevice_test):
    """The model's own tp plan with its head column-parallel (``"colwise"``: logits sharded
    over the vocabulary, as DTensor's ``loss_parallel`` wants): cross entropy runs
    loss-parallel (3 allreduces of one value per token), no all-gather of logits; the
    logits come back as a vocabulary-sharded DTensor."""
    config = _config(2, kv_heads=4)
    reference = transformers.LlamaForCausalLM(config)
    plan = {**reference.tp_plan, "lm_head": "colwise"}
    size = multidevice_test.size
    model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(range(size)), plan)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    labels = torch.randint(0, VOCAB, (2, 8), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphBreakWarning)
        model(input_ids=ids, labels=labels)  # build
        with record_communications() as comms:
            out = model(input_ids=ids, labels=labels)
    expected = reference(input_ids=ids, labels=labels)
    assert isinstance(out.logits, DTensor) and out.logits.placements == (Shard(2),)
    torch.testing.assert_close(out.logits.full_tensor(), expected.logits, rtol=1e-5,
                               atol=1e-5)
    loss = out.loss.full_tensor() if isinstance(out.loss, DTensor) else out.loss
    torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=1e-6)
    crossing = [c for c in comms if len(c.ranks) > 1]
    shard_bytes = 2 * 8 * (VOCAB // size) * 4
    assert not [c for c in crossing if c.kind == "allgather" and c.bytes >= shard_bytes]
    if size > 1:
        # per layer 2 (Megatron), the vocabulary-parallel embedding 1 (where the plan has
        # it: transformers 5.17's has not), the loss 3
        embedding = int("model.embed_tokens" in plan)
        assert sum(c.kind == "allreduce" for c in crossing) == 2 * 2 + embedding + 3
    loss.backward()
    expected.loss.backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("call", ["input_ids", "with labels", "positional"])
def test_an_input_shaped_otherwise_on_one_rank_is_an_error_on_every_rank(multidevice_test,
                                                                         call):
    """Rank 1 passes a shorter sequence than the others to a parallelized model: every rank
    raises a typed error naming the disagreement and the model's argument (no hang, no raw
    collective error)."""
    if multidevice_test.size < 2:
        pytest.skip("needs two ranks")
    config = _config(1)
    model = meshfuse.parallelize(transformers.LlamaForCausalLM(config),
                                 DeviceMesh(range(multidevice_test.size)), _megatron_sp())
    seq = 6 if multidevice_test.rank == 1 else 8
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
    named = "argument [0]" if call == "positional" else "input_ids"
    with pytest.raises(meshfuse.InputError, match=rf"ranks disagree on input T\d+ \('{re.escape(named)}'"
                       r"\) .*rank 1 has torch.int64 of local shape \[2, 6\]"):
        if call == "positional":
            model(ids)
        else:
            model(input_ids=ids, labels=ids.clone() if call == "with labels" else None)


@pytest.mark.parametrize("ranks_wrong", ["every", "one"])
def test_an_input_on_another_device_is_named_on_every_rank(multidevice_test, ranks_wrong):
    """Token ids on another device than the parallelized model's parameters (CPU ids for a
    model on CUDA; here meta ids for a model on the CPU) at its first call: every rank
    raises a typed error naming the argument and the parameters' device (the trace failed
    inside PyTorch, with advice about caches; a rank alone in error left the others waiting
    in the program's first collective)."""
    config = _config(1)
    model = meshfuse.parallelize(transformers.LlamaForCausalLM(config),
                                 DeviceMesh(range(multidevice_test.size)), _megatron_sp())
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    wrong = ranks_wrong == "every" or multidevice_test.rank == min(1, multidevice_test.size - 1)
    here = next(model.parameters()).to_local().device
    given = ids.to("meta") if wrong else ids.to(here)
    with pytest.raises(meshfuse.InputError,
                       match=rf"input_ids is on meta, the model's parameters on "
                             rf"{here}: move the inputs there first"):
        model(input_ids=given, labels=given)


def test_folded_constants_enter_fusions_as_one_dtensor_until_they_change(multidevice_test):
    """The rotary tables and masks that every layer reads are folded constants: each enters
    the layers' fusions as one replicated DTensor, made once, not two per layer and step;
    when a buffer they are folded from changes (``inv_freq`` scaled in place, as a context
    extension would), they are folded again and the new values reach the fusions. Losses
    equal the unmodified module's."""
    config = _config(2)
    reference = transformers.LlamaForCausalLM(config)
    model = meshfuse.parallelize(copy.deepcopy(reference),
                                 DeviceMesh(range(multidevice_test.size)), _megatron_sp())
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    here = ids.to(next(model.parameters()).to_local().device)

    def loss_of(out):
        return (out.loss.full_tensor() if isinstance(out.loss, DTensor) else out.loss).cpu()

    for _ in range(2):
        torch.testing.assert_close(loss_of(model(input_ids=here, labels=here)),
                                   reference(input_ids=ids, labels=ids).loss)
    program = model._meshfuse.last
    first = {name: kept[2] for name, kept in program._replicas.items()}
    assert first  # the layers' rotary tables, at least
    model(input_ids=here, labels=here)
    assert all(program._replicas[name][2] is d for name, d in first.items())
    for m in (model, reference):
        m.model.rotary_emb.inv_freq.mul_(0.5)
    torch.testing.assert_close(loss_of(model(input_ids=here, labels=here)),
                               reference(input_ids=ids, labels=ids).loss)
    assert any(program._replicas[name][2] is not d for name, d in first.items())
