"""Collectives in flight: a launched collective's result, waited for where it is read.

A collective launched asynchronously (:mod:`meshfuse.runtime.comm.collectives`, ``async_op=True``)
is a :class:`Pending`: computation its result does not feed overlaps it (NCCL runs it on its
own stream; gloo on its own thread), and its :meth:`~Pending.wait` gives the tensor.

Every collective launched is waited for: a :class:`Pending` stays in :func:`in_flight` until
its ``wait``; the executor waits for those of a program that fails, and
:func:`settle_in_flight` runs at exit before the process groups are destroyed. Every wait
goes through :meth:`Communicator.wait <meshfuse.runtime.comm.communicator.Communicator.wait>`: a
collective that fails (timed out, or a peer went away) raises
:class:`~meshfuse.runtime.faults.failures.CollectiveFailed` naming the collective and its group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from meshfuse.errors import MeshfuseError
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.faults.lone_failures import Abandoned


class Pending:
    """A collective in flight and what turns its buffer into the result.

    ``wait()`` orders the caller after the collective (on NCCL the current stream waits for
    the collective's stream; the host does not block) and returns the result; later calls
    return it again. ``then(fn)`` appends a local step applied to the result on ``wait``.
    Until ``wait``, the buffer must not be read or freed: the collective may still write it.
    ``label`` names the collective in errors; the executor sets it to the program step.
    """

    __slots__ = ("_finish", "_ranks", "_seq", "_value", "_work", "label")

    def __init__(self, work: dist.Work, buffer: torch.Tensor,
                 finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 label: str = "a collective", ranks: tuple[int, ...] = ()):
        self._work: dist.Work | None = work
        self._value = buffer
        self._finish = [finish] if finish is not None else []
        self.label, self._ranks = label, ranks
        global _launched
        _launched += 1
        self._seq = _launched
        _in_flight[id(self)] = self

    def abandon(self) -> bool:
        """Waits for the collective and drops its result; False if it failed, or cannot
        complete because another rank failed without launching it (not raised: another error
        is being reported)."""
        work, self._work = self._work, None
        _in_flight.pop(id(self), None)
        if work is None:
            return True
        try:
            if isinstance(work, Works):  # each transfer waited for through the communicator
                work.wait(settling=True)
            else:
                Communicator.instance().wait(work, self.label, self._ranks, settling=True)
            return True
        except (MeshfuseError, Abandoned):
            return False

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Pending:
        if self._work is None:
            self._value = fn(self._value)
        else:
            self._finish.append(fn)
        return self

    def wait(self) -> torch.Tensor:
        """The result, once the collective is done.

        Raises:
            CollectiveFailed: if the collective timed out or a peer went away.
        """
        if self._work is not None:
            work, self._work = self._work, None
            _in_flight.pop(id(self), None)
            Communicator.instance().wait(work, self.label, self._ranks)
            for fn in self._finish:
                self._value = fn(self._value)
            self._finish = []
        return self._value


def resolved(x: torch.Tensor | Pending) -> torch.Tensor:
    """``x`` itself, or the result of the collective ``x`` stands for (waited for)."""
    return x.wait() if isinstance(x, Pending) else x


class Works:
    """Several point-to-point operations (``what`` among ``ranks``) waited for as one (the
    tensors they read and write are kept alive until then): the work of a :class:`Pending`
    made of several sends and receives."""

    __slots__ = ("_ranks", "_tensors", "_works", "what")

    def __init__(self, works: Sequence[dist.Work], tensors: Sequence[torch.Tensor],
                 what: str, ranks: tuple[int, ...]):
        self._works, self._tensors = list(works), list(tensors)
        self.what, self._ranks = what, ranks

    def wait(self, settling: bool = False) -> None:
        for work in self._works:
            Communicator.instance().wait(work, self.what, self._ranks, settling=settling,
                                         point_to_point=True)
        self._works, self._tensors = [], []


# The collectives launched and not yet waited for, by id: every one is waited for before the
# process groups go away (an unwaited collective is torch's "unwaited collective calls").
_in_flight: dict[int, Pending] = {}
_launched = 0  # Pendings created so far (each one's ``_seq``)


def in_flight() -> int:
    """The number of collectives launched and not yet waited for."""
    return len(_in_flight)


def launched() -> int:
    """How many collectives were launched so far: a mark for :func:`settle_in_flight`."""
    return _launched


def settle_in_flight(since: int = 0) -> int:
    """Waits for every collective still in flight launched after mark ``since`` (default:
    all), ignoring their failures: for the error path and exit, where an earlier error is the
    one to report. Returns how many failed. Those launched before the mark are left: a
    program settles its own, not a caller's (a pipeline runner's receives posted early)."""
    failed = 0
    for key in [k for k, p in _in_flight.items() if p._seq > since]:
        pending = _in_flight.pop(key, None)
        if pending is not None:
            failed += not pending.abandon()
    return failed


Communicator.before_shutdown(settle_in_flight)
