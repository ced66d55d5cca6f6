"""Launching ``tests/rank_failures.py`` as multi-rank jobs and telling a hung job from a slow one.

A job's ranks are either fresh interpreters (``python tests/rank_failures.py SCENARIO
TIMEOUT``, as a user's launcher starts them), or forked by a :class:`Forker`: one process that
imported torch and meshfuse once and forks each rank (``tests/rank_failures.py --serve``), so
that a test can run many jobs without paying about two CPU seconds of imports per process.
Either way each rank exits through the interpreter's normal exit.

A job is *hung* when none of its processes still running has made progress for
:data:`STALL_S` seconds: each is asleep in the kernel (not runnable) and has gained no CPU time.
A slow job (a loaded machine can take a minute to import torch and as long again to exit) is
waited for, up to :data:`LIMIT_S`. A hung job's processes are asked for their Python stacks
(``SIGUSR1``, which the script hands to :mod:`faulthandler`), then killed; the stacks end up
in the job's output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from meshfuse.launch import free_port, rank_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "rank_failures.py"
STALL_S = 30.0  # longer than any wait of the scenarios (a survivor's timeout and roll call: 6 s)
LIMIT_S = 900.0  # a job still busy after this long is killed too
_POLL_S = 0.2
_PROC = Path("/proc")


def _env() -> dict[str, str]:
    return dict(os.environ, MESHFUSE_BACKEND="gloo",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                         os.environ.get("PYTHONPATH")])))


class Forker:
    """A process that forks ranks of ``tests/rank_failures.py`` on request; see the module doc.
    Close it with :meth:`close`."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--serve"], env=_env(), cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._started: dict[str, int] = {}
        self._ended: dict[int, int] = {}
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self._count = 0

    def spawn(self, scenario: str, timeout: float, rank: int, size: int, port: int,
              log: str) -> int:
        """Forks ``rank`` of ``size`` running ``scenario``; returns its pid."""
        self._count += 1
        tag = str(self._count)
        self._process.stdin.write(
            f"{tag} {scenario} {timeout} {rank} {size} {port} {log}\n")
        self._process.stdin.flush()
        with self._changed:
            self._changed.wait_for(lambda: tag in self._started or
                                   self._process.poll() is not None)
        if tag not in self._started:
            raise RuntimeError(f"the forker exited with code {self._process.returncode}")
        return self._started[tag]

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._ended.get(pid)

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait()

    def _read(self) -> None:
        for line in self._process.stdout:
            what, key, value = line.split()
            with self._changed:
                if what == "started":
                    self._started[key] = int(value)
                else:
                    self._ended[int(key)] = int(value)
                self._changed.notify_all()


@dataclasses.dataclass
class Rank:
    """One rank's process, and what it left when it ended."""

    pid: int
    log: Any  # a temporary file
    process: subprocess.Popen | None = None  # a fresh interpreter (else forked)
    code: int | None = None
    outcome: dict | None = None  # its JSON line
    output: str = ""


@dataclasses.dataclass
class Job:
    """The ranks of one launch; ``hung``: it stopped making progress and was killed."""

    ranks: list[Rank]
    forker: Forker | None = None
    hung: bool = False

    def exit_code(self, rank: Rank) -> int | None:
        if rank.process is not None:
            return rank.process.poll()
        return self.forker.exit_code(rank.pid)


def start(scenario: str, timeout: float, size: int = 2, forker: Forker | None = None) -> Job:
    """Starts the script's ``scenario`` on ``size`` ranks (gloo), collective timeout
    ``timeout`` seconds: forked by ``forker``, else as fresh interpreters."""
    port, env = free_port(), _env()
    ranks = []
    for rank in range(size):
        log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # noqa: SIM115 - closed in finish()
        if forker is not None:
            pid = forker.spawn(scenario, timeout, rank, size, port, log.name)
            ranks.append(Rank(pid, log))
            continue
        process = subprocess.Popen([sys.executable, str(SCRIPT), scenario, str(timeout)],
                                   env=rank_env(env, rank, size, port), cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, text=True)
        ranks.append(Rank(process.pid, log, process))
    return Job(ranks, forker)


def finish(job: Job) -> Job:
    """Waits for every rank of ``job`` to end (see the module doc), then reads their exit
    codes, JSON lines and output."""
    last_progress, last_cpu, begun = time.monotonic(), None, time.monotonic()
    while any(job.exit_code(r) is None for r in job.ranks):
        time.sleep(_POLL_S)
        now, cpu = time.monotonic(), _progress(job)
        if cpu != last_cpu:
            last_progress, last_cpu = now, cpu
        elif now - last_progress > STALL_S or now - begun > LIMIT_S:
            job.hung = True
            _dump_and_kill(job)
    for r in job.ranks:
        r.code = job.exit_code(r)
        r.log.seek(0)
        r.output = r.log.read()
        r.log.close()
        lines = [line for line in r.output.splitlines() if line.startswith("{")]
        r.outcome = json.loads(lines[-1]) if lines else None
    return job


def _progress(job: Job) -> tuple:
    """What changes while any rank still running makes progress: each one's CPU ticks, and
    whether it is runnable (a runnable process is waiting for a CPU, not for a peer)."""
    if not _PROC.exists():  # no /proc to look at: every poll counts as progress
        return (time.monotonic(),)
    marks = []
    for r in job.ranks:
        if job.exit_code(r) is not None:
            continue
        try:
            fields = (_PROC / str(r.pid) / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it just ended
            continue
        state, ticks = fields[0], int(fields[11]) + int(fields[12])  # utime + stime
        if state == "Z":  # ended, not yet reaped
            continue
        marks.append((r.pid, ticks, time.monotonic() if state == "R" else 0))
    return tuple(marks)


def _dump_and_kill(job: Job) -> None:
    alive = [r.pid for r in job.ranks if job.exit_code(r) is None]
    for pid in alive:
        _signal(pid, signal.SIGUSR1)
    time.sleep(3)  # on the failure path only: the stacks take a moment to be written
    for pid in alive:
        _signal(pid, signal.SIGKILL)
    for r in job.ranks:  # wait until each is reaped, so that its exit code is known
        while job.exit_code(r) is None:
            time.sleep(_POLL_S)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
