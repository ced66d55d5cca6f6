"""A small meshfuse program that one rank breaks on purpose; run by tests/test_rank_failures.py.

``python tests/rank_failures.py SCENARIO TIMEOUT`` as one rank of a 2-rank launch (torchrun's
variables set). Every rank builds and runs a sharded sum once (an allreduce) with the default
timeout, then runs it again with ``execute(..., timeout=TIMEOUT)`` while the last rank
misbehaves:

- ``exit_before``: it exits before the collective;
- ``exit_inside``: the others launch the collective and wait in it; it gets to the same
  step and exits where it would launch its part (it learns that they are inside through the
  rendezvous store), so the survivors are waiting on a collective their peer will never join;
- ``sleep``: it stays away until every other rank has raised (past the timeout and the roll
  call after it), then joins, late;
- ``clean``: it behaves; every rank returns normally.

Each rank that gets to the end prints one JSON line: its rank, the error type it raised (or
None), the message, and the seconds from the start of the second call to the error. In the
failure scenarios a survivor exits only once every survivor has raised (they meet through the
store): a survivor that timed out first and left would otherwise close its connections under
a slower one still waiting in the collective, which then sees a peer close instead of its own
timeout, or finds the store gone at its roll call. Nothing waits on the clock, so a loaded
machine changes only how long a job takes.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import select
import signal
import sys
import time

import torch
import torch.distributed as dist

from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType
from meshfuse.launch import rank_env
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.testing.zygote import redirect_stdio

# Each rank's share of the summed axis. An allreduce waits for every rank whatever its size,
# so the scenarios need no large tensor; and planning a sharded program costs time that grows
# with the extent, paid by each of the test's ~60 ranks.
EXTENT = 1 << 12


def sharded_sum(size: int) -> FusionDefinition:
    """``T1 = sum(T0, dims=[1])`` with T0's axis 1 sharded: one allreduce."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, EXTENT * size], dtype=DataType.Float)
        fd.add_output(fd.ops.sum(x, dims=[1]))
    x.set_device_mesh(DeviceMesh(range(size)))
    x.outer_split(1, size)
    x.axis(1).parallelize(ParallelType.mesh_x)
    return fd


def exit_when_others_inside() -> None:
    """Makes this process exit where it would launch its next allreduce, once the other
    ranks have launched theirs."""

    def exit_instead(*args, **kwargs):
        _store().wait(["inside"])
        os._exit(3)

    dist.all_reduce = exit_instead


def tell_once_inside() -> None:
    """Makes this process say, through the store, that it launched its next allreduce."""
    launch = dist.all_reduce

    def launch_and_tell(*args, **kwargs):
        work = launch(*args, **kwargs)
        _store().set("inside", b"1")
        return work

    dist.all_reduce = launch_and_tell


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _raised_key(rank: int) -> str:
    return f"raised{rank}"


def say_raised_and_meet(rank: int, size: int) -> None:
    """A survivor: says through the store that it has raised, then waits until every survivor
    (ranks ``0 .. size - 2``) has."""
    _store().set(_raised_key(rank), b"1")
    _store().wait([_raised_key(r) for r in range(size - 1)])


def stay_away_until_survivors_raised(size: int) -> None:
    """The sleeping culprit: waits until every survivor has raised (so it has missed their
    timeout and their roll call), then returns to join its collective late."""
    try:
        _store().wait([_raised_key(r) for r in range(size - 1)])
    except (RuntimeError, ValueError):  # the store's host, rank 0, left: they all raised
        pass


def main(scenario: str, timeout: float) -> None:
    # The launcher asks a hung rank for its stacks with SIGUSR1 (tests/rank_jobs.py); run by
    # hand, a rank still running after ten minutes shows where it is, and ends.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.dump_traceback_later(600, exit=True)
    comm = Communicator.instance()
    fd = sharded_sum(comm.size)
    local = torch.ones(2, EXTENT)
    fd.execute([local])
    culprit = comm.rank == comm.size - 1
    start = time.monotonic()
    outcome = {"rank": comm.rank, "error": None, "message": ""}
    try:
        if culprit and scenario == "exit_before":
            os._exit(3)
        if scenario == "exit_inside":
            exit_when_others_inside() if culprit else tell_once_inside()
        if culprit and scenario == "sleep":
            stay_away_until_survivors_raised(comm.size)
        (out,) = fd.execute([local], timeout=timeout)
        assert out.tolist() == [float(EXTENT * comm.size)] * 2
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome.update(error=type(e).__name__, message=str(e),
                       bases=[c.__name__ for c in type(e).__mro__],
                       failure=getattr(e, "failure", None))
    outcome["seconds"] = time.monotonic() - start
    outcome["cpu"] = time.process_time()  # so that a launcher can tell what the exit costs
    print(json.dumps(outcome), flush=True)
    if scenario != "clean" and not culprit:
        say_raised_and_meet(comm.rank, comm.size)


def serve() -> None:
    """Forks ranks on request, so that a test launches many jobs without paying the import of
    torch and meshfuse for each process (tests/rank_jobs.py): each line of stdin,
    ``TAG SCENARIO TIMEOUT RANK SIZE PORT LOG``, starts one rank running ``main`` with its
    output to the file LOG, and stdout says ``started TAG PID``, then ``ended PID CODE`` once
    it has exited (through the interpreter's normal exit: atexit, torch's teardown). Ends at
    the end of stdin. Single-threaded, so that a fork copies nothing half-done. The imports'
    objects are frozen out of the collector's sight: a rank's exit then neither walks them
    nor copies their pages (1.4 s of CPU to 0.4 s per rank on 2 cores)."""
    gc.freeze()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        _reap()
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        tag, scenario, timeout, rank, size, port, log = line.split()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _become_rank(int(rank), int(size), int(port), log)
            main(scenario, float(timeout))
            sys.exit(0)  # unwinds serve() in this child: the interpreter's normal exit
        print(f"started {tag} {pid}", flush=True)


def _become_rank(rank: int, size: int, port: int, log: str) -> None:
    """In a forked child: its output to ``log``, torchrun's variables for ``rank``."""
    redirect_stdio(log)
    os.environ.update(rank_env(os.environ, rank, size, port))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        print(f"ended {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve()
    else:
        main(sys.argv[1], float(sys.argv[2]))
