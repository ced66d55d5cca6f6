"""User helpers: a global tensor's shard for a rank under a tensor's schedule, and back.

``shard_tensor(t, tv, rank)`` returns what ``execute`` expects from ``rank`` for input ``tv``
(or returns to ``rank`` for output ``tv``): the rank's indices of each sharded axis, laid out
in ``tv``'s allocation order. ``unshard_tensor`` puts the shards of all ranks back together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from meshfuse.errors import InputError, ShardingError
from meshfuse.ir.layout import derived_extents, device_ids, local_indices, local_layout
from meshfuse.ir.tensor_view import Allocation, TensorView
from meshfuse.passes.pipeline import compiled_for
from meshfuse.runtime.interpreter.binding import device_coords


def _compiled(tv: TensorView) -> tuple[TensorView, Allocation]:
    """``tv``'s counterpart in its compiled fusion (every tensor scheduled), and its memory
    order; ``tv`` itself is left as the user wrote it."""
    compiled = compiled_for(tv.fusion)
    final = compiled[tv]
    return final, compiled.allocations[final]


def _extents(tv: TensorView, shape: Sequence[int]):
    ids = tv.materialized()
    if len(shape) != len(ids):
        raise InputError(
            f"{tv.name} has {len(ids)} axes; a tensor of shape {list(shape)} cannot be sharded "
            "like it"
        )
    for axis, (id_, n) in enumerate(zip(ids, shape)):
        if id_.extent is not None and id_.extent != n:
            raise InputError(
                f"{tv.name} axis {axis} has global extent {id_.extent}; got {n}"
            )
    # Reduction IDs are not materialized: any extent their splits divide will do.
    logical = {i: i.extent or math.prod(t.factor for t in tv.transforms
                                        if getattr(t, "in_id", None) is i) for i in tv.logical}
    logical.update(zip(ids, shape))
    return derived_extents(tv, logical)


def _default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def global_shape(tv: TensorView) -> tuple[int, ...]:
    """The global shape of ``tv`` (its materialized axes), as its compiled fusion has it.

    Raises:
        InputError: an axis whose extent is symbolic (known only from a value).
    """
    tv, _ = _compiled(tv)
    shape = tuple(id_.extent for id_ in tv.materialized())
    if None in shape:
        raise InputError(f"{tv.name} has a symbolic extent (shape {list(shape)}); its global "
                         "shape is known only from a value")
    return shape


def shard_indices(tv: TensorView, shape: Sequence[int],
                  rank: int | None = None) -> list[torch.Tensor | None] | None:
    """Where ``rank``'s shard of a global tensor of ``shape`` lies in it under ``tv``'s
    schedule: for each axis the global indices its local positions hold, ascending (None for
    an axis held whole), so ``local[i0, i1] == t[index0[i0], index1[i1]]``; None when
    ``rank`` is outside ``tv``'s mesh (it holds nothing).

    Example:
        >>> shard_indices(tv, (6,), rank=1)   # tv split cyclically over 2 ranks
        [tensor([1, 3, 5])]
    """
    rank = _default_rank() if rank is None else rank
    tv, _ = _compiled(tv)
    if tv.mesh is not None and rank not in tv.mesh:
        return None
    extents = _extents(tv, shape)
    coords = device_coords(tv, rank)
    return [local_indices(tv, id_, extents, coords) for id_ in tv.materialized()]


def shard_tensor(t: torch.Tensor, tv: TensorView, rank: int | None = None) -> torch.Tensor:
    """``rank``'s local shard of the global tensor ``t`` under ``tv``'s schedule.

    Args:
        t: the global tensor (shape = ``tv``'s logical shape, reductions excluded).
        tv: a scheduled TensorView (any splits, inner or outer, any mesh axes).
        rank: defaults to this process's rank (0 without torch.distributed).

    Returns:
        A new tensor with ``tv``'s local shape and the strides of its allocation domain.

    A tensor the user did not schedule is sharded as the compiled fusion shards it
    (propagation may shard an unscheduled input like its neighbours); ``tv`` itself is not
    changed.
    """
    rank = _default_rank() if rank is None else rank
    tv, allocation = _compiled(tv)
    if tv.mesh is not None and rank not in tv.mesh:
        raise ShardingError(f"rank {rank} is not in the mesh of {tv.name} ({tv.mesh!r})")
    extents = _extents(tv, t.shape)
    coords = device_coords(tv, rank)
    local = t
    for axis, id_ in enumerate(tv.materialized()):
        index = local_indices(tv, id_, extents, coords)
        if index is not None:
            local = local.index_select(axis, index.to(t.device))
    layout = local_layout(tv, allocation, extents, coords)
    out = torch.empty_strided(layout.shape, layout.strides, dtype=t.dtype, device=t.device)
    return out.copy_(local)


def unshard_tensor(shards: Sequence[torch.Tensor], tv: TensorView) -> torch.Tensor:
    """The global tensor from the local shards of every device of ``tv``'s mesh.

    Args:
        shards: one local tensor per device, in the order of ``tv.mesh.device_ids`` (for a
            1-D mesh ``range(d)``: rank order); without a mesh, one tensor. Shards of an
            uneven split have different extents (some may be empty).
        tv: the TensorView they are shards of.
    """
    tv, _ = _compiled(tv)
    devices = tv.mesh.device_ids if tv.mesh is not None else (0,)
    if len(shards) != len(devices):
        raise InputError(
            f"unshard_tensor of {tv.name}: got {len(shards)} shards for {len(devices)} devices"
        )
    ids = tv.materialized()
    shape = [_global_extent(tv, axis, shards, devices) for axis in range(len(ids))]
    extents = _extents(tv, shape)
    out = torch.empty(shape, dtype=shards[0].dtype, device=shards[0].device)
    for device, shard in zip(devices, shards):
        coords = device_coords(tv, device)
        index = tuple(
            _as_column(local_indices(tv, id_, extents, coords), axis, len(ids), extent)
            for axis, (id_, extent) in enumerate(zip(ids, shape))
        )
        out[index] = shard
    return out


def _global_extent(tv: TensorView, axis: int, shards: Sequence[torch.Tensor],
                   devices: Sequence[int]) -> int:
    """The global extent of materialized axis ``axis``: the static one, else the sum of the
    shards' extents along it over the devices that differ only in the mesh coordinates that
    shard it (shards may be uneven)."""
    id_ = tv.materialized()[axis]
    if id_.extent is not None:
        return id_.extent
    if tv.mesh is None:
        return shards[0].shape[axis]
    sharding = {tv.mesh.axis_of(pt) for _, pt in device_ids(tv).get(id_, [])}
    return sum(
        shard.shape[axis] for device, shard in zip(devices, shards)
        if all(c == 0 for m, c in enumerate(tv.mesh.coordinate(device)) if m not in sharding)
    )


def _as_column(index, axis: int, ndim: int, extent: int) -> torch.Tensor:
    """An index tensor for advanced indexing that broadcasts along every other axis."""
    index = torch.arange(extent) if index is None else index
    view = [1] * ndim
    view[axis] = -1
    return index.reshape(view)
