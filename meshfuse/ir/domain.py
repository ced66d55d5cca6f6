"""``domain(tv)``: the split chains of one tensor's schedule, read once and cached.

A schedule derives IDs from a tensor's logical IDs by splits and merges. Many questions walk
those chains: which logical ID a device-parallel ID was split from, which IDs were split from
a logical ID, the path of splits down to an ID, the index of every global index on each ID.
:class:`TensorDomain` answers them from one pass over the transforms; :func:`domain` caches
it per TensorView until its transforms change. What depends on the parallel types (which IDs
are device-parallel) is read from the tensor when asked, and kept while they stay the same.
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
# Logical ID -> its device-parallel IDs with their parallel types.
DeviceIds = dict[IterDomain, list[tuple[IterDomain, ParallelType]]]


class TensorDomain:
    """The split chains of ``tv``'s transforms at the time it was made.

    What the transforms decide (producers, roots, subtrees, paths) is computed once; what
    the parallel types decide (:attr:`device_ids`) is read from the tensor when asked, and
    kept until its parallel types change.

    Attributes:
        producers: the transform that created each derived ID.
        roots: each ID -> the logical ID it was split from (itself for a logical ID);
            IDs that come from a merge are absent.
    """

    def __init__(self, tv: TensorView):
        self.name = tv.name
        self.transforms = tuple(tv.transforms)
        self._tensor = weakref.ref(tv)
        # The list these were read from: the schedule methods only append to a tensor's
        # transform list, and a pass that rewrites it assigns a new one (held here, so that
        # no other list can take this one's identity).
        self._source = tv.transforms
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
        self._paths: dict[IterDomain, tuple[IterDomain, tuple[PathStep, ...]]] = {}
        self._split_roots: dict[IterDomain, IterDomain] = {}
        self._parallel: tuple | None = None
        self._signatures: dict[IterDomain, tuple] | None = None
        self._leaves: dict[IterDomain, list[IterDomain]] = {}
        self._read_parallel()

    @property
    def device_ids(self) -> DeviceIds:
        """Logical ID -> its device-parallel IDs with their types, in the order the tensor's
        ``parallel`` lists them (as the tensor is parallelized now)."""
        self._read_parallel()
        return self._device_ids

    def checked_device_ids(self) -> DeviceIds:
        """:attr:`device_ids`, after :meth:`check_device_ids`."""
        self.check_device_ids()
        return self._device_ids

    def device_leaves(self, logical_id: IterDomain) -> list[IterDomain]:
        """The device-parallel IDs of :meth:`subtree` (``logical_id``'s), in its order."""
        self._read_parallel()
        leaves = self._leaves.get(logical_id)
        if leaves is None:
            parallel = dict(self._parallel)
            leaves = self._leaves[logical_id] = [
                i for i in self.subtrees.get(logical_id, (logical_id,))
                if i in parallel and parallel[i].is_device]
        return leaves

    def _read_parallel(self) -> None:
        """Forgets what was read of the parallel types if the tensor's changed since."""
        tv = self._tensor()
        parallel = self._parallel if tv is None else tuple(tv.parallel.items())
        if parallel == self._parallel:
            return
        self._parallel, self._device_ids, self._merged_device_id = parallel, {}, None
        self._signatures, self._leaves = None, {}
        for id_, pt in parallel:
            if not pt.is_device:
                continue
            if id_ not in self.roots:
                self._merged_device_id = self._merged_device_id or id_
                continue
            self._device_ids.setdefault(self.roots[id_], []).append((id_, pt))

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

    def shard_signatures(self) -> dict[IterDomain, tuple]:
        """Logical ID -> how it is sharded: for each device ID whose chain starts at it, the
        parallel type's name and the :meth:`path` down to it, sorted (absent: unsharded)."""
        self._read_parallel()
        if self._signatures is None:
            found: dict[IterDomain, list] = {}
            for id_, pt in self._parallel:
                if pt.is_device:
                    top, path = self.path(id_)
                    found.setdefault(top, []).append((pt.value, path))
            self._signatures = {top: tuple(sorted(entries)) for top, entries in found.items()}
        return self._signatures

    def check_device_ids(self) -> None:
        """Raises the ScheduleError of :meth:`logical_root` for a device ID from a merge."""
        self._read_parallel()
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

    def split_root(self, id_: IterDomain) -> IterDomain:
        """The last of :meth:`ancestry` (``id_``'s logical ID, or the merged ID it was split
        from)."""
        root = self._split_roots.get(id_)
        if root is None:
            root = self._split_roots[id_] = self.ancestry(id_)[-1]
        return root

    def path(self, id_: IterDomain) -> tuple[IterDomain, tuple[PathStep, ...]]:
        """The ID at the top of ``id_``'s chain and the steps from it down to ``id_``."""
        known = self._paths.get(id_)
        if known is None:
            known = self._paths[id_] = self._walk_path(id_)
        return known

    def _walk_path(self, id_: IterDomain) -> tuple[IterDomain, tuple[PathStep, ...]]:
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


_cache: weakref.WeakKeyDictionary[TensorView, TensorDomain] = weakref.WeakKeyDictionary()


def domain(tv: TensorView) -> TensorDomain:
    """``tv``'s :class:`TensorDomain`, made again when its transforms change (a split or a
    merge since, or a new list; parallel types are read as they are when asked)."""
    cached = _cache.get(tv)
    if cached is None or cached._source is not tv.transforms or \
            len(cached.transforms) != len(tv.transforms) or cached.name != tv.name:
        cached = _cache[tv] = TensorDomain(tv)
    return cached
