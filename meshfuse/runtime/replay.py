"""Automatic CUDA-graph replay of a cached program, where it is safe (``cuda_graph="auto"``).

A cached ``execute`` of a small program is host-bound: Python launches each kernel (or each
compiled segment) in more time than the GPU takes to run it. Replaying a CUDA graph launches
the whole program at once. ``cuda_graph=True`` does that with copies of the inputs and the
outputs; the automatic replay here copies nothing, and so replays only where that is safe:

- **Which programs.** On CUDA, a program that communicates nothing (collectives stay
  launched from Python, overlapped as the interpreter schedules them), draws no random
  numbers (a graph would replay one dropout mask or one random tensor forever: a step with
  a random stream, see ``explain``), has only CUDA tensor inputs and outputs, and whose
  capture succeeds (an op that reads a value back to the host cannot be captured: the
  program then stays with the interpreter). :func:`why_not_replayed` says why not.
- **Inputs in place.** A graph reads its inputs where they were when it was captured, so a
  graph is kept per set of input addresses (and Python scalar values): a call whose inputs
  sit where a captured call's did replays that graph; a new set of addresses is captured
  (up to :data:`MAX_GRAPHS` per signature; beyond, the interpreter runs). The first call of
  a signature always runs the interpreter: it binds kernels and compiles segments, which a
  capture must not do.
- **Outputs in the graph's memory.** A replay returns aliases of the graph's own output
  tensors, whose memory the next replay of the same graph rewrites. So a graph replays only
  when nothing outside holds that memory any more (the storages' use counts are back to what
  the graph itself holds: a result, or any view of it, that the caller still holds counts);
  while a caller keeps an earlier result, the call runs the interpreter instead, and the
  earlier result stays as it was.

Each graph keeps its private memory pool (one run's intermediates and outputs) for as long
as the program is cached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshfuse.ops.registry import lookup
from meshfuse.runtime.executor import Program
from meshfuse.runtime.fused import FUSED
from meshfuse.runtime.graphs import capture

MAX_GRAPHS = 4  # sets of input addresses captured per program signature


def why_not_replayed(program: Program) -> str | None:
    """Why ``program`` is never replayed from a graph automatically, or None."""
    if not program.steps:
        return "it launches nothing"
    for step, call in zip(program.steps, program.calls):
        if step.note:
            return f"it draws random numbers ({step.label}: {step.note})"
        if not _local(step, call):
            return f"it communicates ({step.label})"
    if not all(o.held for o in program.outputs):
        return "this rank does not hold every output"
    return None


def _local(step, call) -> bool:
    """Whether a record runs on this rank's tensors only: a compiled segment, or an op run
    by its registry implementation (a communication, a stream-parallel loop and a
    context-parallel attention run something else)."""
    if step.op == FUSED:
        return True
    try:
        op = lookup(step.op)
    except AttributeError:  # a reshard, a stream-parallel loop: no registry op
        return False
    if op.make_impl is not None:
        return isinstance(op.make_impl, type) and isinstance(call, op.make_impl)
    return call is op.impl


def cuda_capture(program: Program, inputs: Sequence[Any]):
    """:func:`~meshfuse.runtime.graphs.capture` (with its warm-up run on a side stream), on
    CUDA tensors only (ValueError otherwise)."""
    if not all(x.is_cuda for x in inputs if isinstance(x, torch.Tensor)):
        raise ValueError("an input is not a CUDA tensor")
    # Thread-local capture: the program has no collective, and other threads (NCCL's
    # watchdog) may keep using CUDA while it is captured.
    graph, outputs, communications = capture(program, inputs, error_mode="thread_local")
    if not all(o.is_cuda for o in outputs):
        raise ValueError("an output is not a CUDA tensor")
    return graph, outputs, communications


class AutoReplay:
    """The graphs of one program signature, keyed by input addresses; see the module doc.

    ``capture_fn(program, inputs)`` returns ``(graph, outputs, communications)`` like
    :func:`meshfuse.runtime.graphs.capture` (tests pass a stand-in)."""

    def __init__(self, program: Program, capture_fn: Callable | None = None):
        self._program = program
        self._capture = capture_fn or cuda_capture
        self.reason = why_not_replayed(program)
        self._graphs: dict[tuple, _Graph] = {}
        self._ran_once = False

    def run(self, inputs: Sequence[Any]) -> list[torch.Tensor] | None:
        """The outputs replayed (or captured and replayed) for ``inputs``, or None where the
        interpreter must run this call."""
        if self.reason is not None:
            return None
        key = tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in inputs)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph.replay() if graph.free() else None
        if not self._ran_once or len(self._graphs) >= MAX_GRAPHS:
            self._ran_once = True
            return None
        graph = self._captured(inputs)
        if graph is None:
            return None
        self._graphs[key] = graph
        return graph.replay()

    def describe(self) -> str:
        """explain's line: whether and how this signature is replayed."""
        if self.reason is not None:
            return f"CUDA graph replay: off ({self.reason})"
        return (f"CUDA graph replay: {len(self._graphs)} graphs captured (one per set of "
                f"input addresses, at most {MAX_GRAPHS})")

    def _captured(self, inputs: Sequence[Any]) -> _Graph | None:
        try:
            graph, outputs, _ = self._capture(self._program, inputs)
        except Exception as err:  # noqa: BLE001 - an op that cannot be captured
            self.reason = f"no capture: {type(err).__name__}: {err}"
            return None
        return _Graph(graph, outputs)

    @property
    def graphs(self) -> int:
        """How many input-address sets are captured."""
        return len(self._graphs)


class _Graph:
    """One captured graph and its output tensors. The caller gets aliases of the outputs
    (new tensors on the same memory), so anything the caller still holds of a result (the
    tensors, views of them) shows in the outputs' storage use counts."""

    def __init__(self, graph, outputs: list[torch.Tensor]):
        self._graph = graph
        self._outputs = outputs
        handles = {t.untyped_storage()._cdata for t in outputs}  # kept alive by the outputs
        self._storages = sorted(handles)
        self._baseline = [torch._C._storage_Use_Count(s) for s in self._storages]

    def free(self) -> bool:
        """Whether nothing outside holds the previous outputs' memory."""
        return all(torch._C._storage_Use_Count(s) == n
                   for s, n in zip(self._storages, self._baseline))

    def replay(self) -> list[torch.Tensor]:
        self._graph.replay()
        return [t.detach() for t in self._outputs]
