"""Where the engine may decompose a communication next to a GEMM into a stream loop.

Two patterns of a compiled fusion qualify (the sequence-parallel ones), on one mesh axis
of ``d`` devices, when no user stream loop covers them already:

- **allgather -> GEMM**: a ``Reshard`` that gathers a block-sharded axis (``S(a) -> R``)
  whose result is the first operand of a ``linear`` or ``matmul`` that keeps that axis; the
  loop runs ``d`` chunks of it, the blocks coming in ring order (a collective permute each);
- **GEMM -> reduce-scatter**: a ``linear`` or ``matmul`` whose partial result is only
  reduce-scattered onto one of its axes (``P -> S(a)``); the loop computes each block's
  partial product and reduces it onto the block's owner;
- **GEMM -> allreduce** (tensor parallelism without sequence parallelism): a row-parallel
  GEMM's partial result allreduced, cut into row chunks
  (:mod:`meshfuse.parallel.overlap.allreduce_pattern`).

:func:`overlap_candidates` lists them with the user's choice (``tv.set_overlap``: ``True``
forces, ``False`` forbids, read from the GEMM's tensors and the communication's); the
runtime decides the others per input signature with a cost estimate
(:mod:`meshfuse.parallel.overlap.cost`) and turns the chosen ones into
:class:`~meshfuse.parallel.overlap.stream_parallel.StreamLoopPlan` records with :meth:`plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshfuse.ir.domain import domain
from meshfuse.ir.fusion import Expr, Fusion, Reshard
from meshfuse.ir.iter_domain import IterDomain, Split
from meshfuse.ir.parallel_type import DEVICE_PARALLEL_TYPES
from meshfuse.ir.placement import Partial, Replicate, Shard, placements
from meshfuse.ir.tensor_view import TensorView
from meshfuse.parallel.overlap.allreduce_pattern import (
    AllreduceCandidate,
    gemm_allreduce,
    overlap_choice,
)
from meshfuse.parallel.overlap.stream_parallel import (
    StreamAxis,
    StreamLoopPlan,
    chunk_ids_of,
    convex,
)
from meshfuse.passes.localization import reads_expanded

GEMMS = ("linear", "matmul")
ALLGATHER_GEMM = "allgather -> GEMM"
GEMM_REDUCE_SCATTER = "GEMM -> reduce-scatter"


@dataclasses.dataclass(frozen=True, eq=False)
class OverlapCandidate:
    """A communication next to a GEMM that can run as a stream loop of ``devices`` chunks.

    Attributes:
        kind: ``ALLGATHER_GEMM`` or ``GEMM_REDUCE_SCATTER``.
        reshard, gemm: the communication and the GEMM.
        seed: the tensor whose ``logical`` axis is chunked (the gathered tensor, or the
            GEMM's partial result).
        mesh_axis, devices: the mesh axis communicated and its size (the chunk count).
        forced: the user's ``set_overlap`` choice (None: the cost estimate decides).
    """

    kind: str
    reshard: Reshard
    gemm: Expr
    seed: TensorView
    logical: IterDomain
    mesh_axis: int
    devices: int
    forced: bool | None

    def plan(self, reason: str) -> StreamLoopPlan | None:
        """The loop, or None where the pair cannot run per chunk."""
        body = {self.reshard, self.gemm}
        chunk_ids = chunk_ids_of(body, {self.seed: self.logical})
        if chunk_ids is None:
            return None
        ring = None
        if self.kind == ALLGATHER_GEMM:
            ring = DEVICE_PARALLEL_TYPES[self.seed.mesh.ndim - 1 - self.mesh_axis]
        order = tuple(e for e in self.seed.fusion.exprs if e in body)
        stream = StreamAxis(self.logical, self.logical, None, ring)
        return StreamLoopPlan(order, chunk_ids, self.seed, stream, self.devices, reason)


def overlap_candidates(fusion: Fusion, plans: Sequence[StreamLoopPlan]
                       ) -> list[OverlapCandidate | AllreduceCandidate]:
    """The candidates of ``fusion`` outside the user's loops ``plans``, in order; none over a
    mesh axis of one device, whose communication does not run (at one rank, every one)."""
    taken = {e for p in plans for e in p.exprs}
    uses = fusion.uses()
    found = []
    for e in fusion.exprs:
        if not isinstance(e, Reshard) or e in taken:
            continue
        candidate = _allgather_gemm(e, uses) or _gemm_reduce_scatter(e, uses) or \
            gemm_allreduce(e, uses)
        if candidate is not None and candidate.devices > 1 and candidate.gemm not in taken and \
                convex(fusion, {e, candidate.gemm}):
            taken |= {e, candidate.gemm}
            found.append(candidate)
    return found


def _one_change(e: Reshard) -> tuple[int, object, object] | None:
    """The mesh axis whose placement ``e`` changes and the placements before and after,
    when it changes exactly one on one mesh. A shard that both sides place alike must lie
    in blocks on both: a placement does not say how the blocks are cut, and a shard of a
    piece of an axis (strided blocks, the same ``S(a)``) that becomes a block shard moves
    data on that mesh axis too, which a loop over the other would leave out (fuzz seed
    20132 at 4 ranks)."""
    src, dst = e.args[0], e.outputs[0]
    if src.mesh is None or src.mesh != dst.mesh:
        return None
    before, after = placements(src), placements(dst)
    changed = [m for m, (a, b) in enumerate(zip(before, after)) if a != b]
    if len(changed) != 1:
        return None
    m = changed[0]
    if any(isinstance(p, Shard) and (_block_split(src, p.axis) is None or
                                     _block_split(dst, p.axis) is None)
           for other, p in enumerate(before) if other != m):
        return None
    return m, before[m], after[m]


def _block_split(tv: TensorView, axis: int) -> IterDomain | None:
    """Logical ID ``axis`` of ``tv`` when one device split shards it in blocks: an outer
    split of the logical ID itself, the devices outer (not a split of a piece of it, which
    shards it in strided blocks; nor a zigzag one)."""
    logical = tv.materialized()[axis]
    dom = domain(tv)
    ids = dom.device_ids.get(logical, [])
    if len(ids) != 1:
        return None
    device_id = ids[0][0]
    split = dom.producers.get(device_id)
    block = isinstance(split, Split) and split.in_id == logical and \
        split.outer == device_id and not split.zigzag
    return logical if block else None


def _allgather_gemm(e: Reshard, uses) -> OverlapCandidate | None:
    change = _one_change(e)
    if change is None:
        return None
    m, before, after = change
    if not isinstance(after, Replicate) or not isinstance(before, Shard) or before.cyclic:
        return None
    src, dst = e.args[0], e.outputs[0]
    if _block_split(src, before.axis) is None:
        return None
    logical = dst.materialized()[before.axis]
    for gemm in uses.get(dst, []):
        kept = any(logical in gemm.id_map.get(o, ()) for out in gemm.tensor_outputs
                   for o in out.materialized())
        if _chunkable_gemm(gemm) and gemm.args[0] is dst and kept:
            return OverlapCandidate(ALLGATHER_GEMM, e, gemm, dst, logical, m,
                                    src.mesh.shape[m], _forced(e, gemm))
    return None


def _gemm_reduce_scatter(e: Reshard, uses) -> OverlapCandidate | None:
    change = _one_change(e)
    if change is None:
        return None
    m, before, after = change
    src, dst = e.args[0], e.outputs[0]
    gemm = src.definition
    if not isinstance(before, Partial) or not isinstance(after, Shard) or after.cyclic or \
            gemm is None or not _chunkable_gemm(gemm) or \
            len(uses.get(src, [])) != 1 or _block_split(dst, after.axis) is None:
        return None
    return OverlapCandidate(GEMM_REDUCE_SCATTER, e, gemm, src, src.materialized()[after.axis],
                            m, src.mesh.shape[m], _forced(e, gemm))


def _chunkable_gemm(gemm: Expr) -> bool:
    """A GEMM that can run per chunk: not one reading an expanded broadcast axis (its
    implementation is given the whole output's local shape, ``OpDef.expands_broadcasts``)."""
    return gemm.op is not None and gemm.op.name in GEMMS and not reads_expanded(gemm)


def _forced(e: Reshard, gemm: Expr) -> bool | None:
    """The user's choice on any tensor of the pair: False wins over True."""
    return overlap_choice(e, gemm)
