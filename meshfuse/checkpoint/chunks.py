"""A rank's shard of a global tensor as boxes of the global tensor: what a checkpoint writes.

A meshfuse shard is, along each axis, a set of global indices (ascending): a block, the
residues of a cyclic split, an uneven remainder, the product of several mesh axes' splits. A
checkpoint stores a tensor as *chunks*, boxes of the global tensor given by their offsets and
sizes (torch.distributed.checkpoint's ``ChunkStorageMetadata``), so a shard is cut into the
boxes its index sets make: along each axis the runs of consecutive global indices, and the
product of the runs over the axes. A block shard is one box; a cyclic one a box per cycle.
Ranks that hold the same box (replicas) write it once: the save planner keeps one copy of
items with the same name and offsets.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

Index = Sequence[torch.Tensor | None]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A box of the global tensor (``offsets``, ``sizes``) and where it lies in the local
    shard (``start`` of each axis; the sizes are the same)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: tuple[int, ...]

    def storage(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets),
                                    sizes=torch.Size(self.sizes))


@dataclasses.dataclass
class ShardedValue:
    """This rank's ``local`` shard of a global tensor of ``shape``, cut into ``chunks``.

    ``local`` is a plain tensor in the global axes' order (any strides); a rank that holds
    nothing of the tensor has no chunks. ``flat``: ``local`` is instead a 1-D run of the
    global tensor's elements in row-major order (a piece of a flat shard), and each chunk's
    ``start`` is its one offset in ``local``.
    """

    local: torch.Tensor
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    flat: bool = False

    def piece(self, offsets: Sequence[int]) -> torch.Tensor:
        """The view of ``local`` that holds the chunk at global ``offsets``."""
        for chunk in self.chunks:
            if chunk.offsets == tuple(offsets) and self.flat:
                start = chunk.start[0]
                return self.local[start:start + math.prod(chunk.sizes)].view(chunk.sizes)
            if chunk.offsets == tuple(offsets):
                return self.local[tuple(slice(s, s + n) for s, n in
                                        zip(chunk.start, chunk.sizes))]
        raise KeyError(f"no chunk at offsets {tuple(offsets)}")

    @property
    def nbytes(self) -> int:
        """The bytes of this rank's chunks."""
        return sum(math.prod(c.sizes) for c in self.chunks) * self.local.element_size()

    def with_local(self, local: torch.Tensor) -> ShardedValue:
        """The same chunks over another local tensor of the same shape (a staging copy)."""
        return dataclasses.replace(self, local=local)


def _runs(index: torch.Tensor | None, extent: int) -> list[tuple[int, int, int]]:
    """``(global start, local start, length)`` of each run of consecutive global indices
    along one axis (one run covering ``extent`` for an axis held whole)."""
    if index is None:
        return [(0, 0, extent)]
    if index.numel() == 0:
        return []
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, index.numel()]
    values = index.tolist()
    return [(values[s], s, e - s) for s, e in zip(starts, ends)]


def chunks_of(shape: Sequence[int], index: Index | None) -> tuple[Chunk, ...]:
    """The boxes of a shard whose axes hold the global indices ``index`` (None: the rank
    holds nothing) of a global tensor of ``shape``."""
    if index is None:
        return ()
    if len(shape) == 0:
        return (Chunk((), (), ()),)
    per_axis = [_runs(i, n) for i, n in zip(index, shape)]
    return tuple(
        Chunk(tuple(r[0] for r in box), tuple(r[2] for r in box), tuple(r[1] for r in box))
        for box in itertools.product(*per_axis))


def whole(t: torch.Tensor) -> ShardedValue:
    """A tensor every rank holds whole (replicated; written once)."""
    return ShardedValue(t, tuple(t.shape), chunks_of(t.shape, [None] * t.dim()))


def boxed(local: torch.Tensor, shape: Sequence[int], offsets: Sequence[int]) -> ShardedValue:
    """A shard that is one box at ``offsets`` (a DTensor's local tensor)."""
    index = [torch.arange(o, o + n) for o, n in zip(offsets, local.shape)]
    return ShardedValue(local, tuple(shape), chunks_of(shape, index))


def _flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple, tuple]]:
    """``(offsets, sizes)`` of the boxes that the row-major elements ``[start, stop)`` of a
    tensor of ``shape`` make, in order (each box is a run of consecutive elements)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        return [((first, *o), (1, *s)) for o, s in
                _flat_boxes(shape[1:], start - first * inner, stop - first * inner)]
    head, tail = [], []
    rows_start, rows_stop = first, last + 1
    if start % inner:
        head = _flat_boxes(shape, start, (first + 1) * inner)
        rows_start = first + 1
    if stop % inner:
        tail = _flat_boxes(shape, last * inner, stop)
        rows_stop = last
    rows = [((rows_start, *[0] * (len(shape) - 1)), (rows_stop - rows_start, *shape[1:]))] \
        if rows_stop > rows_start else []
    return head + rows + tail


def flat_piece(local: torch.Tensor, shape: Sequence[int], start: int) -> ShardedValue:
    """``local``, the row-major elements ``[start, start + local.numel())`` of a global
    tensor of ``shape``, as the boxes they make (a flat shard's piece of a parameter)."""
    shape = tuple(shape)
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    chunks = tuple(
        Chunk(offsets, sizes, (sum(o * s for o, s in zip(offsets, strides)) - start,))
        for offsets, sizes in _flat_boxes(shape, start, start + local.numel()))
    return ShardedValue(local, shape, chunks, flat=True)
