"""Device-parallel axes made by a merge, rewritten as splits of one logical axis.

nvFuser's schedules may merge two axes and split the merged axis for the devices
(``tv.merge(0); tv.outer_split(0, d); tv.axis(0).parallelize(mesh_x)``). The devices then own
parts of the flattened index ``i * B + j`` of the two logical axes (extents ``A`` and ``B``,
``i`` the outer one). meshfuse's local tensors keep the logical axes, so each device's part
must be a block of them; that is so exactly when the merged split is a split of one of the
two axes in disguise:

- the *outer* part of a split whose inner part has extent ``c`` (device ``(i*B + j) // c``):
  when ``B`` divides ``c``, it is ``i // (c / B)``, the same split of the outer axis (an outer
  split by ``d`` of the merged axis is the outer split by ``d`` of ``i``: its blocks are
  ``torch.chunk``'s);
- the *inner* part of extent ``c`` (device ``(i*B + j) % c``): when ``c`` divides ``B``, it is
  ``j % c``, the same split of the inner axis;
- either part, when one of the two axes has extent 1: a split of the other.

:func:`unmerge_device_axes` rewrites such schedules (on the compiled copy) into those
splits; any other device axis from a merge leaves each device a part that is no block of
the tensor: a ScheduleError that says how to shard instead.
"""

from __future__ import annotations

from meshfuse.errors import ScheduleError
from meshfuse.ir.fusion import Fusion
from meshfuse.ir.iter_domain import IterDomain, Merge, Split, split_ids
from meshfuse.ir.tensor_view import Allocation, TensorView


def unmerge_device_axes(fusion: Fusion) -> None:
    """Rewrites, in place, every device-parallel ID that a split of a merged ID made into a
    split of one logical ID (see the module doc)."""
    for tv in fusion.tensors():
        for id_ in [i for i, pt in tv.parallel.items() if pt.is_device]:
            split = _producer(tv, id_)
            if isinstance(split, Split) and isinstance(_producer(tv, split.in_id), Merge):
                _unmerge(tv, split, id_)


def _producer(tv: TensorView, id_: IterDomain) -> Split | Merge | None:
    return next((t for t in tv.transforms if id_ in t.outputs), None)


def _fail(tv: TensorView, merge: Merge, why: str) -> ScheduleError:
    """The error for a merged device axis that is no split of one logical axis."""
    axes = [tv.logical.index(i) if i in tv.logical else "a derived axis"
            for i in merge.inputs]
    return ScheduleError(
        f"{tv.name}: a device-parallel axis is split from the merge of axes {axes[0]} and "
        f"{axes[1]}, and {why}; split one logical axis itself and parallelize a part of it "
        "(or merge axes whose extents make the devices' parts blocks of one axis)")


def _unmerge(tv: TensorView, split: Split, device: IterDomain) -> None:
    merge = _producer(tv, split.in_id)
    if merge.outer not in tv.logical or merge.inner not in tv.logical:
        raise _fail(tv, merge, "one of them is itself split or merged")
    if merge.outer.extent is None or merge.inner.extent is None:
        raise _fail(tv, merge, "their extents are symbolic (declare them static)")
    rest = split.inner if device is split.outer else split.outer
    if rest not in tv.loop:
        raise _fail(tv, merge, "the other part of the split is split or merged again")
    kept = _equivalent_axis(tv, merge, split, device)
    new = _equivalent_split(merge, split, device, kept)
    new_device, new_rest = (new.outer, new.inner) if device is split.outer else \
        (new.inner, new.outer)
    other = merge.inner if kept is merge.outer else merge.outer
    rest_ids = [new_rest, other] if kept is merge.outer else [other, new_rest]
    _replace(tv, (merge, split), new, {device: [new_device], rest: rest_ids})
    tv.parallel[new_device] = tv.parallel.pop(device)


def _inner_extent(merge: Merge, split: Split) -> int:
    """The extent of the inner part of ``split`` of the merged ID."""
    n = merge.outer.extent * merge.inner.extent
    return split.factor if split.inner_split else -(-n // split.factor)


def _equivalent_axis(tv: TensorView, merge: Merge, split: Split,
                     device: IterDomain) -> IterDomain:
    """The logical ID (of the two merged) on which a split owns each index as ``device``
    does."""
    a, b = merge.outer.extent, merge.inner.extent
    if a == 1:
        return merge.inner
    if b == 1:
        return merge.outer
    c = _inner_extent(merge, split)
    if device is split.outer:
        if c % b == 0:
            return merge.outer
        raise _fail(tv, merge, f"its blocks of {c} elements of the merged {a} x {b} do not "
                    f"hold whole rows of {b}")
    if b % c == 0:
        return merge.inner
    raise _fail(tv, merge, f"the devices take the merged {a} x {b} elements cyclically by {c}, "
                f"and {c} does not divide the rows of {b}")


def _equivalent_split(merge: Merge, split: Split, device: IterDomain,
                      kept: IterDomain) -> Split:
    """The split of ``kept`` whose part at ``device``'s position has ``device``'s extent and
    owner of every index: an outer split by the same factor (``torch.chunk``'s blocks of the
    merged axis are blocks of whole rows), or an inner split by the rows a part holds (an
    outer part), or by the same extent (an inner part)."""
    c = _inner_extent(merge, split)
    if device is split.inner:
        return split_ids(kept, c, True)
    if not split.inner_split:
        return split_ids(kept, split.factor, False)
    rows = merge.inner.extent if kept is merge.outer else 1
    return split_ids(kept, c // rows, True)


def _replace(tv: TensorView, old: tuple[Merge, Split], new: Split,
             ids: dict[IterDomain, list[IterDomain]]) -> None:
    """Swaps the transforms ``old`` for ``new`` and each loop (and allocation) ID for its
    replacement IDs."""
    tv.transforms = [t for t in tv.transforms if t not in old] + [new]

    def swap(seq):
        return [j for i in seq for j in ids.get(i, [i])]

    tv.loop = swap(tv.loop)
    if tv.allocation is not None and any(i in ids for i in tv.allocation.ids):
        contiguity = [c for i, c in zip(tv.allocation.ids, tv.allocation.contiguity)
                      for _ in ids.get(i, [i])]
        tv.allocation = Allocation(tuple(swap(tv.allocation.ids)), tuple(contiguity))
