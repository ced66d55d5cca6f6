"""Recomputation across fused segments: cheap values computed again where they are read.

A matrix product, attention or a communication ends a fused segment, so a value that one
segment computes and a later one reads crosses memory: written by the first, read back by
the second. For a cheap value (a pointwise result, a cast, a view) of inputs that the later
segment holds anyway, recomputing it there costs nothing but arithmetic. The derived
backward of a layer norm is the case that matters: the recomputed normalized input
``(x - mean) * rstd`` feeds the weight gradient's product as a half-precision copy, and the
norm's own backward after that product reads ``x - mean`` and the normalized input again,
both in float32: the first segment wrote two float32 tensors of the activation's size (four
times the bytes of the half-precision copy it had to write) and the second read them back,
where ``x`` and ``mean`` were its inputs already.

:func:`recomputed_in_readers` moves such work: for each value a fused segment reads from an
earlier one, the cone of cheap steps (ops whose derivative rule marks them recomputable,
:class:`~meshfuse.ops.registry.Vjp`'s ``recompute``, that communicate nothing) that makes it
from values the reading segment may read is copied to the front of the reading segment
(under new slots), when that moves fewer bytes than the value does: the value's read, and
its write where nothing else reads it, against the reads of the cone's inputs that the
reading segment did not read before. Sizes are the program's ``slot_bytes`` (a program
without them, or defining a slot twice, is left as it is).

A cone's input may be read by the reading segment when it is alive there (read there or
later, or a program output), or when only fused segments read it in between (pure
functions: nothing can have written it in place), its last use then moving to the reader;
so a float32 value may give way to the bfloat16 input it was cast from, held a little
longer. A cone never reads a Python scalar input: a segment compiles once per value of
its scalars, and one that changes from step to step must not spread to more segments.
Values are never changed: every recomputation runs the same implementation on the
same values as the original step. The steps of segments that nothing reads any more are
dropped (a segment of views that the next segment now makes itself).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from meshfuse.ops.registry import REGISTRY, lookup
from meshfuse.runtime.interpreter.executor import RESHARD, Slot, Step


@dataclasses.dataclass
class Recomputed:
    """:func:`recomputed_in_readers`' result: the steps and their calls, the runs of steps
    that become segments (indices into ``steps``), the number of slots (new slots hold the
    recomputations), and how many steps were dropped (nothing read them any more)."""

    steps: list[Step]
    calls: list[Callable]
    runs: list[list[int]]
    num_slots: int
    dropped: int = 0


def cheap(step: Step) -> bool:
    """Whether a step may be recomputed in a later segment: a single-output op whose
    derivative rule marks it recomputable (pointwise ops, casts, shape ops, local slices)
    and that communicates nothing."""
    if step.op == RESHARD or step.op not in REGISTRY or len(step.outputs) != 1:
        return False
    vjp = lookup(step.op).vjp
    return vjp is not None and vjp.recompute and not vjp.communication


def recomputed_in_readers(steps: Sequence[Step], calls: Sequence[Callable],
                          runs: Sequence[Sequence[int]], segments: Sequence[bool],
                          slot_bytes: Mapping[int, int], keep: set[int],
                          num_slots: int) -> Recomputed:
    """``steps`` (in program order) cut into ``runs``, of which those flagged in
    ``segments`` become fused segments, with the cheap values that a segment reads from an
    earlier segment recomputed in it where that moves fewer bytes (see the module doc).
    ``keep``: the program's output slots."""
    state = _State(list(steps), list(calls), [list(r) for r in runs], num_slots, keep)
    defined = [s for step in steps for s in step.outputs]
    if not slot_bytes or len(defined) != len(set(defined)):
        return state.result()  # no sizes, or a slot defined twice: which value is read?
    for k, is_segment in enumerate(segments):
        if is_segment:
            state.recompute_into(k, slot_bytes, segments)
    state.drop_unread(segments)
    return state.result()


class _State:
    """The steps, calls and runs as the rewriting leaves them, and what the decisions read
    of them, kept up to date as runs are rewritten (each step's run and place in it, the
    step defining each slot, those reading it, the one freeing it): deciding for a run
    costs what it reads, not a pass over the program."""

    def __init__(self, steps: list[Step], calls: list[Callable], runs: list[list[int]],
                 num_slots: int, keep: set[int]) -> None:
        self.steps, self.calls, self.runs = steps, calls, runs
        self.num_slots, self.keep = num_slots, keep
        self.dropped = 0
        self.place = {i: (r, n) for r, run in enumerate(runs) for n, i in enumerate(run)}
        self.definer = {s: i for i, step in enumerate(steps) for s in step.outputs}
        self.readers: dict[int, set[int]] = {}
        self.freer: dict[int, int] = {}
        for run in runs:
            for i in run:
                for s in steps[i].reads:
                    self.readers.setdefault(s, set()).add(i)
                for s in steps[i].free:
                    self.freer[s] = i

    def drop_unread(self, segments: Sequence[bool]) -> None:
        """Drops the steps of segments whose outputs nothing reads any more (each was
        recomputed where it was read: a segment of views before attention had nothing
        left to do), then frees what they read after its new last reader."""
        dropped: set[int] = set()
        pure = [i for r, run in enumerate(self.runs) if segments[r] for i in run]
        while True:
            unread = [i for i in pure if i not in dropped and not any(
                s in self.keep or self.readers.get(s) for s in self.steps[i].outputs)]
            if not unread:
                break
            for i in unread:
                dropped.add(i)
                for s in self.steps[i].reads:
                    self.readers[s].discard(i)
        if dropped:
            self.runs = [[i for i in run if i not in dropped] for run in self.runs]
            self.runs = [run for run in self.runs if run]
            self._refree({s for i in dropped for s in self.steps[i].reads})
        self.dropped = len(dropped)

    def result(self) -> Recomputed:
        order = [i for run in self.runs for i in run]
        position = {old: new for new, old in enumerate(order)}
        return Recomputed([self.steps[i] for i in order], [self.calls[i] for i in order],
                          [[position[i] for i in run] for run in self.runs], self.num_slots,
                          self.dropped)

    def recompute_into(self, k: int, slot_bytes: Mapping[int, int],
                       segments: Sequence[bool]) -> None:
        """Recomputes in run ``k`` the values it reads from earlier segments where that
        saves bytes; candidates in the order they were defined (a cone then reuses the
        recomputations of those before it)."""
        reader = _Reader(self, k, segments)
        renamed: dict[int, int] = {}  # value -> its recomputation's slot in run k
        added: list[int] = []  # the copied steps, in order
        for v in sorted(reader.reads, key=reader.defined_at):
            i = self.definer.get(v)
            j = self.place[i][0] if i in self.place else None
            if j is None or j == k or not segments[j] or len(self.runs[j]) < 2 or \
                    v not in slot_bytes:
                continue  # a value of no segment (a single step runs whatever reads it)
            cone = reader.cone(v, j, renamed, slot_bytes)
            if cone is None:
                continue
            steps, cost = cone
            read_elsewhere = v in self.keep or any(
                self.place[r][0] not in (j, k) for r in self.readers.get(v, ()))
            if cost >= slot_bytes[v] * (1 if read_elsewhere else 2):
                continue
            copies = []
            for i in steps:
                renamed[self.steps[i].outputs[0]] = self.num_slots
                self.num_slots += 1
                copies.append(self._copy(i, renamed))
            added += copies
            made = set(renamed.values())  # the recomputations: slots of run k itself
            reader.reads |= {r for c in copies for r in self.steps[c].reads if r not in made}
        if added:
            self._reroute(k, added, renamed)

    def _copy(self, i: int, renamed: dict[int, int]) -> int:
        """Appends a copy of step ``i`` writing its output's new slot and reading the
        recomputations made before it; returns the copy's index."""
        step = self.steps[i]
        args = tuple(_renamed_arg(a, renamed) for a in step.args)
        copy = dataclasses.replace(step, args=args, outputs=(renamed[step.outputs[0]],),
                                   free=(), label=f"recomputed: {step.label}")
        self.steps.append(copy)
        self.calls.append(self.calls[i])
        self.definer[copy.outputs[0]] = len(self.steps) - 1
        return len(self.steps) - 1

    def _reroute(self, k: int, added: list[int], renamed: dict[int, int]) -> None:
        """Run ``k`` begins with the copies and reads their slots; each value it no longer
        reads is freed after its last reader instead, and each input of a copy after its
        own (the reader, where it read it last)."""
        body = self.runs[k]
        for i in body:
            step = self.steps[i]
            if any(s in renamed for s in step.reads):
                for s in step.reads:
                    if s in renamed:
                        self.readers[s].discard(i)
                self.steps[i] = dataclasses.replace(
                    step, args=tuple(_renamed_arg(a, renamed) for a in step.args))
                for s in self.steps[i].reads:
                    self.readers.setdefault(s, set()).add(i)
        self.runs[k] = added + body
        for n, i in enumerate(self.runs[k]):
            self.place[i] = (k, n)
        for i in added:
            for s in self.steps[i].reads:
                self.readers.setdefault(s, set()).add(i)
        self._refree(set(renamed) | {s for i in added for s in self.steps[i].reads})

    def _refree(self, slots: set[int]) -> None:
        """Each of ``slots`` freed after its last reader; one that nothing reads any more
        (only a dropped step did) after the step that defines it (a segment ignores that:
        it does not return what nothing reads), unless it is kept or a program input."""
        for s in slots:
            old = self.freer.pop(s, None)
            if old is not None:
                step = self.steps[old]
                self.steps[old] = dataclasses.replace(
                    step, free=tuple(f for f in step.free if f != s))
            if s in self.keep:
                continue
            readers = self.readers.get(s)
            last = max(readers, key=self.place.__getitem__) if readers else \
                self.definer.get(s) if self.definer.get(s) in self.place else None
            if last is None:
                continue
            step = self.steps[last]
            self.steps[last] = dataclasses.replace(step, free=(*step.free, s))
            self.freer[s] = last


class _Reader:
    """What deciding the recomputations into run ``k`` of ``state`` reads: the slots the run
    reads from before it (growing as copies read more), and which slots are alive where it
    runs (read there or later, or kept)."""

    def __init__(self, state: _State, k: int, segments: Sequence[bool]) -> None:
        self.state, self.k, self.segments = state, k, segments
        steps = state.steps
        body = state.runs[k]
        self.reads = {s for i in body for s in steps[i].reads} - \
            {s for i in body for s in steps[i].outputs}

    def alive(self, s: int) -> bool:
        return s in self.state.keep or any(
            self.state.place[i][0] >= self.k for i in self.state.readers.get(s, ()))

    def defined_at(self, slot: int) -> tuple[int, int]:
        return self.state.place.get(self.state.definer.get(slot, -1), (-1, -1))

    def cone(self, v: int, j: int, renamed: dict[int, int], slot_bytes: Mapping[int, int]
             ) -> tuple[list[int], int] | None:
        """The steps of run ``j`` that recompute ``v`` (in order) and the bytes the reader
        moves for the inputs it did not read before, or None where ``v`` cannot be
        recomputed there: a step on the way that is not cheap, or an input that the reader
        may not read (see :meth:`readable`)."""
        state = self.state
        cone: list[int] = []
        cost = 0
        seen: set[int] = set()

        def visit(s: int, top: bool) -> bool:
            nonlocal cost
            if s in renamed or (not top and s in self.reads) or s in seen:
                return True
            seen.add(s)
            i = state.definer.get(s)
            in_producer = i in state.place and state.place[i][0] == j
            if in_producer and cheap(state.steps[i]):
                if not all(visit(r, False) for r in state.steps[i].reads):
                    return False
                cone.append(i)
                return True
            # (a slot of no bytes is a Python scalar: a segment compiles once per value of
            # its scalars, and a scalar that changes from step to step must not spread)
            if top or s not in slot_bytes or not self.readable(s, j):
                return False
            # read once; written once more where only its own segment read it
            cost += slot_bytes[s] * (2 if in_producer and not self.alive(s) else 1)
            return True

        if not visit(v, True):
            return None
        return sorted(cone, key=state.place.__getitem__), cost

    def readable(self, s: int, j: int) -> bool:
        """Whether the reader may read slot ``s``, an input of a step of run ``j``: it is
        alive where the reader runs, or no step of the runs from ``j`` to the reader reads
        it but fused segments' (pure functions: none writes it in place), so that freeing
        it after the reader instead of before keeps its value."""
        if self.alive(s):
            return True
        place = self.state.place
        return not any(j <= place[i][0] < self.k and not self.segments[place[i][0]]
                       for i in self.state.readers.get(s, ()))


def _renamed_arg(a, renamed: Mapping[int, int]):
    if isinstance(a, Slot):
        return Slot(renamed.get(a.index, a.index))
    if isinstance(a, list) and a and all(isinstance(s, Slot) for s in a):
        return [Slot(renamed.get(s.index, s.index)) for s in a]
    return a
