"""``meshfuse.parallelize(module, mesh, plan, pipeline=PipelineSpec(...))``: a module's layers
placed on pipeline stages, each stage parallelized by ``plan`` on its sub-mesh.

The module is read as its *pieces*: submodules that run one after the other, each taking the
previous one's output (by default its direct children in order, a ``ModuleList`` or
``Sequential`` child counting as its items: ``embed, layers.0, layers.1, ..., head``). The
spec's ``split_points`` (piece names or indices, where stages 1, 2, ... start) cut them with
:func:`meshfuse.parallel.stages.stage_bounds`. The mesh's ``pp`` dimension holds the pipeline
ranks; the rest of the mesh is each stage's sub-mesh, over which :func:`parallelize` lays out
the stage (its parameters keep the model's names, so the plan's keys are the model's). The
activations cross from a device of one stage to the device at the same coordinate of the
next by point-to-point sends, in the order of the named schedule
(:class:`meshfuse.parallel.stages.PipelineRunner`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor

from meshfuse.capture.plan import outline_of, resolve_plan
from meshfuse.errors import DefinitionError
from meshfuse.parallel.stages import PipelineRunner, schedule, stage_bounds

__all__ = ["Pipeline", "PipelineSpec", "default_pieces"]

PP = "pp"


@dataclass(frozen=True)
class PipelineSpec:
    """How to pipeline a module.

    Args:
        split_points: where stages 1, 2, ... start: piece names (``"layers.2"``) or indices.
        loss_fn: ``loss_fn(output, target)`` on the last stage, a mean over the microbatch.
        schedule: a schedule name (:data:`meshfuse.parallel.stages.NAMES`).
        microbatches: how many microbatches a step's batch is split into.
        pieces: the module's pieces' names in order (default :func:`default_pieces`).
    """

    split_points: Sequence[int | str]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    schedule: str = "1F1B"
    microbatches: int = 1
    pieces: Sequence[str] | None = None


def default_pieces(module: torch.nn.Module) -> list[str]:
    """The module's direct children in order, a ``ModuleList``/``Sequential`` child's items
    each a piece."""
    names = []
    for name, child in module.named_children():
        if isinstance(child, torch.nn.ModuleList | torch.nn.Sequential) and \
                not isinstance(module, torch.nn.Sequential):
            names += [f"{name}.{item}" for item, _ in child.named_children()]
        else:
            names.append(name)
    return names


class Pipeline:
    """This rank's stages of a pipelined module and the runner of their schedule.

    ``step(inputs, targets)`` runs one batch forward and backward (gradients accumulate into
    ``parameters()``) and returns the mean loss on the last stage's ranks, else None."""

    def __init__(self, runner: PipelineRunner, stages: Mapping[int, torch.nn.Module]) -> None:
        self.runner, self.stages = runner, dict(stages)

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None
             ) -> torch.Tensor | None:
        return self.runner.step(inputs, targets)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's stages' parameters (to give an optimizer)."""
        for stage in self.stages.values():
            yield from stage.parameters()

    def explain(self) -> str:
        return self.runner.explain()


class _Stage(torch.nn.Module):
    """Some pieces of a model, registered under their names in the model (so parameter
    names and plan keys are the model's), run in order."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.order = list(names)
        for name in names:
            owner: torch.nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, torch.nn.Module())
                owner = owner._modules[part]
            owner.add_module(leaf, model.get_submodule(name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.order:
            x = self.get_submodule(name)(x)
        return x.full_tensor() if isinstance(x, DTensor) else x

    def extra_repr(self) -> str:
        return self.order[0] if len(self.order) == 1 else \
            f"{self.order[0]} .. {self.order[-1]} ({len(self.order)} pieces)"


def pipeline_stages(module: torch.nn.Module, tmesh: TorchDeviceMesh, plan: Mapping[str, Any],
                    spec: PipelineSpec, parallelize: Callable[..., torch.nn.Module]
                    ) -> Pipeline:
    """The :class:`Pipeline` of ``module`` on ``tmesh`` (whose ``pp`` dimension holds the
    stages), this rank's stages each given to ``parallelize(stage, sub_mesh, plan)``."""
    names = tmesh.mesh_dim_names or ()
    if PP not in names:
        raise DefinitionError(f"parallelize(pipeline=...): the mesh needs a dimension named "
                              f"{PP!r} for the pipeline ranks; its dimensions are {names}")
    rest = tuple(n for n in names if n != PP)
    if plan and not rest:
        raise DefinitionError(f"parallelize(pipeline=...): the plan lays the stages out over "
                              f"the mesh's other dimensions, but the mesh has only {PP!r}; "
                              f"add one (e.g. ('pp', 'tp')) or give an empty plan")
    resolve_plan(outline_of(module), plan, len(rest))  # every key names something
    pp = tmesh.size(names.index(PP))
    pieces = list(spec.pieces) if spec.pieces is not None else default_pieces(module)
    sched = schedule(spec.schedule, pp, spec.microbatches)
    n_stages = len(spec.split_points) + 1
    if sched.n_stages != n_stages:
        raise DefinitionError(f"parallelize(pipeline=...): {len(spec.split_points)} split "
                              f"points make {n_stages} stages, but schedule "
                              f"{sched.name} on the mesh's {PP!r} dimension of size {pp} "
                              f"runs {sched.n_stages}; give {sched.n_stages - 1} split points "
                              f"or a {PP!r} dimension of size {n_stages}")
    bounds = stage_bounds(pieces, n_stages, list(spec.split_points))
    grid = tmesh.mesh.movedim(names.index(PP), 0)
    stage_ranks = [row.flatten().tolist() for row in grid]
    pp_rank = tmesh.get_local_rank(PP)
    sub = (tmesh[rest if len(rest) > 1 else rest[0]]) if rest else None
    stages = {}
    for s in sched.stages_of(pp_rank):
        stage = _Stage(module, pieces[bounds[s][0]:bounds[s][1]])
        if sub is not None:
            stage = parallelize(stage, sub, _plan_for(stage, plan, len(rest)))
        stages[s] = stage
    return Pipeline(PipelineRunner(sched, stages, spec.loss_fn, stage_ranks), stages)


def _plan_for(stage: torch.nn.Module, plan: Mapping[str, Any], ndim: int) -> dict[str, Any]:
    """The keys of ``plan`` that name something in ``stage``."""
    outline = outline_of(stage)
    kept = {}
    for key, value in plan.items():
        try:
            resolve_plan(outline, {key: value}, ndim)
        except DefinitionError:
            continue
        kept[key] = value
    return kept
