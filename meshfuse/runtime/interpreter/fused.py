"""Fused segments: a per-rank program whose runs of fusible steps are compiled by torch.compile.

:func:`fuse_program` reads a :class:`~meshfuse.runtime.interpreter.executor.Program`'s records and
groups each maximal run of *fusible* steps (pointwise ops, casts, broadcasts, reductions, reshapes
and permutes) into one *segment*, after moving fusible steps up past the other steps they do not
depend on (:func:`clustered`); a cheap value that a segment would read back from an
earlier one is computed again in it where that moves fewer bytes
(:mod:`~meshfuse.runtime.interpreter.recompute`). A segment is lowered to a ``torch.fx``
graph that calls the ops' own torch implementations in the records' order, on local
tensors, and that graph is given to ``torch.compile`` (Inductor by default: Triton
kernels on GPUs, C++ on CPUs), which fuses it. meshfuse generates no kernel code itself.

What stays outside segments, as in the interpreter: matrix products (``output_layout
"contiguous"``: cuBLAS), stateful ops (``make_impl``: attention picks its cuDNN/flash kernel),
per-rank ops (``localize``: random ops draw from the rank's stream) and communications, which
stay asynchronous and are waited for where first read. A segment also ends before a step that
reads a communication's result, so the wait happens where the interpreter's would: the steps
placed between a communication's launch and its first reader (``communication_first``) still
overlap it.

The fused program is an ordinary :class:`Program`: a segment is one record (op ``"fused"``,
its inputs as slots, its live outputs, its label listing the steps it runs), so the same
interpreter loop runs it. Each segment is compiled on its first call, for the signature of the
program it belongs to, by handing its graph to the torch.compile backend directly (no Dynamo:
the call path of a compiled segment runs no guards); the runner caches the fused program per
input signature, so cached calls never recompile. A segment identical to one compiled
before, by any program of the process (the same layer's programs in each block of a model:
:mod:`~meshfuse.runtime.interpreter.segment_cache`), reuses that compiled code.
:class:`CompileStats` counts compilations and reuses and records their time (what
``explain`` and the benchmarks report).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from meshfuse.ops.registry import REGISTRY, lookup
from meshfuse.runtime.interpreter import persistent_rows
from meshfuse.runtime.interpreter.executor import RESHARD, Program, Slot, Step
from meshfuse.runtime.interpreter.recompute import recomputed_in_readers
from meshfuse.runtime.interpreter.segment_cache import SHARED
from meshfuse.runtime.interpreter.segment_reductions import reduces_along_rows

FUSED = "fused"


def fusible(step: Step) -> bool:
    """Whether a record may go into a segment: an op (not a communication) that is
    :attr:`~meshfuse.ops.registry.OpDef.fusible`."""
    if step.op == RESHARD or step.op not in REGISTRY:  # a communication, a strategy's loop
        return False
    return lookup(step.op).fusible


@dataclasses.dataclass
class CompileStats:
    """Compilations of a fused program's segments: how many, and how long the first calls
    took (tracing, Inductor and its C++/Triton compiler together); and how many steps the
    fusing copied into later segments (:mod:`~meshfuse.runtime.interpreter.recompute`)."""

    compiles: int = 0  # segments given compiled code (compiled, or found compiled)
    seconds: float = 0.0
    reused: int = 0  # of those, found compiled already (the same graph elsewhere: SHARED)
    recomputed: int = 0  # steps copied into a later segment (recompute.py)

    def describe(self) -> str:
        reused = (f" ({self.reused} reused from identical segments compiled before)"
                  if self.reused else "")
        recomputed = (f"; {self.recomputed} steps recomputed in later segments rather than "
                      "read back from memory" if self.recomputed else "")
        return (f"{self.compiles} segment compilations{reused}, first-call compile time "
                f"{self.seconds:.2f} s{recomputed}")


def fuse_program(program: Program, backend: str = "inductor",
                 stats: CompileStats | None = None) -> Program:
    """``program`` with each maximal run of two or more fusible steps replaced by one
    compiled segment record; see the module doc. ``backend`` is torch.compile's."""
    stats = stats if stats is not None else CompileStats()
    keep = {o.slot for o in program.outputs}
    communicated = {s for step in program.steps if step.op == RESHARD for s in step.outputs}
    order = clustered(program.steps, communicated)
    clustered_steps = [program.steps[i] for i in order]
    runs = _runs(clustered_steps, communicated)
    moved = recomputed_in_readers(
        clustered_steps, [program.calls[i] for i in order], runs,
        [fusible(clustered_steps[run[0]]) for run in runs], program.slot_bytes, keep,
        program.num_slots)
    ordered, ordered_calls = moved.steps, moved.calls
    stats.recomputed += len(moved.steps) - len(program.steps) + moved.dropped
    steps, calls = [], []
    for run in moved.runs:
        if len(run) < 2 or not fusible(ordered[run[0]]):
            for i in run:
                steps.append(ordered[i])
                calls.append(ordered_calls[i])
            continue
        body = [ordered[i] for i in run]
        later = {s for step in ordered[run[-1] + 1:] for s in step.reads}
        step, graph = _segment(body, [ordered_calls[i] for i in run], later | keep)
        steps.append(step)
        calls.append(_Compiled(graph, backend, stats))
    return Program(moved.num_slots, program.input_slots, tuple(steps), program.outputs,
                   program.rank, tuple(calls), program.slot_bytes)


def clustered(steps: Sequence[Step], communicated: set[int]) -> list[int]:
    """The steps' indices in an order that keeps fusible steps together: a fusible step
    moves up to the last fusible step before it when it reads nothing that the steps in
    between (a matrix product, attention...) define or read, none of them is a
    communication, and it reads no communication's result. Every step still runs after what
    it reads, each slot is freed after its last reader (a slot the step frees is read by
    none of the steps it passes), a step that writes an input in place (the fused cross
    entropy's backward, on CUDA) is never passed by a reader of that input, and
    communications keep their place among the other steps. So a derived backward whose
    pointwise work is interleaved with the weight-gradient products (each product's operands
    prepared next to it) gets one segment where it had several: fewer kernels. Then a
    group of fusible steps that no later step would join moves down to the next group of
    fusible steps, under the same conditions seen from the other side
    (:func:`_sunk`): a Llama MLP's ``silu`` between its two input products runs inside
    the segment of the product that multiplies them (one kernel, not two). The order is
    the program's where a slot is defined twice (no step moves then)."""
    defined = [s for step in steps for s in step.outputs]
    if len(defined) != len(set(defined)):
        return list(range(len(steps)))
    groups: list[list[int]] = []  # runs of fusible steps, and other steps one each
    for i, step in enumerate(steps):
        target = _joinable(steps, groups, step, communicated) if fusible(step) else None
        if target is None:
            groups.append([i])
        else:
            groups[target].append(i)
    return [i for group in _sunk(steps, groups, communicated) for i in group]


def _sunk(steps: Sequence[Step], groups: list[list[int]], communicated: set[int]
          ) -> list[list[int]]:
    """``groups`` where each group of fusible steps that frees no slot joins the front of the
    next group of fusible steps, when none of the steps in between is a communication nor
    reads what the group defines or reads, nor waits for a communication (reads its
    result: the group would no longer run under it). So nothing runs before what it reads,
    no slot is read after it is freed (the group frees nothing, the steps it passes read
    none of its inputs), and the group's inputs live no longer than they did."""
    result: list[list[int]] = []
    pending: list[int] | None = None  # a fusible group moving down, and the steps it passed
    passed: list[list[int]] = []
    for group in groups:
        first = steps[group[0]]
        if fusible(first):
            if pending is not None:
                result += passed
                group = pending + group
                pending, passed = None, []
            if any(steps[i].free for i in group):
                result.append(group)
            else:
                pending = group
            continue
        if pending is not None:
            touched = {s for i in pending for s in (*steps[i].outputs, *steps[i].reads)}
            if first.op != RESHARD and not (touched | communicated) & set(first.reads):
                passed.append(group)
                continue
            result += [pending, *passed]
            pending, passed = None, []
        result.append(group)
    if pending is not None:
        result += [pending, *passed]
    return result


def _joinable(steps: Sequence[Step], groups: list[list[int]], step: Step,
              communicated: set[int]) -> int | None:
    """The index of the last group of fusible steps that ``step`` may join (see
    :func:`clustered`), or None."""
    if communicated & set(step.reads):
        return None
    reads = set(step.reads)
    for g in range(len(groups) - 1, -1, -1):
        first = steps[groups[g][0]]
        if fusible(first):
            return g
        if first.op == RESHARD or reads & (set(first.outputs) | set(first.reads)):
            return None
    return None


def _runs(steps: Sequence[Step], communicated: set[int]) -> list[list[int]]:
    """The steps' indices cut into runs: maximal stretches of fusible steps, each other step
    alone; a stretch is also cut before a step reading a communication's result."""
    runs: list[list[int]] = []
    for i, step in enumerate(steps):
        joins = (fusible(step) and runs and fusible(steps[runs[-1][-1]])
                 and not communicated & set(step.reads))
        if joins:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _segment(body: list[Step], calls: list[Callable], live: set[int]
             ) -> tuple[Step, fx.GraphModule]:
    """One segment's record and its fx graph: the body's calls in order, reading the slots
    defined before the segment (placeholders), returning those read after it (``live``)."""
    graph = fx.Graph()
    defined = [s for step in body for s in step.outputs]
    inputs = list(dict.fromkeys(s for step in body for s in step.reads
                                if s not in defined))
    nodes = {slot: graph.placeholder(f"in{slot}") for slot in inputs}

    def arg(a: Any) -> Any:
        if isinstance(a, Slot):
            return nodes[a.index]
        if isinstance(a, list) and a and all(isinstance(s, Slot) for s in a):
            return [nodes[s.index] for s in a]
        return a

    for step, call in zip(body, calls):
        node = graph.call_function(call, tuple(arg(a) for a in step.args), dict(step.attrs))
        if len(step.outputs) == 1:
            nodes[step.outputs[0]] = node
        else:
            for k, slot in enumerate(step.outputs):
                nodes[slot] = graph.call_function(operator.getitem, (node, k))
    outputs = tuple(s for s in defined if s in live)
    graph.output(tuple(nodes[s] for s in outputs))
    graph.lint()
    freed = tuple(s for step in body for s in step.free if s not in defined)
    label = f"fused segment of {len(body)} steps: " + "; ".join(s.label for s in body)
    record = Step(FUSED, tuple(Slot(s) for s in inputs), {}, outputs, freed, label)
    return record, fx.GraphModule(torch.nn.Module(), graph)


_MAX_SPECIALIZATIONS = 8  # distinct scalar values a segment compiles for (torch.compile's limit)


class _Compiled:
    """A segment's graph compiled by a torch.compile backend, and called directly.

    The graph is already a ``torch.fx`` graph of torch calls on local tensors whose shapes,
    strides and dtypes the program's input signature fixes, so the backend (Inductor's
    ``compile_fx``, ``aot_eager``, ...) gets it as it is on the first call, without Dynamo:
    no bytecode tracing, and a call evaluates no guards (Dynamo's guards and frame handling
    cost tens of microseconds per call, more than a small fused kernel runs). What the guards
    would check is what the signature fixes; Inductor's generated code still asserts its
    inputs' sizes and strides.

    Python scalars among the segment's inputs (scalar inputs of the fusion) are baked into
    the graph: each distinct tuple of their values is compiled once (as ``torch.compile``
    with ``dynamic=False`` specializes on them), up to ``_MAX_SPECIALIZATIONS``, after which
    the graph runs uncompiled. Each compilation is counted and its first call timed in the
    :class:`CompileStats`.
    """

    def __init__(self, graph: fx.GraphModule, backend: str, stats: CompileStats):
        self.graph = graph
        self._stats = stats
        self._backend = backend
        self._tensors_only: Callable | None = None  # compiled for all-tensor inputs
        self._specialized: dict[tuple, Callable] = {}

    def __call__(self, *args):
        compiled = self._tensors_only
        if compiled is not None:
            return _unpacked(compiled(*args))
        return _unpacked(self._call_specialized(args))

    def _call_specialized(self, args: tuple) -> Any:
        scalars = {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        key = tuple(scalars.items())
        compiled = self._specialized.get(key)
        if compiled is not None:
            return compiled(*tensors)
        if len(self._specialized) >= _MAX_SPECIALIZATIONS:
            return self.graph(*args)
        start = time.perf_counter()
        graph = _with_constants(self.graph, scalars)
        patches = inductor_patches(self._backend, tensors, graph)
        shared = SHARED.key(graph, tensors, self._backend, patches)
        compiled = SHARED.get(shared)
        if compiled is None:
            heuristics, settings = persistent_rows.compiling(patches)
            with torch._inductor.config.patch(settings) if settings else contextlib.nullcontext(), \
                    heuristics:
                compiled = torch._dynamo.lookup_backend(self._backend)(graph, tensors)
            SHARED.put(shared, compiled)
        else:
            self._stats.reused += 1
        self._stats.compiles += 1
        result = compiled(*tensors)
        self._stats.seconds += time.perf_counter() - start
        self._specialized[key] = compiled
        if not scalars:
            self._tensors_only = compiled
        return result


# Inductor's settings for every meshfuse segment. ``emulate_precision_casts``: a cast to a
# half-precision dtype rounds, as the interpreter's ``x.to(torch.bfloat16)`` does; without it
# Inductor keeps the value in float32 through a fused cast and its way back (a program's
# ``cast(cast(x, BFloat16), Float)`` returned ``x`` unrounded, 0.0074 off; fuzzer seed 8 at
# 2 ranks, compiled).
INDUCTOR = {"emulate_precision_casts": True}
# And on GPUs, for every segment, ``realize_opcount_threshold`` 40 (Inductor's default: 30): a
# pointwise value read by more than one kernel is recomputed in each reader unless its
# expression has more operations than the threshold, then written to memory and read back.
# A derived layer norm's backward recomputes its normalized input from the residual sum (its
# casts, the saved statistics) and multiplies it by the cotangent: over 30 operations, so its
# row kernel wrote that product in float32 ([4096, 1024] at the small GPT layer) and the
# weight gradient's column sum read it back, 32 MiB per norm. At 40 both kernels recompute it
# from the bf16 inputs: on an H100 (2026-12-05, one run) the small layer's derived programs
# took 797 us of kernels per step instead of 817 (the hand-written fusion: 795 at 30, 794 at
# 40), the step 0.885 ms instead of 0.915; the medium layer's 0.6% less, the big one's 0.3% more,
# within its rounds' spread (``benchmarks/results/2026-12-05-1612-*``, ``-1614-*``).
INDUCTOR_ON_CUDA = {"realize_opcount_threshold": 40}
# And on GPUs, for a segment that reduces along rows (``segment_reductions``), Inductor's
# heuristics with persistent kernels for rows of up to 16384 elements
# (:mod:`~meshfuse.runtime.interpreter.persistent_rows`). Inductor's own bound, 1024, loops
# over longer rows, reading them more than once (softmax over rows of 4096, bf16, 8192 rows
# per H200: 80.5 us looped, 38.7 us persistent, 34.9 for a copy of its bytes). A segment
# whose reductions all run across rows (a bias's gradient) keeps Inductor's own heuristics.
INDUCTOR_ALONG_ROWS_ON_CUDA = {persistent_rows.SETTING: persistent_rows.PERSISTENT_ROW}


def inductor_patches(backend: str, tensors: Sequence[torch.Tensor],
                     graph: fx.GraphModule | None = None) -> dict[str, Any]:
    """The Inductor settings a segment (``graph``, called with ``tensors``) is compiled
    with: :data:`INDUCTOR`; on CUDA tensors :data:`INDUCTOR_ON_CUDA` too, and
    :data:`INDUCTOR_ALONG_ROWS_ON_CUDA` where the graph reduces along rows (or is not
    given); none for other backends."""
    if backend != "inductor":
        return {}
    patches = dict(INDUCTOR)
    if any(t.is_cuda for t in tensors):
        patches.update(INDUCTOR_ON_CUDA)
        if graph is None or _along_rows(graph, tensors):
            patches.update(INDUCTOR_ALONG_ROWS_ON_CUDA)
    return patches


def _along_rows(graph: fx.GraphModule, tensors: Sequence[torch.Tensor]) -> bool:
    """:func:`reduces_along_rows`, True where it fails: a hint for Inductor's settings, whose
    failure (torch's fake tensors refusing some op) must not fail the segment."""
    try:
        return reduces_along_rows(graph, tensors)
    except Exception:  # noqa: BLE001 - see the doc: the default settings then
        return True


def _with_constants(gm: fx.GraphModule, constants: dict[int, Any]) -> fx.GraphModule:
    """A copy of ``gm`` whose placeholders at the positions in ``constants`` are replaced by
    those values (a backend may change the graph it is given: the segment's stays as is)."""
    graph = fx.Graph()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fixed = {placeholders[i]: value for i, value in constants.items()}
    copied: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node in fixed:
            continue
        copied[node] = graph.node_copy(node, lambda n: fixed[n] if n in fixed else copied[n])
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph)


def _unpacked(result: tuple) -> Any:
    """A segment's outputs as the interpreter stores a record's: one value, or a tuple."""
    return result[0] if len(result) == 1 else result
