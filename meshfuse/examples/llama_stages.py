"""The Llama-family model of :mod:`meshfuse.examples.llama_torch` as pipeline pieces, and a
few AdamW steps of it under a pipeline schedule beside the same steps on one device.

:func:`llama_pieces` lists the model's parts in order (the embedding, each decoder layer,
the final norm with the head), sharing the model's parameters, for
:func:`meshfuse.parallel.stages.split_pieces`; :func:`train_pipelined` trains them under a
named schedule on this rank's stages, and :func:`train_single` the whole model on one device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from meshfuse.examples.llama import LlamaConfig
from meshfuse.examples.llama_torch import LlamaTorch
from meshfuse.parallel.stages import PipelineRunner, locate, schedule, split_pieces


class _LayerPiece(torch.nn.Module):
    """One decoder layer as a function of the hidden states alone (the rotary tables kept)."""

    def __init__(self, layer: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.layer = layer
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, self.cos, self.sin)


class _Head(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module, lm_head: torch.nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def llama_pieces(model: LlamaTorch) -> list[tuple[str, torch.nn.Module]]:
    """``model``'s parts in order, named after its modules; parameters shared."""
    pieces: list[tuple[str, torch.nn.Module]] = [("model.embed_tokens",
                                                  model.model.embed_tokens)]
    for i, layer in enumerate(model.model.layers):
        pieces.append((f"model.layers.{i}", _LayerPiece(layer, model.cos, model.sin)))
    pieces.append(("lm_head", _Head(model.model.norm, model.lm_head)))
    return pieces


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``logits [b, s, vocab]`` against ``targets [b, s]``."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(cfg: LlamaConfig, batch: int, steps: int, seed: int = 1):
    """``steps`` (ids, targets) pairs of random tokens, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
        yield ids[:, :-1], ids[:, 1:]


def model(cfg: LlamaConfig, seed: int = 0) -> LlamaTorch:
    torch.manual_seed(seed)
    return LlamaTorch(cfg)


def train_single(cfg: LlamaConfig, batch: int, steps: int, lr: float = 1e-2) -> list[float]:
    """Per-step losses of AdamW on the whole model on one device."""
    net = model(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    losses = []
    for ids, targets in batches(cfg, batch, steps):
        opt.zero_grad()
        loss = net(ids, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def pipelined(cfg: LlamaConfig, name: str, n_ranks: int, microbatches: int,
              n_virtual: int | None = None, boundaries: Sequence[int | str] | None = None,
              stage_ranks: Sequence[Sequence[int]] | None = None) -> PipelineRunner:
    """The runner of this rank's stages of the model under schedule ``name``."""
    plan = schedule(name, n_ranks, microbatches, n_virtual)
    stages = split_pieces(llama_pieces(model(cfg)), plan.n_stages, boundaries)
    pp_rank, _ = locate(stage_ranks or [[r] for r in range(n_ranks)])
    return PipelineRunner(plan, {s: stages[s] for s in plan.stages_of(pp_rank)}, lm_loss,
                          stage_ranks)


def train_pipelined(runner: PipelineRunner, cfg: LlamaConfig, batch: int, steps: int,
                    lr: float = 1e-2) -> list[float | None]:
    """Per-step losses of AdamW on ``runner``'s stages (None off the last stage)."""
    params = [p for m in runner.modules.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for ids, targets in batches(cfg, batch, steps):
        opt.zero_grad()
        loss = runner.step(ids, targets)
        opt.step()
        losses.append(None if loss is None else loss.item())
    return losses
