"""A Mixtral-like model: :mod:`meshfuse.examples.llama` with a mixture of experts in place of
each block's MLP, and its plain-PyTorch twin.

Each block's MLP becomes a router (``mlp.gate.weight [E, hidden]``, softmax scores, top-k,
renormalized: Mixtral's routing) and ``E`` SwiGLU experts (``mlp.experts.w1 [E, ffn,
hidden]``, ``w2 [E, hidden, ffn]``, ``w3``). On a mesh the attention runs tensor + sequence
parallel as in the Llama example, and the experts run **expert parallel** over the same
ranks: the tokens stay split along the sequence (one sequence per step) and travel to their
experts' ranks and back (docs/experts.md). ``MixtralBlock.expert_parallel = False``
replicates the experts instead (each rank runs them on its sequence shard).
``MixtralTorch`` is the same model on one device.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from meshfuse.examples import llama
from meshfuse.examples.llama import LlamaBlock, LlamaConfig, LlamaEmbedding, LlamaHead
from meshfuse.examples.llama_torch import LlamaTorch
from meshfuse.ir.mesh import DeviceMesh

EXPERTS = ("mlp.gate.weight", "mlp.experts.w1", "mlp.experts.w2", "mlp.experts.w3")


@dataclasses.dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """Llama's sizes (``ffn``: each expert's), plus the experts and how many a token uses."""

    experts: int = 4
    top_k: int = 2


def block_parameter_shapes(cfg: MixtralConfig) -> dict[str, tuple[int, ...]]:
    shapes = {k: v for k, v in llama.block_parameter_shapes(cfg).items()
              if not k.startswith("mlp.")}
    e, f, h = cfg.experts, cfg.ffn, cfg.hidden
    return shapes | dict(zip(EXPERTS, [(e, h), (e, f, h), (e, h, f), (e, f, h)]))


def init_parameters(cfg: MixtralConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """As the Llama example's: norms near 1, weights scaled by 1/sqrt(fan_in)."""
    params = llama.init_parameters(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for layer in range(cfg.layers):
        prefix = f"model.layers.{layer}."
        for name in [k for k in params if k.startswith(prefix + "mlp.")]:
            del params[name]
        for name in EXPERTS:
            shape = block_parameter_shapes(cfg)[name]
            params[prefix + name] = (torch.randn(shape, generator=gen) /
                                     shape[-1] ** 0.5).to(cfg.torch_dtype)
    return params


class MixtralBlock(LlamaBlock):
    """A decoder layer with a mixture of experts; one sequence (batch 1), its tokens split
    over the mesh with the experts."""

    expert_parallel = True  # False: the experts replicated (see the module doc)

    def definition(self) -> None:
        cfg, o = self.cfg, self.ops
        if self.batch != 1:
            raise ValueError("MixtralBlock runs one sequence per step (batch 1)")
        tp = 1 if self.mesh is None else self.mesh.size
        kv_axis = 0 if cfg.kv_heads % tp == 0 else None
        axes = {"q_proj": 0, "k_proj": kv_axis, "v_proj": kv_axis, "o_proj": 1}
        if self.expert_parallel:
            axes |= {"w1": 0, "w2": 0, "w3": 0}
        x = self.pin(self.define_tensor([1, cfg.seq, cfg.hidden], dtype=self.dtype,
                                        contiguity=True), 1)
        rope = [self.pin(self.define_tensor([cfg.seq, cfg.head_dim], dtype=self.dtype,
                                            contiguity=True), None) for _ in "cs"]
        p = {name.split(".")[-2] if name.endswith("weight") else name.split(".")[-1]:
             self.parameter(name, shape, axes.get(name.split(".")[-1]))
             for name, shape in block_parameter_shapes(cfg).items()}
        n1 = self.gathered(o.rms_norm(x, p["input_layernorm"], cfg.eps))
        q = self.rotate(self.heads(o.linear(n1, p["q_proj"]), cfg.heads), *rope)
        k = self.rotate(self.heads(o.linear(n1, p["k_proj"]), cfg.kv_heads), *rope)
        v = self.heads(o.linear(n1, p["v_proj"]), cfg.kv_heads)
        attn, *_ = o.sdpfa_fwd(q, k, v, 0.0, True)
        h = self.residual(x, o.linear(self.merged(attn), p["o_proj"]))
        # the tokens pinned split along the sequence: expert parallel (its backward too)
        tokens = self.pin(o.squeeze(self.io(o.rms_norm(h, p["post_attention_layernorm"],
                                                       cfg.eps)), [0]), 0)
        weights, indices = o.moe_route(o.linear(tokens, p["gate"]), top_k=cfg.top_k)
        routed, _, _ = o.moe_experts(tokens, indices, weights, p["w1"], p["w2"], p["w3"])
        y = self.pin(o.broadcast_in_dim(self.pin(routed, 0), [1, cfg.seq, cfg.hidden],
                                        [1, 2]), 1)
        self.add_output(self.residual(h, y))


class MixtralModel(torch.nn.Module):
    """The model as fusion modules on this rank: ``model(ids, targets)`` is the loss (see
    ``llama.LlamaModel``; one sequence per step)."""

    def __init__(self, cfg: MixtralConfig, params: dict[str, torch.Tensor],
                 mesh: DeviceMesh | None = None, device=None) -> None:
        super().__init__()
        self.fsdp = None  # no data-parallel dimension (LlamaModel.forward reads it)
        self.embed = llama.fusion_module(LlamaEmbedding(cfg, 1, mesh), params, "")
        block = MixtralBlock(cfg, 1, mesh)
        self.blocks = torch.nn.ModuleList(
            llama.fusion_module(block, params, f"model.layers.{i}.")
            for i in range(cfg.layers))
        self.head = llama.fusion_module(LlamaHead(cfg, 1, mesh), params, "")
        cos, sin = llama.rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.to(device)

    forward = llama.LlamaModel.forward


class _TorchExperts(torch.nn.Module):
    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = torch.nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = torch.nn.ParameterDict({
            n: torch.nn.Parameter(torch.empty(s)) for n, s in
            (("w1", (cfg.experts, cfg.ffn, cfg.hidden)), ("w2", (cfg.experts, cfg.hidden,
                                                                 cfg.ffn)),
             ("w3", (cfg.experts, cfg.ffn, cfg.hidden)))})

    def forward(self, x):
        tokens = x.flatten(0, 1)
        probs = self.gate(tokens).softmax(-1)
        top, indices = probs.topk(self.cfg.top_k, -1)
        top = top / top.sum(-1, keepdim=True)
        y = torch.zeros_like(tokens)
        w1, w2, w3 = (self.experts[n] for n in ("w1", "w2", "w3"))
        for e in range(self.cfg.experts):
            token, slot = torch.nonzero(indices == e, as_tuple=True)
            h = F.silu(tokens[token] @ w1[e].t()) * (tokens[token] @ w3[e].t())
            y = y.index_add(0, token, (h @ w2[e].t()) * top[token, slot, None])
        return y.view_as(x)


class MixtralTorch(LlamaTorch):
    """The model on one device in plain PyTorch, named as :func:`init_parameters`."""

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__(cfg)
        for layer in self.model.layers:
            layer.mlp = _TorchExperts(cfg)
        self.to(cfg.torch_dtype)
