"""Local shards: which part of a global tensor a device holds, and in which memory layout.

This module reads a TensorView's schedule (docs/design.md, sections 4 and 5):

- each *device-parallel* loop ID is reached from exactly one logical ID through splits; the
  device whose coordinate on that mesh axis is ``c`` holds the logical indices whose index on
  that ID is ``c`` (an outer split gives a block shard, an inner split a cyclic one, several
  splits compose);
- a logical ID that is itself device-parallel (the older "logical DID axis") has local extent 1;
- the local tensor has the logical rank (reduction IDs excluded), each sharded axis holding its
  indices in increasing order, and strides given by the allocation domain with DID IDs of
  extent 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from meshfuse.errors import ScheduleError
from meshfuse.ir.domain import domain
from meshfuse.ir.iter_domain import IterDomain, Merge, Split
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.ir.tensor_view import Allocation, TensorView


def derived_extents(tv: TensorView, logical: Mapping[IterDomain, int]) -> dict[IterDomain, int]:
    """Extents of every ID of ``tv`` given the logical ones; checks that splits divide."""
    extents = dict(logical)
    for t in tv.transforms:
        if isinstance(t, Split):
            n = extents[t.in_id]
            if n % t.factor != 0:
                root = _split_ancestry(tv, t.in_id)[-1]
                where = (f"axis {tv.logical.index(root)}" if root in tv.logical
                         else "a merged axis")
                raise ScheduleError(
                    f"split factor {t.factor} does not divide extent {n} of {where} of "
                    f"{tv.name}; choose a divisor of {n} or change the input's size"
                )
            rest = n // t.factor
            extents[t.outer], extents[t.inner] = (
                (rest, t.factor) if t.inner_split else (t.factor, rest)
            )
        else:
            extents[t.out] = extents[t.outer] * extents[t.inner]
    return extents


def producers(tv: TensorView) -> dict[IterDomain, Split | Merge]:
    """The transform that created each derived ID of ``tv``."""
    return domain(tv).producers


def logical_root(tv: TensorView, id_: IterDomain) -> IterDomain:
    """The logical ID that ``id_`` was split from (itself if logical).

    Raises:
        ScheduleError: if ``id_`` comes from a merge (a merged axis cannot be sharded).
    """
    return domain(tv).logical_root(id_)


def device_ids(tv: TensorView) -> dict[IterDomain, list[tuple[IterDomain, ParallelType]]]:
    """Logical ID -> the device-parallel IDs derived from it (with their types)."""
    d = domain(tv)
    d.check_device_ids()
    return d.device_ids


def split_indices(
    tv: TensorView, logical_id: IterDomain, extents: Mapping[IterDomain, int]
) -> dict[IterDomain, torch.Tensor]:
    """For ``logical_id`` and each ID split from it: the index on that ID of every global
    index of ``logical_id`` (an outer ID gets ``i // inner``, an inner one ``i % inner``)."""
    return domain(tv).split_indices(logical_id, extents)


def shard_factor(tv: TensorView, logical_id: IterDomain) -> int:
    """How many shards ``logical_id`` is cut into: the product of the sizes of the mesh axes
    its device IDs run over (known before the global extent is)."""
    return math.prod(tv.mesh.axis_size(pt) for _, pt in device_ids(tv).get(logical_id, []))


def local_indices(
    tv: TensorView,
    logical_id: IterDomain,
    extents: Mapping[IterDomain, int],
    coords: Mapping[ParallelType, int],
) -> torch.Tensor | None:
    """The global indices of ``logical_id`` held by the device at ``coords``, ascending.

    ``None`` when the axis is not sharded. ``coords`` maps each device parallel type to the
    device's coordinate on that type's mesh axis.
    """
    shards = device_ids(tv).get(logical_id)
    if not shards:
        return None
    index = split_indices(tv, logical_id, extents)
    keep = torch.ones(extents[logical_id], dtype=torch.bool)
    for id_, pt in shards:
        keep &= index[id_] == coords[pt]
    return torch.nonzero(keep).flatten()


def local_extent(tv: TensorView, id_: IterDomain, extents: Mapping[IterDomain, int]) -> int:
    """The local extent of any ID of ``tv``: a device-parallel ID has extent 1, and an ID
    that device-parallel IDs were split from shrinks by their extents."""
    factor = 1
    for pt_id, pt in tv.parallel.items():
        if pt.is_device and id_ in _split_ancestry(tv, pt_id):
            factor *= extents[pt_id]
    return extents[id_] // factor


def _split_ancestry(tv: TensorView, id_: IterDomain) -> list[IterDomain]:
    """``id_`` and the IDs it was split from, up to its logical ID."""
    return domain(tv).ancestry(id_)


@dataclasses.dataclass(frozen=True)
class LocalLayout:
    """The bound local layout of one tensor on one device.

    Attributes:
        shape: local extents of the materialized logical axes.
        strides: dense strides in the allocation domain's order.
        order: logical axis positions, outermost in memory first.
        contiguity: per logical axis, ``True`` if its stride must be dense, ``False`` if it
            may be larger, ``None`` if free (broadcast).
    """

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    order: tuple[int, ...]
    contiguity: tuple[bool | None, ...]


def local_layout(
    tv: TensorView, allocation: Allocation, extents: Mapping[IterDomain, int]
) -> LocalLayout:
    """Local shape, dense strides and memory order of ``tv`` under ``allocation``.

    Each logical axis takes the stride of the innermost allocation ID derived from it whose
    local extent is above 1 (or, if it has none, of its innermost allocation ID).
    """
    logical = tv.materialized()
    shape = tuple(local_extent(tv, i, extents) for i in logical)
    ids = allocation.ids
    local = [local_extent(tv, i, extents) for i in ids]
    dense = [math.prod(local[pos + 1 :]) for pos in range(len(ids))]
    roots = [_allocation_root(tv, i) for i in ids]
    strides, positions, contiguity = [], [], []
    for id_ in logical:
        mine = [pos for pos, root in enumerate(roots) if root is id_]
        sized = [pos for pos in mine if local[pos] > 1]
        if len(sized) > 1 and any(local[p] > 1 and roots[p] is not id_ for p in range(sized[0], sized[-1])):
            raise ScheduleError(
                f"the allocation domain of {tv.name} places parts of one sharded logical axis "
                "apart; keep the parts of an axis next to each other in the allocation domain"
            )
        pos = (sized or mine)[-1]
        strides.append(dense[pos])
        positions.append(pos)
        contiguity.append(allocation.contiguity[pos])
    order = tuple(sorted(range(len(logical)), key=lambda a: positions[a]))
    return LocalLayout(shape, tuple(strides), order, tuple(contiguity))


def _allocation_root(tv: TensorView, id_: IterDomain) -> IterDomain:
    root = _split_ancestry(tv, id_)[-1]
    if root in producers(tv):
        raise ScheduleError(
            f"the allocation domain of {tv.name} holds a merged ID; allocate the merged axes "
            "separately (merged allocation IDs are not supported yet)"
        )
    return root
