"""Starting N ranks on this host without a launcher: torchrun's variables, one process each.

Used by the demo; ``torchrun --nproc-per-node N`` and ``mpirun -np N`` do the same job and
are what to use across hosts.
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

LAUNCHER_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")


def under_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True inside a process started by torchrun, mpirun or :func:`spawn`."""
    env = os.environ if env is None else env
    return any(v in env for v in LAUNCHER_VARIABLES)


def launcher_world_size(env: Mapping[str, str] | None = None) -> int | None:
    """The world size a launcher gave this process (``WORLD_SIZE``, else
    ``OMPI_COMM_WORLD_SIZE``); ``None`` without a launcher or when the value is not a
    positive integer (the communicator reports that one when it starts)."""
    env = os.environ if env is None else env
    for var in LAUNCHER_VARIABLES:
        if var in env:
            try:
                size = int(env[var])
            except ValueError:
                return None
            return size if size > 0 else None
    return None


def cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now (the OS picks it) and that this process has
    not handed out lately: the ranks of a job bind it only once they have started, and a
    process starting several jobs at once (a test suite) must not give two of them one port
    (their rank 0s would race to bind it: one fails with EADDRINUSE)."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            break
    _HANDED_OUT.append(port)
    return port


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=4096)  # free_port's, lately


def rank_env(base: Mapping[str, str], rank: int, size: int, port: int) -> dict[str, str]:
    """``base`` with torchrun's variables for ``rank`` of ``size`` on this host, and the
    CPU threads shared out among the ranks."""
    env = {k: v for k, v in base.items() if not k.startswith("OMPI_COMM_WORLD_")}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(max(1, cpu_count() // size)),
    )
    return env


def spawn(size: int, argv: Sequence[str], timeout_s: float | None = None) -> list[int]:
    """Runs ``python argv...`` as ``size`` ranks; returns their exit codes (rank order).

    If one rank fails, the others are stopped rather than left waiting in a collective.
    """
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, *argv], env=rank_env(os.environ, r, size, port))
        for r in range(size)
    ]
    codes: list[int | None] = [None] * size
    try:
        while None in codes:
            for r, p in enumerate(procs):
                if codes[r] is None:
                    try:
                        codes[r] = p.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        continue
                    if codes[r] != 0:
                        _stop(procs)
    finally:
        _stop(procs)
    return [c if c is not None else -1 for c in codes]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
