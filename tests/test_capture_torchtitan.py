"""``meshfuse.parallelize`` on torchtitan's Llama 3 (its PyPI package, a tiny random
configuration): logits and every parameter's gradient equal the unsharded module's under
Megatron's tensor + sequence parallel plan written in torchtitan's module names (the token
embedding vocabulary-parallel). Its complex RoPE (``view_as_complex``, complex multiply) runs
as graph breaks, the only ones."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from capture_checks import check_gradients
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import meshfuse
from meshfuse import DeviceMesh
from meshfuse.capture.program import GraphBreakWarning

pytest.importorskip("triton")  # torchtitan imports it
llama3 = pytest.importorskip("torchtitan.models.llama3")
attention = pytest.importorskip("torchtitan.models.common.attention")

pytestmark = pytest.mark.mpi

VOCAB, DIM, HEADS = 128, 64, 4


def _tiny_llama3(monkeypatch):
    """Two layers of torchtitan's Llama 3 with PyTorch's SDPA (its flex attention has no CPU
    backward; torchtitan builds SDPA only where asked directly)."""
    monkeypatch.setattr(llama3, "get_attention_config",
                        lambda backend: attention.ScaledDotProductAttention.Config())
    config = llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=llama3.Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=llama3.RMSNorm.Config(normalized_shape=DIM),
        lm_head=llama3.Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=llama3._build_llama3_layers(
            n_layers=2, dim=DIM, n_heads=HEADS, n_kv_heads=2, hidden_dim=128,
            rope=llama3.ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000),
            attn_backend="sdpa", fuse_qkv=False))
    return _built(config)


def _built(config):
    """The model of a torchtitan ``config``, its weights drawn small and seeded (the same on
    every rank)."""
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


def _titan_plan(sequence_parallel: bool) -> dict:
    """torchtitan's own TP(+SP) plan (``parallelize_llama``), its module names."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "layers.*.attention.qkv_linear.w[qkv]": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward.w[13]": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan.update({
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.ffn_norm": SequenceParallel(),
            "norm": SequenceParallel(),
            "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                                     desired_input_layouts=(Replicate(),)),
            "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),)),
        })
    return plan


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_torchtitan_llama3_matches_the_module(multidevice_test, monkeypatch,
                                              sequence_parallel):
    reference = _tiny_llama3(monkeypatch)
    model = copy.deepcopy(reference)
    mesh = DeviceMesh(range(multidevice_test.size))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphBreakWarning)
        model = meshfuse.parallelize(model, mesh, _titan_plan(sequence_parallel))
        out = model(ids)
    breaks = "\n".join(str(w.message) for w in caught if w.category is GraphBreakWarning)
    # Only the complex RoPE breaks (the embedding, now vocabulary-parallel, runs in a fusion).
    rope = [f"aten.{op}.{overload} in layers.{i}.attention.rope"
            for i in range(2) for op, overload in
            (("view_as_complex", "default"), ("mul", "Tensor"), ("view_as_real", "default"))]
    assert [line.split(":")[0].strip() for line in breaks.splitlines()
            if line.startswith("  ")] == rope
    expected = reference(ids)
    whole = out.full_tensor() if isinstance(out, DTensor) else out
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)
    dy = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    whole.backward(dy)
    expected.backward(dy)
    check_gradients(model, reference)


def test_torchtitan_llama3_adamw_steps_follow_the_module(multidevice_test, monkeypatch):
    """20 AdamW steps (TP+SP, the cross entropy on the gathered logits, outside the model):
    each step's loss equals the unsharded module's."""
    reference = _tiny_llama3(monkeypatch)
    mesh = DeviceMesh(range(multidevice_test.size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(copy.deepcopy(reference), mesh, _titan_plan(True))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    history = []
    for step in range(20):
        g = torch.Generator().manual_seed(step % 3)
        ids, labels = (torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(2))
        losses = []
        for m, opt in zip((model, reference), optimizers):
            opt.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", GraphBreakWarning)
                logits = m(ids)
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6), step
        history.append(losses[0])
    assert sum(history[-3:]) < sum(history[:3]) - 0.1  # it learns the three batches


def _tiny_qwen3_moe(monkeypatch):
    """Two layers of torchtitan's Qwen3 with routed experts (4, two per token), SDPA."""
    qwen3 = pytest.importorskip("torchtitan.models.qwen3")
    qwen3_model = pytest.importorskip("torchtitan.models.qwen3.model")
    for module in (qwen3, qwen3_model):
        if hasattr(module, "get_attention_config"):
            monkeypatch.setattr(module, "get_attention_config",
                                lambda backend: attention.ScaledDotProductAttention.Config())
    head = 16
    layers = qwen3._build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=2, dim=DIM, n_heads=HEADS, n_kv_heads=2, head_dim=head,
        attn_backend="sdpa", rope=qwen3.CosSinRoPE.Config(dim=head, max_seq_len=64,
                                                          theta=1e6),
        moe_hidden_dim=32, num_experts=4, top_k=2, moe_comm_backend="standard")
    config = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=qwen3._qwen3_norm(DIM), layers=layers,
        tok_embeddings=qwen3.Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=qwen3.Linear.Config(in_features=DIM, out_features=VOCAB))
    return _built(config)


def test_torchtitan_qwen3_moe_counts_its_tokens_per_expert(multidevice_test, monkeypatch):
    """torchtitan's Qwen3-MoE, attention tensor-parallel (its fused qkv column-wise), the
    experts replicated (their dispatch runs as graph breaks). Its MoE forward adds each
    step's token counts into the buffer ``tokens_per_expert_E`` in place (the auxiliary-loss
    free load balancing reads them): the module's buffers after two calls are the
    reference's; logits and gradients the module's (within float32's reordering: the
    gradients through the routing within 1e-3 of their norm)."""
    if multidevice_test.size not in (1, 2):
        pytest.skip("one and two ranks")
    reference = _tiny_qwen3_moe(monkeypatch)
    plan = {"layers.*.attention.qkv_linear.wqkv": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(
            range(multidevice_test.size)), plan)
        for seed in range(2):
            ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
            out, expected = model(ids), reference(ids)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            out.sum().backward()
            expected.sum().backward()
    counts = [(name, b) for name, b in reference.named_buffers() if "tokens_per_expert" in name]
    assert counts and all(b.sum() == 2 * 2 * 2 * 8 for _, b in counts)  # 2 calls x top 2
    for name, b in counts:
        torch.testing.assert_close(model.get_buffer(name), b, msg=name)
    check_gradients(model, reference, norm_tolerance=1e-3)


def _tiny_deepseek_v3(monkeypatch):
    """Two layers of torchtitan's DeepSeek-V3 (multi-head latent attention: the keys and
    values through a rank-32 projection and its norm; YaRN-scaled complex RoPE on 8 of each
    head's dimensions), the first with a dense feed-forward, the second with 4 routed experts
    (two per token) and a shared one, SDPA."""
    deepseek = pytest.importorskip("torchtitan.models.deepseek_v3")
    monkeypatch.setattr(deepseek, "get_attention_config",
                        lambda backend: attention.ScaledDotProductAttention.Config())
    common = pytest.importorskip("torchtitan.models.common")
    layers = deepseek._build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=0.70,
        dense_hidden_dim=128, moe_hidden_dim=32, num_experts=4, num_shared_experts=1,
        router_top_k=2, router_score_func="softmax", attn_backend="sdpa",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=common.ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0, scaling="yarn",
                                       rope_factor=40.0, beta_fast=32.0, beta_slow=1.0,
                                       original_seq_len=32))
    config = deepseek.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM, layers=layers, mtp_layers=[],
        tok_embeddings=common.Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=common.RMSNorm.Config(normalized_shape=DIM),
        lm_head=common.Linear.Config(in_features=DIM, out_features=VOCAB))
    return _built(config)


def _deepseek_plan() -> dict:
    """torchtitan's TP + SP plan for DeepSeek-V3 (its ``parallelize_deepseekv3``): the
    attention's query and latent-to-heads projections column-wise, the dense and shared
    experts' feed-forwards Megatron's way, the routed experts and the router replicated."""
    seq = Shard(1)
    into_blocks = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": into_blocks,
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wkv_b": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": into_blocks,
        "layers.*.feed_forward.w[13]": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "layers.*.moe": into_blocks,
        "layers.*.moe.shared_experts.w[13]": ColwiseParallel(),
        "layers.*.moe.shared_experts.w2": RowwiseParallel(output_layouts=seq),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }


def test_torchtitan_deepseek_v3_matches_the_module(multidevice_test, monkeypatch):
    """torchtitan's DeepSeek-V3 under its own TP + SP plan (at 3 ranks the 4 heads split
    unevenly), two calls: logits equal the module's, the load-balancing buffers (token counts, expert biases) too, and every
    gradient within 1e-3 of its norm (torchtitan computes the routed experts in bfloat16, in
    which float32's reorderings of the sharded attention flip roundings)."""
    reference = _tiny_deepseek_v3(monkeypatch)
    mesh = DeviceMesh(range(multidevice_test.size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(copy.deepcopy(reference), mesh, _deepseek_plan())
        for seed in range(2):
            ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
            out, expected = model(ids), reference(ids)
            whole = out.full_tensor() if isinstance(out, DTensor) else out
            torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)
            dy = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
            whole.backward(dy)
            expected.backward(dy)
    buffers = dict(reference.named_buffers())
    assert any("tokens_per_expert" in name for name in buffers)
    for name, b in model.named_buffers():
        whole = b.full_tensor() if isinstance(b, DTensor) else b
        torch.testing.assert_close(whole, buffers[name], msg=name)
    check_gradients(model, reference, norm_tolerance=1e-3)
    wq = model.get_submodule("layers.0.attention.wq").weight
    assert wq.placements == (Shard(0),)
