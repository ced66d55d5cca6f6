"""Runs training jobs of several world sizes one after another, as a user's launcher would,
for the checkpoint tests that move a checkpoint between world sizes.

    python tests/checkpoint_jobs.py JOBS.json

``JOBS.json`` lists jobs ``{"ranks": N, "target": "module:function", "argv": [...]}``: each
job is ``N`` ranks with torchrun's variables (a fresh gloo process group), each calling
``function(argv)`` (a script's ``main``) and exiting with its return value. This process
imports torch, meshfuse and the targets once and forks every rank from itself (it never runs
a torch operation, so no thread is running when it forks), so a job costs no interpreter
start-up. The jobs run in order; when a rank fails the job's other ranks are killed, the
failed rank's output is printed and this process exits 1 without running the later jobs.
Each rank's output is ``JOBS.json``'s directory ``/job<J>.rank<R>.log``.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

LIMIT_S = 300.0  # one job; a hung collective ends here
_POLL_S = 0.05
sys.path.insert(0, str(Path(__file__).resolve().parent))  # targets among the tests' modules


def _target(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _become_rank(function, argv, env: dict[str, str], log: str) -> None:
    """In a forked child: the rank's environment and output, then ``function(argv)``."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.environ.clear()
    os.environ.update(env)
    code = 1
    try:
        code = int(function(list(argv)) or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001  (printed to the rank's log)
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(job: dict, function, logs: list[str]) -> tuple[int, int]:
    """Runs one job; returns (the first failing rank or -1, its exit code)."""
    from meshfuse.launch import free_port, rank_env

    port, ranks = free_port(), job["ranks"]
    pids = []
    for rank in range(ranks):
        env = rank_env(os.environ, rank, ranks, port)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _become_rank(function, job["argv"], env, logs[rank])
        pids.append(pid)
    alive, deadline, failed = dict(enumerate(pids)), time.monotonic() + LIMIT_S, (-1, 0)
    while alive:
        for rank, pid in list(alive.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del alive[rank]
                code = os.waitstatus_to_exitcode(status)
                if code and failed[0] < 0:
                    failed = (rank, code)
        if (failed[0] >= 0 or time.monotonic() > deadline) and alive:
            for pid in alive.values():
                os.kill(pid, signal.SIGKILL)
            for pid in alive.values():
                os.waitpid(pid, 0)
            return failed if failed[0] >= 0 else (next(iter(alive)), -9)
        time.sleep(_POLL_S)
    return failed


def main(path: str) -> int:
    jobs = json.loads(Path(path).read_text())
    here = Path(path).resolve().parent
    functions = [_target(job["target"]) for job in jobs]
    try:
        import matplotlib  # the scripts' --out pictures: imported once, here
        matplotlib.use("Agg")
        import matplotlib.pyplot
    except ImportError:
        pass
    for j, (job, function) in enumerate(zip(jobs, functions)):
        logs = [str(here / f"job{j}.rank{r}.log") for r in range(job["ranks"])]
        rank, code = _run(job, function, logs)
        if rank >= 0:
            tail = Path(logs[rank]).read_text()[-3000:]
            print(f"job {j} ({job['ranks']} ranks, {job['target']} {' '.join(job['argv'])}): "
                  f"rank {rank} exited with {code}:\n{tail}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
