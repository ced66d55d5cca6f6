"""Stream-parallel loops in the per-rank program: the loop record and its interpreter.

A ``stream_loop`` step (made by :mod:`meshfuse.parallel.overlap.stream_loop_lowering` from the loops
:func:`meshfuse.parallel.overlap.stream_parallel.plan_stream_loops` plans) holds a
:class:`StreamLoop` record, which is data: the chunk count, the body's own step records, the
chunk axis of every value slot it touches, the communications decomposed per chunk
(:class:`ChunkGather`), the results it writes chunk by chunk, and the size of its stream
pool. ``explain`` and ``Program.records()`` print it.

Running it (:class:`StreamLoopCall`): the loop's results are allocated whole; then for each
chunk ``i`` (on CUDA on stream ``i mod pool`` of a per-device pool, after the current stream;
on the CPU in order) every chunked input is narrowed to the chunk, the body steps run on the
chunk, and each result is written into its block of the whole result; at the end the current
stream waits for the pool's streams. A chunk's communication and its GEMM are thus ordered on
one stream while the neighbouring chunks' run on others, and NCCL transfers overlap GEMMs.

Chunk ``i`` covers indices ``[i*q, (i+1)*q)`` of this rank's extent ``n`` along the chunk
axis, ``q = ceil(n / chunks)`` (as an outer split: later chunks may be short or empty). With
a ring order (``swizzle1d``, or ``offset_stream_indexing_by_rank``), chunk ``i`` on the
device at coordinate ``c`` works on block ``(i + c) mod d``.

A communication in the body whose source is sharded along the chunk axis and whose target
is not (an allgather feeding the loop: nvFuser's DID -> Stream) runs per chunk as a
broadcast of block ``i`` from its owner, or, in ring order, as a collective permute (each
device sends its own block to the device that needs it next and receives the block it works
on): ``d - 1`` transfers under ``d`` GEMMs. Any other communication in the body runs its
bound plan on each chunk (an allreduce per chunk after a row-parallel GEMM).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from meshfuse.runtime.comm import copy_engine
from meshfuse.runtime.comm.collectives import (
    Group,
    allreduce_in_place,
    broadcast,
    collective_permute,
    reduce_to,
)
from meshfuse.runtime.comm.pending import resolved
from meshfuse.runtime.interpreter.executor import Slot, Step

STREAM_LOOP = "stream_loop"
MAX_STREAMS = 8  # chunks beyond this reuse the pool's streams round-robin
PROCESS_GROUP = "process_group"  # decomposed communications over torch.distributed
COPY_ENGINE = "copy_engine"  # ... as copy-engine pulls (meshfuse.runtime.comm.copy_engine)


@dataclasses.dataclass(frozen=True)
class ChunkGather:
    """An allgather decomposed per chunk: block ``b`` of the source's sharded axis, owned by
    coordinate ``b`` of ``group``'s mesh axis, comes to every member.

    Attributes:
        shape: the whole target's local shape (block ``b`` is its chunk ``b``).
        axis: the gathered axis.
        ring: True: a collective permute (ring order); False: a broadcast from the owner.
    """

    group: Group
    shape: tuple[int, ...]
    axis: int
    ring: bool

    def describe(self) -> str:
        how = "collective permute" if self.ring else "broadcast from the block's owner"
        return (f"axis {self.axis} gathered per chunk by {how} over mesh axis "
                f"{self.group.mesh_axis} (ranks {list(self.group.ranks)})")


@dataclasses.dataclass(frozen=True)
class ChunkReduce:
    """A reduce-scatter decomposed per chunk: the partial results of block ``b`` (this
    chunk) reduced onto coordinate ``b`` of ``group``'s mesh axis, which owns that block.

    Attributes:
        shape: the whole partial's local shape (block ``b`` is its chunk ``b``).
        axis: the scattered axis.
        dtype: the partial's.
    """

    group: Group
    reduce_op: str
    shape: tuple[int, ...] = ()
    axis: int = 0
    dtype: torch.dtype = torch.float32

    def describe(self) -> str:
        return (f"reduced per chunk ({self.reduce_op}) onto the block's owner over mesh axis "
                f"{self.group.mesh_axis} (ranks {list(self.group.ranks)})")


@dataclasses.dataclass(frozen=True)
class StreamLoop:
    """The record of one stream-parallel loop on this rank.

    Attributes:
        chunks: the number of chunks (iterations).
        body: the body's step records, in order, over the program's slots.
        dims: each chunked slot -> its chunk axis (slots absent are read whole).
        gathers: body step index -> the :class:`ChunkGather` it runs instead of its plan.
        reads: the slots read from outside the loop (the loop step's arguments).
        results: the slots the loop defines for later steps, with their whole local shapes
            and dtypes.
        streams: the size of the CUDA stream pool (chunk ``i`` on stream ``i mod streams``).
        ring: ``(coordinate, size)`` of this rank on the ring's mesh axis, or None (chunk
            ``i`` works on block ``i``).
        into: body step index of a GEMM (``linear`` without bias, ``matmul``) -> the result
            slot whose block it writes directly (``out=``), with no copy.
        reduce_in_place: body step index of an allreduce -> its group and reduction, run in
            place on the block its GEMM wrote (None: a communication that moves nothing, on
            a mesh of one device).
        reduces: body step index -> the :class:`ChunkReduce` it runs instead of its plan;
            its result is this rank's whole shard, written at the chunk of its own block.
        transport: how the decomposed communications move data: ``"process_group"``
            (torch.distributed's collectives) or ``"copy_engine"`` (pulls from symmetric
            memory, :mod:`meshfuse.runtime.comm.copy_engine`: the chunks then run on one stream,
            in ring order, this rank's own block last when the loop reduces).
        transport_note: why that transport (for explain).
    """

    chunks: int
    body: tuple[Step, ...]
    dims: Mapping[int, int]
    gathers: Mapping[int, ChunkGather]
    reads: tuple[int, ...]
    results: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]
    streams: int
    ring: tuple[int, int] | None
    into: Mapping[int, int] = dataclasses.field(default_factory=dict)
    reduce_in_place: Mapping[int, tuple[Group, str] | None] = \
        dataclasses.field(default_factory=dict)
    reduces: Mapping[int, ChunkReduce] = dataclasses.field(default_factory=dict)
    transport: str = PROCESS_GROUP
    transport_note: str = ""

    @property
    def own_last(self) -> bool:
        """Whether this rank's own block comes last (a copy-engine loop that reduces)."""
        return self.transport == COPY_ENGINE and bool(self.reduces)

    def block(self, i: int) -> int:
        """The block chunk ``i`` works on here."""
        if self.ring is None:
            return i
        return (i + self.ring[0] + self.own_last) % self.ring[1]

    def transport_line(self) -> str | None:
        """One line for explain: how this loop's decomposed communications move data, and
        why; None when it has none (its communications run their plans per chunk)."""
        if not self.gathers and not self.reduces:
            return None
        kinds = [*("allgather" for _ in self.gathers), *("reduce-scatter" for _ in self.reduces)]
        by = "copy engines (symmetric memory)" if self.transport == COPY_ENGINE else \
            "the process group"
        note = f": {self.transport_note}" if self.transport_note else ""
        return (f"stream loop of {self.chunks} chunks ({', '.join(kinds)} decomposed): "
                f"transfers by {by}{note}")

    def describe(self) -> list[str]:
        shift = self.ring[0] + self.own_last if self.ring is not None else 0
        order = "in order" if self.ring is None else \
            f"ring order (chunk i -> block (i + {shift}) mod {self.ring[1]})"
        by = ", transfers by copy engines" if self.transport == COPY_ENGINE else ""
        lines = [f"stream loop: {self.chunks} chunks, {order}, on {self.streams} streams{by}"]
        for index, step in enumerate(self.body):
            decomposed = self.gathers.get(index) or self.reduces.get(index)
            label = step.label.partition(":")[0] + f": {decomposed.describe()}" \
                if decomposed else step.label
            if index in self.into:
                label += f" (into the block of %{self.into[index]})"
            if index in self.reduce_in_place:
                label += " (in place)"
            lines.append(f"  chunk: {label}")
        dims = ", ".join(f"%{s} axis {d}" for s, d in sorted(self.dims.items()))
        lines.append(f"  chunked: {dims}")
        return lines

class StreamLoopCall:
    """Runs a :class:`StreamLoop` record with the body's implementations (``calls[k]`` for
    ``loop.body[k]``; a decomposed gather's is replaced by its per-chunk transfer)."""

    def __init__(self, loop: StreamLoop, calls: tuple[Callable, ...]):
        self.loop = loop
        self.calls = calls

    def __call__(self, *values: Any) -> Any:
        loop = self.loop
        outside = {s: resolved(v) for s, v in zip(loop.reads, values)}
        device = next((v.device for v in outside.values() if isinstance(v, torch.Tensor)),
                      torch.device("cpu"))
        results = {s: torch.empty(shape, dtype=dtype, device=device)
                   for s, shape, dtype in loop.results}
        moves = _copy_engine_moves(loop, outside, device) if loop.transport == COPY_ENGINE \
            else {}
        with _streams(device, loop.streams) as on_stream:
            for i in range(loop.chunks):
                with on_stream(i):
                    self._chunk(loop.block(i), outside, results, moves)
        for move in moves.values():
            move.finish()
        out = tuple(results[s] for s, _, _ in loop.results)
        return out[0] if len(out) == 1 else out

    def _chunk(self, block: int, outside: Mapping[int, Any], results: Mapping[int, Any],
               moves: Mapping[int, Any]) -> None:
        loop = self.loop
        env = {s: _narrow(v, loop.dims.get(s), block, loop.chunks) for s, v in outside.items()}
        targets = _reduce_targets(loop, moves, block)
        for index, (step, call) in enumerate(zip(loop.body, self.calls)):
            args = [_arg(a, env) for a in step.args]
            gather = loop.gathers.get(index)
            if index in moves:
                move = moves[index]
                result = move.block(block) if gather is not None else \
                    move.partial(block, args[0])
            elif gather is not None:
                result = _gather(gather, args[0], block, loop.chunks)
            elif index in loop.reduces:
                result = _reduce(loop.reduces[index], args[0], block)
            elif index in targets and _gemm_into(step.op, args, targets[index]) is not None:
                result = targets[index]
            elif index in loop.reduce_in_place:
                reduction = loop.reduce_in_place[index]
                result = args[0] if reduction is None else allreduce_in_place(args[0], *reduction)
            elif index in loop.into:
                target = _narrow(results[loop.into[index]], loop.dims.get(loop.into[index]),
                                 block, loop.chunks)
                result = _gemm_into(step.op, args, target)
                if result is None:
                    result = call(*args, **step.attrs)
            else:
                result = call(*args, **step.attrs)
            if len(step.outputs) == 1:
                env[step.outputs[0]] = result
            else:
                env.update(zip(step.outputs, result))
        for s, whole in results.items():
            if env[s] is None:  # a block reduced onto another rank
                continue
            part = resolved(env[s])
            target = _narrow(whole, loop.dims.get(s), block, loop.chunks)
            if part.data_ptr() != target.data_ptr() or part.stride() != target.stride():
                target.copy_(part)


def _copy_engine_moves(loop: StreamLoop, outside: Mapping[int, Any],
                       device: torch.device) -> dict[int, Any]:
    """Body step index -> the :class:`~meshfuse.runtime.comm.copy_engine.Gathering` or
    :class:`~meshfuse.runtime.comm.copy_engine.Reducing` of each decomposed communication of one
    run of the loop, made (in body order, every rank alike) on the current stream."""
    moves: dict[int, Any] = {}
    for index, step in enumerate(loop.body):
        gather, reduce = loop.gathers.get(index), loop.reduces.get(index)
        if gather is not None:
            source = outside[step.args[0].index]
            moves[index] = copy_engine.Gathering(
                source, gather.group, _block_shapes(gather.shape, gather.axis, loop.chunks),
                index)
        elif reduce is not None:
            moves[index] = copy_engine.Reducing(
                reduce.group, _block_shapes(reduce.shape, reduce.axis, loop.chunks),
                reduce.dtype, reduce.reduce_op, index, device)
    return moves


def _block_shapes(shape: tuple[int, ...], axis: int, chunks: int) -> list[tuple[int, ...]]:
    """The shape of each of ``chunks`` blocks of ``shape`` along ``axis``."""
    return [(*shape[:axis], _block(shape[axis], b, chunks)[1], *shape[axis + 1:])
            for b in range(chunks)]


def _reduce_targets(loop: StreamLoop, moves: Mapping[int, Any], block: int) -> dict[int, Any]:
    """Body GEMM index -> the workspace slot its partial of ``block`` is written into: a
    plain GEMM whose result only a copy-engine reduce reads."""
    targets = {}
    for index, move in moves.items():
        if index not in loop.reduces:
            continue
        (source,) = [a.index for a in loop.body[index].args[:1] if isinstance(a, Slot)]
        producers = [k for k, step in enumerate(loop.body) if source in step.outputs]
        readers = [k for k, step in enumerate(loop.body)
                   if any(isinstance(a, Slot) and a.index == source for a in step.args)]
        if len(producers) == 1 and readers == [index] and \
                plain_gemm(loop.body[producers[0]]) and (target := move.target(block)) is not None:
            targets[producers[0]] = target
    return targets


def plain_gemm(step: Step) -> bool:
    """Whether ``step`` is a GEMM that can write into a given tensor (``out=``): a
    ``linear`` without bias or a ``matmul``."""
    return (step.op == "linear" and len(step.args) == 3 and step.args[2] is None) or \
        step.op == "matmul"


def _gemm_into(op: str, args: list, target: torch.Tensor) -> torch.Tensor | None:
    """The GEMM of ``args`` written into ``target`` (``out=``), or None where ``out=`` does
    not apply (a batched weight, dtypes or shapes that differ)."""
    a, b = args[0], args[1]
    if op == "linear":
        if b.ndim != 2:
            return None
        b = b.t()
    if a.dtype != b.dtype or a.dtype != target.dtype or not target.is_contiguous() or \
            a.ndim < 2 or b.ndim != 2 or (*a.shape[:-1], b.shape[-1]) != tuple(target.shape):
        return None
    return torch.matmul(a, b, out=target)


def _arg(a: Any, env: Mapping[int, Any]) -> Any:
    if isinstance(a, Slot):
        return resolved(env[a.index])
    if isinstance(a, list) and a and all(isinstance(x, Slot) for x in a):
        return [resolved(env[x.index]) for x in a]
    return a


def _narrow(x: Any, dim: int | None, block: int, chunks: int) -> Any:
    """Block ``block`` of ``chunks`` of ``x`` along ``dim`` (``x`` itself when ``dim`` is
    None): ``ceil(n / chunks)`` indices each, the last ones short or empty."""
    if dim is None or not isinstance(x, torch.Tensor):
        return x
    start, length = _block(x.shape[dim], block, chunks)
    return x.narrow(dim, start, length)


def _block(n: int, block: int, chunks: int) -> tuple[int, int]:
    q = -(-n // chunks)
    start = min(block * q, n)
    return start, max(0, min(q, n - start))


def _gather(gather: ChunkGather, x: torch.Tensor, block: int, chunks: int) -> torch.Tensor:
    """Block ``block`` of the gathered tensor, from the member that owns it."""
    shape = list(gather.shape)
    shape[gather.axis] = _block(shape[gather.axis], block, chunks)[1]
    group = gather.group
    if group.size == 1:
        return x
    if gather.ring:
        me, d = group.coordinate, group.size
        # This member needs block `block`; the member that needs this one's block now is
        # the one `block - me` positions before it on the ring.
        return collective_permute(x, (me - (block - me)) % d, block, shape, group)
    if group.coordinate == block:
        return broadcast(x, block, group)
    return broadcast(torch.empty(shape, dtype=x.dtype, device=x.device), block, group)


def _reduce(reduce: ChunkReduce, x: torch.Tensor, block: int) -> torch.Tensor | None:
    """Block ``block`` reduced over the group onto its owner: the result there, None on
    the other members."""
    if reduce.group.size == 1:
        return x
    return reduce_to(x, block, reduce.group, reduce.reduce_op)


_pool: dict[tuple[str, int | None, int], Any] = {}


@contextlib.contextmanager
def _streams(device: torch.device, size: int):
    """Yields ``on_stream(i)``: a context running chunk ``i``'s work on stream ``i mod size``
    of this device's pool, after the current stream's work; on exit the current stream waits
    for every pool stream used. On the CPU, ``on_stream`` does nothing."""
    if device.type != "cuda":
        yield lambda i: contextlib.nullcontext()
        return
    main = torch.cuda.current_stream(device)
    used = []

    def on_stream(i: int):
        key = (device.type, device.index, i % size)
        stream = _pool.get(key)
        if stream is None:
            stream = _pool[key] = torch.cuda.Stream(device)
        stream.wait_stream(main)
        used.append(stream)
        return torch.cuda.stream(stream)

    try:
        yield on_stream
    finally:
        for stream in used:
            main.wait_stream(stream)
