"""A dead or stuck rank ends in CommunicationError on every survivor, and a clean run exits 0.

Each test launches its own two ranks (gloo, CPU) running ``tests/rank_failures.py`` with a
short timeout, as a user's ``torchrun`` job would run: the multi-rank test harness cannot
host a rank that dies on purpose.
"""

from __future__ import annotations

import os
import re

import pytest
from rank_jobs import Job, finish, start

from meshfuse.errors import CommunicationError, InputError
from meshfuse.runtime.failures import (
    DEFAULT_TIMEOUT_S,
    CollectiveFailed,
    checked_timeout,
    kind_of_failure,
    timeout_from_env,
)

TIMEOUT_S = 3.0
# How long after the timeout a survivor may take to raise: the roll call, and start-up slack.
GRACE_S = 10.0
# The bar: a 2-rank program that ends normally exits 0 in 20 runs out of 20.
EXIT_RUNS = int(os.environ.get("MESHFUSE_EXIT_RUNS", "20"))
CLEAN_AT_ONCE = 4  # clean jobs running at a time (each is two processes importing torch)

SCENARIOS = ("exit_before", "exit_inside", "sleep")


@pytest.fixture(scope="module")
def runs() -> dict[str, Job]:
    """Every scenario's job, and the clean ones: the failure scenarios are started first and
    mostly wait, the clean jobs run a few at a time meanwhile."""
    started = {name: start(name, TIMEOUT_S) for name in SCENARIOS}
    jobs = {}
    for first in range(0, EXIT_RUNS, CLEAN_AT_ONCE):
        batch = {f"clean{i}": start("clean", TIMEOUT_S)
                 for i in range(first, min(first + CLEAN_AT_ONCE, EXIT_RUNS))}
        jobs.update({name: finish(job) for name, job in batch.items()})
    jobs.update({name: finish(job) for name, job in started.items()})
    return jobs


@pytest.mark.parametrize("scenario, failure, words", [
    ("exit_before", "peer", ["closed its connection", "rank 1 was not there"]),
    ("exit_inside", "peer", ["closed its connection", "rank 1 was not there"]),
    ("sleep", "timeout", [f"timed out after {TIMEOUT_S:g} s", "rank 1 was not there",
                          "MESHFUSE_TIMEOUT"]),
])
def test_survivor_raises_communication_error(runs, scenario, failure, words):
    """Rank 1 exits before the allreduce, exits while rank 0 waits inside it, or sleeps past
    the timeout: rank 0 raises CommunicationError naming the step, the group and rank 1,
    within the timeout plus a few seconds, and exits 0 once it has handled it."""
    job = runs[scenario]
    survivor, culprit = job.ranks
    assert not job.hung, survivor.output + culprit.output
    outcome = survivor.outcome
    assert outcome is not None, survivor.output
    assert "CommunicationError" in outcome["bases"], outcome
    message = outcome["message"]
    assert re.search(r"rank 0: step \d \(T\d = \w+\(T\d.*\): allreduce\(sum\) over mesh axis 0"
                     r".* \(ranks \[0, 1\]\)\) among ranks \[0, 1\]", message), message
    for word in words:
        assert word in message, (word, message)
    assert outcome["seconds"] < TIMEOUT_S + GRACE_S, outcome
    assert survivor.code == 0, survivor.output
    if scenario == "sleep":  # it comes back late and finds rank 0 gone: the same error
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
