"""Lowering stream-parallel loops into the per-rank program.

:func:`group_stream_loops` replaces the steps of each loop's body (a
:class:`~meshfuse.parallel.overlap.stream_parallel.StreamLoopPlan`, the user's or the engine's) by
one ``stream_loop`` step whose record (:class:`~meshfuse.parallel.overlap.stream_loop.StreamLoop`)
says, for this rank: the chunk count, the body's records, the chunk axis of every slot, which
communications run decomposed per block (an allgather of the stream axis as broadcasts or a
collective permute, a reduce-scatter onto it as reduces onto each block's owner) and which
run their plan per chunk, which GEMMs write straight into their result's block, and the
size of the stream pool. The loop step goes after what its body needs and before what needs
it; every step's ``free`` is recomputed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from meshfuse.errors import InputError, ScheduleError
from meshfuse.ir.domain import domain
from meshfuse.ir.fusion import Expr, Reshard
from meshfuse.ir.memory_type import MemoryType
from meshfuse.ir.placement import Partial, Replicate, Shard, placements
from meshfuse.ir.printer import format_expr
from meshfuse.ir.tensor_view import Val
from meshfuse.parallel.overlap import allreduce_loop
from meshfuse.parallel.overlap.allreduce_pattern import AllreduceLoopPlan
from meshfuse.parallel.overlap.stream_loop import (
    COPY_ENGINE,
    MAX_STREAMS,
    PROCESS_GROUP,
    STREAM_LOOP,
    ChunkGather,
    ChunkReduce,
    StreamLoop,
    StreamLoopCall,
    plain_gemm,
)
from meshfuse.parallel.overlap.stream_parallel import StreamLoopPlan, chunk_sharding
from meshfuse.runtime.comm import copy_engine
from meshfuse.runtime.comm.collectives import Group
from meshfuse.runtime.interpreter.binding import Binding
from meshfuse.runtime.interpreter.executor import RESHARD, Slot, Step

AUTO = "auto"
TRANSPORT_ENV = "MESHFUSE_OVERLAP_TRANSPORT"

# group_of(mesh, mesh_axis) -> this rank's Group along that mesh axis (every rank calls it
# alike: creating groups is collective).
GroupOf = Callable[[Any, int], "Group | None"]


def group_stream_loops(plans: Sequence[StreamLoopPlan | AllreduceLoopPlan], exprs: Sequence[Expr],
                       steps: Sequence[Step], calls: Sequence[Callable],
                       slot_of: Mapping[Val, int], keep: set[int], binding: Binding,
                       rank: int, group_of: GroupOf, ring_all: bool = False,
                       transport: str = AUTO, device: torch.device | None = None
                       ) -> tuple[list[Step], list[Callable]]:
    """``steps`` (those of ``exprs``, this rank's) with each loop's body replaced by one
    ``stream_loop`` step, placed after what the body needs and before what needs it, and
    every step's ``free`` recomputed. ``keep``: slots never freed (fusion outputs).
    ``ring_all``: every decomposed allgather in ring order (``offset_stream_indexing_by_rank``).
    ``transport``: the decomposed communications' (:func:`choose_transport`) on ``device``.
    """
    steps, calls = list(steps), list(calls)
    exprs = list(exprs)
    for plan in plans:
        members = [k for k, e in enumerate(exprs) if e in plan.exprs]
        if not members:
            continue
        if isinstance(plan, AllreduceLoopPlan):  # meshfuse.parallel.overlap.allreduce_loop's own
            made = allreduce_loop.lowered(
                plan, [steps[k] for k in members], [calls[k] for k in members], binding,
                group_of, STREAM_LOOP, functools.partial(choose_transport, transport, device)
            ) if len(members) == 2 else None
            if made is None:
                continue
            step, call = made
            steps, calls, exprs = _splice(steps, calls, exprs, members, step, call)
            continue
        loop = _loop_record(plan, [exprs[k] for k in members], [steps[k] for k in members],
                            slot_of, keep, steps, members, binding, rank, group_of, ring_all)
        loop = _with_transport(loop, transport, device, plan)
        call = StreamLoopCall(loop, tuple(calls[k] for k in members))
        label = "; ".join(loop.describe())
        step = Step(STREAM_LOOP, tuple(Slot(s) for s in loop.reads), {},
                    tuple(s for s, _, _ in loop.results), (), label, plan=(loop,))
        steps, calls, exprs = _splice(steps, calls, exprs, members, step, call)
    return _with_frees(steps, keep), calls


def _loop_record(plan: StreamLoopPlan, exprs: list[Expr], body: list[Step],
                 slot_of: Mapping[Val, int], keep: set[int], steps: Sequence[Step],
                 members: list[int], binding: Binding, rank: int, group_of: GroupOf,
                 ring_all: bool) -> StreamLoop:
    chunks = _chunk_count(plan, binding)
    dims = {slot_of[tv]: plan.axis(tv) for tv in plan.chunk_ids if tv in slot_of}
    gathers, reduces, ring = {}, {}, None
    for index, expr in enumerate(exprs):
        if not isinstance(expr, Reshard):
            continue
        found = _decomposed(plan, expr, binding, chunks, group_of,
                            ring_all or plan.stream.swizzle is not None)
        if isinstance(found, ChunkGather):
            gathers[index] = found
            dims.pop(slot_of[expr.args[0]], None)  # the owner's block is its whole shard
            ring = (found.group.coordinate, found.group.size) if found.ring else ring
        elif isinstance(found, ChunkReduce):
            reduces[index] = found
            dims.pop(slot_of[expr.outputs[0]], None)  # its own block is its whole shard
    defined = {s for step in body for s in step.outputs}
    read = [s for step in body for s in step.reads if s not in defined]
    later = {s for k, step in enumerate(steps) if k not in members for s in step.reads}
    by_slot = {slot_of[tv]: tv for tv in plan.chunk_ids if tv in slot_of}
    results = []
    for s in sorted(defined):
        if s in later or s in keep:
            tv = by_slot[s]
            results.append((s, tuple(binding.layouts[tv].shape), tv.dtype.torch_dtype))
    streams = max(1, min(chunks, MAX_STREAMS))
    into, reduce_in_place = _destinations(body, {s for s, _, _ in results}, gathers, group_of)
    return StreamLoop(chunks, tuple(body), dims, gathers, tuple(dict.fromkeys(read)),
                      tuple(results), streams, ring, into, reduce_in_place, reduces)


def _destinations(body: list[Step], results: set[int], gathers: Mapping[int, ChunkGather],
                  group_of: GroupOf) -> tuple[dict[int, int], dict]:
    """GEMMs that can write their result's block directly: those whose output is a loop
    result, and those whose output only feeds an allreduce (one step, same mesh) whose
    output is one (the allreduce then runs in place on that block)."""
    readers: dict[int, list[int]] = {}
    for k, step in enumerate(body):
        for s in step.reads:
            readers.setdefault(s, []).append(k)
    into, reduce_in_place = {}, {}
    for k, step in enumerate(body):
        if not plain_gemm(step) or len(step.outputs) != 1:
            continue
        (out,) = step.outputs
        if out in results:
            into[k] = out
            continue
        users = readers.get(out, [])
        if len(users) != 1 or users[0] in gathers:
            continue
        reshard = body[users[0]]
        if reshard.op != RESHARD or reshard.outputs[0] not in results:
            continue
        if not reshard.plan:  # no data moves (a mesh of one device): the block as it is
            into[k] = reshard.outputs[0]
            reduce_in_place[users[0]] = None
        elif len(reshard.plan) == 1 and reshard.plan[0].kind == "allreduce":
            plan = reshard.plan[0]
            into[k] = reshard.outputs[0]
            reduce_in_place[users[0]] = (group_of(plan.mesh, plan.mesh_axis), plan.reduce_op)
    return into, reduce_in_place


def _chunk_count(plan: StreamLoopPlan, binding: Binding) -> int:
    s = plan.stream
    count = plan.chunks or (s.stream_id.extent if s.chunk_id is not None
                            else binding.extents[s.logical])
    if count is None or count < 1:
        raise ScheduleError(f"the stream-parallel axis of {plan.seed.name} has no static "
                            "positive chunk count; split it by a number (outer_split)")
    return count


def _decomposed(plan: StreamLoopPlan, expr: Reshard, binding: Binding, chunks: int,
                group_of: GroupOf, ring: bool) -> ChunkGather | ChunkReduce | None:
    """The per-chunk form of a body communication that gathers the chunk axis (DID ->
    Stream) or reduce-scatters onto it (Stream -> DID), or None when the chunk axis lies
    alike on both sides (the plan then runs per chunk)."""
    src, dst = expr.args[0], expr.outputs[0]
    chunk = plan.chunk_ids.get(src)
    if src.mesh == dst.mesh and chunk is not None and \
            chunk_sharding(src, chunk) == chunk_sharding(dst, plan.chunk_ids.get(dst)):
        return None
    before, after = placements(src), placements(dst)
    changed = [m for m, (a, b) in enumerate(zip(before, after)) if a != b]
    gathers = len(changed) == 1 and isinstance(after[changed[0]], Replicate) and \
        before[changed[0]] == Shard(plan.axis(src), None) and \
        len(domain(src).device_ids.get(chunk, [])) == 1
    reduces = len(changed) == 1 and isinstance(before[changed[0]], Partial) and \
        after[changed[0]] == Shard(plan.axis(dst), None) and \
        len(domain(dst).device_ids.get(plan.chunk_ids[dst], [])) == 1
    if src.mesh != dst.mesh or not (gathers or reduces):
        raise ScheduleError(
            f"{format_expr(expr)} is in the stream loop of {plan.seed.name} and changes how its "
            "stream axis is sharded in a way that cannot run per chunk (an allgather of that "
            "axis or a reduce-scatter onto it can); keep the communication out of the loop")
    if gathers and src.definition in plan.exprs:
        raise ScheduleError(
            f"{format_expr(expr)} gathers the stream axis of {src.name} per chunk, but "
            f"{src.name} is computed in the loop; compute it before the loop (do not "
            "parallelize it on stream)")
    d = src.mesh.shape[changed[0]]
    if chunks != d:
        what = "gathers" if gathers else "reduce-scatters onto"
        raise ScheduleError(
            f"{format_expr(expr)} {what} axis {plan.axis(dst)} per chunk of the stream loop "
            f"of {plan.seed.name}: the loop needs one chunk per device ({d}), not {chunks}; "
            f"outer_split that axis by {d}")
    group = group_of(src.mesh, changed[0])
    if reduces:
        return ChunkReduce(group, before[changed[0]].reduce_op, tuple(binding.layouts[src].shape),
                           plan.axis(src), src.dtype.torch_dtype)
    return ChunkGather(group, tuple(binding.layouts[dst].shape), plan.axis(src), ring)


def choose_transport(requested: str, device: torch.device | None, groups: Sequence[Group],
                     symmetric: bool, scheduled: bool = False) -> tuple[str, str]:
    """The transport of a loop's decomposed communications over ``groups`` (none: any) on
    ``device``, and why (a phrase for explain). ``requested``: ``"copy_engine"``
    (``CommunicatorBackend.cuda``), ``"process_group"`` (``CommunicatorBackend.nccl``) or
    ``"auto"`` (``MESHFUSE_OVERLAP_TRANSPORT``; unset or ``auto``: for a loop the engine
    chose, the copy engines where they can run, else the process group: on 2 H200s they beat
    NCCL's loops, whose kernels wait for the GEMMs' SMs; for a ``scheduled`` loop, the user's
    own stream axis, the process group, as nvFuser runs it); ``symmetric``: a tensor of the
    loop has ``MemoryType.symmetric`` (asks for the copy engines)."""
    if requested == AUTO:
        requested = os.environ.get(TRANSPORT_ENV, AUTO).lower().replace("nccl", PROCESS_GROUP)
        if requested not in (AUTO, COPY_ENGINE, PROCESS_GROUP):
            raise InputError(f"{TRANSPORT_ENV}={requested!r}: give 'auto', 'copy_engine' or "
                             "'process_group' (or 'nccl')")
    if symmetric and requested == AUTO:
        requested = COPY_ENGINE
    if requested == PROCESS_GROUP:
        return PROCESS_GROUP, "asked for the process group"
    if requested == AUTO and scheduled:
        return PROCESS_GROUP, (f"a scheduled stream axis, as nvFuser runs it ({TRANSPORT_ENV}="
                               "copy_engine, CommunicatorBackend.cuda or MemoryType.symmetric "
                               "asks for the copy engines)")
    if len({(g.ranks, g.mesh_axis) for g in groups}) > 1:
        return PROCESS_GROUP, "its communications span several mesh axes"
    why_not = copy_engine.unavailable(device or torch.device("cpu"),
                                      groups[0] if groups else None)
    if why_not is not None:
        return PROCESS_GROUP, f"copy engines unavailable: {why_not}"
    return COPY_ENGINE, "asked for" if requested == COPY_ENGINE else "the default"


def _with_transport(loop: StreamLoop, requested: str, device: torch.device | None,
                    plan: StreamLoopPlan) -> StreamLoop:
    """``loop`` with its transport chosen: with the copy engines, one stream and ring order
    (its own block first for a gather, last for a reduce)."""
    groups = [c.group for c in (*loop.gathers.values(), *loop.reduces.values())]
    if not groups or any(g.size == 1 for g in groups):
        return loop
    symmetric = any(tv.memory_type is MemoryType.symmetric for tv in plan.chunk_ids)
    transport, why = choose_transport(requested, device, groups, symmetric,
                                      scheduled=not plan.chosen_by_engine)
    if transport != COPY_ENGINE:
        return dataclasses.replace(loop, transport_note=why)
    gathers = {k: dataclasses.replace(g, ring=True) for k, g in loop.gathers.items()}
    return dataclasses.replace(loop, transport=COPY_ENGINE, transport_note=why, streams=1,
                               ring=(groups[0].coordinate, groups[0].size), gathers=gathers)


def _splice(steps, calls, exprs, members, step, call):
    """The loop step in place of its body: the steps between the body's first and last
    that the body needs go before it, the others after. What the body needs is read from
    the expressions (``exprs``: an expression, or the tuple of a loop spliced before), not
    from this rank's steps: a rank may leave an argument out (a partial sum's addend, added
    on one coordinate only), and the steps, communications among them, must come in the
    same order on every rank."""
    first, last = members[0], members[-1]
    body = set(members)
    needed: set[int] = set()
    wanted = {v for k in members for v in _values(exprs[k], "inputs")}
    for k in range(last, first - 1, -1):
        if k not in body and wanted & _values(exprs[k], "outputs"):
            needed.add(k)
            wanted |= _values(exprs[k], "inputs")
    between = [k for k in range(first, last + 1) if k not in body]
    order = list(range(first)) + [k for k in between if k in needed] + [None] + \
        [k for k in between if k not in needed] + list(range(last + 1, len(steps)))
    pick = (lambda seq, new: [new if k is None else seq[k] for k in order])
    return pick(steps, step), pick(calls, call), pick(exprs, tuple(exprs[k] for k in members))


def _values(entry: Expr | tuple, which: str) -> set:
    """The values an expression (or each of a spliced loop's members) reads or defines."""
    entries = entry if isinstance(entry, tuple) else (entry,)
    return {v for e in entries for v in getattr(e, which)}


def _with_frees(steps: list[Step], keep: set[int]) -> list[Step]:
    """``steps`` with each slot freed after its last reader (fusion outputs kept)."""
    last: dict[int, int] = {}
    for k, step in enumerate(steps):
        reads = step.reads
        if step.op == STREAM_LOOP:
            reads = list(step.plan[0].reads)
        for s in reads:
            last[s] = k
    frees: dict[int, list[int]] = {}
    for s, k in last.items():
        if s not in keep:
            frees.setdefault(k, []).append(s)
    return [dataclasses.replace(step, free=tuple(sorted(frees.get(k, []))))
            for k, step in enumerate(steps)]


def stream_loop_lines(plans: Sequence[StreamLoopPlan], ring: bool = False) -> list[str]:
    """explain's lines on the stream-parallel loops (what runs per chunk); the
    communications listed above them run decomposed this way."""
    return [f"  {p.describe(ring)}" for p in plans]
