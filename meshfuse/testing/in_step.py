"""After each multi-device test, the ranks check that the test left them in step.

A test that leaves its ranks out of step (a lone failure it did not recover from, see
:mod:`meshfuse.runtime.faults.lone_failures`) would otherwise make every later test of its batch
fail with ``the ranks are out of step``, far from the cause. So, once a multi-device test has
torn down, every rank posts whether it is out of step in the rendezvous store (no process group:
those may be the broken part) and reads the others'. When one is, every rank calls
:meth:`~meshfuse.runtime.comm.communicator.Communicator.recover` and the test fails, naming the
ranks and why: the next test starts in step, and the failure is reported where it arose.
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from meshfuse.runtime.comm.communicator import Communicator

_KEY = "meshfuse/harness/in_step"
_WAIT_S = 300.0  # a rank still in the test is the batch's deadline to judge, not this wait


class RanksInStep:
    """Counts the multi-device tests of this process's batch and checks each one's end."""

    def __init__(self) -> None:
        self._tests = 0

    def check(self, nodeid: str) -> None:
        """Every rank's word on whether it is in step after ``nodeid``; recovers and fails the
        test when some rank is not. Nothing to do on one process or before any group exists."""
        if not dist.is_initialized():
            return
        communicator = Communicator.instance()  # made by the test's setup
        store = dist.distributed_c10d._get_default_store()
        if communicator.size == 1 or store is None:
            return
        self._tests += 1
        prefix = f"{_KEY}/{self._tests}"
        reason = communicator.lone.out_of_step
        store.set(f"{prefix}/{communicator.rank}", reason or "")
        keys = [f"{prefix}/{r}" for r in range(communicator.size)]
        store.wait(keys, datetime.timedelta(seconds=_WAIT_S))
        reasons = {r: store.get(k).decode() for r, k in enumerate(keys)}
        out = {r: text for r, text in reasons.items() if text}
        if not out:
            return
        communicator.recover()
        listed = "; ".join(f"rank {r}: {text}" for r, text in sorted(out.items()))
        pytest.fail(f"{nodeid} left the ranks out of step ({listed}); the harness recovered "
                    "them (Communicator.recover()) for the next test", pytrace=False)
