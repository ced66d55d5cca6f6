"""Host time of cached calls: what a call costs in Python, before the first kernel and
between kernels, for ``explain(inputs)`` and the benchmarks.

A small program's cached call is host-bound: the GPU waits while Python checks the inputs,
finds the program, and walks its records launching one kernel each. The runner measures
every cached call of a signature from ``execute``'s entry to its return, by path:

- **replayed** (one launch of a CUDA graph: the key lookup, the busy check, the launch);
- **interpreted** (the interpreter's loop). Its first few cached calls are also *timed
  step by step*: the program runs with each call wrapped by two clock reads, which gives
  the microseconds before the first launch (the runner's own work: signature, lookups),
  between launches (the interpreter's loop: reading slots, freeing values), in the
  launches (PyTorch's dispatch and the kernel launch itself, or a compiled segment's
  wrapper) and after the last. The wrapping adds its two clock reads per step (about
  0.1 us each): the breakdown is an upper bound by that much.

The first call of a signature (binding, building, compiling) is not counted: its time is
the build's (``explain`` reports the compile time apart).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from meshfuse.runtime.interpreter.executor import Program

TIMED_CALLS = 3  # interpreted calls of a signature timed step by step (the least is kept)


@dataclasses.dataclass
class Breakdown:
    """One interpreted call, step by step (nanoseconds)."""

    before_first: int
    between: int
    in_launches: int
    after_last: int
    launches: int

    @property
    def total(self) -> int:
        return self.before_first + self.between + self.in_launches + self.after_last

    def describe(self) -> str:
        return (f"{self.before_first / 1e3:.0f} us before the first launch, "
                f"{self.between / 1e3:.0f} us between its {self.launches} launches, "
                f"{self.in_launches / 1e3:.0f} us in them, {self.after_last / 1e3:.0f} us "
                "after the last")


@dataclasses.dataclass
class PathTime:
    """The host time of the calls of one path: how many, the least, the last (ns)."""

    calls: int = 0
    least: int = 0
    last: int = 0

    def add(self, ns: int) -> None:
        self.least = ns if not self.calls else min(self.least, ns)
        self.last = ns
        self.calls += 1


@dataclasses.dataclass
class HostLog:
    """The host time of one signature's cached calls (see the module doc)."""

    replayed: PathTime = dataclasses.field(default_factory=PathTime)
    interpreted: PathTime = dataclasses.field(default_factory=PathTime)
    breakdown: Breakdown | None = None
    timed_left: int = TIMED_CALLS

    def run(self, program: Program, inputs: Sequence[Any], donate: bool, start: int) -> list:
        """``program.run(inputs, donate)``, timed step by step while calls are left to
        time (``start``: the call's entry, ``time.perf_counter_ns()``)."""
        if self.timed_left <= 0:
            return program.run(inputs, donate)
        self.timed_left -= 1
        stamps: list[int] = []
        timed = Program(program.num_slots, program.input_slots, program.steps,
                        program.outputs, program.rank,
                        tuple(_stamped(call, stamps) for call in program.calls),
                        program.slot_bytes)
        outputs = timed.run(inputs, donate)
        end = time.perf_counter_ns()
        if stamps:
            found = _breakdown(start, stamps, end)
            if self.breakdown is None or found.total < self.breakdown.total:
                self.breakdown = found
        return outputs

    def lines(self) -> list[str]:
        """explain's lines (none before a cached call)."""
        lines = []
        if self.replayed.calls:
            lines.append(f"  replayed: {_us(self.replayed)} (one graph launch)")
        if self.interpreted.calls:
            lines.append(f"  interpreted: {_us(self.interpreted)}")
        if self.breakdown is not None:
            lines.append(f"  interpreted, step by step: {self.breakdown.describe()}")
        return ["host time per cached call (this rank, measured):", *lines] if lines else []


def _us(path: PathTime) -> str:
    return (f"{path.least / 1e3:.0f} us at least, {path.last / 1e3:.0f} us the last "
            f"(over {path.calls} calls)")


def _stamped(call: Callable, stamps: list[int]) -> Callable:
    """``call``, appending the clock before and after it runs to ``stamps``."""
    clock = time.perf_counter_ns

    def stamped(*args, **kwargs):
        stamps.append(clock())
        try:
            return call(*args, **kwargs)
        finally:
            stamps.append(clock())

    return stamped


def _breakdown(start: int, stamps: list[int], end: int) -> Breakdown:
    begins, ends = stamps[0::2], stamps[1::2]
    between = sum(b - e for b, e in zip(begins[1:], ends[:-1]))
    inside = sum(e - b for b, e in zip(begins, ends))
    return Breakdown(begins[0] - start, between, inside, end - ends[-1], len(begins))
