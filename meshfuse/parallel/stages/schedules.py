"""Microbatch schedules as data: for each pipeline rank, the ordered list of its actions.

A :class:`Schedule` holds the compute actions of every rank and the placement of stages on
ranks; :meth:`Schedule.with_communication` inserts the sends and receives between stages
(a receive just before the action that reads it, a send just after the action that makes
it; none between two stages of one rank). The generators, in PyTorch's vocabulary:

- :func:`gpipe`: every forward, then every backward;
- :func:`one_f_one_b`: ``p - 1 - r`` forwards of warm-up on rank ``r``, then one forward and
  one backward in turn, then the remaining backwards (bubble ``(p-1)/m``);
- :func:`interleaved_1f1b`: ``v`` stages per rank placed round-robin (stage ``s`` on rank
  ``s % p``), forwards depth-first in rounds of microbatches (bubble ``(p-1)/(v m)``);
- :func:`zero_bubble`: ZB1P, 1F1B with each backward split into its input-gradient half
  ``I`` and its weight-gradient half ``W``, rank ``r`` keeping ``r`` halves ``W`` back to
  fill the cool-down (about ``(p-1)/(3m)`` with equal times), also interleaved with ``v > 1``;
- :func:`zbv`: ZBV, two stages per rank in a V (stage ``r`` and ``2p-1-r`` on rank ``r``).

:func:`schedule` builds one by name. The schedules are those of the papers (GPipe; Megatron's
1F1B and interleaved 1F1B; Qi et al.'s zero-bubble ZB-H1 and ZB-V) as PyTorch's
``torch.distributed.pipelining`` orders them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from meshfuse.errors import ScheduleError
from meshfuse.parallel.stages.actions import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    Action,
    B,
    F,
    I,
    W,
)

NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble", "ZBV")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The actions of every pipeline rank (``actions[r]`` in order) and where stages live
    (``placement[s]`` is the rank of stage ``s``)."""

    name: str
    n_microbatches: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    @property
    def n_ranks(self) -> int:
        return len(self.actions)

    @property
    def n_stages(self) -> int:
        return len(self.placement)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` runs, in order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    @property
    def split_backward(self) -> bool:
        return any(a.kind == BACKWARD_WEIGHT for rank in self.actions for a in rank)

    def with_communication(self) -> Schedule:
        """The schedule with a receive before each action whose input comes from another
        rank, and a send after each action whose result goes to another rank."""
        actions = tuple(tuple(_communicating(self, rank)) for rank in self.actions)
        return dataclasses.replace(self, actions=actions)


def _communicating(schedule: Schedule, actions) -> list[Action]:
    last, out = schedule.n_stages - 1, []
    for a in actions:
        if not a.is_compute:
            out.append(a)
            continue
        here = schedule.placement[a.stage]
        if a.kind == FORWARD and a.stage > 0 and schedule.placement[a.stage - 1] != here:
            out.append(Action(RECV_FORWARD, a.stage, a.microbatch))
        if a.is_backward and a.stage < last and schedule.placement[a.stage + 1] != here:
            out.append(Action(RECV_BACKWARD, a.stage, a.microbatch))
        out.append(a)
        if a.kind == FORWARD and a.stage < last and schedule.placement[a.stage + 1] != here:
            out.append(Action(SEND_FORWARD, a.stage, a.microbatch))
        if a.is_backward and a.stage > 0 and schedule.placement[a.stage - 1] != here:
            out.append(Action(SEND_BACKWARD, a.stage, a.microbatch))
    return out


def _check(n_ranks: int, n_microbatches: int, what: str) -> None:
    if n_ranks < 1 or n_microbatches < 1:
        raise ScheduleError(f"{what} needs at least one rank and one microbatch, got "
                            f"{n_ranks} ranks and {n_microbatches} microbatches")


def gpipe(n_ranks: int, n_microbatches: int) -> Schedule:
    """GPipe: on each rank, every microbatch's forward, then every backward in the same
    order (all activations live at once)."""
    _check(n_ranks, n_microbatches, "GPipe")
    mbs = range(n_microbatches)
    actions = tuple(tuple([F(r, i) for i in mbs] + [B(r, i) for i in mbs])
                    for r in range(n_ranks))
    return Schedule("GPipe", n_microbatches, tuple(range(n_ranks)), actions)


def one_f_one_b(n_ranks: int, n_microbatches: int) -> Schedule:
    """1F1B: rank ``r`` runs ``min(p - 1 - r, m)`` forwards, then alternates one forward and
    one backward, then finishes the backwards (at most ``p - r`` activations live)."""
    _check(n_ranks, n_microbatches, "1F1B")
    actions = tuple(tuple(_rank_1f1b(r, n_ranks, 1, n_microbatches, n_ranks - 1 - r))
                    for r in range(n_ranks))
    return Schedule("1F1B", n_microbatches, tuple(range(n_ranks)), actions)


def interleaved_1f1b(n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> Schedule:
    """Interleaved 1F1B: ``n_virtual`` stages per rank (stage ``s`` on rank ``s % p``). The
    forwards go depth first in rounds of microbatches: a round through the rank's first
    stage, the same round through its second, ...; the backwards the other way. Rank ``r``
    warms up with ``(v - 1) * round + 2 (p - 1 - r)`` forwards (Megatron's count).

    Raises:
        ScheduleError: if the microbatches do not split into whole rounds.
    """
    _check(n_ranks, n_microbatches, "Interleaved1F1B")
    per_round = _round_size(n_ranks, n_microbatches, "Interleaved1F1B")
    actions = []
    for r in range(n_ranks):
        warmup = (n_virtual - 1) * per_round + 2 * (n_ranks - 1 - r)
        actions.append(tuple(_rank_1f1b(r, n_ranks, n_virtual, n_microbatches, warmup,
                                        per_round)))
    placement = tuple(s % n_ranks for s in range(n_ranks * n_virtual))
    return Schedule("Interleaved1F1B", n_microbatches, placement, tuple(actions))


def zero_bubble(n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """ZB1P (zero bubble, one pipeline): 1F1B (interleaved with ``n_virtual > 1``) whose
    backwards are split into ``I`` (input gradient, sent back at once) and ``W`` (weight
    gradient). Rank ``r`` warms up with ``(v - 1) * round + (p - 1 - r)`` forwards and keeps
    its ``W`` halves ``r`` backwards behind, so that they run in what 1F1B leaves idle."""
    _check(n_ranks, n_microbatches, "ZeroBubble")
    per_round = _round_size(n_ranks, n_microbatches, "ZeroBubble")
    actions = []
    for r in range(n_ranks):
        warmup = (n_virtual - 1) * per_round + (n_ranks - 1 - r)
        actions.append(tuple(_rank_1f1b(r, n_ranks, n_virtual, n_microbatches, warmup,
                                        per_round, deferred=r)))
    placement = tuple(s % n_ranks for s in range(n_ranks * n_virtual))
    return Schedule("ZeroBubble", n_microbatches, placement, tuple(actions))


def _round_size(n_ranks: int, n_microbatches: int, what: str) -> int:
    rounds = max(1, n_microbatches // n_ranks)
    if n_microbatches % rounds:
        raise ScheduleError(f"{what} runs microbatches in rounds of about {n_ranks} (the "
                            f"ranks); {n_microbatches} microbatches do not split into "
                            f"{rounds} equal rounds: use a multiple of {rounds}")
    return n_microbatches // rounds


def _rank_1f1b(rank: int, p: int, v: int, m: int, warmup: int, per_round: int | None = None,
               deferred: int | None = None) -> list[Action]:
    """One rank's 1F1B-family order: ``warmup`` forwards, forward/backward pairs, the last
    backwards; with ``deferred`` set, backwards split and each ``W`` that many behind."""
    per_round = per_round or m
    total, warmup = v * m, min(warmup, v * m)
    forwards = _depth_first(rank, p, v, per_round, total, reverse=False)
    backwards = _depth_first(rank, p, v, per_round, total, reverse=True)
    back = B if deferred is None else I
    out = forwards[:warmup]
    for i, (stage, mb) in enumerate(backwards):
        if warmup + i < total:
            out.append(forwards[warmup + i])
        out.append(back(stage, mb))
        if deferred is not None and i >= deferred:
            out.append(W(*backwards[i - deferred]))
    if deferred is not None:
        out.extend(W(*sm) for sm in backwards[max(0, total - deferred):])
    return [a if isinstance(a, Action) else F(*a) for a in out]


def _depth_first(rank: int, p: int, v: int, per_round: int, total: int,
                 reverse: bool) -> list[tuple[int, int]]:
    """(stage, microbatch) of the k-th forward (or backward) of ``rank``: local stage
    ``(k // per_round) % v`` (counted from the last for backwards), microbatches in order."""
    count: dict[int, int] = {}
    out = []
    for k in range(total):
        local = (k // per_round) % v
        stage = (v - 1 - local if reverse else local) * p + rank
        count[stage] = count.get(stage, -1) + 1
        out.append((stage, count[stage]))
    return out


def zbv(n_ranks: int, n_microbatches: int) -> Schedule:
    """ZBV: ``2p`` stages in a V, stage ``r`` and ``2p - 1 - r`` on rank ``r`` (the last
    stage shares rank 0 with the first), backwards split; near zero bubble for ``m >= 2p``.
    Built for at least ``2p - 1`` microbatches, and the extra ones dropped."""
    _check(n_ranks, n_microbatches, "ZBV")
    placement = tuple(s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(2 * n_ranks))
    actions = tuple(tuple(a for a in _rank_zbv(r, n_ranks, max(n_microbatches,
                                                                2 * n_ranks - 1))
                          if a.microbatch < n_microbatches) for r in range(n_ranks))
    return Schedule("ZBV", n_microbatches, placement, actions)


def _rank_zbv(rank: int, p: int, m: int) -> list[Action]:
    down, up = rank, 2 * p - 1 - rank  # the rank's stage on the way down, and back up
    out: list[Action] = []
    done = {FORWARD: {down: 0, up: 0}, BACKWARD_INPUT: {down: 0, up: 0},
            BACKWARD_WEIGHT: {down: 0, up: 0}}

    def run(kind: str, stage: int) -> None:
        out.append(Action(kind, stage, done[kind][stage]))
        done[kind][stage] += 1

    for _ in range(2 * (p - rank) - 1):  # fill the way down
        run(FORWARD, down)
    for _ in range(rank):
        run(FORWARD, up)
        run(FORWARD, down)
    for _ in range(p - rank):  # the bottom of the V starts coming back
        _run_all(run, (FORWARD, up), (BACKWARD_INPUT, up), (BACKWARD_WEIGHT, up))
    while done[FORWARD][up] < done[FORWARD][down] or done[FORWARD][down] < m:
        if done[FORWARD][down] < m:
            run(FORWARD, down)
        _run_all(run, (BACKWARD_INPUT, down), (BACKWARD_WEIGHT, down))
        _run_all(run, (FORWARD, up), (BACKWARD_INPUT, up), (BACKWARD_WEIGHT, up))
    for _ in range(rank):  # drain: input gradients first, weights later
        _run_all(run, (BACKWARD_INPUT, down), (BACKWARD_INPUT, up))
    for _ in range(p - rank):
        _run_all(run, (BACKWARD_INPUT, down), (BACKWARD_WEIGHT, down))
    for stage in (up, down):
        while done[BACKWARD_WEIGHT][stage] < done[BACKWARD_INPUT][stage]:
            run(BACKWARD_WEIGHT, stage)
    return out


def _run_all(run, *steps) -> None:
    for kind, stage in steps:
        run(kind, stage)


_BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved1f1b": lambda p, m, v: interleaved_1f1b(p, m, v or 2),
    "zerobubble": lambda p, m, v: zero_bubble(p, m, v or 1),
    "zb1p": lambda p, m, v: zero_bubble(p, m, v or 1),
    "zbv": lambda p, m, v: zbv(p, m),
}


def schedule(name: str, n_ranks: int, n_microbatches: int,
             n_virtual: int | None = None) -> Schedule:
    """The schedule called ``name`` (one of :data:`NAMES`, case-insensitive) for
    ``n_ranks`` pipeline ranks and ``n_microbatches`` microbatches.

    Example::

        >>> print(schedule("1F1B", 2, 3).actions[1])  # doctest: +SKIP
    """
    builder = _BUILDERS.get(name.lower().replace("-", "").replace("_", ""))
    if builder is None:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; choose one of "
                            f"{', '.join(NAMES)}")
    return builder(n_ranks, n_microbatches, n_virtual)
