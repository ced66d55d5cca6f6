"""The GEMM -> allreduce loop: its record in the per-rank program, its lowering and its
interpreter.

A row-parallel GEMM and the allreduce of its partial result
(:class:`~meshfuse.parallel.overlap.allreduce_pattern.AllreduceLoopPlan`) become one ``stream_loop``
step holding an :class:`AllreduceLoop` record. Running it (:class:`AllreduceLoopCall`):
the result is allocated whole; the GEMM's first operand and the result are seen as rows
(every axis but the last, flattened); chunk ``i`` covers rows ``[i*q, (i+1)*q)``, ``q =
ceil(rows / chunks)`` (the last chunks short or empty); its GEMM writes its block of the
result (``out=``) on the current stream, then its allreduce is launched in place on that
block, asynchronously: on NCCL it runs on the communicator's stream, after that GEMM and
beside the next chunk's. The step's result is a
:class:`~meshfuse.runtime.comm.pending.Pending` of the whole result, waited for where it is
first read, as a plain allreduce's is: work after the loop that does not read it is not
held back by the last chunk's allreduce.

Whether it pays, by which transport and in how many chunks:
:mod:`meshfuse.parallel.overlap.allreduce_loop_cost`. By the copy engines
(:class:`CopyEngineReduce`) the peers' rows are pulled from symmetric memory without SMs and summed
where the result is read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshfuse.ir.memory_type import MemoryType
from meshfuse.parallel.overlap.allreduce_pattern import AllreduceLoopPlan
from meshfuse.runtime.comm import copy_engine
from meshfuse.runtime.comm.collectives import (
    Group,
    allreduce_in_place,
    record_transfer,
)
from meshfuse.runtime.comm.pending import Pending, resolved
from meshfuse.runtime.interpreter.binding import Binding
from meshfuse.runtime.interpreter.executor import Slot, Step

PROCESS_GROUP = "process_group"  # the chunks' allreduces over torch.distributed
COPY_ENGINE = "copy_engine"  # ... as copy-engine pulls (CopyEngineReduce)


@dataclasses.dataclass(frozen=True)
class AllreduceLoop:
    """The record of one GEMM -> allreduce loop on this rank.

    Attributes:
        chunks: the number of row chunks.
        op: the GEMM's op (``linear`` or ``matmul``).
        attrs: its local attributes.
        group, reduce_op: the allreduce's (group None: a mesh of one device, nothing moves).
        reads: the slots of the GEMM's two operands (the loop step's arguments, in order).
        tail: the GEMM's other arguments (a ``linear``'s absent bias).
        results: the result's slot, whole local shape and dtype (one entry).
        gemm_label, reduce_label: the two expressions, printed.
    """

    chunks: int
    op: str
    attrs: dict
    group: Group | None
    reduce_op: str
    reads: tuple[int, ...]
    tail: tuple[Any, ...]
    results: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]
    gemm_label: str = ""
    reduce_label: str = ""
    transport: str = PROCESS_GROUP
    transport_note: str = ""

    def transport_line(self) -> str | None:
        """explain's line on how the chunks' allreduces move data."""
        if self.group is None:
            return None
        note = f": {self.transport_note}" if self.transport_note else ""
        if self.transport == COPY_ENGINE:
            return (f"stream loop of {self.chunks} row chunks (allreduce decomposed): transfers "
                    f"by copy engines (symmetric memory), the sum where the result is "
                    f"read{note}")
        return (f"stream loop of {self.chunks} row chunks (allreduce decomposed): transfers "
                "by the process group, each chunk's allreduce launched under the next "
                f"chunk's GEMM{note}")

    def describe(self) -> list[str]:
        (slot, shape, _), = self.results
        ranks = "one device" if self.group is None else f"ranks {list(self.group.ranks)}"
        how = f"allreduce({self.reduce_op}) in place, asynchronous" \
            if self.transport == PROCESS_GROUP else \
            "the peers' rows pulled by copy engines, combined where the result is read"
        return [f"stream loop: {self.chunks} row chunks of %{slot} {list(shape)}",
                f"  chunk: {self.gemm_label} (into the rows of %{slot})",
                f"  chunk: {self.reduce_label.partition(':')[0]}: {how} ({ranks})"]


class _Chunks:
    """The chunks' allreduces of one run, waited for as one collective."""

    __slots__ = ("_pending",)

    def __init__(self, pending: Sequence[Pending]):
        self._pending = list(pending)

    def wait(self) -> None:
        for pending in self._pending:
            pending.wait()
        self._pending = []


class AllreduceLoopCall:
    """Runs an :class:`AllreduceLoop` with the GEMM's implementation ``gemm`` (used where
    the result's rows cannot be written directly: dtypes that differ)."""

    def __init__(self, loop: AllreduceLoop, gemm: Callable):
        self.loop, self.gemm = loop, gemm

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | Pending:
        loop = self.loop
        (slot, shape, dtype), = loop.results
        a, b = resolved(a), resolved(b)
        # Row counts spelled out: reshape(-1, 0) (an empty shard of the contracted axis) is
        # ambiguous
        rows = a.reshape(math.prod(a.shape[:-1]), a.shape[-1])
        weight = b.t() if loop.op == "linear" else b
        out = torch.empty(shape, dtype=dtype, device=a.device)
        moves = None
        if loop.transport == COPY_ENGINE:
            moves = CopyEngineReduce(loop.group, shape, dtype, loop.reduce_op, slot, a.device)
        written = out if moves is None else moves.own
        into = written.view(math.prod(shape[:-1]), shape[-1])
        pending = []
        n = rows.shape[0]
        q = max(1, -(-n // loop.chunks))
        for start in range(0, n, q):
            block = into[start:start + q]
            if rows.dtype == weight.dtype == dtype:
                torch.matmul(rows[start:start + q], weight, out=block)
            else:
                block.copy_(self.gemm(rows[start:start + q], b, *loop.tail, **loop.attrs))
            if moves is not None:
                moves.written(start, start + block.shape[0])
            elif loop.group is not None:
                pending.append(allreduce_in_place(block, loop.group, loop.reduce_op, True))
        label = f"allreduce({loop.reduce_op}) of {loop.chunks} row chunks"
        if moves is not None:
            return Pending(moves.into(out), out, label=label, ranks=loop.group.ranks)
        if not pending:
            return out
        return Pending(_Chunks(pending), out, label=label, ranks=loop.group.ranks)


class CopyEngineReduce:
    """An allreduce of one loop run by the copy engines (CUDA, symmetric memory).

    The chunks' GEMMs write this rank's partial into its symmetric workspace (``own``);
    after each chunk, a barrier (every rank's rows of the chunk are written), then a side
    stream pulls those rows of every other rank's workspace with ``cudaMemcpyAsync`` (a
    copy engine: no SM is taken from the GEMMs that follow). Waiting for the result (the
    first read: :meth:`wait`) orders the current stream after the pulls, combines the
    partials into the result with one kernel, and ends with a barrier (no rank reads this
    rank's workspace any more, so the next run may write it). The SMs are used only by the
    barriers and the combining kernel, both queued between the program's kernels.
    """

    def __init__(self, group: Group, shape: tuple[int, ...], dtype: torch.dtype,
                 reduce_op: str, key: int, device: torch.device):
        self.group, self.dtype, self.reduce_op = group, dtype, reduce_op
        self.combine = copy_engine.COMBINE[reduce_op]
        self.width = shape[-1] if shape else 1
        nbytes = math.prod(shape) * dtype.itemsize
        self.workspace = copy_engine.workspace(group, ("allreduce", key), nbytes, device)
        self.own = self.workspace.local(0, shape, dtype)
        me, d = group.coordinate, group.size
        self.peers = [(me + s) % d for s in range(1, d)]
        # allocated on the current stream before any copy is ordered after it
        self.received = [torch.empty(shape, dtype=dtype, device=device) for _ in self.peers]
        self.pulls: list[torch.cuda.Event] = []
        self.out: torch.Tensor | None = None

    def written(self, start: int, stop: int) -> None:
        """Rows ``[start, stop)`` of ``own`` are written (on the current stream)."""
        self.workspace.barrier()
        ready = torch.cuda.Event()
        ready.record()
        for peer, buffer in zip(self.peers, self.received):
            rows = buffer.view(-1, self.width)[start:stop]
            source = self.workspace.remote(copy_engine.peer(self.group, peer),
                                           start * self.width * self.dtype.itemsize,
                                           rows.shape, self.dtype)
            self.pulls.append(copy_engine.pull(source, rows, ready))
            record_transfer("copy_engine_pull", self.group, rows, peer=self.group.ranks[peer],
                            reduce_op=self.reduce_op)

    def into(self, out: torch.Tensor) -> CopyEngineReduce:
        """Itself, to combine into ``out`` when waited for (a Pending's work)."""
        self.out = out
        return self

    def wait(self) -> None:
        current = torch.cuda.current_stream(self.own.device)
        for done in self.pulls:
            current.wait_event(done)
        first, *rest = self.received
        self.combine(self.own, first, out=self.out)
        for part in rest:
            self.combine(self.out, part, out=self.out)
        self.workspace.barrier()
        self.pulls, self.received = [], []


GroupOf = Callable[[Any, int], "Group | None"]


# transport_of(groups, symmetric) -> (transport, why): the transport asked for a loop over
# ``groups`` (meshfuse.parallel.overlap.stream_loop_lowering.choose_transport, bound to the request
# and the device); ``symmetric``: a tensor of the loop has MemoryType.symmetric.
TransportOf = Callable[[Sequence[Group], bool], "tuple[str, str]"]


def lowered(plan: AllreduceLoopPlan, body: Sequence[Step], calls: Sequence[Callable],
            binding: Binding, group_of: GroupOf, loop_op: str, transport_of: TransportOf
            ) -> tuple[Step, Callable] | None:
    """The loop step (op ``loop_op``) and its call for ``plan``'s two steps ``body`` (the
    GEMM's, then the allreduce's) on this rank, or None when the allreduce's plan is not a
    single allreduce (the pair then runs as it is)."""
    gemm, reduce = body
    if reduce.plan and (len(reduce.plan) != 1 or reduce.plan[0].kind != "allreduce"):
        return None
    if any(not isinstance(a, Slot) for a in gemm.args[:2]) or \
            any(a is not None for a in gemm.args[2:]):
        return None
    group, reduce_op = None, "sum"
    if reduce.plan:
        step = reduce.plan[0]
        group, reduce_op = group_of(step.mesh, step.mesh_axis), step.reduce_op
    dst = plan.reshard.outputs[0]
    (out,) = reduce.outputs
    results = ((out, tuple(binding.layouts[dst].shape), dst.dtype.torch_dtype),)
    reads = tuple(a.index for a in gemm.args[:2])
    transport, why = PROCESS_GROUP, ""
    if group is not None and group.size > 1:
        symmetric = any(tv.memory_type is MemoryType.symmetric
                        for e in plan.exprs for tv in (*e.tensor_inputs, *e.tensor_outputs))
        transport, why = transport_of([group], symmetric)
    loop = AllreduceLoop(plan.chunks, gemm.op, dict(gemm.attrs), group, reduce_op, reads,
                         tuple(gemm.args[2:]), results, gemm.label, reduce.label, transport,
                         why)
    step = Step(loop_op, tuple(Slot(s) for s in reads), {}, (out,), (),
                "; ".join(loop.describe()), plan=(loop,))
    return step, AllreduceLoopCall(loop, calls[0])
