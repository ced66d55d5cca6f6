"""Printing a schedule: the action table, the stage map, and ``explain``'s summary.

:func:`action_table` lays the compute actions out on the unit-time clock of
:func:`~meshfuse.parallel.stages.simulate.simulate` (a row from each start or end to the
next, one column per rank, ``.`` where a rank waits), so the bubble is visible; :func:`action_lists` prints each
rank's whole list (communication included), deterministic and golden-testable.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshfuse.parallel.stages.actions import text
from meshfuse.parallel.stages.schedules import Schedule
from meshfuse.parallel.stages.simulate import Costs, Timeline, simulate


def action_lists(schedule: Schedule) -> str:
    """One line per rank: ``rank r: F0.0 SF0.0 ...``."""
    return "\n".join(f"rank {r}: {text(acts)}" for r, acts in enumerate(schedule.actions))


def action_table(schedule: Schedule, timeline: Timeline | None = None) -> str:
    """The compute actions by time (rows: from each start or end to the next) and rank
    (columns) of ``timeline`` (by default, the unit-time one, where a whole backward takes
    two units); idle slots print as ``.``."""
    timeline = timeline or simulate(schedule)
    steps = sorted({s.start for s in timeline.spans} | {s.end for s in timeline.spans})
    last = f"rank {schedule.n_ranks - 1}"
    width = max([len(str(s.action)) for s in timeline.spans] + [len(last)])
    rows = ["time  " + " ".join(f"rank {r}".ljust(width) for r in range(schedule.n_ranks))]
    for t in steps[:-1]:
        cells = []
        for r in range(schedule.n_ranks):
            span = next((s for s in timeline.rank_spans(r) if s.start <= t < s.end), None)
            cells.append((str(span.action) if span is not None else ".").ljust(width))
        rows.append(f"{t:<5g} " + " ".join(cells).rstrip())
    return "\n".join(rows)


def stage_map(schedule: Schedule, stage_ranks: Sequence[Sequence[int]] | None = None,
              stage_names: Sequence[str] | None = None) -> str:
    """One line per stage: its pipeline rank, the devices of its sub-mesh and what it
    holds (``stage_names``, e.g. ``layers 0-3``)."""
    lines = []
    for s, r in enumerate(schedule.placement):
        devices = f" devices {list(stage_ranks[r])}" if stage_ranks is not None else ""
        what = f": {stage_names[s]}" if stage_names is not None else ""
        lines.append(f"stage {s} on pipeline rank {r}{devices}{what}")
    return "\n".join(lines)


def explain(schedule: Schedule, costs: Costs | None = None,
            stage_ranks: Sequence[Sequence[int]] | None = None,
            stage_names: Sequence[str] | None = None) -> str:
    """The stage map, the action table and the predicted bubble of ``schedule``."""
    timeline = simulate(schedule, costs)
    unit = simulate(schedule)
    return "\n".join([
        f"pipeline schedule {schedule.name}: {schedule.n_stages} stages on "
        f"{schedule.n_ranks} ranks, {schedule.n_microbatches} microbatches"
        + (", backward split into I and W" if schedule.split_backward else ""),
        stage_map(schedule, stage_ranks, stage_names),
        action_table(schedule, unit),
        (f"predicted bubble: {timeline.bubble_fraction:.3f} of the busy time "
        f"(makespan {timeline.makespan:g})"),
    ])
