"""The memory pools that the automatic CUDA graphs share, and when a graph may replay.

A CUDA graph replays its kernels on the memory they were given at its capture, which its
memory pool keeps for it. With a pool of its own, each graph holds the memory of one run of
its program: its outputs and its intermediates. A stack of N layers, each with a graph for
its forward and one for its backward, would hold N copies of a layer's intermediates, though
one layer runs at a time (on a Llama-3.2-1B step: 17 GiB of intermediates beside 15.5 GiB of
outputs). So the automatic graphs of one kind on one device share one pool
(:func:`shared_pool`): a graph captured later takes the memory that earlier graphs used only
inside their run. Two kinds, two pools: the forwards (and plain ``execute`` calls) and the
backwards (calls that donate their inputs), so that gradients a training loop keeps (a
parameter's ``.grad``) never lie in the forwards' intermediates; and of each kind, one pool
for the first graph of each set of input addresses and one for the second (*Buffers*
below).

Safety. A graph's outputs stay allocated as long as the graph lives (the runner keeps them),
so no later capture is given their memory. But a later capture may put its outputs in memory
an earlier graph used for intermediates, which that graph rewrites at each replay. So each
capture records the pool's memory it may write (:func:`written`: the pool's memory that
nothing held when it began, and the segments it added), and the graphs captured after it whose
outputs lie there are its *blockers*: it replays only when nothing outside holds their
outputs (their previous results are dead: rewriting them loses nothing). In a training loop
that is so at every step: the previous step's residuals are freed by its backward, its
gradients by ``zero_grad``. Where it is not (a result kept across steps), the graph is
busy, as when its own outputs are held: a second graph is captured for its inputs, or the
interpreter runs.

Buffers. That second graph of a set of input addresses (its second buffer: the caller holds
the first one's results) goes into a second pool of its kind, shared by the second graphs
of all sets. In the first graph's pool its outputs would lie in the first graph's
intermediates: a loop that keeps the previous result while it calls again (``out =
f(x)``, rebound after the call) would find the first graph blocked by the second's
outputs, the second busy with its own, and run the interpreter at every third call; each
time the forward's residuals at new addresses, for which the backward captured graph after
graph (on an H200, 2026-12-04: ten backward graphs in 200 such steps of a GPT layer).

Status: the default (``MESHFUSE_SHARED_GRAPH_POOLS=0``: a pool per graph). On one H200
(``benchmarks/results/2026-12-04-1535-*``), a Llama-3.2-1B-shaped training step
(``benchmarks/capture_llama.py``) took 29.4 GiB from the device at its peak with shared
pools against 43.3 GiB with a pool per graph (``torch.compile``: 26.7), at the same speed;
a 1.1B FSDP step 13.2 GiB against 20.7 (FSDP2 + ``torch.compile``: 13.9). Until
2026-12-04 the shared pools recaptured in steady state: the zeros that every attention
without dropout returns as its RNG state (one tensor, shared) counted as each graph's
output, and their use count, which grows with each layer's residuals, made every layer
but the first look held at the next step's start (``benchmarks/replay_trace.py`` showed
it). Outputs outside the memory a capture may write are no longer the graph's
(``automatic._foreign``).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

Range = tuple[int, int]  # [start, end) of device memory

FORWARD, BACKWARD = "forward", "backward"


class SharedPool:
    """One shared memory pool: its CUDA handle (made at its first capture) and the graphs
    captured into it, in order (weak references: a dropped runner's graphs leave)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.memory: Any = None  # a torch.cuda.MemPool, made at the first capture
        self.graphs: list[weakref.ref] = []

    @property
    def handle(self) -> Any:
        """The pool's id for ``torch.cuda.graph(pool=...)`` (None before its first capture)."""
        return None if self.memory is None else self.memory.id

    def cuda_handle(self) -> Any:
        """The pool's id, the pool made first. A ``MemPool`` object keeps the pool alive
        while no graph uses it (a pool named by ``graph_pool_handle`` is released with its
        last graph, and a later capture into it fails)."""
        if self.memory is None:
            self.memory = torch.cuda.MemPool()
        return self.memory.id

    def add(self, graph: Any) -> None:
        """Records ``graph`` (with ``output_ranges()``, ``written`` and ``blockers``) as
        captured last: it blocks each earlier graph whose written memory holds its outputs."""
        mine = graph.output_ranges()
        alive = []
        for ref in self.graphs:
            earlier = ref()
            if earlier is None:
                continue
            alive.append(ref)
            if overlaps(mine, earlier.written):
                earlier.blockers.append(weakref.ref(graph))
        self.graphs = [*alive, weakref.ref(graph)]


_POOLS: dict[tuple[str, int | None, str, int], SharedPool] = {}


def shared_pool(device: torch.device, kind: str, buffer: int = 0) -> SharedPool | None:
    """The pool the automatic graphs of ``kind`` (:data:`FORWARD` or :data:`BACKWARD`) on
    ``device`` share (the default), those that are the ``buffer``-th graph of their set of
    input addresses (see *Buffers* in the module doc); None with
    ``MESHFUSE_SHARED_GRAPH_POOLS=0`` (read at each capture): each graph its own pool (see
    the module doc: Status)."""
    if os.environ.get("MESHFUSE_SHARED_GRAPH_POOLS", "1") == "0":
        return None
    key = (device.type, device.index, kind, buffer)
    if key not in _POOLS:
        _POOLS[key] = SharedPool(kind)
    return _POOLS[key]


def pool_layout(handle: Any) -> tuple[int, list[Range], list[Range]]:
    """``(bytes, segments, held)`` of the CUDA pool ``handle``: its segments' total bytes,
    their ranges, and the ranges of its blocks allocated now."""
    total, segments, held = 0, [], []
    for segment in torch.cuda.memory_snapshot():
        if segment.get("segment_pool_id") != handle:
            continue
        start = segment["address"]
        total += segment["total_size"]
        segments.append((start, start + segment["total_size"]))
        for block in segment["blocks"]:  # in address order, from the segment's start
            if block["state"] == "active_allocated":
                held.append((start, start + block["size"]))
            start += block["size"]
    return total, segments, held


def written(segments: list[Range], held_before: list[Range]) -> list[Range]:
    """The memory a capture may have written: the pool's ``segments`` after it, less the
    blocks allocated before it began (``held_before``: earlier graphs' outputs)."""
    result = []
    for start, end in sorted(segments):
        at = start
        for a, b in sorted(held_before):
            if b <= at or a >= end:
                continue
            if a > at:
                result.append((at, a))
            at = max(at, b)
        if at < end:
            result.append((at, end))
    return result


def overlaps(a: list[Range], b: list[Range]) -> bool:
    """Whether some range of ``a`` meets some range of ``b``."""
    return any(x < d and c < y for x, y in a for c, d in b)
