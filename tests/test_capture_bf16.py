"""``meshfuse.parallelize`` on bfloat16 models (``transformers``, tiny random configurations,
``model.to(torch.bfloat16)``): every value keeps the dtype PyTorch computes it in (float32
where the module casts up: RMSNorm's variance, the rotary tables; bfloat16 elsewhere), so the
logits, loss and gradients are those of the eager bfloat16 module, within bfloat16's rounding.

meshfuse's own arithmetic on bfloat16 returns float32 (nvFuser's rule); the capture casts each
ATen op's result back to the dtype the trace recorded (``aten_ops.as_traced``). Without it a
float32 value met a bfloat16 weight in the first ``q_proj``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor

import meshfuse
from meshfuse import DeviceMesh
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.testing.utils import current_device

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.mpi

VOCAB, HIDDEN, BATCH, SEQ = 128, 32, 2, 8


def _config(family: str):
    common = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "use_cache": False}
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64,
            use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
            bos_token_id=0, eos_token_id=0)
    if family == "mistral":
        common["head_dim"] = 8
    return getattr(transformers, f"{family.capitalize()}Config")(**common)


MODELS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel"}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(transformers, MODELS[family])(_config(family)).to(torch.bfloat16)


def _whole(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def _plan(family: str, reference: torch.nn.Module) -> dict:
    """The model's own Hugging Face plan (GPT-2 has none: Megatron's, by hand)."""
    if family != "gpt2":
        return reference.tp_plan
    return {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.mlp.c_fc": "colwise",
            "transformer.h.*.attn.c_proj": "rowwise", "transformer.h.*.mlp.c_proj": "rowwise"}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """bfloat16's tolerance: the error's norm within 2% of the value's (bfloat16 keeps 8
    bits: each rounding moves a value by up to 0.4%; sums rounded in another order differ
    element-wise by more where terms cancel, so no element-wise bound). The loss is float32
    (Hugging Face's loss casts the logits up) but computed from bfloat16 logits."""
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    error = (actual.float() - expected.float()).norm() / expected.float().norm()
    assert error <= 2e-2, f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("family", sorted(MODELS))
def test_bf16_models_match_the_eager_bf16_module(multidevice_test, family):
    reference = _model(family).to(current_device())
    mesh = DeviceMesh(range(multidevice_test.size))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphBreakWarning)
        model = meshfuse.parallelize(copy.deepcopy(reference), mesh, _plan(family, reference))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(current_device())
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(current_device())
        out = model(input_ids=ids, labels=labels)
    expected = reference(input_ids=ids, labels=labels)
    assert expected.logits.dtype == torch.bfloat16
    _close(_whole(out.logits), expected.logits, "logits")
    _close(_whole(out.loss), expected.loss, "loss")
    _whole(out.loss).backward()
    expected.loss.backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16, name
        _close(p.grad.full_tensor(), ref.grad, name)
