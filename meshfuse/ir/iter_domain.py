"""IterDomains and the transforms between them.

An :class:`IterDomain` (ID) is one axis of iteration of a tensor: its extent (static, or
symbolic until execute binds it) and its kind (iteration, reduction or broadcast). IDs are
immutable values with an identity (``uid``); how a tensor's loop IDs are *executed* (serially or
over a mesh axis) is kept by the tensor, not in the ID.

A schedule derives new IDs from old ones through transform records:

- :class:`Split`: ``in_id`` of extent ``n`` becomes ``outer`` and ``inner``. With
  ``inner_split=True`` the inner extent is ``factor``; with ``inner_split=False`` (an *outer
  split*) the outer extent is ``factor``; the other part has extent ``ceil(n / factor)``.
  Index ``i`` of ``in_id`` is ``o * inner + j``. When ``factor`` does not divide ``n`` the
  last positions ``(o, j)`` (those with ``o * inner + j >= n``) stand for no index: an outer
  split of 12 by 5 gives blocks of 3, 3, 3, 3 and 0 indices, as ``torch.chunk`` does.
  A *zig-zag* (head-tail) outer split (``zigzag=True``) cuts ``in_id`` into ``2 * factor``
  equal chunks and gives outer index ``o`` chunks ``o`` and ``2 * factor - 1 - o``, the
  inner index running over both in order: sharded over ranks, each rank holds one chunk from
  the front and the matching one from the back, which balances causal attention.
- :class:`Merge`: adjacent ``outer`` and ``inner`` become ``out`` of the product extent.
"""

import dataclasses
import enum
import itertools

from meshfuse.ir.parallel_type import ParallelType

_uids = itertools.count()


class IterType(enum.Enum):
    """Kind of an IterDomain; the value is its letter in printed IR."""

    Iteration = "i"
    Reduction = "r"
    Broadcast = "b"


@dataclasses.dataclass(frozen=True, eq=False)
class IterDomain:
    """One axis of iteration. Equality and hashing are by identity (``uid``).

    Attributes:
        extent: the global extent, or ``None`` while symbolic (bound at execute time).
        iter_type: iteration, reduction or broadcast.
        uid: a process-unique number, for identity only (printing renumbers per fusion).
    """

    extent: int | None
    iter_type: IterType = IterType.Iteration
    uid: int = dataclasses.field(default_factory=lambda: next(_uids))

    @property
    def is_reduction(self) -> bool:
        return self.iter_type is IterType.Reduction

    @property
    def is_broadcast(self) -> bool:
        return self.iter_type is IterType.Broadcast

    def like(self, extent: int | None = None) -> "IterDomain":
        """A new ID (new identity) of the same kind, with ``extent`` or this one's."""
        return IterDomain(self.extent if extent is None else extent, self.iter_type)


@dataclasses.dataclass(frozen=True)
class Split:
    """``in_id`` split into ``outer`` and ``inner``; ``factor`` is the inner extent when
    ``inner_split`` else the outer extent; ``zigzag``: an outer split into head-tail chunk
    pairs (see the module doc)."""

    in_id: IterDomain
    outer: IterDomain
    inner: IterDomain
    factor: int
    inner_split: bool
    zigzag: bool = False

    @property
    def inputs(self) -> tuple[IterDomain, ...]:
        return (self.in_id,)

    @property
    def outputs(self) -> tuple[IterDomain, ...]:
        return (self.outer, self.inner)


@dataclasses.dataclass(frozen=True)
class Merge:
    """Adjacent ``outer`` and ``inner`` merged into ``out``."""

    outer: IterDomain
    inner: IterDomain
    out: IterDomain

    @property
    def inputs(self) -> tuple[IterDomain, ...]:
        return (self.outer, self.inner)

    @property
    def outputs(self) -> tuple[IterDomain, ...]:
        return (self.out,)


Transform = Split | Merge


def split_ids(in_id: IterDomain, factor: int, inner_split: bool, zigzag: bool = False) -> Split:
    """Creates the two IDs of a split of ``in_id`` and returns the record.

    ``factor`` need not divide the extent: the other part has extent ``ceil(n / factor)``
    (see the module doc); a symbolic extent gets a symbolic other part.
    """
    n = in_id.extent
    rest = None if n is None else -(-n // factor)
    kind = in_id.iter_type
    if inner_split:
        outer, inner = IterDomain(rest, kind), IterDomain(factor, kind)
    else:
        outer, inner = IterDomain(factor, kind), IterDomain(rest, kind)
    return Split(in_id, outer, inner, factor, inner_split, zigzag)


def merge_ids(outer: IterDomain, inner: IterDomain) -> Merge:
    """Creates the merged ID of ``outer`` and ``inner`` and returns the record."""
    if outer.extent is None or inner.extent is None:
        extent = None
    else:
        extent = outer.extent * inner.extent
    kind = outer.iter_type if outer.iter_type is inner.iter_type else IterType.Iteration
    return Merge(outer, inner, IterDomain(extent, kind))


def format_id(
    id_: IterDomain, parallel_type: ParallelType = ParallelType.Serial, number: int | None = None
) -> str:
    """An ID as printed IR shows it (see :mod:`meshfuse.ir.printer`): ``iDIDx4{2}``."""
    pt = "" if parallel_type is ParallelType.Serial else parallel_type.value
    extent = "?" if id_.extent is None else id_.extent
    n = "" if number is None else number
    return f"{id_.iter_type.value}{pt}{n}{{{extent}}}"
