"""Plans: what a user writes to lay a model out, read into per-parameter placements and the
layouts pinned at module boundaries.

A plan maps name patterns (fnmatch, ``"model.layers.*.self_attn.q_proj"``) to one of:

- a DTensor parallel style: ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
  ``PrepareModuleInput``, ``PrepareModuleOutput`` (with their ``input_layouts``,
  ``output_layouts``, ``desired_input_layouts``);
- a Hugging Face tp-plan string (``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"``,
  ``"embedding_rowwise"``, ``"sequence_parallel"``, ``"replicated_with_grad_allreduce"``...):
  a model's own ``model.tp_plan`` works as given, and so does its config's
  ``base_model_tp_plan`` (a key also matches below the model's ``base_model_prefix``; a key
  of the model's own plan may match nothing, as that plan is its whole family's);
- a sequence of DTensor placements, for the parameter whose name matches the key.

The first key that matches a module or parameter wins. Only parameters and module boundary
layouts are pinned: every other tensor's sharding is propagated, and the communications
follow from the pins. A module's *output* layout is pinned on the values it returns
(``RowwiseParallel``'s replicated output: Megatron's allreduce; ``output_layouts=Shard(1)``:
a reduce-scatter); its *input* layout where the style asks for a redistribution
(``ColwiseParallel(input_layouts=Shard(1))``: the all-gather before the linear).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import Placement

from meshfuse.errors import DefinitionError

__all__ = ["ModelOutline", "ModuleLayouts", "ResolvedPlan", "outline_of", "resolve_plan"]

Layout = tuple[Placement, ...]


@dataclasses.dataclass(frozen=True)
class ModuleLayouts:
    """The layouts pinned at one module's boundary (None: propagated)."""

    inputs: Placement | None = None
    outputs: Placement | None = None


@dataclasses.dataclass(frozen=True)
class ResolvedPlan:
    """A plan applied to a module: each parameter's placements (one per mesh axis) and the
    modules whose boundaries are pinned. ``axis`` is the mesh axis the styles shard on.
    ``gathered``: parameters the ops read in another layout than they are stored in (fully
    sharded ones: read gathered over the data-parallel dimension), by name. ``batch_axis``:
    the data-parallel mesh axis, whose batch split the pinned activations keep."""

    parameters: Mapping[str, Layout]
    modules: Mapping[str, ModuleLayouts]
    ndim: int
    gathered: Mapping[str, Layout] = dataclasses.field(default_factory=dict)
    batch_axis: int | None = None  # fully sharded: the mesh axis the batch is split over

    def layout(self, placement: Placement, axis: int | None = None) -> Layout:
        """``placement`` on the plan's mesh axis (the last), replicated on the others."""
        axis = self.ndim - 1 if axis is None else axis
        return tuple(placement if i == axis else Replicate() for i in range(self.ndim))


_HF_STYLES: dict[str, Any] = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "local_colwise": lambda: _Local(ColwiseParallel()),
    "local_rowwise": lambda: _Local(RowwiseParallel()),
    "sequence_parallel": lambda: SequenceParallel(),
    "gather": lambda: PrepareModuleOutput(output_layouts=Shard(-1),
                                          desired_output_layouts=Replicate()),
    "replicate": lambda: _Replicated(),
    "local": lambda: _Replicated(),
    # a replicated parameter read on sharded activations (Qwen3's per-head q_norm/k_norm):
    # its gradient is a partial sum there, which the derived backward reduces anyway
    "replicated_with_grad_allreduce": lambda: _Replicated(),
    # DeepSeek-V2/V3's kv_a_proj_with_mqa: replicated, its rope part's gradient partial
    # under Hugging Face's eager TP (reduced here as any replicated result's)
    "mla_kv_a_proj": lambda: _Replicated(),
}


@dataclasses.dataclass(frozen=True)
class _Local:
    """HF's ``local_*`` styles: the parameters of ``style``, no boundary layouts."""

    style: Any


class _Replicated:
    """Every parameter replicated, no boundary layouts."""


@dataclasses.dataclass(frozen=True)
class ModelOutline:
    """What a plan is read against: each module's path and class name, each parameter's
    name and number of axes (from a module, or from a Dynamo graph's module stacks).
    ``family_plan``: the model's own Hugging Face plan (``model.tp_plan``, its config's
    ``base_model_tp_plan``), written for every model of its family: one of its keys may
    match nothing in this model (Qwen3-MoE's plan names a dense MLP's projections, which a
    model whose every layer holds experts lacks), and it may name styles of its experts'
    tensor parallelism that meshfuse does not read (see :func:`_style`)."""

    modules: Mapping[str, str]
    parameters: Mapping[str, int]
    prefix: str = ""
    family_plan: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def outline_of(module: torch.nn.Module) -> ModelOutline:
    """The outline of ``module``; ``prefix`` is Hugging Face's ``base_model_prefix``."""
    plans = (getattr(getattr(module, "config", None), "base_model_tp_plan", None),
             getattr(module, "tp_plan", None))
    family = {k: v for plan in plans if isinstance(plan, Mapping) for k, v in plan.items()}
    return ModelOutline({p: type(m).__name__ for p, m in module.named_modules()},
                        {n: p.ndim for n, p in module.named_parameters()},
                        getattr(module, "base_model_prefix", "") or "", family)


def resolve_plan(model: ModelOutline, plan: Mapping[str, Any], ndim: int, *,
                 every_key: bool = True) -> ResolvedPlan:
    """Reads ``plan`` against ``model``'s modules and parameters (see the module doc);
    ``every_key``: each key must match something (but the model's own plan's keys, which
    may name what only other models of its family have: ``ModelOutline.family_plan``).

    Raises:
        DefinitionError: for a key that matches nothing, a style meshfuse does not read, or
            placements of the wrong length.
    """
    prefix = model.prefix
    resolved = ResolvedPlan({}, {}, ndim)
    used: set[str] = set()
    for path, kind in model.modules.items():
        key = _first_match(plan, path, prefix)
        if key is None or _is_placements(plan[key]):
            continue
        used.add(key)
        own = model.family_plan.get(key, _NOT_OWN) == plan[key]
        _apply_style(resolved, path, kind, _own_parameters(model, path),
                     _style(plan[key], key, own))
    for name in model.parameters:
        key = _first_match(plan, name, prefix)
        if key is not None and _is_placements(plan[key]):
            used.add(key)
            layout = tuple(plan[key])
            if len(layout) != ndim:
                raise DefinitionError(
                    f"plan[{key!r}]: {len(layout)} placements for a {ndim}-D mesh; give one "
                    "per mesh axis")
            resolved.parameters[name] = layout
        resolved.parameters.setdefault(name, resolved.layout(Replicate()))
    unused = [k for k in plan if k not in used and k not in model.family_plan]
    if unused and every_key:
        raise DefinitionError(
            f"plan keys {unused} match no module or parameter of the model; "
            "keys are dotted module or parameter names with fnmatch patterns "
            "('model.layers.*.mlp.up_proj')")
    return resolved


def _own_parameters(model: ModelOutline, path: str) -> dict[str, int]:
    """The parameters directly in module ``path`` (leaf name -> number of axes)."""
    start = f"{path}." if path else ""
    return {n[len(start):]: d for n, d in model.parameters.items()
            if n.startswith(start) and "." not in n[len(start):]}


def _first_match(plan: Mapping[str, Any], name: str, prefix: str) -> str | None:
    if not name:
        return None
    for key in plan:
        if fnmatch.fnmatchcase(name, key) or prefix and fnmatch.fnmatchcase(name,
                                                                            f"{prefix}.{key}"):
            return key
    return None


def _is_placements(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and \
        all(isinstance(p, Placement) for p in value)


# Hugging Face's expert-parallel styles (a model's ``ep_plan``), which no DTensor style or
# placement writes either: the tokens are dispatched to the ranks holding their experts.
_HF_EXPERT_STYLES = ("grouped_gemm", "ep_dispatch_experts", "ep_router", "moe_tp_experts")


_NOT_OWN = object()


def expert_entries(plan: Mapping[str, Any]) -> dict[str, str]:
    """The entries of ``plan`` in Hugging Face's expert styles (``"moe_tp_experts"``...)."""
    return {k: v for k, v in plan.items() if isinstance(v, str) and v in _HF_EXPERT_STYLES}


def _style(value: Any, key: str, own: bool = False) -> Any:
    """The style of ``plan[key] = value``; ``own``: the entry is the model's own plan's.
    Some versions of Hugging Face's plans shard experts by tensor parallelism
    (``"layers.*.mlp.experts": "moe_tp_experts"``, with ``"packed_colwise"`` and
    ``"rowwise"`` entries on the experts' parameters), others leave the experts out: in a
    model's own plan, such an entry leaves them replicated, as the other versions do."""
    if isinstance(value, str):
        if value in _HF_EXPERT_STYLES and own:
            return _Replicated()
        if value in _HF_EXPERT_STYLES:
            raise DefinitionError(
                f"plan[{key!r}] = {value!r}: Hugging Face's expert parallelism (a model's "
                "ep_plan) is not read for a captured model; leave its keys out (the experts "
                "are then laid out as the rest of the plan says: replicated by default), or "
                "write the MoE block with meshfuse's experts op (meshfuse.examples.moe), "
                "which runs expert-parallel")
        if value not in _HF_STYLES:
            raise DefinitionError(
                f"plan[{key!r}] = {value!r}: meshfuse reads the Hugging Face styles "
                f"{sorted(_HF_STYLES)}; write this one as a DTensor style or placements")
        return _HF_STYLES[value]()
    return value


def _apply_style(plan: ResolvedPlan, path: str, kind: str, params: Mapping[str, int],
                 style: Any) -> None:
    name = (lambda n: f"{path}.{n}" if path else n)
    embedding = kind.endswith("Embedding")
    if isinstance(style, _Replicated):
        return
    local = isinstance(style, _Local)
    style = style.style if local else style
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        colwise = isinstance(style, ColwiseParallel)
        for n, axes in params.items():
            plan.parameters[name(n)] = plan.layout(_parameter_shard(kind, axes, colwise))
        if local:
            return
        desired = style.desired_input_layouts[0] if colwise else \
            (Replicate() if embedding else Shard(-1))
        given = style.input_layouts[0]
        plan.modules[path] = ModuleLayouts(
            inputs=desired if given != desired else None,
            outputs=style.output_layouts[0] if style.output_layouts[0] != Shard(-1) or
            not colwise else None)
    elif isinstance(style, SequenceParallel):
        shard = style.sequence_sharding[0]
        plan.modules[path] = ModuleLayouts(inputs=shard, outputs=shard)
    elif isinstance(style, PrepareModuleInput):
        plan.modules[path] = ModuleLayouts(inputs=style.desired_input_layouts[0])
    elif isinstance(style, PrepareModuleOutput):
        plan.modules[path] = ModuleLayouts(outputs=style.desired_output_layouts[0])
    else:
        raise DefinitionError(
            f"plan for {path!r}: {type(style).__name__} is not a style meshfuse reads "
            "(ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput/Output, "
            "a Hugging Face style string, or placements)")


def _parameter_shard(kind: str, axes: int, colwise: bool) -> Placement:
    """The shard a column- or row-parallel style gives one parameter of ``module``: a
    linear's weight ``[out, in]`` (GPT-2's Conv1D holds ``[in, out]``), an embedding's
    ``[vocab, dim]``; a bias follows the output features (column) or is replicated (row)."""
    if axes == 1:
        return Shard(0) if colwise else Replicate()
    transposed = kind == "Conv1D" or kind.endswith("Embedding")
    out_axis = 1 if transposed else 0
    return Shard(out_axis if colwise else 1 - out_axis)
