"""Pipeline schedules as data (meshfuse.parallel.stages): the action lists of the published
schedules (golden text, and PyTorch's torch.distributed.pipelining lists where it builds them
as data), their bubbles against the formulas, the validator's catches, the simulated
timeline, the action table, and stage splits."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.pipelining import schedules as theirs

from meshfuse.errors import DefinitionError, ScheduleError
from meshfuse.parallel.stages import (
    Costs,
    action_lists,
    action_table,
    explain,
    parse,
    schedule,
    simulate,
    stage_bounds,
    text,
    validate,
)

ALL = [("GPipe", None), ("1F1B", None), ("Interleaved1F1B", 2), ("Interleaved1F1B", 3),
       ("ZeroBubble", None), ("ZeroBubble", 2), ("ZBV", None)]


def test_1f1b_golden():
    s = schedule("1F1B", 4, 6)
    assert [text(a) for a in s.actions] == [
        "F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1 F0.5 B0.2 B0.3 B0.4 B0.5",
        "F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 F1.4 B1.2 F1.5 B1.3 B1.4 B1.5",
        "F2.0 F2.1 B2.0 F2.2 B2.1 F2.3 B2.2 F2.4 B2.3 F2.5 B2.4 B2.5",
        "F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3 F3.4 B3.4 F3.5 B3.5",
    ]


def test_gpipe_and_zero_bubble_golden():
    assert text(schedule("GPipe", 2, 3).actions[1]) == "F1.0 F1.1 F1.2 B1.0 B1.1 B1.2"
    # ZB-H1: rank r keeps r weight halves back, run in 1F1B's cool-down
    assert [text(a) for a in schedule("ZeroBubble", 3, 4).actions] == [
        "F0.0 F0.1 F0.2 I0.0 W0.0 F0.3 I0.1 W0.1 I0.2 W0.2 I0.3 W0.3",
        "F1.0 F1.1 I1.0 F1.2 I1.1 W1.0 F1.3 I1.2 W1.1 I1.3 W1.2 W1.3",
        "F2.0 I2.0 F2.1 I2.1 F2.2 I2.2 W2.0 F2.3 I2.3 W2.1 W2.2 W2.3",
    ]
    interleaved = schedule("Interleaved1F1B", 2, 4, 2)
    assert interleaved.placement == (0, 1, 0, 1)
    # rounds of p = 2 microbatches, depth first: a round through stage 1, then stage 3
    assert text(interleaved.actions[1]) == \
        "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3"


def _pytorch_lists(cls, p: int, m: int, v: int) -> list[str]:
    """PyTorch's per-rank compute lists of a schedule it builds as data (private API)."""
    kinds = {theirs._ComputationType.FORWARD: "F", theirs._ComputationType.FULL_BACKWARD: "B",
             theirs._ComputationType.BACKWARD_INPUT: "I",
             theirs._ComputationType.BACKWARD_WEIGHT: "W"}
    sched = object.__new__(getattr(theirs, cls))
    rounds = max(1, m // p)
    for key, value in {"pp_group_size": p, "n_local_stages": v, "_n_microbatches": m,
                           "number_of_rounds": rounds, "microbatches_per_round": m // rounds,
                           "num_stages": p * v}.items():
        setattr(sched, key, value)
    return [" ".join(f"{kinds[a.computation_type]}{a.stage_index}.{a.microbatch_index}"
                     for a in sched._calculate_single_rank_operations(r) if a is not None)
            for r in range(p)]


@pytest.mark.parametrize(("cls", "name", "v"), [
    ("ScheduleInterleaved1F1B", "Interleaved1F1B", 2),
    ("ScheduleInterleaved1F1B", "Interleaved1F1B", 3),
    ("ScheduleInterleavedZeroBubble", "ZeroBubble", 1),
    ("ScheduleInterleavedZeroBubble", "ZeroBubble", 2),
    ("ScheduleZBVZeroBubble", "ZBV", 2)])
def test_same_lists_as_pytorch(cls, name, v):
    for p in (2, 3, 4):
        for m in (4, 6, 8):
            try:
                expected = _pytorch_lists(cls, p, m, v)
            except (AttributeError, TypeError, KeyError) as e:  # private API moved
                pytest.skip(f"torch.distributed.pipelining's {cls} changed: {e}")
            assert [text(a) for a in schedule(name, p, m, v).actions] == expected, (p, m)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 12)])
def test_bubbles_equal_the_formulas(p, m):
    def bubble(name, v=None, costs=None):
        return simulate(schedule(name, p, m, v), costs).bubble_fraction

    assert bubble("1F1B") == pytest.approx((p - 1) / m)
    assert bubble("GPipe") == pytest.approx((p - 1) / m)
    # unequal forward and backward times do not change 1F1B's fraction
    assert bubble("1F1B", costs=Costs(f=1.0, b=1.5, w=0.5)) == pytest.approx((p - 1) / m)
    for v in (2, 3):
        assert bubble("Interleaved1F1B", v) == pytest.approx((p - 1) / (v * m))
    assert bubble("ZeroBubble") == pytest.approx((p - 1) / (3 * m))
    assert bubble("ZeroBubble", 2) == pytest.approx((p - 1) / (6 * m))
    assert bubble("ZBV") <= bubble("ZeroBubble") + 1e-12


def test_every_schedule_validates_with_its_communication():
    for name, v in ALL:
        for p in (1, 2, 3, 4):
            for m in (1, 3, 4, 8):
                if name in ("Interleaved1F1B", "ZeroBubble") and m % max(1, m // p):
                    continue
                s = schedule(name, p, m, v)
                assert validate(s).bubble_fraction == pytest.approx(
                    validate(s.with_communication()).bubble_fraction)


def test_communication_is_inserted_between_ranks_only():
    assert action_lists(schedule("1F1B", 2, 2).with_communication()) == (
        "rank 0: F0.0 SF0.0 F0.1 SF0.1 RB0.0 B0.0 RB0.1 B0.1\n"
        "rank 1: RF1.0 F1.0 B1.0 SB1.0 RF1.1 F1.1 B1.1 SB1.1")
    # ZBV's bottom (stages 1 and 2 on rank 1) and top (3 to 0: the loss) stay local
    v = schedule("ZBV", 2, 3).with_communication()
    sends = {a.kind + str(a.stage) for rank in v.actions for a in rank if a.kind[0] == "S"}
    assert sends == {"SF0", "SF2", "SB1", "SB3"}


def _broken(s, rank, actions):
    rows = list(s.actions)
    rows[rank] = tuple(parse(actions))
    return dataclasses.replace(s, actions=tuple(rows))


def test_validator_catches_missing_repeated_misplaced_and_deadlock():
    s = schedule("1F1B", 2, 2)
    with pytest.raises(ScheduleError, match="never runs B1.1"):
        validate(_broken(s, 1, "F1.0 B1.0 F1.1"))
    with pytest.raises(ScheduleError, match="F1.0 runs twice"):
        validate(_broken(s, 1, "F1.0 F1.0 B1.0 F1.1 B1.1"))
    with pytest.raises(ScheduleError, match="rank 1 runs F0.0"):
        validate(_broken(s, 1, "F0.0 F1.0 B1.0 F1.1 B1.1"))
    # rank 0 waits for B1.1's gradient before sending F0.1, which rank 1 needs first
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 at RB0.1.*rank 1 at RF1.1"):
        validate(_broken(s, 0, "F0.0 B0.0 B0.1 F0.1"))
    comm = s.with_communication()
    with pytest.raises(ScheduleError, match="SF0.1 has no matching RF1.1"):
        validate(_broken(comm, 1, "RF1.0 F1.0 B1.0 SB1.0 F1.1 B1.1 SB1.1"))


def test_action_table_shows_the_bubble():
    # a whole backward takes two units (I and W): rank 0 idles while B1.0 runs
    assert action_table(schedule("1F1B", 2, 3)) == "\n".join([
        "time  rank 0 rank 1",
        "0     F0.0   .",
        "1     F0.1   F1.0",
        "2     .      B1.0",
        "4     B0.0   F1.1",
        "5     B0.0   B1.1",
        "6     F0.2   B1.1",
        "7     B0.1   F1.2",
        "8     B0.1   B1.2",
        "9     .      B1.2",
        "10    B0.2   .",
    ])
    text_ = explain(schedule("ZeroBubble", 2, 4), Costs(f=1, b=1, w=1))
    assert "stage 1 on pipeline rank 1" in text_
    assert "predicted bubble: 0.083" in text_


def test_simulated_timeline_with_measured_times():
    # a slow last stage (the head): the others wait on it
    costs = Costs(per_stage={1: (2.0, 2.0, 0.0)})
    t = simulate(schedule("1F1B", 2, 4), costs)
    assert t.makespan == pytest.approx(1 + 4 * 4 + 2)  # F0.0, four slow F+B, last B0.3
    ends = {str(s.action): s.end for s in t.spans}
    assert ends["B1.3"] == pytest.approx(17) and ends["B0.3"] == pytest.approx(19)
    latency = simulate(schedule("1F1B", 2, 4), Costs(latency=0.5))
    assert latency.makespan > simulate(schedule("1F1B", 2, 4)).makespan


def test_parse_and_errors():
    assert text(parse("F0.1 SB12.3 W2.0")) == "F0.1 SB12.3 W2.0"
    with pytest.raises(ScheduleError, match="cannot read pipeline action 'X1.0'"):
        parse("X1.0")
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'PipeDream'"):
        schedule("PipeDream", 2, 4)
    with pytest.raises(ScheduleError, match="10 microbatches do not split into 3 equal"):
        schedule("Interleaved1F1B", 3, 10)


def test_stage_bounds():
    names = ["embed"] + [f"layer{i}" for i in range(7)] + ["head"]
    assert stage_bounds(names, 2) == [(0, 5), (5, 9)]
    assert stage_bounds(names, 4) == [(0, 3), (3, 5), (5, 7), (7, 9)]
    assert stage_bounds(names, 2, boundaries=["layer3"]) == [(0, 4), (4, 9)]
    assert stage_bounds(names, 3, boundaries=[2, 6]) == [(0, 2), (2, 6), (6, 9)]
    # a heavy head: fewer layers with it
    assert stage_bounds(names, 2, costs=[0.1] + [1.0] * 7 + [3.0]) == [(0, 6), (6, 9)]
    with pytest.raises(DefinitionError, match="no piece named 'layer9'"):
        stage_bounds(names, 2, boundaries=["layer9"])
    with pytest.raises(DefinitionError, match="must be 1 increasing"):
        stage_bounds(names, 2, boundaries=[3, 5])
    with pytest.raises(DefinitionError, match="cannot cut 9 pieces into 10"):
        stage_bounds(names, 10)
