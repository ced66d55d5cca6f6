"""The Llama-family model of :mod:`meshfuse.examples.llama_torch` as pipeline pieces, and a
few AdamW steps of it under a pipeline schedule beside the same steps on one device.

:func:`llama_pieces` lists the model's parts in order (the embedding, each decoder layer,
the final norm with the head), sharing the model's parameters, for
:func:`meshfuse.parallel.stages.split_pieces`; :func:`train_pipelined` trains them under a
named schedule on this rank's stages, and :func:`train_single` the whole model on one device.

The same pieces as meshfuse fusions, for stages that are themselves tensor parallel (or
fully sharded) over their own sub-mesh: a :class:`FusionStage` holds a range of them
as fusion modules on its mesh: :class:`LlamaEmbedding` on the first stage, one
:class:`LlamaBlock` definition shared by its layers, and on the last stage
:class:`LlamaHead`, whose loss is the runner's loss (:meth:`FusionStage.loss`). Activations
leave a stage sequence split, as the next stage's blocks take them: the device at coordinate
``c`` of one stage sends its shard to coordinate ``c`` of the next.

A stage whose devices form a ``dp x tp`` grid (:func:`sharded_fusion_stage`) runs one
:class:`FusionStage` per ``dp`` row on that row's share of each microbatch, its parameters
sharded over ``dp`` by :class:`~meshfuse.parallel.stages.ShardedStage` (gathered once per
step, gradients reduce-scattered once per step).

Every fusion agrees on its inputs among its own mesh's ranks only, so the stages run
independently. Creating a process group is collective over the world, though: every rank
calls :func:`create_stage_groups` before the first step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from meshfuse.examples.llama import (
    LlamaBlock,
    LlamaConfig,
    LlamaEmbedding,
    LlamaHead,
    fusion_module,
    rope_tables,
)
from meshfuse.examples.llama_torch import LlamaTorch
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.parallel.fsdp import NamedMesh
from meshfuse.parallel.stages import (
    PipelineRunner,
    ShardedStage,
    locate,
    schedule,
    split_pieces,
)
from meshfuse.parallel.stages import create_stage_groups as _create_stage_groups
from meshfuse.runtime.comm.collectives import group_along
from meshfuse.runtime.comm.communicator import Communicator


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


def create_stage_groups(meshes: Sequence[DeviceMesh | NamedMesh]) -> None:
    """The process groups of every stage's mesh, created on every rank in one order
    (:func:`meshfuse.parallel.stages.create_stage_groups`, named meshes taken as theirs)."""
    _create_stage_groups([m.mesh if isinstance(m, NamedMesh) else m for m in meshes])


class FusionStage(torch.nn.Module):
    """Pieces ``[start, stop)`` of the model (piece 0 the embedding, ``cfg.layers + 1`` the
    head) as fusion modules on ``mesh``.

    Args:
        cfg: the sizes.
        microbatch: sequences per microbatch (every fusion's batch).
        params: the model's global parameters by ``LlamaForCausalLM`` name.
        start, stop: the pieces this stage holds.
        mesh: the stage's mesh: 1-D (tensor parallel over it) or a :class:`NamedMesh` with
            ``tp`` and/or ``dp`` (fully sharded over ``dp``: each fusion's parameters sharded,
            gathered per call).
    """

    def __init__(self, cfg: LlamaConfig, microbatch: int, params: dict[str, torch.Tensor],
                 start: int, stop: int, mesh: DeviceMesh | NamedMesh) -> None:
        super().__init__()
        self.fsdp = mesh if isinstance(mesh, NamedMesh) and "dp" in mesh.names else None
        self.embed = fusion_module(LlamaEmbedding(cfg, microbatch, mesh), params, "", self.fsdp) \
            if start == 0 else None
        block = LlamaBlock(cfg, microbatch, mesh)  # one definition for the stage's layers
        layers = range(max(start, 1) - 1, min(stop, cfg.layers + 1) - 1)
        self.blocks = torch.nn.ModuleList(
            fusion_module(block, params, f"model.layers.{i}.", self.fsdp) for i in layers)
        self.head = fusion_module(LlamaHead(cfg, microbatch, mesh), params, "", self.fsdp) \
            if stop == cfg.layers + 2 else None
        self.layers = list(layers)
        self._names = {f"blocks.{j}.{n.replace('.', '_')}": f"model.layers.{i}.{n}"
                       for j, i in enumerate(self.layers) for n in block.params}
        self._names.update({f"{m}.{n.replace('.', '_')}": n for m in ("embed", "head")
                            if getattr(self, m) is not None for n in getattr(self, m).fd.params})
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def extra_repr(self) -> str:
        parts = (["embedding"] if self.embed is not None else []) + \
            [f"layer {i}" for i in self.layers] + (["head"] if self.head is not None else [])
        return ", ".join(parts)

    def checkpoint_names(self) -> dict[str, str]:
        """Each parameter's ``LlamaForCausalLM`` name, by its name here (as
        ``LlamaModel.checkpoint_names``): a stage saves and loads its part of the whole
        model's checkpoint (:mod:`meshfuse.checkpoint`)."""
        return dict(self._names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's output: the hidden states (this rank's sequence shard); the first
        stage takes token ids (replicated, the microbatch's whole)."""
        if self.embed is not None:
            x = x.contiguous()  # a microbatch of a batch's columns may not be
            if self.fsdp is not None:
                x = self.embed.shard_input(self.embed.fd.ids, x)
            x = self.embed(x)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return x

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of its output ``x`` (the runner's ``loss_fn``)."""
        targets = targets.contiguous()
        if self.fsdp is not None:
            targets = self.head.shard_input(self.head.fd.targets, targets)
        return self.head(x, targets)


def sharded_fusion_stage(cfg: LlamaConfig, microbatch: int, params: dict[str, torch.Tensor],
                         start: int, stop: int, grid: DeviceMesh) -> ShardedStage:
    """Pieces ``[start, stop)`` on a stage whose devices are the 2-D ``dp x tp`` mesh
    ``grid``: this rank's row runs them as a :class:`FusionStage` tensor parallel over the
    row (one device: not parallel) on ``microbatch / dp`` sequences, its parameters sharded
    over ``grid``'s column (:class:`ShardedStage`). The runner takes the rows by
    ``data_parallel=(dp coordinate, dp)`` (:func:`grid_share`)."""
    comm = Communicator.instance()
    dp = grid.devices.shape[0]
    row = DeviceMesh(list(grid.group_ranks(comm.rank, 1)))
    stage = FusionStage(cfg, microbatch // dp, params, start, stop, row)
    return ShardedStage(stage, group_along(comm, grid, 0))


def grid_share(grid: DeviceMesh) -> tuple[int, int]:
    """``(dp coordinate, dp)`` of this rank in the ``dp x tp`` mesh ``grid``."""
    return grid.coordinate(Communicator.instance().rank)[0], grid.devices.shape[0]
