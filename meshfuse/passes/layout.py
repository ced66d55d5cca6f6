"""Derives the allocation domain (memory order) of every tensor that has none.

A tensor keeps an allocation domain the user gave (or ``define_tensor``'s ``stride_order``).
The outputs of an op declared ``output_layout="contiguous"`` (matrix products) are row-major,
as are those an op lists in ``contiguous_outputs`` (attention's log-sum-exp).
Any other tensor is laid out like its producer's inputs: each output axis sits where the first
input axis it maps from sits in that input's memory order (BSHE q/k/v give a BSHE ``attn``); an
axis that maps from nothing (an expanded broadcast) stays next to the logical axis before it.
All derived allocations are contiguous.

This module owns the memory-order rules. Sharding propagation, which knows which input a
tensor it fills follows and how their split IDs correspond, asks :func:`follow_allocation`
for that tensor's order (split pieces included); :func:`infer_allocations` derives the rest.
"""

from __future__ import annotations

from collections.abc import Iterable

from meshfuse.errors import MeshfuseError
from meshfuse.ir.domain import domain
from meshfuse.ir.fusion import Fusion, Reshard
from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.tensor_view import Allocation, TensorView, check_allocation


def memory_positions(tv: TensorView, allocation: Allocation) -> dict[IterDomain, float]:
    """Each logical ID's position in ``allocation``: that of the innermost non-device ID
    split from it (or of the logical ID itself)."""
    d = domain(tv)
    positions: dict[IterDomain, float] = {}
    for pos, id_ in enumerate(allocation.ids):
        root, _ = d.path(id_)
        if tv.parallel_type(id_).is_device and root in positions:
            continue
        positions[root] = pos
    return positions


def infer_allocations(fusion: Fusion) -> dict[TensorView, Allocation]:
    """The allocation domain of every tensor of ``fusion``: given, or derived."""
    result: dict[TensorView, Allocation] = {}
    for tv in fusion.tensors():
        if tv.allocation is not None:
            result[tv] = tv.allocation
    for expr in fusion.exprs:
        positions: dict[IterDomain, float] = {}
        for inp in expr.tensor_inputs:
            for id_, pos in memory_positions(inp, result[inp]).items():
                positions[id_] = pos / max(len(result[inp].ids), 1)
        for index, out in enumerate(expr.tensor_outputs):
            if out in result:
                continue
            if not isinstance(expr, Reshard) and not expr.op.follows_inputs(index):
                ids = out.materialized()
                result[out] = Allocation(ids, tuple(None if i.is_broadcast else True for i in ids))
            else:
                result[out] = _follow(out, expr.id_map, positions)
    return result


def _follow(tv: TensorView, id_map, positions: dict[IterDomain, float]) -> Allocation:
    keys: dict[IterDomain, float] = {}
    previous = -1.0
    # Reduction IDs take part, so that a keepdim axis stays where its reduced axis was.
    for id_ in tv.logical:
        sources = [s for s in id_map.get(id_, ()) if s in positions]
        keys[id_] = previous = positions[sources[0]] if sources else previous + 1e-6
    order = sorted(tv.materialized(), key=lambda i: keys[i])
    return Allocation(tuple(order), tuple(None if i.is_broadcast else True for i in order))


def follow_allocation(ref: TensorView, target: TensorView,
                      replay: dict[IterDomain, IterDomain]) -> Allocation | None:
    """``ref``'s allocation order carried over to ``target``; IDs of ``target`` it does not
    cover go right after the logical axis before them. None if that is not a valid cover."""
    ids = [replay[i] for i in ref.allocation.ids if i in replay]
    ids = [i for i in ids if i in _domain(target)]
    for axis, logical_id in enumerate(target.materialized()):
        pieces = [i for i in _leaves(target, logical_id)]
        if logical_id in ids or all(p in ids for p in pieces):
            continue
        before = _last_position(ids, target, target.materialized()[:axis])
        for offset, piece in enumerate(p for p in pieces if p not in ids):
            ids.insert(before + 1 + offset, piece)
    candidate = Allocation(tuple(ids), tuple(None if i.is_broadcast else True for i in ids))
    saved = target.allocation
    target.allocation = candidate
    try:
        check_allocation(target)
    except MeshfuseError:
        target.allocation = saved
        return None
    return candidate


def _domain(tv: TensorView) -> set[IterDomain]:
    ids = set(tv.logical)
    for t in tv.transforms:
        ids.update(t.outputs)
    return ids


def _leaves(tv: TensorView, logical_id: IterDomain) -> list[IterDomain]:
    subtree = set(domain(tv).subtree(logical_id))
    return [i for i in tv.loop if i in subtree]


def _last_position(ids: list[IterDomain], tv: TensorView, axes: Iterable[IterDomain]) -> int:
    d = domain(tv)
    below = {i for logical_id in axes for i in d.subtree(logical_id)}
    return max((p for p, i in enumerate(ids) if i in below), default=-1)
