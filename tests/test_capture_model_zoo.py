"""``meshfuse.parallelize`` with each ``transformers`` family's own tensor-parallel plan
(``model.tp_plan``, as Hugging Face writes it), unmodified: dense decoders, mixtures of
experts, linear attention and state-space hybrids, each built small and random from its
configuration class (Falcon and StableLM have no plan: not here). Logits and every
parameter's gradient equal the unsharded module's, the plan shards parameters, and their
communications cross ranks.

The families whose plans or layers need more than this (a Megatron plan written here,
DeepSeek-V3's latent attention, the expert-parallel plan) are in
``tests/test_capture_models.py``; graph breaks are allowed here (a router's random jitter, a
mamba scan)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import meshfuse
from meshfuse import DeviceMesh
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.dtensor import mesh_to_torch
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.mpi

VOCAB, BATCH, SEQ = 128, 2, 8

SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "max_position_embeddings": 64,
         "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
# (``use_cache`` left at the configs' default, True: a parallelized model builds no cache;
# the eager references are called with use_cache=False: Jamba's and Qwen3-Next's own
# forward fails building its cache in training, and so does the compile backend's graph)

# Set where a configuration has them: no dropout (the reference and the parallel model
# would draw different masks), four small experts, two of them per token.
NO_DROPOUT = ("attention_dropout", "hidden_dropout", "residual_dropout", "resid_pdrop",
              "embd_pdrop", "attn_pdrop", "ffn_dropout")
SMALL_EXPERTS = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}

# Family (``model_type``) -> what its configuration needs besides SIZES.
DENSE = {
    "apertus": {}, "arcee": {}, "cohere": {}, "cohere2": {}, "ernie4_5": {}, "exaone4": {},
    "gemma": {}, "gemma2": {}, "gemma3_text": {}, "glm": {},
    "glm4": {}, "gpt_neox": {}, "gptj": {"rotary_dim": 4}, "codegen": {"rotary_dim": 4},
    "granite": {}, "helium": {}, "hunyuan_v1_dense": {}, "internlm3": {}, "ministral": {},
    "nemotron": {}, "olmo": {}, "olmo2": {}, "olmo3": {}, "phi": {}, "phi3": {},
    "qwen3": {}, "seed_oss": {}, "smollm3": {}, "starcoder2": {},
}
EXPERTS = {
    "ernie4_5_moe": {}, "exaone_moe": {}, "glm4_moe": {}, "gpt_oss": {}, "granitemoe": {},
    "granitemoeshared": {}, "hunyuan_v1_moe": {}, "llama4_text": {}, "minimax": {},
    "mixtral": {}, "olmoe": {}, "phimoe": {}, "qwen2_moe": {},
}
HYBRIDS = {"jamba": {}, "lfm2": {}, "qwen3_next": {}}
FAMILIES = {**DENSE, **EXPERTS, **HYBRIDS}
# Run at every world size (1, 2, 4: four ranks split the two key/value heads); the others at
# two ranks only, to keep the suite's time: one of each kind of layer.
AT_EVERY_SIZE = {"gemma2", "gpt_neox", "phi3", "gpt_oss", "phimoe", "qwen2_moe", "lfm2"}
# (and fully sharded: test_a_family_fully_sharded_trains_as_the_module)


def _model(family: str):
    """The family's causal LM, small and random (seeded)."""
    sizes = {k: v for k, v in {**SIZES, **FAMILIES[family]}.items() if v is not None}
    config = transformers.AutoConfig.for_model(family, **sizes)
    for name in NO_DROPOUT:
        if hasattr(config, name):
            setattr(config, name, 0.0)
    for name, value in SMALL_EXPERTS.items():
        if hasattr(config, name):
            setattr(config, name, value)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(current_device())


def _whole(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_familys_own_plan_gives_the_modules_logits_and_gradients(multidevice_test, family):
    ranks = multidevice_test.size
    if ranks != 2 and family not in AT_EVERY_SIZE:
        pytest.skip("run at two ranks (AT_EVERY_SIZE lists the families run at each size)")
    reference = _model(family)
    assert reference.tp_plan, f"{family} has no tensor-parallel plan"
    ranks = multidevice_test.size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(range(ranks)),
                                     reference.tp_plan)
        g = torch.Generator().manual_seed(1)
        ids, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(current_device())
                       for _ in range(2))
        with record_communications() as communications:
            out = model(input_ids=ids, labels=labels)
            _whole(out.loss).backward()
    expected = reference(input_ids=ids, labels=labels, use_cache=False)
    expected.loss.backward()
    torch.testing.assert_close(_whole(out.logits), expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_whole(out.loss), expected.loss, rtol=1e-5, atol=1e-6)
    parameters = dict(model.named_parameters())
    assert list(parameters) == [n for n, _ in reference.named_parameters()]
    for (name, p), ref in zip(parameters.items(), reference.parameters()):
        if ref.grad is None:  # a parameter this step does not reach (an unrouted expert)
            assert p.grad is None or not _whole(p.grad).any(), name
            continue
        assert p.grad.placements == p.placements, name
        torch.testing.assert_close(_whole(p.grad), ref.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if ranks > 1:
        sharded = [n for n, p in parameters.items()
                   if any(isinstance(s, Shard) for s in p.placements)]
        assert sharded, f"{family}'s plan sharded no parameter"
        assert any(len(c.ranks) > 1 for c in communications)


@pytest.mark.parametrize("family", sorted(AT_EVERY_SIZE))
def test_a_family_fully_sharded_trains_as_the_module(multidevice_test, family):
    """``fsdp="dp"``: at two ranks FSDP alone, at four dp=2 x tp=2 with the family's own
    plan. Two AdamW steps follow the module's losses; every parameter of more than one row
    is sharded over dp (one of a single row, Qwen2-MoE's shared-expert gate, stays
    replicated there: nothing to split)."""
    ranks = multidevice_test.size
    if ranks == 1:
        pytest.skip("FSDP needs two ranks or more")
    sizes = {"dp": 2, "tp": ranks // 2} if ranks == 4 else {"dp": ranks}
    mesh = mesh_to_torch(DeviceMesh(torch.arange(ranks).reshape(tuple(sizes.values()))),
                         mesh_dim_names=tuple(sizes))
    reference = _model(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(copy.deepcopy(reference), mesh,
                                     reference.tp_plan if "tp" in sizes else {}, fsdp="dp")
    for name, p in model.named_parameters():
        split = isinstance(p.placements[0], Shard | _StridedShard)
        assert split == (p.shape[0] > 1), f"{name} {tuple(p.shape)}: {p.placements}"
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        ids, labels = (torch.randint(0, VOCAB, (2 * sizes["dp"], SEQ), generator=g)
                       .to(current_device()) for _ in range(2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GraphBreakWarning)
            loss = _whole(model(input_ids=ids, labels=labels).loss)
            loss.backward()
        expected = reference(input_ids=ids, labels=labels, use_cache=False).loss
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, step=step: f"step {step}: {m}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


# Pipelined (test_a_family_pipelined_trains_as_the_module): Llama-4's rotary frequencies
# are complex and its router a Linear subclass computing its top-k, Qwen3-Next's layers
# assign into slices (ATen's copy), PhiMoE's router breaks the graph; GPT-NeoX's layers are
# ``gpt_neox.layers``.
PIPELINED = {"gpt_neox", "llama4_text", "phimoe", "qwen3_next"}


def _cross_entropy(out, target):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


@pytest.mark.parametrize("family", sorted(PIPELINED))
def test_a_family_pipelined_trains_as_the_module(multidevice_test, family):
    """Two stages cut at the second layer (its ModuleList found by name), two microbatches
    under 1F1B: at two ranks pp=2, at four pp=2 x tp=2 with the family's own plan. Two AdamW
    steps give the module's losses on the last stage's ranks."""
    ranks = multidevice_test.size
    if ranks not in (2, 4):
        pytest.skip("pp=2 at two ranks, pp=2 x tp=2 at four")
    reference = _model(family)
    layers = next(n for n, m in reference.named_modules()
                  if isinstance(m, torch.nn.ModuleList) and len(m) == 2)
    g = torch.Generator().manual_seed(1)
    data = [tuple(torch.randint(0, VOCAB, (4, SEQ), generator=g).to(current_device())
                  for _ in range(2)) for _ in range(2)]
    model = copy.deepcopy(reference)
    expected = []
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for ids, target in data:
        optimizer.zero_grad()
        loss = _cross_entropy(reference(input_ids=ids, use_cache=False), target)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    sizes = {"pp": 2, "tp": 2} if ranks == 4 else {"pp": 2}
    mesh = mesh_to_torch(DeviceMesh(torch.arange(ranks).reshape(tuple(sizes.values()))),
                         mesh_dim_names=tuple(sizes))
    spec = meshfuse.PipelineSpec(split_points=[f"{layers}.1"], loss_fn=_cross_entropy,
                                 microbatches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        pipe = meshfuse.parallelize(model, mesh, reference.tp_plan if ranks == 4 else {},
                                    pipeline=spec)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        losses = []
        for ids, target in data:
            optimizer.zero_grad()
            losses.append(pipe.step({"input_ids": ids}, target))
            optimizer.step()
    if multidevice_test.rank >= ranks // 2:  # the last stage's ranks
        assert [x.item() for x in losses] == pytest.approx(expected, rel=1e-5)
    else:
        assert losses == [None, None]


# Through torch.compile (test_the_compile_backend_takes_a_familys_own_plan): Llama-4's plan
# names its experts' tensor parallelism (``moe_tp_experts``), which a Dynamo graph cannot
# tell from the model's own plan: read as its own (the experts replicated).
COMPILED = {"gpt_neox", "llama4_text", "qwen2_moe"}


@pytest.mark.parametrize("family", sorted(COMPILED))
def test_the_compile_backend_takes_a_familys_own_plan(multidevice_test, family):
    """``torch.compile(model, backend=meshfuse.backend(mesh, model.tp_plan))`` at two ranks:
    the module's logits and gradients (whole, on its plain parameters), and the plan's
    communications ran (Dynamo did not fall back to the eager module)."""
    if multidevice_test.size != 2:
        pytest.skip("run at two ranks")
    reference = _model(family)
    model = copy.deepcopy(reference)
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=False, backend=meshfuse.backend(
        DeviceMesh(range(2)), reference.tp_plan))
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(current_device())
                   for _ in range(2))
    with warnings.catch_warnings(), record_communications() as communications:
        warnings.simplefilter("ignore", GraphBreakWarning)
        out = compiled(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
    expected = reference(input_ids=ids, labels=labels, use_cache=False)
    expected.loss.backward()
    assert any(len(c.ranks) > 1 for c in communications)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        if ref.grad is not None:
            torch.testing.assert_close(p.grad, ref.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
