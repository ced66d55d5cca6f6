"""The Llama-family model of :mod:`meshfuse.examples.llama` in plain PyTorch, on one device.

Its modules are laid out and named as ``transformers``' ``LlamaForCausalLM`` (so one state
dict loads into both, and into the meshfuse model): the training script's single-device
baseline, written here so that the example needs no ``transformers``. The tests check it
against ``LlamaForCausalLM`` itself, and train the meshfuse model against the latter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshfuse.examples.llama import LlamaConfig, rope_tables


def _linear(n_in: int, n_out: int) -> torch.nn.Linear:
    return torch.nn.Linear(n_in, n_out, bias=False)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=-1)
    return t * cos + torch.cat([-second, first], dim=-1) * sin


class _Attention(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg, dh = cfg, cfg.head_dim
        self.q_proj = _linear(cfg.hidden, cfg.heads * dh)
        self.k_proj = _linear(cfg.hidden, cfg.kv_heads * dh)
        self.v_proj = _linear(cfg.hidden, cfg.kv_heads * dh)
        self.o_proj = _linear(cfg.heads * dh, cfg.hidden)

    def forward(self, x, cos, sin):
        def heads(t):
            return t.unflatten(-1, (-1, self.cfg.head_dim)).transpose(1, 2)

        q = _rotate(heads(self.q_proj(x)), cos, sin)
        k = _rotate(heads(self.k_proj(x)), cos, sin)
        a = F.scaled_dot_product_attention(q, k, heads(self.v_proj(x)), is_causal=True,
                                           enable_gqa=True)
        return self.o_proj(a.transpose(1, 2).flatten(2))


class _Mlp(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(cfg.hidden, cfg.ffn), _linear(cfg.hidden, cfg.ffn)
        self.down_proj = _linear(cfg.ffn, cfg.hidden)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = torch.nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = torch.nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.mlp = _Mlp(cfg)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Decoder(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = torch.nn.ModuleList(_Layer(cfg) for _ in range(cfg.layers))
        self.norm = torch.nn.RMSNorm(cfg.hidden, eps=cfg.eps)


class LlamaTorch(torch.nn.Module):
    """``LlamaTorch(cfg)(ids, targets)`` is the mean cross entropy of the next-token logits
    ``[batch, seq, vocab]`` against ``targets`` (class indices)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Decoder(cfg)
        self.lm_head = _linear(cfg.hidden, cfg.vocab)
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.to(cfg.torch_dtype)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.model.norm(x))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
