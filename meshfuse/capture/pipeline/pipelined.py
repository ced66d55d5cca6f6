"""``meshfuse.parallelize(module, mesh, plan, pipeline=PipelineSpec(...))``: a module's layers
placed on pipeline stages, each stage parallelized by ``plan`` on its sub-mesh.

Any module ``torch.export`` traces can be pipelined, an unmodified Hugging Face decoder
included: the spec's ``split_points`` name the modules where stages 1, 2, ... start
(``"model.layers.2"``), or index the module's *pieces* (:func:`default_pieces`). A stage
holds the modules whose parameters it trains (each parameter goes to the stage of its
module, in the order the modules are registered). On the first step the whole model is
traced on one microbatch and the graph cut at the split points
(:mod:`meshfuse.capture.pipeline.cut`): every value live across a boundary (the hidden
states, a decoder's rotary embeddings and mask, ...) crosses it, in graph order, and a
gradient comes back for each floating value that needs one.

The mesh's ``pp`` dimension holds the pipeline ranks; the rest of the mesh is each stage's
sub-mesh, over which :func:`parallelize` lays out the stage (its parameters keep the model's
names, so the plan's keys are the model's). With ``fsdp=`` naming a dimension of the rest,
each stage's parameters are instead sharded over it and gathered once per step
(:class:`~meshfuse.parallel.stages.ShardedStage`), each of its devices running its block of
every microbatch's rows. The values cross from a device of one stage to the device at the
same coordinate of the next by point-to-point sends, in the order of the named schedule
(:class:`meshfuse.parallel.stages.PipelineRunner`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor

from meshfuse.capture.pipeline.cut import cut_graph
from meshfuse.capture.pipeline.stage import (
    GraphStage,
    check_owners,
    owners_by_stage,
    plain_parameters,
    shared_buffers,
)
from meshfuse.capture.pipeline.ties import (
    Tie,
    TiedGradients,
    check_tie_placement,
    ties_across_stages,
)
from meshfuse.capture.plan import outline_of, resolve_plan
from meshfuse.capture.trace import capture, refuse_mutations, without_cache
from meshfuse.dtensor import mesh_from_torch
from meshfuse.errors import DefinitionError, InputError
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.parallel.fsdp.clip import grad_norm, scale_to
from meshfuse.parallel.stages import (
    PipelineRunner,
    ShardedStage,
    create_stage_groups,
    schedule,
)
from meshfuse.runtime.comm import collectives
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.interpreter.agreement import Fact, agreed

__all__ = ["Pipeline", "PipelineSpec", "default_pieces", "pipeline_stages"]

PP = "pp"


@dataclass(frozen=True)
class PipelineSpec:
    """How to pipeline a module.

    Args:
        split_points: where stages 1, 2, ... start: module names (``"model.layers.2"``) or
            indices of the module's pieces.
        loss_fn: ``loss_fn(output, target)`` on the last stage, a mean over the microbatch;
            ``output`` is what the module returns (a Hugging Face ``ModelOutput``).
        schedule: a schedule name (:data:`meshfuse.parallel.stages.NAMES`).
        microbatches: how many microbatches a step's batch is split into.
        pieces: the module's pieces' names in order (default :func:`default_pieces`),
            which integer split points index.
    """

    split_points: Sequence[int | str]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    schedule: str = "1F1B"
    microbatches: int = 1
    pieces: Sequence[str] | None = None


def default_pieces(module: torch.nn.Module) -> list[str]:
    """The module's children in order, a child holding a ``ModuleList``/``Sequential``
    opened into its own children (a Hugging Face ``model`` into ``embed_tokens``,
    ``layers.0``, ...), a ``ModuleList``/``Sequential`` child into its items."""
    names = []
    for name, child in module.named_children():
        is_list = isinstance(child, torch.nn.ModuleList | torch.nn.Sequential)
        if is_list and not isinstance(module, torch.nn.Sequential):
            names += [f"{name}.{item}" for item, _ in child.named_children()]
        elif not is_list and any(isinstance(m, torch.nn.ModuleList | torch.nn.Sequential)
                                 for m in child.modules()):
            names += [f"{name}.{inner}" for inner in default_pieces(child)]
        else:
            names.append(name)
    return names


class Pipeline:
    """This rank's stages of a pipelined module and the runner of their schedule.

    ``step(inputs, targets)`` runs one batch forward and backward (gradients accumulate into
    ``parameters()``) and returns the mean loss on the last stage's ranks, else None. Give
    every rank the batch's inputs (the stages are cut from a trace of the whole model on
    its first step); the targets are read on the last stage's ranks."""

    def __init__(self, runner: PipelineRunner, stages: Mapping[int, torch.nn.Module],
                 model: torch.nn.Module, points: Sequence[str], owners: list[list[str]],
                 spec: PipelineSpec, shapes: Mapping[str, tuple[torch.Size, torch.dtype]],
                 data_parallel: collectives.Group | None = None,
                 ties: Sequence[Tie] = ()) -> None:
        self.runner, self.stages = runner, dict(stages)
        self.model, self.points, self.spec = model, list(points), spec
        self.owners = owners  # each stage's modules (owners_by_stage)
        self.data_parallel = data_parallel
        self.shapes = dict(shapes)  # the parameters' whole shapes, before the stages
        self.traced: tuple | None = None  # the microbatch signature the stages were cut at
        self.out_spec: Any = None
        runner.loss_fn = self._loss
        # weights tied across stages: each stage's name of them, and their gradients' sums
        self.copies = {k: v for tie in ties for k, v in tie.copies().items()}
        self.tied = TiedGradients(ties, runner.stage_ranks, runner.schedule.placement, stages,
                                  flat=data_parallel is not None)

    def step(self, inputs: Any, targets: torch.Tensor | None) -> torch.Tensor | None:
        """One batch: ``inputs`` a tensor, a tuple of positional inputs or a dict of keyword
        inputs, each tensor's first dimension the batch.

        Raises:
            InputError: on every rank of the pipeline, before anything is sent, when some
                rank's batch does not split into the microbatches, differs from the first
                step's, or differs from another rank's (the ranks agree on their inputs'
                shapes first: one small collective per step)."""
        comm = Communicator.instance()
        ranks = tuple(sorted(r for group in self.runner.stage_ranks for r in group))
        if comm.size == 1 or len(ranks) == 1:
            batch = self._checked(inputs, targets)
        else:
            batch = agreed(comm, lambda: self._checked(inputs, targets), _input_facts,
                           "pass every rank the same batch", ranks=ranks)
        if self.traced is None:  # the ranks agree on the batch: cut the stages for it
            self._cut(*batch.micro)
            self.traced = batch.signature
        self.tied.begin_step()
        loss = self.runner.step(batch.tensors, targets)
        self.tied.add_up()
        if loss is not None and self.data_parallel is not None:
            loss = collectives.allreduce(loss, self.data_parallel, "sum") / \
                self.data_parallel.size
        return loss

    def _checked(self, inputs: Any, targets: Any) -> _Batch:
        """The batch, checked: it splits into the microbatches and, after the first step,
        has the first step's shapes."""
        args, kwargs = _call(inputs)
        kwargs = without_cache(self.model, kwargs)
        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        m = self.spec.microbatches
        dp = self.data_parallel.size if self.data_parallel is not None else 1
        _check_batch(flat, targets, m, dp)
        signature = (spec, tuple((tuple(x.shape), x.dtype) for x in flat
                                 if isinstance(x, torch.Tensor)))
        if self.traced is not None and signature != self.traced:
            raise InputError(f"pipeline step: inputs {signature[1]} differ from those of the "
                             f"first step {self.traced[1]}; the stages were cut for those: "
                             f"give every step batches of one shape")
        micro = torch.utils._pytree.tree_unflatten(
            [x.chunk(m)[0].chunk(dp)[0] if isinstance(x, torch.Tensor) else x for x in flat],
            spec)
        return _Batch(tuple(x for x in flat if isinstance(x, torch.Tensor)), signature, micro)

    def _cut(self, args: tuple, kwargs: dict) -> None:
        """Traces the model on one microbatch and gives each stage of this rank its graph."""
        with plain_parameters(self.model, self.shapes):
            captured = capture(self.model, args, kwargs)
        refuse_mutations(captured, "a pipeline")
        graphs = cut_graph(captured, self.points, self.copies,
                           shared_buffers(self.model, self.owners))
        check_owners(graphs, self.model, self.owners)
        self.out_spec = captured.out_spec
        for s, stage in self.stages.items():
            _inner(stage).set_graph(graphs[s])

    def _loss(self, outputs: tuple, target: Any) -> torch.Tensor:
        out = torch.utils._pytree.tree_unflatten(list(outputs), self.out_spec)
        return self.spec.loss_fn(out, target)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's stages' parameters (to give an optimizer), each once: a weight tied
        across two stages of this rank is one parameter of both."""
        seen: set[int] = set()
        for stage in self.stages.values():
            for p in stage.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scales the gradients of every stage's parameters so that their global norm is at
        most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on the whole model;
        returns the norm before, the same on every rank. Each element of the model counts
        once: a shard once over the devices that hold it alike, a weight tied across
        stages once over its copies. Call it on every rank, after ``step`` (one allreduce
        over the job)."""
        grads, pieces, copies, seen = [], [], [], set()
        for s, stage in self.stages.items():
            if isinstance(stage, ShardedStage):
                g = stage.shard.grad
                if g is None:
                    continue
                grads.append(g)  # (local tensors: the scaling's)
                at = 0
                for start, end, n in self.tied.flat_pieces(s):
                    pieces += [g[at:start], g[start:end]]
                    copies += [1, n]
                    at = end
                pieces.append(g[at:])
                copies.append(1)
                continue
            for name, p in stage.named_parameters():
                if p.grad is None or id(p) in seen:
                    continue  # (one parameter of two stages of this rank: counted once)
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                alike = math.prod(p.device_mesh.size(i) for i, x in enumerate(p.placements)
                                  if x.is_replicate()) if isinstance(p, DTensor) else 1
                seen.add(id(p))
                grads.append(local)
                pieces.append(local)
                copies.append(alike * self.tied.copies_of(s, name))
        norm = grad_norm(pieces, copies)
        scale_to(grads, norm, max_norm)
        return norm.float()

    def explain(self) -> str:
        return "\n".join([self.runner.explain(), *self.tied.lines()])


def pipeline_stages(module: torch.nn.Module, tmesh: TorchDeviceMesh, plan: Mapping[str, Any],
                    spec: PipelineSpec, parallelize: Callable[..., torch.nn.Module],
                    fsdp: str | None = None) -> Pipeline:
    """The :class:`Pipeline` of ``module`` on ``tmesh`` (whose ``pp`` dimension holds the
    stages), this rank's stages each given to ``parallelize(stage, sub_mesh, plan)`` (or,
    with ``fsdp``, sharded over that dimension)."""
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
    _check_fsdp(fsdp, rest, plan)
    pp = tmesh.size(names.index(PP))
    sched = schedule(spec.schedule, pp, spec.microbatches)
    n_stages = len(spec.split_points) + 1
    if sched.n_stages != n_stages:
        raise DefinitionError(f"parallelize(pipeline=...): {len(spec.split_points)} split "
                              f"points make {n_stages} stages, but schedule "
                              f"{sched.name} on the mesh's {PP!r} dimension of size {pp} "
                              f"runs {sched.n_stages}; give {sched.n_stages - 1} split points "
                              f"or a {PP!r} dimension of size {n_stages}")
    points = split_modules(module, spec)
    owners = owners_by_stage(module, points)
    ties = ties_across_stages(module, owners)
    check_tie_placement(ties, sched.placement, bool(rest))
    if rest and fsdp is None:  # each copy laid out by its stage's plan (before any is)
        ties = [_laid_out(tie, module, owners, plan, len(rest)) for tie in ties]
    shapes = {n: (p.shape, p.dtype) for n, p in module.named_parameters(remove_duplicate=False)}
    grid = tmesh.mesh.movedim(names.index(PP), 0)
    stage_ranks = [row.flatten().tolist() for row in grid]
    sub = (tmesh[rest if len(rest) > 1 else rest[0]]) if rest else None
    _create_stage_groups(grid)
    group = collectives.group_along(Communicator.instance(), mesh_from_torch(tmesh),
                                    names.index(fsdp)) if fsdp else None
    stages = {}
    for s in sched.stages_of(tmesh.get_local_rank(PP)):
        stage: torch.nn.Module = GraphStage(module, owners[s])
        if group is not None:
            stage = ShardedStage(stage, group)
        elif sub is not None:
            stage = parallelize(stage, sub, _plan_for(stage, plan, len(rest)))
        stages[s] = stage
    dp = (group.coordinate, group.size) if group is not None else None
    runner = PipelineRunner(sched, stages, spec.loss_fn, stage_ranks, data_parallel=dp)
    return Pipeline(runner, stages, module, points, owners, spec, shapes, group, ties)


def _laid_out(tie: Tie, module: torch.nn.Module, owners: Sequence[Sequence[str]],
              plan: Mapping[str, Any], ndim: int) -> Tie:
    """``tie`` with the placements each copy's stage's plan gives it."""
    layouts = []
    for s, name in tie.names:
        stage = GraphStage(module, owners[s])
        resolved = resolve_plan(outline_of(stage), _plan_for(stage, plan, ndim), ndim)
        layouts.append(tuple(resolved.parameters[name]))
    return Tie(tie.names, tuple(layouts))


def split_modules(module: torch.nn.Module, spec: PipelineSpec) -> list[str]:
    """The split points as module names, checked: each a module of ``module``, in the
    order they are registered."""
    pieces = list(spec.pieces) if spec.pieces is not None else default_pieces(module)
    order = [name for name, _ in module.named_modules()]
    points = []
    for point in spec.split_points:
        if isinstance(point, int):
            if not 0 < point < len(pieces):
                raise DefinitionError(f"pipeline split point {point} must be an increasing "
                                      f"piece index from 1 to {len(pieces) - 1}; the pieces "
                                      f"are {', '.join(pieces)}")
            point = pieces[point]
        if point not in order or not point:
            raise DefinitionError(f"no module named {point!r} to start a pipeline stage at; "
                                  f"give a module name such as one of the pieces "
                                  f"{', '.join(pieces)}")
        points.append(point)
    positions = [order.index(p) for p in points]
    if positions != sorted(set(positions)):
        raise DefinitionError(f"pipeline split points {list(spec.split_points)} must be "
                              f"increasing: modules in the order the model registers them "
                              f"({', '.join(pieces)})")
    return points


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


def _create_stage_groups(grid: torch.Tensor) -> None:
    """The process groups of every stage's sub-mesh (a row of ``grid``), on every rank
    (:func:`~meshfuse.parallel.stages.create_stage_groups`); none for a mesh of ``pp``
    alone."""
    if grid[0].dim() and Communicator.instance().size > 1:
        create_stage_groups([DeviceMesh(row) for row in grid])


def _check_fsdp(fsdp: str | None, rest: tuple[str, ...], plan: Mapping[str, Any]) -> None:
    if fsdp is None:
        return
    if rest != (fsdp,) or plan:
        raise DefinitionError(f"parallelize(pipeline=..., fsdp={fsdp!r}) shards each stage's "
                              f"parameters over the mesh's {fsdp!r} dimension, on a mesh "
                              f"('pp', {fsdp!r}) with an empty plan; this mesh's other "
                              f"dimensions are {rest} and the plan has {len(plan)} keys: "
                              f"drop fsdp= for a tensor-parallel pipeline")


@dataclass(frozen=True)
class _Batch:
    """A step's batch: its tensors, their signature (the input structure, shapes, dtypes)
    and one microbatch of it (positional and keyword inputs: what the stages are cut at)."""

    tensors: tuple[torch.Tensor, ...]
    signature: tuple
    micro: tuple


def _input_facts(batch: _Batch) -> list[Fact]:
    """What every rank's batch must hold alike: its tensors' shapes and dtypes."""
    value = tuple((tuple(x.shape), str(x.dtype)) for x in batch.tensors)
    shown = ", ".join(f"{list(x.shape)} {x.dtype}" for x in batch.tensors)
    return [Fact("the pipeline step's inputs", value, shown)]


def _call(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}
    raise InputError(f"pipeline step: inputs must be a tensor, a tuple of positional inputs or "
                     f"a dict of keyword inputs, on every rank (the stages are cut from a "
                     f"trace of the whole model); got {type(inputs).__name__}")


def _check_batch(flat: list, targets: Any, m: int, dp: int) -> None:
    """Every input (and the targets, where given) splits into ``m`` microbatches of ``dp``
    blocks of rows: checked on every rank alike, before anything runs."""
    given = [(f"input {i}", x) for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    if isinstance(targets, torch.Tensor):
        given.append(("targets", targets))
    for what, x in given:
        if x.dim() == 0 or x.shape[0] % (m * dp):
            rows = "" if dp == 1 else f" of {dp} equal blocks of rows each"
            raise InputError(f"pipeline step: {what} of shape {tuple(x.shape)} does not split "
                             f"into {m} microbatches{rows}; give a batch whose first "
                             f"dimension is a multiple of {m * dp}, or a number of "
                             f"microbatches that divides it")


def _inner(stage: torch.nn.Module) -> GraphStage:
    return stage.module if isinstance(stage, ShardedStage) else stage
