"""Launching ``tests/rank_failures.py`` as a 2-rank job and telling a hung job from a slow one.

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
import time
from pathlib import Path
from typing import Any

from meshfuse.launch import free_port, rank_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "rank_failures.py"
STALL_S = 30.0  # longer than any wait of the scenarios (the sleeping culprit's: about 8 s)
LIMIT_S = 900.0  # a job still busy after this long is killed too
_POLL_S = 0.5
_PROC = Path("/proc/self/stat")


@dataclasses.dataclass
class Rank:
    """One rank's process, and what it left when it ended."""

    process: subprocess.Popen
    log: Any  # a temporary file
    code: int | None = None
    outcome: dict | None = None  # its JSON line
    output: str = ""


@dataclasses.dataclass
class Job:
    """The ranks of one launch; ``hung``: it stopped making progress and was killed."""

    ranks: list[Rank]
    hung: bool = False


def start(scenario: str, timeout: float, size: int = 2) -> Job:
    """Starts the script's ``scenario`` on ``size`` ranks (gloo), collective timeout
    ``timeout`` seconds."""
    port = free_port()
    env = dict(os.environ, MESHFUSE_BACKEND="gloo",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    ranks = []
    for rank in range(size):
        log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in finish()
        process = subprocess.Popen([sys.executable, str(SCRIPT), scenario, str(timeout)],
                                   env=rank_env(env, rank, size, port), cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, text=True)
        ranks.append(Rank(process, log))
    return Job(ranks)


def finish(job: Job) -> Job:
    """Waits for every rank of ``job`` to end (see the module doc), then reads their exit
    codes, JSON lines and output."""
    last_progress, last_cpu, begun = time.monotonic(), None, time.monotonic()
    while any(r.process.poll() is None for r in job.ranks):
        time.sleep(_POLL_S)
        now, cpu = time.monotonic(), _progress(job)
        if cpu != last_cpu:
            last_progress, last_cpu = now, cpu
        elif now - last_progress > STALL_S or now - begun > LIMIT_S:
            job.hung = True
            _dump_and_kill(job)
    for r in job.ranks:
        r.code = r.process.wait()
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
        if r.process.poll() is not None:
            continue
        try:
            fields = Path(f"/proc/{r.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it just ended
            continue
        state, ticks = fields[0], int(fields[11]) + int(fields[12])  # utime + stime
        marks.append((r.process.pid, ticks, time.monotonic() if state == "R" else 0))
    return tuple(marks)


def _dump_and_kill(job: Job) -> None:
    alive = [r.process for r in job.ranks if r.process.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGUSR1)
    time.sleep(3)  # on the failure path only: the stacks take a moment to be written
    for p in alive:
        p.kill()
