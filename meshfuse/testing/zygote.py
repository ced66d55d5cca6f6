"""Forked ranks for the multi-device test harness: one import of torch for a whole batch.

A worker of a batch (:mod:`meshfuse.testing.launcher`) is ``python -m pytest`` with a rank's
environment. Started as a fresh interpreter, each worker spends seconds of CPU importing torch,
torch.distributed and pytest before it collects a test; at world size 4 that is paid four
times, on a host whose cores the ranks share. Instead, the launcher starts one *zygote* (this
file run as a script) that imports those libraries once, then forks each rank; a forked rank
sets its environment, starts its own session (a process group the launcher can kill whole)
and runs ``pytest.main`` with the worker's arguments, then exits through the interpreter's
normal exit, as ``python -m pytest`` does.

The zygote imports no meshfuse module (it is run as a file, not with ``-m``, which would import
the package) and no test module, so that pytest imports, registers and rewrites the assertions
of the same modules as in a fresh worker; this module imports nothing but the standard library.
A forked rank's ``MESHFUSE_TEST_PARENT_PID`` (:mod:`meshfuse.testing.worker`) becomes the
zygote's pid, its parent; the zygote in turn ends when the launcher's process is gone.
It reads one JSON request on stdin:
``{"argv": [...], "cwd": ..., "threads": N, "ranks": [{"env": {...}, "log": path}, ...]}``
and answers on stdout, one line each: ``started RANK PID`` as it forks each rank, then
``ended PID CODE`` as each one exits (``CODE`` as :attr:`subprocess.Popen.returncode` reads:
negative for a signal). It ends once every rank has ended, or when its parent is gone.

The launcher's side is :class:`ForkedRanks`: it starts the zygote and gives one
:class:`ForkedRank` per rank, with the part of :class:`subprocess.Popen`'s interface that the
launcher uses (``pid``, ``poll``, ``wait``).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

# What every worker imports before its first test; kept to libraries, see the module doc.
PRELOADED = ("torch", "torch.distributed", "torch.distributed.tensor", "numpy", "pytest")
# The worker's watch on its parent (meshfuse.testing.worker.PARENT_PID_ENV; not imported, see
# the module doc).
_PARENT_PID_ENV = "MESHFUSE_TEST_PARENT_PID"
_PARENT_POLL_S = 1.0


def fork_available() -> bool:
    """True where ranks are forked from a zygote: Linux (forking a process that imported torch
    is safe there while no thread has started; macOS's system libraries are not fork-safe)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


class ForkedRank:
    """One forked rank, as the launcher sees it: its pid, and its exit code once known."""

    def __init__(self, ranks: ForkedRanks, pid: int) -> None:
        self._ranks = ranks
        self.pid = pid

    def poll(self) -> int | None:
        """The rank's exit code, or None while it runs."""
        return self._ranks.exit_code(self.pid)

    def wait(self) -> int:
        """Waits for the rank to end; returns its exit code."""
        return self._ranks.wait(self.pid)


class ForkedRanks:
    """A zygote and the ranks it forked for one batch run.

    Args:
        argv: the worker's command line after ``python`` (``-m pytest ...``).
        cwd: the workers' working directory.
        envs: each rank's environment (rank order).
        logs: each rank's output file.
        threads: the ranks' ``OMP_NUM_THREADS`` (the zygote's too: libgomp reads it on import).
    """

    def __init__(self, argv: Sequence[str], cwd: str, envs: Sequence[Mapping[str, str]],
                 logs: Sequence[str], threads: int) -> None:
        self._ended: dict[int, int] = {}
        self._changed = threading.Condition()
        env = dict(envs[0], OMP_NUM_THREADS=str(threads))
        self._process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())], cwd=cwd, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            start_new_session=True)
        request = {"argv": list(argv), "cwd": cwd, "threads": threads,
                   "ranks": [{"env": dict(e), "log": str(log)} for e, log in zip(envs, logs)]}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.close()
        self.ranks: list[ForkedRank] = []
        for _ in envs:
            line = self._process.stdout.readline().split()
            if len(line) != 3 or line[0] != "started":
                self.close()
                raise RuntimeError(
                    f"the test zygote ({Path(__file__).name}) exited with code "
                    f"{self._process.returncode} before it started every rank")
            self.ranks.append(ForkedRank(self, int(line[2])))
        threading.Thread(target=self._read, name="meshfuse-zygote", daemon=True).start()

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._ended.get(pid)

    def wait(self, pid: int) -> int:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._ended)
            return self._ended[pid]

    def close(self) -> None:
        """Kills the zygote (its ranks are the launcher's to kill) and reaps it."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()

    def _read(self) -> None:
        for line in self._process.stdout:
            what, pid, code = line.split()
            if what == "ended":
                with self._changed:
                    self._ended[int(pid)] = int(code)
                    self._changed.notify_all()
        with self._changed:  # the zygote is gone: a rank it did not report is lost
            for rank in self.ranks:
                self._ended.setdefault(rank.pid, -9)
            self._changed.notify_all()


# ----- the zygote process -------------------------------------------------------------------


def main() -> None:
    """The zygote: imports :data:`PRELOADED`, forks the requested ranks, reports their exits."""
    request = json.loads(sys.stdin.readline())
    modules = {name: importlib.import_module(name) for name in PRELOADED}
    run = _rank_runner(modules["pytest"].main, modules["torch"].set_num_threads)
    parent = os.getppid()
    pids = []
    # What the imports made lives as long as the ranks: out of the collector's sight, a
    # rank's collections neither walk it nor copy its pages (fork's copy on write); a rank
    # then also exits in a third of the time.
    gc.freeze()
    for rank, spec in enumerate(request["ranks"]):
        sys.stdout.flush()  # else the child inherits, and writes, what is still buffered
        pid = os.fork()
        if pid == 0:
            run(request["argv"], request["cwd"], spec["env"], spec["log"], request["threads"])
        pids.append(pid)
        print(f"started {rank} {pid}", flush=True)
    # Only now a thread: forking a process with threads copies their locks mid-use.
    threading.Thread(target=_exit_without, args=(parent,), daemon=True).start()
    while pids:
        pid, status = os.wait()
        if pid in pids:
            pids.remove(pid)
            print(f"ended {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


def _exit_without(parent: int) -> None:
    """Ends the zygote once ``parent`` (the launcher's process) is gone."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def redirect_stdio(log: str) -> None:
    """This process's stdout and stderr into the file ``log`` (made anew), stdin from
    /dev/null: how a forked rank starts."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def _rank_runner(pytest_main: Callable, set_num_threads: Callable) -> Callable:
    """The function a forked child runs to become a rank: it runs pytest and never returns."""

    def run(argv: Sequence[str], cwd: str, env: Mapping[str, str], log: str,
            threads: int) -> None:
        os.setsid()
        redirect_stdio(log)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        if _PARENT_PID_ENV in env:
            os.environ[_PARENT_PID_ENV] = str(os.getppid())
        set_num_threads(threads)
        args = list(argv)
        if args[:2] != ["-m", "pytest"]:
            raise SystemExit(f"the test zygote runs '-m pytest ...', not {args}")
        sys.argv = ["pytest", *args[2:]]
        raise SystemExit(int(pytest_main(args[2:])))

    return run


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m pytest` has it, not this file's directory
    main()
