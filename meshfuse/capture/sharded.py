"""Fully sharded data parallelism of a captured module (``parallelize(..., fsdp="dp")``).

The plan's placements gain ``Shard(0)`` on the data-parallel mesh dimension for every
parameter with a first axis of more than one row (FSDP2's layout: each rank holds a block of rows, within its
tensor-parallel shard's when the plan splits the same axis, which DTensor writes
``_StridedShard(0, split_factor=tp)``); the user's tensor inputs are
split on their first (batch) axis over that dimension before the call (a parameter of one
row, a gate to one feature, stays replicated over it: an axis of extent 1 is a broadcast
axis, which nothing splits; its gradient is allreduced). The fusions then
read each parameter gathered over ``dp`` (resharding: an allgather before its first use,
:mod:`meshfuse.parallel.fsdp` explains the strategy) and their derived backwards
reduce-scatter its gradient back to the parameter's layout; the loss, a mean over the split
batch, is allreduced. Gradients and optimizer state are DTensors laid out as the parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

from meshfuse.capture.plan import ResolvedPlan
from meshfuse.errors import ScheduleError


def _axis(mesh: TorchDeviceMesh, name: str) -> int:
    names = list(mesh.mesh_dim_names or ())
    if name not in names:
        raise ScheduleError(f"fsdp={name!r}: the mesh has no such dimension (its dimensions: "
                            f"{names}); make it with init_device_mesh(..., mesh_dim_names=("
                            f"'{name}', 'tp'))")
    return names.index(name)


def fully_shard_plan(resolved: ResolvedPlan, mesh: TorchDeviceMesh, name: str,
                     plan: Mapping[str, Any], module: torch.nn.Module) -> ResolvedPlan:
    """``resolved`` with every parameter of a first axis of more than one row sharded on it
    over dimension ``name`` of ``mesh`` too.

    Raises:
        ScheduleError: ``name`` is not a dimension of ``mesh``, or it is the last one (the
            one the plan's tensor parallelism shards over) while the plan is not empty.
    """
    axis = _axis(mesh, name)
    if plan and axis == mesh.ndim - 1:
        raise ScheduleError(f"fsdp={name!r} is the mesh's last dimension, which the plan's "
                            "tensor parallelism shards over: put the data-parallel dimension "
                            f"first, e.g. mesh_dim_names=('{name}', 'tp'), or give plan={{}}")
    shapes = {n: p.shape for n, p in module.named_parameters()}
    layouts, gathered = {}, {}
    for param, layout in resolved.parameters.items():
        stored, shape = list(layout), shapes.get(param, ())
        if len(shape) > 0 and shape[0] > 1 and isinstance(stored[axis], Replicate):
            stored[axis] = _rows(layout, axis, mesh, len(shape))
            gathered[param] = tuple(layout)  # what the ops read: the plan's layout
        layouts[param] = tuple(stored)
    return dataclasses.replace(resolved, parameters=layouts, gathered=gathered,
                               batch_axis=axis)


def _rows(layout: tuple, axis: int, mesh: TorchDeviceMesh, ndim: int) -> Shard:
    """The data-parallel placement of a parameter on mesh axis ``axis``: ``Shard(0)``, or,
    where later mesh axes (tensor parallelism) split the first axis too, FSDP2's
    ``_StridedShard(0)``: a block of rows within the tensor-parallel shard, so the gather
    before use is an allgather over ``axis`` alone and the gradient's a reduce-scatter."""
    later = math.prod(mesh.size(m) for m in range(axis + 1, mesh.ndim)
                      if isinstance(layout[m], Shard) and layout[m].dim % ndim == 0)
    return _StridedShard(0, split_factor=later) if later > 1 else Shard(0)


def batch_placements(mesh: TorchDeviceMesh, name: str) -> tuple:
    """The layout of an input: its first axis split over dimension ``name``."""
    axis = _axis(mesh, name)
    return tuple(Shard(0) if i == axis else Replicate() for i in range(mesh.ndim))


def split_batch(tree: Any, mesh: TorchDeviceMesh, placements: tuple) -> Any:
    """Each plain tensor of ``tree`` with a first axis (the same global batch on every rank)
    as a DTensor split on that axis; this rank keeps its rows, nothing is sent."""
    def split(x: torch.Tensor) -> Any:
        if isinstance(x, DTensor) or x.ndim == 0:
            return x
        return distribute_tensor(x, mesh, placements, src_data_rank=None)
    return pytree.tree_map_only(torch.Tensor, split, tree)
