"""A dead or stuck rank ends in CommunicationError on every survivor, and a clean run exits 0.

Each job runs ``tests/rank_failures.py`` on its own ranks (gloo, CPU) with a short timeout, as
a user's ``torchrun`` job would run: the multi-rank test harness cannot host a rank that dies
on purpose. The ranks are forked by one process that imported torch and meshfuse once
(``rank_jobs.Forker``); two of the clean jobs start fresh interpreters, as a launcher does.
"""

from __future__ import annotations

import gc
import os
import re
import weakref

import pytest
from rank_jobs import Forker, Job, finish, start

from meshfuse.errors import CommunicationError, InputError
from meshfuse.runtime.comm.retired_groups import keep_until_timed_out
from meshfuse.runtime.faults.failures import (
    DEFAULT_TIMEOUT_S,
    CollectiveFailed,
    checked_timeout,
    kind_of_failure,
    timeout_from_env,
)
from meshfuse.runtime.faults.lone_failures import Abandoned, GroupBroken, LoneFailures

TIMEOUT_S = 3.0
# How long after the timeout a survivor may take to raise: the roll call, and slack for a
# loaded machine. Far below the 120 s the jobs' environment gives (MESHFUSE_TIMEOUT, from
# tests/conftest.py): a survivor under it honoured the call's timeout.
GRACE_S = 60.0
# The bar: a 2-rank program that ends normally exits 0 in 20 runs out of 20.
EXIT_RUNS = int(os.environ.get("MESHFUSE_EXIT_RUNS", "20"))
FRESH_RUNS = 2  # of them, launched as fresh interpreters (the others forked)
CLEAN_AT_ONCE = 4  # clean jobs running at a time
SIZES = (2, 4)

SCENARIOS = ("exit_before", "exit_inside", "sleep")


@pytest.fixture(scope="module")
def runs() -> dict[str, Job]:
    """Every scenario's job at each size, and the clean ones: the failure scenarios are
    started first and mostly wait, the clean jobs run a few at a time meanwhile."""
    forker = Forker()
    try:
        started = {f"{name}{size}": start(name, TIMEOUT_S, size, forker)
                   for name in SCENARIOS for size in SIZES}
        jobs = {}
        for first in range(0, EXIT_RUNS, CLEAN_AT_ONCE):
            batch = {f"clean{i}": start("clean", TIMEOUT_S, 2, None if i < FRESH_RUNS else forker)
                     for i in range(first, min(first + CLEAN_AT_ONCE, EXIT_RUNS))}
            jobs.update({name: finish(job) for name, job in batch.items()})
        jobs.update({name: finish(job) for name, job in started.items()})
    finally:
        forker.close()
    return jobs


# What a survivor's message says for each kind of failure; every message names the culprit.
WORDS = {
    "peer": ["closed its connection"],
    "timeout": [f"timed out after {TIMEOUT_S:g} s", "MESHFUSE_TIMEOUT"],
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("scenario, failure", [
    ("exit_before", "peer"), ("exit_inside", "peer"), ("sleep", "timeout")])
def test_survivors_raise_communication_error(runs, scenario, failure, size):
    """The last rank exits before the allreduce, exits while the others wait inside it, or
    sleeps past the timeout: every other rank raises CommunicationError naming the step, the
    group and the culprit, within the timeout plus a few seconds, and exits 0 once it has
    handled it. (At 4 ranks, a survivor that is not the dead rank's neighbour in gloo's ring
    sees no connection close: it times out, and the roll call names the culprit all the
    same.)"""
    job = runs[f"{scenario}{size}"]
    *survivors, culprit = job.ranks
    assert not job.hung, "\n".join(r.output for r in job.ranks)
    group = re.escape(str(list(range(size))))
    for rank, survivor in enumerate(survivors):
        outcome = survivor.outcome
        assert outcome is not None, survivor.output
        assert "CommunicationError" in outcome["bases"], outcome
        # (a survivor may also see a peer close: another survivor that timed out first and
        # exited; at least one names the failure itself, below)
        assert outcome["failure"] in ("peer", "timeout"), outcome
        message = outcome["message"]
        assert re.search(rf"rank {rank}: step \d \(T\d = \w+\(T\d.*\): allreduce\(sum\) over "
                         rf"mesh axis 0.* \(ranks {group}\)\) among ranks {group}", message), message
        for word in [*WORDS[outcome["failure"]], f"rank {size - 1} was not there"]:
            assert word in message, (word, message)
        assert outcome["seconds"] < TIMEOUT_S + GRACE_S, outcome
        assert survivor.code == 0, survivor.output
    assert any(s.outcome["failure"] == failure for s in survivors), "; ".join(
        f"rank {r}: {s.outcome['failure']} after {s.outcome['seconds']:.1f} s "
        f"({s.outcome['cpu']:.2f} s of CPU): {s.outcome['message']}"
        for r, s in enumerate(survivors))  # (whole: pytest cuts a long repr of the dicts)
    if scenario == "sleep":  # it comes back late and finds the others gone: the same error
        assert culprit.outcome is not None, culprit.output
        assert "CommunicationError" in culprit.outcome["bases"], culprit.output
    else:
        assert culprit.code == 3, culprit.output


def test_clean_exit(runs):
    """A 2-rank program that runs an allreduce and ends exits 0 on every rank, in every one
    of EXIT_RUNS launches, without torch's warnings about unwaited collectives or an
    undestroyed process group, and without hanging at exit."""
    for i in range(EXIT_RUNS):
        job = runs[f"clean{i}"]
        outputs = "\n".join(r.output for r in job.ranks)
        assert not job.hung, f"launch {i} hung (stacks below):\n{outputs}"
        for r in job.ranks:
            assert r.code == 0, f"launch {i}: exit code {r.code}\n{r.output}"
            assert r.outcome is not None and r.outcome["error"] is None, r.output
            for warning in ("unwaited", "destroy_process_group", "terminate called"):
                assert warning not in r.output, r.output


# ----- the pieces, in one process ----------------------------------------------------------------

def test_timeout_from_the_environment():
    assert timeout_from_env({}) == DEFAULT_TIMEOUT_S == 300
    assert timeout_from_env({"MESHFUSE_TIMEOUT": " 2.5 "}) == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(CommunicationError, match="MESHFUSE_TIMEOUT"):
            timeout_from_env({"MESHFUSE_TIMEOUT": bad})


def test_timeout_option_is_checked():
    assert checked_timeout(3) == 3.0
    for bad in (0, -2, "5", True, None):
        with pytest.raises(InputError, match="positive number of seconds"):
            checked_timeout(bad)


@pytest.mark.parametrize("message, kind", [
    ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation",
     "timeout"),
    ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242", "peer"),
    ("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer",
     "peer"),
    ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)",
     "timeout"),
    ("NCCL error: remote process exited or there was a network error", "peer"),
    ("Tensors must be CUDA and dense", "other"),
])
def test_failures_are_told_apart(message, kind):
    assert kind_of_failure(message) == kind


def test_collective_failed_names_the_step_and_the_missing_rank():
    error = CollectiveFailed("allreduce(sum) over mesh axis 0", (0, 1), 0, "timeout", (1,), 5.0,
                             "[pair.cc:1] Timed out waiting 5000ms")
    named = error.at_step("step 3 (T7 = reshard(T5, [P] -> [R]): allreduce(sum) over mesh axis 0)")
    assert isinstance(named, CommunicationError)
    text = str(named)
    for words in ("rank 0: step 3 (T7 = reshard(T5, [P] -> [R])", "among ranks [0, 1]", "timed out after 5 s",
                  "rank 1 was not there", "MESHFUSE_TIMEOUT", "Timed out waiting 5000ms"):
        assert words in text, text
    assert named.absent == (1,) and named.failure == "timeout"
    unknown = CollectiveFailed("broadcast", (0, 1, 2), 2, "peer", None, 5.0, "Broken pipe")
    assert "could not be told" in str(unknown)


class _LateWork:
    """A torch.distributed Work stand-in that completes on its ``waits``-th timed wait."""

    def __init__(self, waits: int):
        self.left = waits

    def wait(self, timeout=None):
        self.left -= 1
        if self.left > 0:
            raise RuntimeError("Timed out waiting")

    def is_completed(self) -> bool:
        return self.left <= 0


def _two_ranks_of_three() -> tuple[LoneFailures, LoneFailures]:
    import torch.distributed as dist

    store = dist.HashStore()
    ranks = [LoneFailures(rank, 3, store, lambda: 0.1) for rank in (0, 1)]
    for lone in ranks:
        lone.begin_call()
    return ranks[0], ranks[1]


def test_a_rank_told_its_group_broke_stops_waiting():
    """Rank 1's collective of group (0, 1) failed: rank 0, waiting for that group's
    collective in the same call, raises GroupBroken with rank 1's notice at once; a wait for
    another group's collective, or one in another call, goes on."""
    waiting, failing = _two_ranks_of_three()
    failing.tell_broken("allreduce(sum) over mesh axis 0", (1, 0), "peer", "Connection closed")
    with pytest.raises(GroupBroken) as told:
        waiting.wait(_LateWork(waits=1000), (0, 1))
    notice = told.value.notice
    assert (notice.rank, notice.error, notice.group) == (1, ("peer", "Connection closed"), (1, 0))
    waiting, failing = _two_ranks_of_three()
    failing.tell_broken("allreduce(sum) over mesh axis 1", (1, 2), "peer", "Connection closed")
    work = _LateWork(waits=5)
    waiting.wait(work, (0, 2))
    assert work.is_completed()
    waiting, failing = _two_ranks_of_three()
    failing.begin_call()  # one call ahead: its notice is not about the collective waited for
    failing.tell_broken("allreduce(sum) over mesh axis 0", (0, 1), "timeout", "Timed out")
    waiting.wait(_LateWork(waits=5), (0, 1))
    waiting, failing = _two_ranks_of_three()
    failing.tell_broken("allreduce(sum) over mesh axis 0", (0, 1), "timeout", "Timed out")
    with pytest.raises(Abandoned):  # on a rank's own error path: stop waiting, no report
        waiting.wait(_LateWork(waits=1000), (0, 1), settling=True)


def test_a_failure_in_the_next_call_waits_until_the_rank_gets_there():
    """Rank 1 finished call 1 and failed alone in call 2 while rank 0, slower, still waits
    for the end of call 1's collective (its data already sent): rank 0 finishes call 1, and
    raises rank 1's error in call 2, where it waits for rank 1 in vain (regression: at 4
    ranks on 2 cores, the slow rank raised it in call 1 and never became out of step)."""
    waiting, failing = _two_ranks_of_three()
    failing.begin_call()
    failing.told(InputError("execute(timeout=-1): bad"), 2, "before running")
    work = _LateWork(waits=3)
    waiting.wait(work, (0, 1, 2))
    assert work.is_completed() and waiting.out_of_step is None
    waiting.begin_call()
    with pytest.raises(InputError, match=r"^rank 1: execute\(timeout=-1\)"):
        waiting.wait(_LateWork(waits=1000), (0, 1, 2))
    assert "rank 1's error in call 2" in waiting.out_of_step


def test_a_peer_close_caused_by_a_timeout_is_reported_as_the_timeout():
    """When a rank times out, gloo closes its connections: a rank of the same group seeing
    the peer close learns from the board that the cause was the timeout."""
    seeing, timed_out = _two_ranks_of_three()
    assert seeing.reported_timeout((0, 1)) is None
    timed_out.tell_broken("allreduce(sum) over mesh axis 0", (0, 1), "timeout", "Timed out 3000ms")
    assert seeing.reported_timeout((0, 2)) is None
    assert seeing.reported_timeout((1, 0)).rank == 1


def test_retired_groups_outlive_a_garbage_collection():
    """A group ``recover()`` destroyed is not freed by a later garbage collection (freeing a
    gloo group with a collective pending would block until that collective times out): it
    is held until then by a thread of its own."""

    class Group:  # stands in for a ProcessGroup in a reference cycle
        def __init__(self):
            self.cycle = self

    group = Group()
    alive = weakref.ref(group)
    keep_until_timed_out([group], 60.0)
    del group
    gc.collect()
    assert alive() is not None
