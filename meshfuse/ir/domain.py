"""``domain(tv)``: the split chains of one tensor's schedule, read once and cached.

A schedule derives IDs from a tensor's logical IDs by splits and merges. Many questions walk
those chains: which logical ID a device-parallel ID was split from, which IDs were split from
a logical ID, the path of splits down to an ID, the index of every global index on each ID.
:class:`TensorDomain` answers them from one pass over the transforms; :func:`domain` caches
it per TensorView until the schedule changes (new transforms, parallel types or mesh).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from meshfuse.errors import ScheduleError
from meshfuse.ir.iter_domain import IterDomain, Merge, Split
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.ir.tensor_view import TensorView

# A split step on the way from a logical ID down to an ID: (factor, inner_split, took the
# inner part); a merge is ("merge",).
PathStep = tuple


class TensorDomain:
    """The split chains of ``tv``'s schedule at the time it was made.

    Attributes:
        producers: the transform that created each derived ID.
        roots: each ID -> the logical ID it was split from (itself for a logical ID);
            IDs that come from a merge are absent.
        device_ids: logical ID -> its device-parallel IDs with their types, in the order
            ``tv.parallel`` lists them.
    """

    def __init__(self, tv: TensorView):
        self.name = tv.name
        self.transforms = tuple(tv.transforms)
        self.producers: dict[IterDomain, Split | Merge] = {
            out: t for t in self.transforms for out in t.outputs}
        self.roots: dict[IterDomain, IterDomain] = {i: i for i in tv.logical}
        self.subtrees: dict[IterDomain, list[IterDomain]] = {i: [i] for i in tv.logical}
        for t in self.transforms:
            root = self.roots.get(t.inputs[0]) if isinstance(t, Split) else None
            if root is not None:
                for out in t.outputs:
                    self.roots[out] = root
                self.subtrees[root].extend(t.outputs)
        self.device_ids: dict[IterDomain, list[tuple[IterDomain, ParallelType]]] = {}
        self._merged_device_id: IterDomain | None = None
        for id_, pt in tv.parallel.items():
            if not pt.is_device:
                continue
            if id_ not in self.roots:
                self._merged_device_id = self._merged_device_id or id_
                continue
            self.device_ids.setdefault(self.roots[id_], []).append((id_, pt))

    def logical_root(self, id_: IterDomain) -> IterDomain:
        """The logical ID ``id_`` was split from (itself if logical).

        Raises:
            ScheduleError: if ``id_`` comes from a merge (a merged axis cannot be sharded).
        """
        if id_ not in self.roots and id_ in self.producers:
            raise ScheduleError(
                f"{self.name}: a device-parallel axis derived from a merge is not supported; "
                "split the logical axis itself and parallelize a part of it"
            )
        return self.roots.get(id_, id_)

    def check_device_ids(self) -> None:
        """Raises the ScheduleError of :meth:`logical_root` for a device ID from a merge."""
        if self._merged_device_id is not None:
            self.logical_root(self._merged_device_id)

    def subtree(self, logical_id: IterDomain) -> list[IterDomain]:
        """``logical_id`` and every ID split from it, in transform order."""
        return list(self.subtrees.get(logical_id, [logical_id]))

    def ancestry(self, id_: IterDomain) -> list[IterDomain]:
        """``id_`` and the IDs it was split from, up to its logical ID (or up to the merge
        it comes from)."""
        chain = [id_]
        while chain[-1] in self.producers:
            t = self.producers[chain[-1]]
            if isinstance(t, Merge):
                break
            chain.append(t.in_id)
        return chain

    def path(self, id_: IterDomain) -> tuple[IterDomain, tuple[PathStep, ...]]:
        """The ID at the top of ``id_``'s chain and the steps from it down to ``id_``."""
        steps, current = [], id_
        while current in self.producers:
            t = self.producers[current]
            steps.append((t.factor, "zigzag" if t.zigzag else t.inner_split,
                          current is t.inner) if isinstance(t, Split) else ("merge",))
            current = t.inputs[0]
        return current, tuple(reversed(steps))

    def split_indices(self, logical_id: IterDomain,
                      extents: Mapping[IterDomain, int]) -> dict[IterDomain, torch.Tensor]:
        """For ``logical_id`` and each ID split from it: the index on that ID of every global
        index of ``logical_id`` (an outer ID gets ``i // inner``, an inner one ``i % inner``;
        a zig-zag split's outer ID the head-tail pair of ``i``'s chunk)."""
        index = {logical_id: torch.arange(extents[logical_id])}
        for t in self.transforms:
            if isinstance(t, Split) and t.in_id in index:
                if t.zigzag:
                    index[t.outer], index[t.inner] = _zigzag(index[t.in_id], t.factor,
                                                             extents[t.in_id], self.name)
                    continue
                inner = extents[t.inner]
                index[t.outer] = index[t.in_id] // inner
                index[t.inner] = index[t.in_id] % inner
        return index


def _zigzag(i: torch.Tensor, factor: int, extent: int, name: str):
    """The outer and inner indices of a zig-zag split of ``extent`` into ``factor`` pairs."""
    if extent % (2 * factor):
        raise ScheduleError(f"{name}: a zig-zag split of an axis of extent {extent} into "
                            f"{factor} head-tail pairs needs a multiple of {2 * factor}")
    chunk = extent // (2 * factor)
    which = i // chunk
    back = which >= factor
    outer = torch.where(back, 2 * factor - 1 - which, which)
    return outer, i % chunk + back * chunk


_cache: weakref.WeakKeyDictionary[TensorView, tuple[tuple, TensorDomain]] = \
    weakref.WeakKeyDictionary()


def domain(tv: TensorView) -> TensorDomain:
    """``tv``'s :class:`TensorDomain`, made once per schedule."""
    key = (len(tv.transforms), tuple(tv.parallel.items()), tv.name)
    cached = _cache.get(tv)
    if cached is None or cached[0] != key:
        cached = _cache[tv] = (key, TensorDomain(tv))
    return cached[1]
