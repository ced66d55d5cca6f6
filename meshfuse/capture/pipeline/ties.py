"""Weights tied across pipeline stages: one parameter held, under several names, by modules
of different stages (a decoder's token embedding and its head, ``tie_word_embeddings``:
Llama-3.2-1B, Gemma, Qwen2-0.5B, GPT-2).

Each pipeline rank holding one of those stages trains a copy of the parameter, laid out on
its stage's devices by the plan as that stage's other parameters are (the embedding's copy
may be replicated where the head's is split over the vocabulary). The copies start equal
(the model's one tensor) and stay equal because their gradients are: after each step's
backward, the ranks at one coordinate of the stages holding copies add their gradients
(:meth:`TiedGradients.add_up`, one allreduce per tie), and an optimizer of each rank's
``pipe.parameters()`` then updates every copy alike. Copies laid out alike add their local
shards; otherwise each adds the whole gradient (gathered on its stage's devices) and keeps
its own shard of the sum. With ``fsdp`` each stage's parameters are one flat shard per
data-parallel member (:class:`~meshfuse.parallel.stages.ShardedStage`), cut at offsets
that differ between the stages: there each member puts the part of the tied weight's
gradient its shard holds into a zero tensor of the weight's size, the members of both
stages add those in one allreduce, and each takes its part back. Gradients accumulated over
several steps without ``zero_grad`` stay right: at the start of a step every copy but the
first stage's drops the sum it holds (:meth:`TiedGradients.begin_step`), so that each step
adds only its own contributions.

Where one pipeline rank runs two stages of a tie (ZBV puts the first and the last stage on
rank 0), the stages share the parameter itself when the stages are not laid out further (a
mesh of ``pp`` alone: autograd adds both uses into its one ``.grad``); laid out over other
mesh dimensions (or sharded by ``fsdp``) they would hold two copies on one device, which is
refused. The pipeline's cut reads a tied parameter in each stage under the name that stage
holds it by (:func:`~meshfuse.capture.pipeline.cut.cut_graph`'s ``copies``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate

from meshfuse.errors import DefinitionError
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.parallel.stages import ShardedStage
from meshfuse.runtime.comm import collectives
from meshfuse.runtime.comm.communicator import Communicator

__all__ = ["Tie", "TiedGradients", "check_tie_placement", "ties_across_stages"]


@dataclasses.dataclass(frozen=True)
class Tie:
    """One parameter held by modules of several stages.

    Attributes:
        names: ``(stage, name)`` for each stage holding it, by stage: the name the stage
            holds it under (its first, where a stage holds it under several).
        layouts: for each of ``names``, the placements its stage's plan gives that copy
            (None: the stages are not laid out over other mesh dimensions).
    """

    names: tuple[tuple[int, str], ...]
    layouts: tuple[tuple | None, ...] = ()

    def copies(self) -> dict[str, dict[int, str]]:
        """Each name of the parameter -> the name each stage reads it by (see ``cut_graph``)."""
        by_stage = dict(self.names)
        return {name: by_stage for _, name in self.names}


def ties_across_stages(model: torch.nn.Module, owners: Sequence[Sequence[str]]) -> list[Tie]:
    """The parameters of ``model`` held by modules of more than one stage (``owners``: each
    stage's modules, :func:`~meshfuse.capture.pipeline.stage.owners_by_stage`)."""
    stage_of = {m: s for s, held in enumerate(owners) for m in held}
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    ties = []
    for held in names.values():
        first: dict[int, str] = {}
        for name in held:
            first.setdefault(stage_of[name.rpartition(".")[0]], name)
        if len(first) > 1:
            ties.append(Tie(tuple(sorted(first.items()))))
    return ties


def check_tie_placement(ties: Sequence[Tie], placement: Sequence[int], laid_out: bool) -> None:
    """Refuses the ties a pipeline cannot keep equal (see the module doc): two stages of one
    on a pipeline rank (``placement``: each stage's) where the stages are laid out further
    (``laid_out``: a plan or fsdp over the mesh's other dimensions)."""
    for tie in ties:
        stages = [s for s, _ in tie.names]
        shown = ", ".join(f"{name!r} (stage {s})" for s, name in tie.names)
        ranks = [placement[s] for s in stages]
        if laid_out and len(set(ranks)) < len(ranks):
            raise DefinitionError(
                f"parameter {shown} is one weight tied across pipeline stages that run on "
                f"one pipeline rank (stages {stages} on ranks {ranks}); laid out over the "
                f"mesh's other dimensions each stage would hold a copy of its own on the same "
                f"devices: use a schedule that puts those stages on different ranks, or "
                f"untie it (config tie_word_embeddings=False)")


class TiedGradients:
    """Keeps the copies of ``ties`` equal on this rank's ``stages`` (see the module doc).

    Creating it creates, on every rank alike, the groups of ranks that hold copies of each
    tie at one coordinate of their stages' devices (``stage_ranks``: each pipeline rank's
    devices, in coordinate order; ``placement``: each stage's pipeline rank), or with
    ``flat`` (the stages are :class:`~meshfuse.parallel.stages.ShardedStage` s) all the
    devices of those stages."""

    def __init__(self, ties: Sequence[Tie], stage_ranks: Sequence[Sequence[int]],
                 placement: Sequence[int], stages: Mapping[int, torch.nn.Module],
                 flat: bool = False) -> None:
        comm = Communicator.instance()
        self._ties: list[_Copies] = []
        for tie in ties:
            rows = sorted({placement[s] for s, _ in tie.names})
            if len(rows) == 1:  # one rank holds every stage of it: one parameter there
                continue
            devices = torch.tensor([list(stage_ranks[r]) for r in rows])
            mesh = DeviceMesh(devices.flatten() if flat else devices)
            group = collectives.group_along(comm, mesh, 0) if comm.size > 1 else None
            mine = [(s, name) for s, name in tie.names if s in stages]
            if group is None or not mine:
                continue
            self._ties.append(_Copies(
                tie.names, group, mine, flat, alike=len(set(tie.layouts)) <= 1,
                first=placement[tie.names[0][0]] == placement[mine[0][0]]))
        self._stages = stages

    def copies_of(self, stage: int, name: str) -> int:
        """How many copies the parameter ``name`` of this rank's ``stage`` has (1: it is
        tied to none, or one parameter holds every stage's on this rank)."""
        return next((len(c.names) for c in self._ties if (stage, name) in c.mine), 1)

    def flat_pieces(self, stage: int) -> list[tuple[int, int, int]]:
        """``(start, end, copies)``: where in the flat shard of this rank's ``stage`` (a
        ShardedStage) a tied parameter's piece lies, in order, and its copies."""
        found = []
        for c in self._ties:
            for s, name in c.mine:
                if s == stage:
                    _, start, end, _ = _part(self._stages[s], name)
                    if start < end:
                        found.append((start, end, len(c.names)))
        return sorted(found)

    def lines(self) -> list[str]:
        """explain's lines: each tie this rank holds a copy of, and how its gradients add."""
        return [f"tied across stages: {', '.join(f'{n!r} (stage {s})' for s, n in c.names)}; "
                f"this rank's copy adds its {_ADDED[c.flat, c.alike]} with ranks "
                f"{list(c.group.ranks)} after each step" for c in self._ties]

    def begin_step(self) -> None:
        """Every copy but those on the tie's first stage's rank drops the gradient it holds
        (the sum of the steps before, which the first stage's copy holds too)."""
        for copies in self._ties:
            if copies.first:
                continue
            for s, name in copies.mine:
                stage = self._stages[s]
                if isinstance(stage, ShardedStage):
                    _, start, end, _ = _part(stage, name)
                    if stage.shard.grad is not None:
                        stage.shard.grad[start:end].zero_()
                else:
                    stage.get_parameter(name).grad = None

    def add_up(self) -> None:
        """Each copy's gradient becomes the sum of every copy's (one allreduce per tie)."""
        for copies in self._ties:
            s, name = copies.mine[0]  # (several: one parameter, stages not laid out)
            if isinstance(self._stages[s], ShardedStage):
                _add_up_flat(self._stages[s], name, copies.group)
                continue
            p = self._stages[s].get_parameter(name)
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if copies.alike:
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                summed = collectives.allreduce(local, copies.group, "sum")
                p.grad = DTensor.from_local(summed, p.device_mesh, p.placements,
                                            shape=p.shape, stride=p.stride(), run_check=False) \
                    if isinstance(p, DTensor) else summed
                continue
            whole = grad.full_tensor() if isinstance(grad, DTensor) else grad
            summed = collectives.allreduce(whole, copies.group, "sum")
            if isinstance(p, DTensor):
                summed = DTensor.from_local(summed, p.device_mesh,
                                            [Replicate()] * p.device_mesh.ndim,
                                            run_check=False).redistribute(p.device_mesh,
                                                                          p.placements)
            p.grad = summed


@dataclasses.dataclass(frozen=True)
class _Copies:
    """This rank's part in keeping one tie's copies equal: the tie's names, the group of
    the ranks holding copies at its coordinate (flat shards: every device of those
    stages), its stages' names of the parameter, whether the stages are flat shards,
    whether every copy is laid out alike, and whether it is the first stage's copy (which
    keeps a sum over steps)."""

    names: tuple[tuple[int, str], ...]  # the tie's (see Tie)
    group: collectives.Group
    mine: list[tuple[int, str]]
    flat: bool
    alike: bool
    first: bool


# what a copy adds, by (flat shards, laid out alike): explain's words
_ADDED = {(False, True): "local shard of the gradient", (False, False): "whole gradient",
          (True, True): "piece of the gradient (in its flat shard)"}


def _part(stage: ShardedStage, name: str) -> tuple[int, int, int, int]:
    """``(numel, start, end, offset)``: the size of the parameter ``name`` of ``stage``'s
    module, where in the stage's shard a piece of it lies (``[start, end)``, empty where the
    shard holds none of it) and where that piece starts among the parameter's elements."""
    shape, first, stop, at = next((shape, first, stop, at) for held, shape, first, stop, at
                                  in stage.held_pieces() if held == f"module.{name}")
    return shape.numel(), at, at + stop - first, first


def _add_up_flat(stage: ShardedStage, name: str, group: collectives.Group) -> None:
    """The tied parameter ``name``'s gradient summed over ``group``, the devices of every
    stage holding a copy, each holding a piece of it in its flat shard's gradient."""
    numel, start, end, offset = _part(stage, name)
    shard = stage.shard
    if shard.grad is None:
        shard.grad = torch.zeros_like(shard)
    whole = shard.new_zeros(numel)
    whole[offset:offset + end - start] = shard.grad[start:end]
    whole = collectives.allreduce(whole, group, "sum", inplace=True)
    shard.grad[start:end] = whole[offset:offset + end - start]
