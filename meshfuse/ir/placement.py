"""Placements: how a tensor lies along each axis of its mesh, read from its schedule.

Like DTensor's placements, one per mesh axis: :class:`Replicate`, :class:`Shard` (a logical
axis split over that mesh axis: a block shard from an outer split, cyclic from an inner one,
or any split chain), or :class:`Partial` (a reduction over an axis sharded there: each device
holds a partial result that a collective must reduce).
"""

from __future__ import annotations

import dataclasses

from meshfuse.ir.domain import domain
from meshfuse.ir.iter_domain import IterDomain, Split
from meshfuse.ir.layout import logical_root, producers
from meshfuse.ir.tensor_view import TensorView


@dataclasses.dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclasses.dataclass(frozen=True)
class Shard:
    """Sharded on materialized logical axis ``axis`` by the device ID ``id``."""

    axis: int
    id: IterDomain = dataclasses.field(compare=False)
    cyclic: bool = False
    zigzag: bool = False  # head-tail chunk pairs (a zig-zag split)

    def __str__(self) -> str:
        return f"S({self.axis}){'c' if self.cyclic else 'z' if self.zigzag else ''}"


@dataclasses.dataclass(frozen=True)
class Partial:
    """A partial result whose reduction is ``reduce_op`` (sum, max, min, prod)."""

    reduce_op: str = "sum"

    def __str__(self) -> str:
        return "P" if self.reduce_op == "sum" else f"P({self.reduce_op})"


Placement = Replicate | Shard | Partial


def placements(tv: TensorView, reduce_op: str = "sum") -> tuple[Placement, ...]:
    """One placement per axis of ``tv``'s mesh (outermost mesh axis first).

    ``reduce_op`` names the reduction of a partial result (the op that produced ``tv``).
    """
    assert tv.mesh is not None
    result: list[Placement] = [Replicate()] * tv.mesh.ndim
    made_by = producers(tv)
    for id_, pt in tv.parallel.items():
        if not pt.is_device:
            continue
        axis = tv.mesh.axis_of(pt)
        if id_.is_reduction:
            # With an iteration ID on the same mesh axis the reduction is complete and
            # scattered (that ID's Shard): partial only otherwise.
            if not isinstance(result[axis], Shard):
                result[axis] = Partial(reduce_op)
            continue
        root = logical_root(tv, id_)
        split = made_by.get(id_)
        cyclic = isinstance(split, Split) and split.inner is id_ and split.inner_split
        zigzag = isinstance(split, Split) and split.outer is id_ and split.zigzag
        result[axis] = Shard(tv.materialized().index(root), id_, cyclic, zigzag)
    return tuple(result)


def shard_signature(tv: TensorView, logical_id: IterDomain) -> tuple:
    """A structural description of how ``logical_id`` is sharded: for each device ID split
    from it, the parallel type and the path of splits (factor, inner_split, which side)."""
    return domain(tv).shard_signatures().get(logical_id, ())


def same_sharding(a: TensorView, b: TensorView) -> bool:
    """True if ``a`` and ``b`` (of equal logical rank) lie alike on one mesh. A reduction
    axis parallelized on a mesh axis that also shards an iteration axis (nvFuser's form of
    a reduce-scatter's result, see :func:`placements`) is complete: it lies as an
    unparallelized one."""
    if a.mesh != b.mesh or len(a.logical) != len(b.logical):
        return False
    of_a, of_b = domain(a).shard_signatures(), domain(b).shard_signatures()
    if not of_a and not of_b:
        return True
    return all(_held(a, x, of_a.get(x, ())) == _held(b, y, of_b.get(y, ()))
               for x, y in zip(a.logical, b.logical))


def _held_signature(tv: TensorView, logical_id: IterDomain) -> tuple:
    """``shard_signature`` less a scattered reduction's entries (complete on every rank)."""
    return _held(tv, logical_id, shard_signature(tv, logical_id))


def _held(tv: TensorView, logical_id: IterDomain, signature: tuple) -> tuple:
    """``signature`` (``logical_id``'s) less a scattered reduction's entries."""
    if not signature or not logical_id.is_reduction:
        return signature
    scattering = _scattering(tv)
    return tuple(entry for entry in signature if entry[0] not in scattering)


def _scattering(tv: TensorView) -> set[str]:
    """The parallel types (by value) that shard an iteration axis of ``tv``."""
    return {pt.value for id_, pt in tv.parallel.items() if pt.is_device and not id_.is_reduction}


def reduction_complete(tv: TensorView, logical_id: IterDomain) -> bool:
    """Whether reduction axis ``logical_id`` of ``tv`` is reduced on every rank: none of
    its device splits is parallelized on a mesh axis that leaves it partial (each one's
    mesh axis also shards an iteration axis: a reduce-scatter's result)."""
    return logical_id.is_reduction and not _held_signature(tv, logical_id)
