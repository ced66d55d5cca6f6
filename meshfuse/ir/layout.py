"""Local shards: which part of a global tensor a device holds, and in which memory layout.

This module reads a TensorView's schedule (docs/design.md, sections 4 and 5):

- each *device-parallel* loop ID is reached from exactly one logical ID through splits; the
  device whose coordinate on that mesh axis is ``c`` holds the logical indices whose index on
  that ID is ``c`` (an outer split gives a block shard, an inner split a cyclic one, several
  splits compose);
- a split need not divide its extent (an *uneven* split): the other part has extent
  ``ceil(n / factor)`` and its last positions stand for no index. An outer split gives
  DTensor's ``Shard`` (``torch.chunk`` sizes: 12 over 5 devices holds 3, 3, 3, 3 and 0
  indices), an inner split takes every ``d``-th index (sizes differ by at most one);
- the *local extent* of an ID on a device is how many of its positions stand for an index
  the device holds: a logical axis holds its indices, a device-parallel ID 1 (0 where the
  device's shard is empty), a split part counts its positions among the held indices. Local
  shapes therefore depend on the device, and so does everything built from them;
- a logical ID that is itself device-parallel (the older "logical DID axis") has local extent 1;
- the local tensor has the logical rank (reduction IDs excluded), each sharded axis holding its
  indices in increasing order, and dense strides over the local extents in the memory order
  of the allocation domain.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from meshfuse.errors import ScheduleError
from meshfuse.ir.domain import TensorDomain, domain
from meshfuse.ir.iter_domain import IterDomain, Merge, Split
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.ir.tensor_view import Allocation, TensorView


def derived_extents(tv: TensorView, logical: Mapping[IterDomain, int]) -> dict[IterDomain, int]:
    """Extents of every ID of ``tv`` given the logical ones.

    A split of ``n`` by ``factor`` gives ``factor`` and ``ceil(n / factor)``; the factor
    need not divide ``n`` (an uneven split, see the module doc).
    """
    extents = dict(logical)
    for t in tv.transforms:
        if isinstance(t, Split):
            rest = -(-extents[t.in_id] // t.factor)
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
    return domain(tv).checked_device_ids()


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


def block_factor(tv: TensorView, logical_id: IterDomain) -> int | None:
    """How many even blocks ``logical_id`` is cut into, where it is block-sharded: by outer
    splits on device IDs, each of the part the one before left (the batch split over
    ``replicate`` then ``dp``: a block per pair of coordinates, in order); the product of
    their factors. None for an unsplit axis or any other split (inner, zigzag, on a
    non-device ID). An axis of another extent holds the same elements block by block only
    where the factor divides both extents (6 rows over 4 devices go 2, 2, 2, 0; the 12
    elements they make, 3, 3, 3, 3)."""
    splits = [t for t in tv.transforms if isinstance(t, Split) and t.in_id in
              domain(tv).subtree(logical_id)]
    if not splits or splits[0].in_id is not logical_id:
        return None
    factor = 1
    for k, split in enumerate(splits):
        if split.inner_split or split.zigzag or not tv.parallel_type(split.outer).is_device \
                or k and split.in_id is not splits[k - 1].inner:
            return None
        factor *= split.factor
    return factor


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
    return _held(domain(tv), logical_id, extents, coords)[0]


def _held(d: TensorDomain, logical_id: IterDomain, extents: Mapping[IterDomain, int],
          coords: Mapping[ParallelType, int]) -> tuple[torch.Tensor | None, dict]:
    """:func:`local_indices` of ``logical_id`` (of the tensor whose domain is ``d``), with
    the :func:`split_indices` it read (empty when the axis is not sharded)."""
    shards = d.checked_device_ids().get(logical_id)
    if not shards:
        return None, {}
    index = d.split_indices(logical_id, extents)
    keep = torch.ones(extents[logical_id], dtype=torch.bool)
    for id_, pt in shards:
        keep &= index[id_] == coords[pt]
    return torch.nonzero(keep).flatten(), index


def local_extent(
    tv: TensorView,
    id_: IterDomain,
    extents: Mapping[IterDomain, int],
    coords: Mapping[ParallelType, int],
) -> int:
    """The local extent of any ID of ``tv`` on the device at ``coords``: how many of its
    positions stand for a global index that the device holds.

    A logical ID's local extent is the number of its indices held here; a device-parallel
    ID has local extent 1 (0 on a device whose shard is empty); an ID split from a sharded
    axis counts its positions among the held indices; an ID of an unsharded axis keeps its
    global extent.
    """
    return local_extents(tv, [id_], extents, coords)[0]


def local_extents(tv: TensorView, ids: Sequence[IterDomain], extents: Mapping[IterDomain, int],
                  coords: Mapping[ParallelType, int]) -> list[int]:
    """:func:`local_extent` of each of ``ids``, the held indices of each logical axis read
    once."""
    d = domain(tv)
    held: dict[IterDomain, tuple[torch.Tensor | None, dict]] = {}
    counted: dict[IterDomain, dict[IterDomain, int] | None] = {}
    result = []
    for id_ in ids:
        root = d.split_root(id_)
        if root not in counted:
            counted[root] = _one_split_extents(d, root, extents, coords)
        if counted[root] is not None:
            result.append(counted[root][id_])
            continue
        if root not in held:
            held[root] = _held(d, root, extents, coords) if root in tv.logical else (None, {})
        indices, index = held[root]
        if indices is None:
            result.append(extents[id_])
        elif id_ is root:
            result.append(indices.numel())
        else:
            result.append(index[id_][indices].unique().numel())
    return result


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
    tv: TensorView,
    allocation: Allocation,
    extents: Mapping[IterDomain, int],
    coords: Mapping[ParallelType, int] | None = None,
) -> LocalLayout:
    """Local shape, dense strides and memory order of ``tv`` on the device at ``coords``
    (default: coordinate 0 on every mesh axis) under ``allocation``.

    Each logical axis is placed at the innermost allocation ID derived from it whose local
    extent is above 1 (or, if it has none, at its innermost allocation ID); the strides are
    dense over the logical axes' local extents in that order, so the empty positions of an
    uneven split take no memory.
    """
    if coords is None:
        coords = {pt: 0 for pt in tv.parallel.values() if pt.is_device}
    logical = tv.materialized()
    ids = allocation.ids
    known = local_extents(tv, [*logical, *ids], extents, coords)
    shape, local = tuple(known[:len(logical)]), known[len(logical):]
    roots = [_allocation_root(tv, i) for i in ids]
    positions, contiguity = [], []
    for id_ in logical:
        mine = [pos for pos, root in enumerate(roots) if root is id_]
        sized = [pos for pos in mine if local[pos] > 1]
        if len(sized) > 1 and any(local[p] > 1 and roots[p] is not id_ for p in range(sized[0], sized[-1])):
            raise ScheduleError(
                f"the allocation domain of {tv.name} places parts of one sharded logical axis "
                "apart; keep the parts of an axis next to each other in the allocation domain"
            )
        pos = (sized or mine)[-1]
        positions.append(pos)
        contiguity.append(allocation.contiguity[pos])
    order = tuple(sorted(range(len(logical)), key=lambda a: positions[a]))
    strides = [0] * len(logical)
    running = 1
    for axis in reversed(order):
        strides[axis] = running
        running *= max(shape[axis], 1)
    return LocalLayout(shape, tuple(strides), order, tuple(contiguity))


def _one_split_extents(d: TensorDomain, root: IterDomain, extents: Mapping[IterDomain, int],
                       coords: Mapping[ParallelType, int]) -> dict[IterDomain, int] | None:
    """The local extents of ``root`` and its two parts when one split (not a zig-zag) of
    logical ``root`` made them and one part is device-parallel (a block or a cyclic shard),
    counted without index tensors (the common case, whose indices are as long as the axis);
    None otherwise, or for an axis that is no logical one of the tensor."""
    if root not in d.subtrees or len(d.subtrees[root]) != 3:
        return None
    shards = d.checked_device_ids().get(root)
    t = d.producers[d.subtrees[root][1]]
    if t.zigzag or shards is None or len(shards) != 1:
        return None
    (device_id, pt), = shards
    n, inner, c = extents[root], extents[t.inner], coords[pt]
    if device_id is t.outer:  # indices [c * inner, (c + 1) * inner) of n
        held = max(0, min(n, (c + 1) * inner) - c * inner)
        return {root: held, t.outer: min(held, 1), t.inner: held}
    held = len(range(c, n, inner))  # indices c, c + inner, ... of n
    return {root: held, t.outer: held, t.inner: min(held, 1)}


def _allocation_root(tv: TensorView, id_: IterDomain) -> IterDomain:
    d = domain(tv)
    root = d.split_root(id_)
    if root in d.producers:
        raise ScheduleError(
            f"the allocation domain of {tv.name} holds a merged ID; allocate the merged axes "
            "separately (merged allocation IDs are not supported yet)"
        )
    return root
