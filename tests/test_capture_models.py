"""``meshfuse.parallelize`` on models nobody here wrote (``transformers``, tiny random
configurations): logits, loss and every parameter's gradient equal the unsharded module's,
the communications are the plan's, and AdamW steps follow the unsharded module's losses."""

from __future__ import annotations

import copy
import re
import warnings
from collections import Counter

import pytest
import torch
from capture_checks import check_gradients
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import meshfuse
from meshfuse import DeviceMesh
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.mpi

VOCAB, HIDDEN, BATCH, SEQ = 128, 32, 2, 8


# The decoder sizes every Llama-like family here is built with (small and random).
DECODER = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 64, "use_cache": False}


def _llama(num_hidden_layers: int = 2):
    config = transformers.LlamaConfig(**{**DECODER, "num_hidden_layers": num_hidden_layers})
    return transformers.LlamaForCausalLM(config)


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER))


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**DECODER, head_dim=8))


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64, use_cache=False,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": _llama, "qwen2": _qwen2, "mistral": _mistral, "gpt2": _gpt2}

# Module names of Megatron's layout, per model family: column-parallel inputs, row-parallel
# outputs, the norms sequence parallelism shards, the head (GPT-2's is tied to its
# embedding, which stays replicated: its fused qkv ``c_attn`` is sharded column-wise whole).
LLAMA_NAMES = {
    "columns": ["model.layers.*.self_attn.[qkv]_proj", "model.layers.*.mlp.gate_proj",
                "model.layers.*.mlp.up_proj"],
    "rows": ["model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj"],
    "norms": ["model.layers.*.*_layernorm", "model.norm"],
    "head": "lm_head",
}
GPT2_NAMES = {
    "columns": ["transformer.h.*.attn.c_attn", "transformer.h.*.mlp.c_fc"],
    "rows": ["transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_proj"],
    "norms": ["transformer.h.*.ln_[12]", "transformer.ln_f"],
    "head": None,
}


def megatron_plan(sequence_parallel: bool, names: dict = LLAMA_NAMES) -> dict:
    """Megatron's tensor parallel plan (with SP: norms and the residual stream sharded on
    the sequence)."""
    seq = Shard(1)
    cols = ColwiseParallel(input_layouts=seq) if sequence_parallel else ColwiseParallel()
    rows = RowwiseParallel(output_layouts=seq) if sequence_parallel else RowwiseParallel()
    plan = {**dict.fromkeys(names["columns"], cols), **dict.fromkeys(names["rows"], rows)}
    if names["head"]:
        plan[names["head"]] = ColwiseParallel(
            input_layouts=seq if sequence_parallel else Replicate(), output_layouts=Replicate())
    if sequence_parallel:
        plan.update(dict.fromkeys(names["norms"], SequenceParallel()))
    return plan


def _inputs(seed: int = 0):
    """Token ids and labels on this rank's device (the parallelized model's, its GPU where
    there is one; the reference module is put there too)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(current_device()),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(current_device()))


def _whole(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def _parallel(model_name: str, plan_name: str, multidevice_test, remat: str = "recompute"):
    torch.manual_seed(0)
    reference = {**MODELS, **OWN_PLAN_MODELS}[model_name]().to(current_device())
    model = copy.deepcopy(reference)
    names = GPT2_NAMES if model_name == "gpt2" else LLAMA_NAMES
    plan = reference.tp_plan if plan_name == "hf" else \
        megatron_plan(plan_name == "tp_sp", names)
    mesh = DeviceMesh(range(multidevice_test.size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        return reference, meshfuse.parallelize(model, mesh, plan, remat=remat)


@pytest.mark.parametrize("plan_name", ["tp", "tp_sp", "hf"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_logits_loss_and_gradients_match_the_module(multidevice_test, model_name, plan_name):
    if model_name == "gpt2" and plan_name == "hf":
        pytest.skip("GPT-2 has no Hugging Face tp plan")
    reference, model = _parallel(model_name, plan_name, multidevice_test)
    ids, labels = _inputs()
    with warnings.catch_warnings():
        # No graph break: embedding, the labels' padding and the loss have rules.
        warnings.simplefilter("error", GraphBreakWarning)
        out = model(input_ids=ids, labels=labels)
    expected = reference(input_ids=ids, labels=labels)
    assert type(out) is type(expected)
    torch.testing.assert_close(_whole(out.logits), expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_whole(out.loss), expected.loss, rtol=1e-5, atol=1e-6)
    _whole(out.loss).backward()
    expected.loss.backward()
    check_gradients(model, reference)


def _check_a_step(model, reference) -> None:
    """The parallelized ``model``'s logits, loss and gradients on :func:`_inputs` are the
    module ``reference``'s (graph breaks allowed)."""
    ids, labels = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        out = model(input_ids=ids, labels=labels)
    expected = reference(input_ids=ids, labels=labels)
    torch.testing.assert_close(_whole(out.logits), expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_whole(out.loss), expected.loss, rtol=1e-5, atol=1e-6)
    _whole(out.loss).backward()
    expected.loss.backward()
    check_gradients(model, reference)


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**DECODER, head_dim=8))


def _qwen3_moe():
    config = transformers.Qwen3MoeConfig(**DECODER, head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16)
    return transformers.Qwen3MoeForCausalLM(config)


def _deepseek_v3():
    """Multi-head latent attention, its dense layers only (``first_k_dense_replace``)."""
    config = transformers.DeepseekV3Config(
        **{**DECODER, "num_key_value_heads": 4}, moe_intermediate_size=16, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1)
    return transformers.DeepseekV3ForCausalLM(config)


# Families run with their own Hugging Face plan only (the Megatron plans' names differ).
OWN_PLAN_MODELS = {"qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}


@pytest.mark.parametrize("model_name", sorted(OWN_PLAN_MODELS))
def test_a_models_own_plan_as_given(multidevice_test, model_name):
    """``model.tp_plan`` as Hugging Face writes it: Qwen3's per-head ``q_norm``/``k_norm``
    are ``"replicated_with_grad_allreduce"`` (replicated; their gradients, partial over
    the head shards, come back whole); Qwen3-MoE's plan names a dense MLP's projections,
    which its layers (all of experts) lack; DeepSeek-V3's ``kv_a_proj_with_mqa`` is
    ``"mla_kv_a_proj"`` (replicated) and its attention fills its queries in place
    (``tests/test_capture_in_place.py``). Loss and gradients are the module's."""
    reference, model = _parallel(model_name, "hf", multidevice_test)
    _check_a_step(model, reference)
    params = dict(model.named_parameters())
    norm = params.get("model.layers.0.self_attn.q_norm.weight",
                      params.get("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"))
    assert all(isinstance(p, Replicate) for p in norm.placements)


def _ep_plan(model) -> dict:
    """The model's expert-parallel plan (``ep_plan``; ``_ep_plan`` in transformers 5.17)."""
    return dict(getattr(model, "ep_plan", None) or getattr(model, "_ep_plan", None) or {})


def test_a_models_expert_parallel_plan_is_refused_by_name():
    """Hugging Face's ``ep_plan`` styles (``grouped_gemm``, ``ep_dispatch_experts``) are
    not read: a DefinitionError names the entry and says what to do instead."""
    model = _qwen3_moe()
    plan = {**model.tp_plan, **_ep_plan(model),
            "model.layers.*.mlp.experts": "ep_dispatch_experts"}
    with pytest.raises(meshfuse.DefinitionError, match="expert parallelism .* ep_plan"):
        meshfuse.parallelize(model, DeviceMesh([0]), plan)


# What transformers 5.17's Qwen3-MoE plan holds for its experts (tensor parallelism inside
# each expert), which later versions leave out.
EXPERT_TP_ENTRIES = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                     "model.layers.*.mlp.experts.down_proj": "rowwise",
                     "model.layers.*.mlp.experts": "moe_tp_experts"}


def test_a_models_own_expert_tensor_parallel_entries_leave_its_experts_replicated(
        multidevice_test):
    """A model's own plan with its experts' tensor-parallel entries (transformers 5.17's
    Qwen3-MoE) works as the versions without them do: the experts replicated, the loss and
    gradients the module's. The same entries given for a model whose own plan lacks them
    are refused, as the ``ep_plan`` styles are."""
    torch.manual_seed(0)
    reference = _qwen3_moe().to(current_device())
    reference.tp_plan = {**reference.tp_plan, **EXPERT_TP_ENTRIES}
    model = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(model, DeviceMesh(range(multidevice_test.size)),
                                     reference.tp_plan)
    _check_a_step(model, reference)
    experts = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert all(isinstance(p, Replicate) for p in experts.placements)
    # its own plan without the entries (transformers 5.17's has them): the user's are refused
    plain = _qwen3_moe()
    plain.tp_plan = {k: v for k, v in plain.tp_plan.items() if ".mlp.experts" not in k}
    with pytest.raises(meshfuse.DefinitionError, match="moe_tp_experts"):
        meshfuse.parallelize(plain, DeviceMesh([0]), {**plain.tp_plan, **EXPERT_TP_ENTRIES})


def test_a_config_asking_for_a_cache_trains_without_one(multidevice_test):
    """A configuration as ``from_pretrained`` gives it (``use_cache=True``): the call is
    captured with ``use_cache=False`` (a training step reads no cache; a ``DynamicCache``
    among the outputs cannot be traced), ``past_key_values`` is None; a call that asks for
    the cache itself is refused, saying to pass ``use_cache=False``."""
    config = transformers.LlamaConfig(**{**DECODER, "use_cache": True})
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).to(current_device())
    model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(
        range(multidevice_test.size)), reference.tp_plan)
    ids, labels = _inputs()
    out = model(input_ids=ids, labels=labels)
    assert out.past_key_values is None
    torch.testing.assert_close(out.loss, reference(input_ids=ids, labels=labels).loss)
    with pytest.raises(meshfuse.DefinitionError, match="pass use_cache=False"):
        model(input_ids=ids, labels=labels, use_cache=True)


def test_a_users_key_that_matches_nothing_is_still_refused():
    """Only the model's own plan's keys may match nothing: a key of the user's (a typo) is
    an error naming it."""
    model = _qwen3_moe()
    plan = {**model.tp_plan, "model.layers.*.mlp.up_projection": "colwise"}
    with pytest.raises(meshfuse.DefinitionError, match="up_projection"):
        meshfuse.parallelize(model, DeviceMesh([0]), plan)


@pytest.mark.parametrize("remat", ["recompute_fused", "recompute_gathers"])
def test_other_remat_policies_give_the_modules_gradients(multidevice_test, remat):
    """Llama with TP+SP under other rematerialization policies than the default; with
    ``recompute_gathers`` the backward gathers each sequence-parallel input again (one
    more allgather per column-parallel group than ``recompute``'s backward)."""
    reference, model = _parallel("llama", "tp_sp", multidevice_test, remat)
    ids, labels = _inputs()
    out = model(input_ids=ids, labels=labels)
    expected = reference(input_ids=ids, labels=labels)
    torch.testing.assert_close(_whole(out.loss), expected.loss, rtol=1e-5, atol=1e-6)
    with record_communications() as comms:
        _whole(out.loss).backward()
    expected.loss.backward()
    check_gradients(model, reference)
    gathers = _fusion_traffic(comms)["allgather"]
    _, base_model = _parallel("llama", "tp_sp", multidevice_test)
    base_out = base_model(input_ids=ids, labels=labels)
    with record_communications() as base_comms:
        _whole(base_out.loss).backward()
    more = _fusion_traffic(base_comms)["allgather"]
    if multidevice_test.size > 1 and remat == "recompute_gathers":
        assert gathers > more, (gathers, more)
    else:
        assert gathers == more, (gathers, more)


def test_an_unknown_remat_policy_is_refused():
    with pytest.raises(meshfuse.DefinitionError, match="remat must be one of"):
        meshfuse.parallelize(_llama(1), DeviceMesh([0]), {}, remat="checkpoint")


def _fusion_traffic(comms) -> Counter:
    return Counter(c.kind for c in comms if len(c.ranks) > 1)


@pytest.mark.parametrize("plan_name", ["tp", "tp_sp", "hf"])
def test_communications_are_megatrons(multidevice_test, plan_name):
    """Per layer, forward: 2 allreduces (TP), or 2 allgathers and 2 reduce-scatters (TP+SP);
    the lm_head gathers its vocabulary shards (and, with SP, the sequence first). The HF
    plan is TP with the embedding vocabulary-parallel: one allreduce more."""
    reference, model = _parallel("llama", plan_name, multidevice_test)
    ids, labels = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model(input_ids=ids, labels=labels)  # build
        with record_communications() as comms:
            loss = _whole(model(input_ids=ids, labels=labels).loss)
        with record_communications() as backward:
            loss.backward()
    layers, size = 2, multidevice_test.size
    # Heads that the ranks do not divide are not split on head boundaries by the plan's
    # [heads * head_dim, hidden] weights: q (4 heads), k and v (2 each) are then gathered
    # before the reshape into heads (an all-gather each per layer; a warning says so).
    uneven_q = 4 % size != 0
    head_gathers = layers * (int(uneven_q) + 2 * int(2 % size != 0))
    if size == 1:
        assert _fusion_traffic(comms) == _fusion_traffic(backward) == Counter()
    elif plan_name in ("tp", "hf"):
        # The HF plan's vocabulary-parallel embedding: each rank looks up the tokens of its
        # vocabulary shard (zeros elsewhere), one allreduce of the embeddings. The loss reads
        # the gathered (replicated) logits: no loss-parallel traffic.
        # (transformers 5.17's plan has no embedding entry)
        embedding = int(plan_name == "hf" and "model.embed_tokens" in reference.tp_plan)
        assert _fusion_traffic(comms) == Counter(allreduce=2 * layers + embedding,
                                                 allgather=1 + head_gathers)
        if not head_gathers:
            # The transposes: the column-parallel inputs' gradients are partial sums (q, k,
            # v share one; gate and up another; the head's), the gathered logits' a slice.
            # The vocabulary-parallel embedding's weight gradient lands on the rows each
            # rank holds: none more for the HF plan.
            assert _fusion_traffic(backward) == Counter(allreduce=2 * layers + 1)
    else:
        # With all query heads gathered, the attention runs on each rank's sequence shard
        # (the residual stream's split), and an all-to-all per layer turns its output into
        # the head-dim split that the row-parallel output projection reads.
        assert _fusion_traffic(comms) == Counter(allgather=2 * layers + 2 + head_gathers,
                                                 reduce_scatter=2 * layers,
                                                 all_to_all=layers * int(uneven_q))
        if not head_gathers:
            # The transposes: a reduce-scatter per gathered input (the layers' and the
            # head's), an all-gather per reduce-scattered output. The norms' weights, read
            # by sequence shards, have partial gradients: Megatron allreduces each (5);
            # meshfuse's propagation allreduces 3 and gathers the activations of one
            # layer's norm instead (one all-gather more than the 4 transposes).
            assert _fusion_traffic(backward) == Counter(reduce_scatter=2 * layers + 1,
                                                        allgather=2 * layers + 1,
                                                        allreduce=3)


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_torch_compile_backend_matches_the_module(multidevice_test, model_name):
    """``torch.compile(backend=meshfuse.backend(...))`` with the model's own HF plan (GPT-2,
    which has none: Megatron's): the module keeps whole plain parameters, whose gradients
    come back whole."""
    torch.manual_seed(0)
    reference = MODELS[model_name]().to(current_device())
    model = copy.deepcopy(reference)
    mesh = DeviceMesh(range(multidevice_test.size))
    plan = megatron_plan(False, GPT2_NAMES) if model_name == "gpt2" else reference.tp_plan
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=meshfuse.backend(mesh, plan), dynamic=False)
    ids, labels = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        out = compiled(input_ids=ids, labels=labels)
    expected = reference(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    expected.loss.backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_adamw_steps_follow_the_module(multidevice_test, model_name):
    """20 AdamW steps on DTensor parameters (TP+SP): each step's loss equals the unsharded
    module's (the optimizer updates each rank's shard), and the model learns (the three
    batches' losses fall). The learning rate is a usual one (1e-3): Adam scales each
    gradient to the learning rate, float32 rounding noise too (likely that of gradients
    zero in exact arithmetic, such as a key projection's bias, which softmax ignores); at
    1e-2 the noise of sums taken in another order moved Qwen2's loss by 1.4e-5 (relative)
    in 5 steps at one rank."""
    reference, model = _parallel(model_name, "tp_sp", multidevice_test)
    history = []
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    for step in range(20):
        ids, labels = _inputs(step % 3)
        losses = []
        for m, opt in zip((model, reference), optimizers):
            opt.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", GraphBreakWarning)
                loss = _whole(m(input_ids=ids, labels=labels).loss)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6), step
        history.append(losses[0])
    assert sum(history[-3:]) < sum(history[:3]) - 0.1


def test_identical_layers_build_one_program(multidevice_test):
    """Four Llama layers under TP: every layer reads a replicated residual stream, so layers
    1-3 run layer 0's built program (and its derived backward); the values still match."""
    torch.manual_seed(0)
    reference = _llama(num_hidden_layers=4).to(current_device())
    model = copy.deepcopy(reference)
    mesh = DeviceMesh(range(multidevice_test.size))
    ids, labels = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(model, mesh, megatron_plan(False))
        out = model(input_ids=ids, labels=labels)
    text = model.explain()
    # Fusion 0 is the embedding (outside the repeated blocks), fusion 1 layer 0.
    assert re.search(r"fusion 1: \d+ ops over model\.layers\.0\n", text)
    assert text.count("the program of fusion 1 (an identical block, built once)") == 3
    expected = reference(input_ids=ids, labels=labels)
    torch.testing.assert_close(_whole(out.loss), expected.loss, rtol=1e-5, atol=1e-6)
    _whole(out.loss).backward()
    expected.loss.backward()
    check_gradients(model, reference)
