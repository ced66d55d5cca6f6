"""Checking and timing a schedule: every dependency met, no deadlock, the timeline and its
bubble.

:func:`simulate` plays every rank's actions in order, each as soon as the rank is free and
its inputs exist (a forward needs the previous stage's forward of the microbatch, a backward
the next stage's backward and its own forward, a ``W`` its ``I``; a receive waits for its
send, sends never wait), with the given per-stage times. It returns a :class:`Timeline`.
:func:`validate` checks that every stage runs each microbatch's forward and backward once,
on the rank holding the stage, in an order that cannot deadlock.

The bubble fraction is the idle time of the ranks over their busy time, between the first
start and the last end: ``(p - 1) / m`` for 1F1B with any equal times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from meshfuse.errors import ScheduleError
from meshfuse.parallel.stages.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    Action,
)
from meshfuse.parallel.stages.schedules import Schedule


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time of one microbatch's forward (``f``), input-gradient (``b``) and weight-gradient
    (``w``) work; a whole backward takes ``b + w``. ``per_stage`` overrides them for some
    stages (``{stage: (f, b, w)}``); ``latency`` is the time of one send to its receive."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    latency: float = 0.0
    per_stage: Mapping[int, tuple[float, float, float]] = dataclasses.field(
        default_factory=dict)

    def of(self, action: Action) -> float:
        f, b, w = self.per_stage.get(action.stage, (self.f, self.b, self.w))
        return {FORWARD: f, BACKWARD: b + w, BACKWARD_INPUT: b, BACKWARD_WEIGHT: w}.get(
            action.kind, 0.0)


@dataclasses.dataclass(frozen=True)
class Span:
    rank: int
    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """When each compute action of a simulated schedule ran (``spans``, in start order)."""

    n_ranks: int
    spans: tuple[Span, ...]

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.spans), default=0.0) - min(
            (s.start for s in self.spans), default=0.0)

    @property
    def busy(self) -> float:
        return sum(s.end - s.start for s in self.spans)

    @property
    def bubble_fraction(self) -> float:
        """Idle over busy time of all ranks, from the first start to the last end."""
        return (self.n_ranks * self.makespan - self.busy) / self.busy if self.busy else 0.0

    def rank_spans(self, rank: int) -> list[Span]:
        return [s for s in self.spans if s.rank == rank]


def _producer(schedule: Schedule, a: Action) -> list[tuple[str, int]]:
    """The (kind, stage) keys of what ``a`` waits for, of ``a``'s microbatch."""
    last = schedule.n_stages - 1
    if a.kind == FORWARD:
        return [(FORWARD, a.stage - 1)] if a.stage > 0 else []
    if a.kind in (BACKWARD, BACKWARD_INPUT):
        needs = [(FORWARD, a.stage)]
        return needs + ([("grad", a.stage + 1)] if a.stage < last else [])
    if a.kind == BACKWARD_WEIGHT:
        return [(BACKWARD_INPUT, a.stage)]
    if a.kind == RECV_FORWARD:
        return [(SEND_FORWARD, a.stage - 1)]
    if a.kind == RECV_BACKWARD:
        return [(SEND_BACKWARD, a.stage + 1)]
    return [(FORWARD, a.stage)] if a.kind == SEND_FORWARD else [("grad", a.stage)]


def _done_keys(a: Action) -> list[tuple[str, int]]:
    keys = [(a.kind, a.stage)]
    if a.kind in (BACKWARD, BACKWARD_INPUT):
        keys.append(("grad", a.stage))
    if a.kind == BACKWARD:
        keys.append((BACKWARD_INPUT, a.stage))
    return keys


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """The timeline of ``schedule`` under ``costs`` (all 1 by default); without its
    communication actions, those of :meth:`Schedule.with_communication`.

    Raises:
        ScheduleError: if the ranks deadlock, naming what each one waits for.
    """
    costs = costs or Costs()
    if all(a.is_compute for acts in schedule.actions for a in acts):
        schedule = schedule.with_communication()  # a receive is where latency is paid
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end time
    clock = [0.0] * schedule.n_ranks
    nxt = [0] * schedule.n_ranks
    spans: list[Span] = []
    while any(n < len(acts) for n, acts in zip(nxt, schedule.actions)):
        progressed = False
        for r, acts in enumerate(schedule.actions):
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                needs = [done.get((k, s, a.microbatch)) for k, s in _producer(schedule, a)]
                if any(t is None for t in needs):
                    break
                ready = max(needs, default=0.0)
                if a.kind in (RECV_FORWARD, RECV_BACKWARD):
                    ready += costs.latency
                start = max(clock[r], ready)
                clock[r] = start + costs.of(a)
                if a.is_compute:
                    spans.append(Span(r, a, start, clock[r]))
                for k, s in _done_keys(a):
                    done[(k, s, a.microbatch)] = clock[r]
                nxt[r] += 1
                progressed = True
        if not progressed:
            raise ScheduleError(_deadlock(schedule, nxt))
    return Timeline(schedule.n_ranks, tuple(sorted(spans, key=lambda s: (s.start, s.rank))))


def _deadlock(schedule: Schedule, nxt: Sequence[int]) -> str:
    waits = ", ".join(f"rank {r} at {acts[n]} (action {n})"
                      for r, (n, acts) in enumerate(zip(nxt, schedule.actions))
                      if n < len(acts))
    return (f"pipeline schedule {schedule.name} deadlocks: {waits} wait for inputs that "
            f"no rank can produce; reorder the actions so each one's inputs come first")


def validate(schedule: Schedule) -> Timeline:
    """Checks ``schedule``: each stage's forward and backward (``B``, or ``I`` and ``W``)
    of each microbatch once, on the stage's rank, sends matched by receives, no deadlock.
    Returns its timeline with unit times.

    Raises:
        ScheduleError: naming the first action missing, repeated or misplaced.
    """
    seen: dict[tuple[str, int, int], int] = {}
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if schedule.placement[a.stage] != r and a.is_compute:
                raise ScheduleError(f"pipeline schedule {schedule.name}: rank {r} runs {a}, "
                                    f"but stage {a.stage} is on rank "
                                    f"{schedule.placement[a.stage]}")
            key = (a.kind, a.stage, a.microbatch)
            if key in seen:
                raise ScheduleError(f"pipeline schedule {schedule.name}: {a} runs twice "
                                    f"(ranks {seen[key]} and {r})")
            seen[key] = r
    for stage in range(schedule.n_stages):
        for mb in range(schedule.n_microbatches):
            _check_stage_microbatch(schedule, seen, stage, mb)
    _check_messages(schedule, seen)
    return simulate(schedule)


def _check_stage_microbatch(schedule: Schedule, seen, stage: int, mb: int) -> None:
    split = (BACKWARD_INPUT, stage, mb) in seen or (BACKWARD_WEIGHT, stage, mb) in seen
    kinds = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if split else (FORWARD, BACKWARD)
    for kind in kinds:
        if (kind, stage, mb) not in seen:
            raise ScheduleError(f"pipeline schedule {schedule.name} never runs "
                                f"{Action(kind, stage, mb)}: every stage needs each "
                                f"microbatch's forward and backward")
    if split and (BACKWARD, stage, mb) in seen:
        raise ScheduleError(f"pipeline schedule {schedule.name} runs both "
                            f"{Action(BACKWARD, stage, mb)} and its halves I and W")


def _check_messages(schedule: Schedule, seen) -> None:
    for (kind, stage, mb) in seen:
        pair = {SEND_FORWARD: (RECV_FORWARD, stage + 1),
                SEND_BACKWARD: (RECV_BACKWARD, stage - 1),
                RECV_FORWARD: (SEND_FORWARD, stage - 1),
                RECV_BACKWARD: (SEND_BACKWARD, stage + 1)}.get(kind)
        if pair is not None and (pair[0], pair[1], mb) not in seen:
            raise ScheduleError(f"pipeline schedule {schedule.name}: "
                                f"{Action(kind, stage, mb)} has no matching "
                                f"{Action(pair[0], pair[1], mb)}")
