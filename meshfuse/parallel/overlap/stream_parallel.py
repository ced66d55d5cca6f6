"""Stream-parallel loops: which expressions run as a loop over chunks, and on which axis of
each tensor.

A tensor with a loop ID parallelized on ``ParallelType.stream`` asks for a host loop over the
chunks of one of its logical axes: the ID is either that logical axis itself (one chunk per
index) or the *outer* part of a split of it or of a part of it (as many chunks as the outer
extent; after a device split, the chunks cut this rank's shard). The loop's
body is

- the expression that defines a stream-parallel tensor and every expression that reads one,
- and the communications next to those: a ``Reshard`` whose result a body op reads (the
  allgather in front of a GEMM), or that reads a body op's result (the allreduce or
  reduce-scatter after it). One in front that moves a tensor without a chunk axis (a
  weight or bias resharded for the GEMM) is the same for every chunk: it stays out of the
  loop and runs once, before it.

Every tensor of the body then has a *chunk axis*: the logical ID the stream axis maps to
through the ops' domain maps (an op input without such an axis, a weight, is read whole).
Every output of a body expression must have one (an op that reduces the stream axis cannot
run per chunk). Expressions are grouped into one loop when their bodies share a tensor.

:func:`plan_stream_loops` returns one :class:`StreamLoopPlan` per loop; it reads the
compiled fusion and changes nothing. The runtime (:mod:`meshfuse.parallel.overlap.stream_loop`)
turns each into a loop record of the per-rank program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from meshfuse.errors import ScheduleError
from meshfuse.ir.domain import domain
from meshfuse.ir.fusion import Expr, Fusion, Reshard
from meshfuse.ir.iter_domain import IterDomain, Split
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.ir.printer import format_expr
from meshfuse.ir.tensor_view import TensorView


@dataclasses.dataclass(frozen=True)
class StreamAxis:
    """The stream-parallel loop ID of one tensor.

    Attributes:
        stream_id: the loop ID parallelized on ``stream``.
        logical: the logical ID it comes from (the chunked axis).
        chunk_id: the ID whose extent is one chunk's (the inner part of the split), or None
            when the stream ID is the logical ID itself (chunks of one index).
        swizzle: the mesh parallel type of ``swizzle1d``, or None (chunks in order).
    """

    stream_id: IterDomain
    logical: IterDomain
    chunk_id: IterDomain | None
    swizzle: ParallelType | None


@dataclasses.dataclass(frozen=True, eq=False)
class StreamLoopPlan:
    """One stream-parallel loop of a compiled fusion.

    Attributes:
        exprs: the body, in the fusion's order.
        chunk_ids: each tensor of the body -> the logical ID it is chunked along (tensors
            read whole are absent).
        seed: a tensor whose stream ID defines the number of chunks.
        stream: that tensor's :class:`StreamAxis`.
        chunks: the chunk count of a loop the engine chose (None: from the stream ID).
        reason: why the engine chose it (its cost estimate), for explain.
    """

    exprs: tuple[Expr, ...]
    chunk_ids: Mapping[TensorView, IterDomain]
    seed: TensorView
    stream: StreamAxis
    chunks: int | None = None
    reason: str = ""

    @property
    def chosen_by_engine(self) -> bool:
        """Whether the engine chose this loop (its cost estimate or ``set_overlap(True)``),
        rather than the user's ``ParallelType.stream``."""
        return self.chunks is not None

    def axis(self, tv: TensorView) -> int | None:
        """The materialized axis of ``tv`` that is chunked, or None if read whole."""
        logical = self.chunk_ids.get(tv)
        return None if logical is None else tv.materialized().index(logical)

    def describe(self, ring: bool = False) -> str:
        """One line: the seed's stream axis, its chunking and the body, each communication
        with how it runs per chunk. ``ring``: gathers in ring order even without a
        ``swizzle1d`` (``offset_stream_indexing_by_rank``)."""
        s = self.stream
        count = self.chunks or s.stream_id.extent or "?"
        ring = ring or s.swizzle is not None
        order = ", ring order" if ring else ""
        body = "; ".join(format_expr(e) + self._per_chunk(e, ring) for e in self.exprs)
        why = f" [{self.reason}]" if self.reason else ""
        return (f"stream loop: {count} chunks of axis {self.axis(self.seed)} of "
                f"{self.seed.name}{order}: {body}{why}")

    def _per_chunk(self, e: Expr, ring: bool) -> str:
        if not isinstance(e, Reshard):
            return ""
        src, dst = e.args[0], e.outputs[0]
        if src not in self.chunk_ids or dst not in self.chunk_ids or \
                chunk_sharding(src, self.chunk_ids[src]) == chunk_sharding(dst, self.chunk_ids[dst]):
            return " (per chunk)"
        if not chunk_sharding(src, self.chunk_ids[src]):
            return " (per chunk: a reduce onto the block's owner)"
        return " (per chunk: " + ("a collective permute, none for the own block)" if ring
                                  else "a broadcast from the block's owner)")


def stream_axis(tv: TensorView) -> StreamAxis | None:
    """``tv``'s stream-parallel loop ID and what it chunks, or None.

    Raises:
        ScheduleError: for two stream IDs, a stream ID from a merge or on the inner part of
            a split (chunks must be contiguous blocks).
    """
    ids = [i for i, pt in tv.parallel.items() if pt is ParallelType.Stream]
    if not ids:
        return None
    if len(ids) > 1:
        raise ScheduleError(f"{tv.name} has {len(ids)} axes parallelized on stream; a tensor "
                            "runs as one loop: parallelize one axis")
    (stream_id,) = ids
    d = domain(tv)
    producer = d.producers.get(stream_id)
    if producer is None:
        return StreamAxis(stream_id, stream_id, None, tv.swizzles.get(stream_id))
    if not isinstance(producer, Split) or producer.outer is not stream_id or \
            producer.in_id not in d.roots:
        raise ScheduleError(
            f"the stream-parallel axis of {tv.name} must be a logical axis or the outer part "
            "of a split of it (outer_split(axis, chunks)); chunks are contiguous blocks"
        )
    return StreamAxis(stream_id, d.roots[producer.in_id], producer.inner,
                      tv.swizzles.get(stream_id))


def plan_stream_loops(fusion: Fusion) -> list[StreamLoopPlan]:
    """The stream-parallel loops of a compiled fusion (see the module doc), in order."""
    axes = {tv: a for tv in fusion.tensors() if (a := stream_axis(tv)) is not None}
    uses = fusion.uses()
    plans: list[StreamLoopPlan] = []
    claimed: set[TensorView] = set()
    for seed, axis in axes.items():
        if seed in claimed:
            continue
        body = _grow(seed, axes, uses)
        while True:
            seeds = {s: a.logical for s, a in axes.items() if s in _tensors(body) or s is seed}
            body -= _loop_invariant_moves(body, _propagated(body, seeds))
            chunk_ids = _chunk_ids(body, seeds)
            producers = _producers_to_pull_in(body, chunk_ids)
            if not producers:
                break
            body |= producers
        claimed.update(chunk_ids)
        ordered = tuple(e for e in fusion.exprs if e in body)
        _check_convex(fusion, set(ordered), seed)
        plans.append(StreamLoopPlan(ordered, chunk_ids, seed, axis))
    return plans


def _tensors(exprs) -> set[TensorView]:
    return {t for e in exprs for t in (*e.tensor_inputs, *e.tensor_outputs)}


def _grow(seed: TensorView, axes: Mapping[TensorView, StreamAxis],
          uses: Mapping) -> set[Expr]:
    """The body grown from ``seed``: definitions and readers of stream-parallel tensors,
    then the communications next to body ops."""
    body: set[Expr] = set()
    pending = [seed]
    while pending:
        tv = pending.pop()
        for e in [tv.definition, *uses.get(tv, [])]:
            if e is not None and e not in body:
                body.add(e)
                pending += [t for t in (*e.tensor_inputs, *e.tensor_outputs)
                            if t in axes and t is not tv]
    for e in [e for e in body if not isinstance(e, Reshard)]:
        for v in e.tensor_inputs:
            if isinstance(v.definition, Reshard):
                body.add(v.definition)
        for out in e.tensor_outputs:
            body.update(u for u in uses.get(out, []) if isinstance(u, Reshard))
    return body


def _producers_to_pull_in(body: set[Expr], chunk_ids: Mapping[TensorView, IterDomain]
                          ) -> set[Expr]:
    """The ops computing the source of a body communication that leaves the chunk axis as
    it is (a GEMM before its allgather of another axis): they run per chunk too, so that
    chunk ``i``'s communication overlaps chunk ``i + 1``'s compute."""
    found = set()
    for e in body:
        if not isinstance(e, Reshard):
            continue
        src, dst = e.args[0], e.outputs[0]
        producer = src.definition
        if producer is None or isinstance(producer, Reshard) or producer in body:
            continue
        if src in chunk_ids and dst in chunk_ids and \
                chunk_sharding(src, chunk_ids[src]) == chunk_sharding(dst, chunk_ids[dst]):
            found.add(producer)
    return found


def chunk_sharding(tv: TensorView, logical: IterDomain) -> tuple:
    """How ``logical`` of ``tv`` is split over devices: each device ID's parallel type and
    path of splits (empty when not sharded)."""
    d = domain(tv)
    return tuple(sorted((pt.value, d.path(i)[1]) for i, pt in d.device_ids.get(logical, [])))


def chunk_ids_of(body: set[Expr], seeds: Mapping[TensorView, IterDomain]
                 ) -> dict[TensorView, IterDomain] | None:
    """The chunk IDs of a body grown by the engine, or None where it cannot run per chunk."""
    try:
        return _chunk_ids(body, seeds)
    except ScheduleError:
        return None


def convex(fusion: Fusion, body: set[Expr]) -> bool:
    """Whether ``body`` can run as one step (nothing outside it between two of its parts)."""
    try:
        _check_convex(fusion, body, next(iter(body)).tensor_outputs[0])
    except ScheduleError:
        return False
    return True


def _loop_invariant_moves(body: set[Expr], known: Mapping[TensorView, IterDomain]
                          ) -> set[Expr]:
    """The communications :func:`_grow` put in front of body ops that move a tensor with no
    chunk axis (a weight, a bias resharded for the GEMM): the same for every chunk, they run
    once, before the loop."""
    return {e for e in body if isinstance(e, Reshard) and e.outputs[0] not in known
            and e.args[0] not in known and e.args[0].definition not in body}


def _chunk_ids(body: set[Expr], seeds: Mapping[TensorView, IterDomain]
               ) -> dict[TensorView, IterDomain]:
    """Each body tensor's chunked logical ID (see :func:`_propagated`).

    Raises:
        ScheduleError: where an op's output has none (the op cannot run per chunk).
    """
    known = _propagated(body, seeds)
    for e in body:
        for out in e.tensor_outputs:
            if out not in known:
                raise ScheduleError(
                    f"{format_expr(e)} cannot run per chunk of the stream-parallel loop: "
                    f"{out.name} has no axis the stream axis maps to (the op reduces or drops "
                    "it); parallelize on stream an axis the op keeps")
    return known


def _propagated(body: set[Expr], seeds: Mapping[TensorView, IterDomain]
                ) -> dict[TensorView, IterDomain]:
    """The chunked logical IDs of the body's tensors that have one, carried through the
    domain maps from the stream-parallel tensors until nothing changes."""
    known = dict(seeds)
    changed = True
    while changed:
        changed = False
        for e in body:
            for tv, id_ in _mapped(e, known).items():
                if tv in known and known[tv] is not id_:
                    raise ScheduleError(
                        f"{tv.name} is chunked along two axes by the stream-parallel loop "
                        f"through {format_expr(e)}; parallelize one axis on stream")
                if tv not in known:
                    known[tv] = id_
                    changed = True
    return known


def _mapped(e: Expr, known: Mapping[TensorView, IterDomain]) -> dict[TensorView, IterDomain]:
    """The chunk IDs of ``e``'s tensors implied by those in ``known``."""
    owner = {i: t for t in e.tensor_inputs for i in t.logical}
    found: dict[TensorView, IterDomain] = {}
    for out in e.tensor_outputs:
        for out_id in out.materialized():
            sources = [s for s in e.id_map.get(out_id, ()) if s in owner]
            chunked = known.get(out) is out_id or any(
                known.get(owner[s]) is s for s in sources)
            if not chunked:
                continue
            found[out] = out_id
            for s in sources:
                if not s.is_broadcast or out_id.is_broadcast:
                    found.setdefault(owner[s], s)
    return found


def _check_convex(fusion: Fusion, body: set[Expr], seed: TensorView) -> None:
    """No expression outside the loop may both read a body result and feed the body: the
    loop runs as one step."""
    producer = {o: e for e in fusion.exprs for o in e.outputs}
    after: set[Expr] = set()
    for e in fusion.exprs:
        deps = {producer.get(v) for v in e.inputs} - {None}
        if e not in body and deps & (body | after):
            after.add(e)
        elif e in body and deps & after:
            outside = next(iter(deps & after))
            raise ScheduleError(
                f"{format_expr(outside)} reads a result of the stream loop of {seed.name} and "
                "feeds it; parallelize it on stream too, or move it out of the loop")
