"""The parent side of the multi-device test harness: spawn a batch of ranks, judge each test.

For one world size ``n``, :func:`run_batch` starts ``n`` worker processes, each
``python -m pytest <test files>`` (forked from one process that imported torch and pytest
once, on Linux: :mod:`meshfuse.testing.zygote`) with torchrun's variables set (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), runs all the selected
tests of that size in them, and turns the ranks' records (see :mod:`meshfuse.testing.worker`)
into one :class:`Verdict` per test.

A worker that dies without finishing its session is a crash: the others are killed, the test
the dead rank was in fails with its output tail, and the tests that did not finish are run
again in a new batch. Past the deadline every worker is killed and the unfinished tests fail.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from meshfuse.launch import free_port, rank_env
from meshfuse.testing.worker import (
    NODEIDS_ENV,
    PARENT_PID_ENV,
    RECORDS_ENV,
    WORKER_ENV,
    log_path,
    read_records,
    records_path,
    stacks_path,
)
from meshfuse.testing.zygote import ForkedRank, ForkedRanks, fork_available

TAIL_CHARS = 4000
_POLL_S = 0.05
_STACKS_WAIT_S = 2.0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one test at one world size: ``passed``, ``failed``, ``skipped`` or
    ``xfailed``, with the failure report or the reason."""

    outcome: str
    message: str = ""


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """What to run at one world size.

    Attributes:
        world_size: the number of ranks.
        nodeids: the node ids of the tests, as the workers will collect them.
        paths: the test files to collect (absolute).
        rootdir: the working directory and pytest rootdir of the workers.
        pytest_args: further pytest arguments of the workers.
        timeout_s: the time all batches of this world size may take together.
        env: the base environment of the workers.
        threads_per_rank: ``OMP_NUM_THREADS`` of each worker.
    """

    world_size: int
    nodeids: tuple[str, ...]
    paths: tuple[str, ...]
    rootdir: str
    pytest_args: tuple[str, ...]
    timeout_s: float
    env: Mapping[str, str]
    threads_per_rank: int = 1


@dataclasses.dataclass
class RankRun:
    """What one rank of a batch did: the tests it started and ended, and how it exited."""

    rank: int
    started: list[str]
    ended: dict[str, tuple[str, str]]
    done: bool
    exit_code: int | None
    tail: str
    stacks: str = ""

    @property
    def crashed(self) -> bool:
        """True if the rank exited without finishing its pytest session."""
        return self.exit_code is not None and not self.done

    @property
    def current(self) -> str | None:
        """The test the rank was in when it stopped, if any."""
        last = self.started[-1] if self.started else None
        return last if last is not None and last not in self.ended else None

    def exit_text(self) -> str:
        """The exit code in words."""
        if self.exit_code is None:
            return "was killed by the harness"
        if self.exit_code < 0:
            try:
                return f"died of {signal.Signals(-self.exit_code).name}"
            except ValueError:
                return f"died of signal {-self.exit_code}"
        return f"exited with code {self.exit_code}"


def run_batches(specs: list[BatchSpec], parallel: bool) -> dict[int, dict[str, Verdict]]:
    """Runs :func:`run_batch` for each spec, all at once if ``parallel``; verdicts by world size.

    Running the batches of several world sizes at once overlaps their start-up (importing torch
    dominates small tests); do it only when ranks do not compete for devices (CPU, gloo).
    """
    if not parallel or len(specs) < 2:
        return {spec.world_size: run_batch(spec) for spec in specs}
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=len(specs))
    try:
        futures = [pool.submit(run_batch, spec, stop) for spec in specs]
        return {spec.world_size: f.result() for spec, f in zip(specs, futures)}
    except BaseException:  # e.g. Ctrl-C: stop the other batches too, then re-raise
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True)


def run_batch(spec: BatchSpec, stop: threading.Event | None = None) -> dict[str, Verdict]:
    """Runs ``spec``'s tests on ``spec.world_size`` ranks; returns a verdict for each node id.

    Never hangs: past ``spec.timeout_s``, or once ``stop`` is set, the workers are killed and
    unfinished tests fail.
    """
    deadline = time.monotonic() + spec.timeout_s
    verdicts: dict[str, Verdict] = {}
    remaining = list(spec.nodeids)
    fruitless_retries = 0
    while remaining:
        ranks, ending = _run_once(spec, remaining, deadline, stop)
        judged, retry = judge(remaining, ranks, ending, spec)
        verdicts.update(judged)
        if retry and len(retry) == len(remaining):
            # The crash was outside any test (start-up, collection): try once more, then give up.
            fruitless_retries += 1
            if fruitless_retries > 1:
                verdicts.update({n: _not_run(n, ranks, ending, spec) for n in retry})
                break
        remaining = retry
    return verdicts


def judge(
    nodeids: list[str], ranks: list[RankRun], ending: str, spec: BatchSpec
) -> tuple[dict[str, Verdict], list[str]]:
    """The verdicts of one batch run and the node ids to run again.

    Args:
        nodeids: the tests of the run.
        ranks: what each rank did.
        ending: ``"normal"`` (every rank finished), ``"crash"`` or ``"timeout"``.
        spec: the batch.
    """
    verdicts: dict[str, Verdict] = {}
    retry: list[str] = []
    crashed_in = {r.current for r in ranks if r.crashed}
    for nodeid in nodeids:
        outcomes = [r.ended.get(nodeid) for r in ranks]
        if all(outcomes):
            verdicts[nodeid] = aggregate(outcomes)
        elif ending == "crash" and nodeid not in crashed_in:
            retry.append(nodeid)
        else:
            verdicts[nodeid] = _not_run(nodeid, ranks, ending, spec)
    return verdicts, retry


def aggregate(outcomes: list[tuple[str, str]]) -> Verdict:
    """The verdict of a test from each rank's ``(outcome, text)``, indexed by rank.

    Any failure fails the test with every failing rank's report. Ranks must agree on
    skipping: a test skipped on some ranks only fails, as its collectives would hang.
    """
    failed = [(r, text) for r, (o, text) in enumerate(outcomes) if o == "failed"]
    if failed:
        names = ", ".join(str(r) for r, _ in failed)
        lines = [f"failed on rank{'s' if len(failed) > 1 else ''} {names} of {len(outcomes)}"]
        seen: dict[str, int] = {}
        for r, text in failed:
            if text in seen:
                lines.append(f"--- rank {r}: the same as rank {seen[text]} ---")
            else:
                seen[text] = r
                lines += [f"--- rank {r} ---", text]
        return Verdict("failed", "\n".join(lines))
    kinds = {o for o, _ in outcomes}
    if "skipped" in kinds:
        reasons = {text for o, text in outcomes if o == "skipped"}
        if kinds == {"skipped"}:
            return Verdict(
                "skipped", reasons.pop() if len(reasons) == 1 else "; ".join(sorted(reasons))
            )
        states = ", ".join(
            f"rank {r} {o}" + (f" ({text})" if o == "skipped" else "")
            for r, (o, text) in enumerate(outcomes)
        )
        return Verdict(
            "failed",
            f"ranks disagree on skipping: {states}; skip on every rank or none, on a condition "
            f"all ranks share, before the first collective",
        )
    if "xfailed" in kinds:
        return Verdict("xfailed", next(text for o, text in outcomes if o == "xfailed"))
    return Verdict("passed")


def _not_run(nodeid: str, ranks: list[RankRun], ending: str, spec: BatchSpec) -> Verdict:
    """The failure of a test that not every rank finished."""
    states = ", ".join(
        f"rank {r.rank} {r.ended[nodeid][0]}"
        if nodeid in r.ended
        else f"rank {r.rank} was running it"
        if r.current == nodeid
        else f"rank {r.rank} did not start it"
        for r in ranks
    )
    shown: list[RankRun] = []
    if ending == "timeout":
        why = f"the batch timed out after {spec.timeout_s:g} s"
        running = [r for r in ranks if r.current == nodeid]
        if running:
            why += " (a hang is often a collective that not every rank called; "
            why += "MESHFUSE_TEST_TIMEOUT sets the limit)"
            shown = running
        else:
            elsewhere = sorted({r.current for r in ranks if r.current})
            why += f" in {', '.join(elsewhere) or 'start-up'}, so this test did not run"
    elif ending == "crash":
        shown = [r for r in ranks if r.crashed]
        why = "; ".join(
            f"rank {r.rank} {r.exit_text()}" + (f" while running {r.current}" if r.current else "")
            for r in shown
        )
    else:
        why = f"the {spec.world_size} workers ended without running it (a collection error?)"
        shown = ranks[:1]
    lines = [f"{why}; {states}"]
    for r in ranks:
        if nodeid in r.ended and r.ended[nodeid][0] == "failed":
            lines += [f"--- rank {r.rank} failed ---", r.ended[nodeid][1]]
    for r in shown:
        lines += [f"--- output tail of rank {r.rank} ({r.exit_text()}) ---", r.tail]
        if r.stacks:
            lines += [f"--- Python stacks of rank {r.rank} when it was stopped ---", r.stacks]
    return Verdict("failed", "\n".join(lines))


def _run_once(
    spec: BatchSpec, nodeids: list[str], deadline: float, stop: threading.Event | None
) -> tuple[list[RankRun], str]:
    """Runs one batch of workers to its end; returns what each rank did and how it ended."""
    n = spec.world_size
    tmp = tempfile.mkdtemp(prefix=f"meshfuse-ws{n}-")
    procs: list[subprocess.Popen | ForkedRank] = []
    zygote: ForkedRanks | None = None
    try:
        nodeids_file = Path(tmp) / "nodeids.txt"
        nodeids_file.write_text("\n".join(nodeids) + "\n")
        port = free_port()
        argv = ["-m", "pytest", *spec.paths, *spec.pytest_args]
        envs = [worker_env(spec.env, rank, n, port, tmp, nodeids_file, spec.threads_per_rank)
                for rank in range(n)]
        logs = [str(log_path(tmp, rank)) for rank in range(n)]
        if fork_available():
            zygote = ForkedRanks(argv, spec.rootdir, envs, logs, spec.threads_per_rank)
            procs = list(zygote.ranks)
        else:
            procs = [_popen([sys.executable, *argv], spec.rootdir, env, log)
                     for env, log in zip(envs, logs)]
        ending = _wait(procs, tmp, deadline, stop)
        codes = [p.poll() for p in procs]  # None: still running, to be killed
        if ending == "timeout" and not (stop is not None and stop.is_set()):
            _dump_stacks(procs, tmp)  # not when stopped: nobody will read them
        _kill(procs)
        return [_rank_run(tmp, rank, code) for rank, code in enumerate(codes)], ending
    finally:
        _kill(procs)
        if zygote is not None:
            zygote.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _popen(cmd: list[str], cwd: str, env: dict[str, str], log: str) -> subprocess.Popen:
    """A worker as a fresh interpreter (where ranks cannot be forked), output to ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, to kill it whole
        )


def _wait(
    procs: list[subprocess.Popen | ForkedRank], tmp: str, deadline: float, stop: threading.Event | None
) -> str:
    """Waits for the workers; ``"normal"``, ``"crash"`` (one exited unfinished) or ``"timeout"``."""
    done: dict[int, bool] = {}
    while True:
        for rank, p in enumerate(procs):
            if p.poll() is not None and rank not in done:
                done[rank] = any(
                    r.get("event") == "done" for r in read_records(records_path(tmp, rank))
                )
                if not done[rank]:
                    return "crash"
        if len(done) == len(procs):
            return "normal"
        if time.monotonic() > deadline or (stop is not None and stop.is_set()):
            return "timeout"
        time.sleep(_POLL_S)


def _dump_stacks(procs: list[subprocess.Popen | ForkedRank], tmp: str) -> None:
    """Asks every running worker for its Python stacks (see :mod:`meshfuse.testing.worker`)."""
    running = [(rank, p) for rank, p in enumerate(procs) if p.poll() is None]
    for _, p in running:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    files = [stacks_path(records_path(tmp, rank)) for rank, _ in running]
    end = time.monotonic() + _STACKS_WAIT_S
    while time.monotonic() < end and not all(f.exists() and f.stat().st_size for f in files):
        time.sleep(_POLL_S)
    time.sleep(_POLL_S)  # let the last writes land


def _kill(procs: list[subprocess.Popen | ForkedRank]) -> None:
    """Kills every still running worker with its children, and reaps it."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _rank_run(tmp: str, rank: int, exit_code: int | None) -> RankRun:
    started: list[str] = []
    ended: dict[str, tuple[str, str]] = {}
    done = False
    for rec in read_records(records_path(tmp, rank)):
        if rec.get("event") == "start":
            started.append(rec["nodeid"])
        elif rec.get("event") == "end":
            ended[rec["nodeid"]] = (rec["outcome"], rec["text"])
        elif rec.get("event") == "done":
            done = True
    stacks = _tail(stacks_path(records_path(tmp, rank)))
    # pytest's and pluggy's frames say nothing about where a test hung.
    stacks = "\n".join(
        line
        for line in stacks.splitlines()
        if not any(
            s in line for s in ("/_pytest/", "/pluggy/", "<frozen runpy>", "pytest/__main__")
        )
    )
    return RankRun(rank, started, ended, done, exit_code, _tail(log_path(tmp, rank)), stacks)


def _tail(path: Path) -> str:
    try:
        return path.read_bytes()[-TAIL_CHARS:].decode(errors="replace")
    except FileNotFoundError:
        return ""


def worker_env(
    base: Mapping[str, str],
    rank: int,
    size: int,
    port: int,
    tmp: str,
    nodeids_file: Path,
    threads: int,
) -> dict[str, str]:
    """The environment of worker ``rank`` of ``size``: torchrun's variables and the harness's."""
    clean = {k: v for k, v in base.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")}
    env = rank_env(clean, rank, size, port)
    env["OMP_NUM_THREADS"] = str(threads)
    env[WORKER_ENV] = "1"
    env[RECORDS_ENV] = str(records_path(tmp, rank))  # the file this rank appends to
    env[NODEIDS_ENV] = str(nodeids_file)
    env[PARENT_PID_ENV] = str(os.getpid())
    return env
