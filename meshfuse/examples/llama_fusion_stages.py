"""Pipeline stages made of the Llama example's meshfuse fusions (:mod:`meshfuse.examples.llama`),
each stage tensor parallel (or fully sharded) over its own sub-mesh.

The model's pieces are those of :func:`meshfuse.examples.llama_stages.llama_pieces` (the
embedding, each decoder layer, the final norm with the head); a stage holds a range of them
as fusion modules on its mesh: :class:`LlamaEmbedding` on the first stage, one
:class:`LlamaBlock` definition shared by its layers, and on the last stage
:class:`LlamaHead`, whose loss is the runner's loss (:meth:`FusionStage.loss`). Activations
leave a stage sequence split, as the next stage's blocks take them: the device at coordinate
``c`` of one stage sends its shard to coordinate ``c`` of the next.

Every fusion agrees on its inputs among its own mesh's ranks only, so the stages run
independently. Creating a process group is collective over the world, though: every rank
calls :func:`create_stage_groups` before the first step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshfuse.examples.llama import (
    LlamaBlock,
    LlamaConfig,
    LlamaEmbedding,
    LlamaHead,
    fusion_module,
    rope_tables,
)
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.parallel.fsdp import NamedMesh
from meshfuse.runtime.comm.communicator import Communicator


def create_stage_groups(meshes: Sequence[DeviceMesh | NamedMesh]) -> None:
    """Creates, on every rank and in one order, the process groups of every stage's mesh
    (each axis): a stage's fusions then find them rather than create them on their ranks
    alone (which would leave the ranks' group counts apart)."""
    comm = Communicator.instance()
    for mesh in meshes:
        mesh = mesh.mesh if isinstance(mesh, NamedMesh) else mesh
        for axis in range(mesh.ndim):
            comm.group_if_member(mesh, axis)


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
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def extra_repr(self) -> str:
        parts = (["embedding"] if self.embed is not None else []) + \
            [f"layer {i}" for i in self.layers] + (["head"] if self.head is not None else [])
        return ", ".join(parts)

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
