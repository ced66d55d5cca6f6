"""An error raised on one rank only, told to every rank: who waits, who tells, who is out of step.

The cross-rank agreement (:mod:`meshfuse.runtime.interpreter.agreement`) shares every error raised
before a new input signature's program runs. Errors raised later, or on a call whose signature is
cached, are raised on one rank while the others go on into the program's collectives and wait
for it. :class:`LoneFailures` tells them, through the notice board
(:mod:`meshfuse.runtime.faults.board`):

- the failing rank posts a ``failed`` notice for its call, then waits a few seconds at most for
  every other rank's word about that call: if each of them failed too, at the same place, the
  ranks are still in step (a mistake every rank made alike); otherwise they are *out of step*
  (some rank waits in, or finished, collectives the failing rank never joined);
- a rank waiting for a collective that is late reads the board every
  :data:`~meshfuse.runtime.faults.board.POLL_S`: on a ``failed`` notice it posts ``blocked`` and
  raises the failing rank's error (same type, its message prefixed with that rank);
- a rank whose collective fails (a timeout, a peer gone) posts a ``broken`` notice for the
  collective's group; a rank of that group waiting for that group's collective in the same
  call raises the same failure at once (:class:`GroupBroken`) rather than at its own timeout;
- a rank out of step raises at once on every later call; after a failure,
  :meth:`~meshfuse.runtime.comm.communicator.Communicator.recover` (on every rank) starts over with
  fresh process groups.

No collective and no store access is added to a call that succeeds without waiting: the board
is read only while a collective is already late, and written only on failure.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from meshfuse.errors import CommunicationError
from meshfuse.runtime.faults.apart import ApartWaiter
from meshfuse.runtime.faults.board import AGREEING, BLOCKED, BROKEN, FAILED, POLL_S, Board, Notice
from meshfuse.runtime.faults.failures import OutOfStep, is_shared, remote_error

BEFORE_RUNNING = "before running"
_SLICE = datetime.timedelta(seconds=POLL_S)  # how long a wait runs before it reads the board


class Abandoned(Exception):
    """Raised by :meth:`LoneFailures.wait` in settling mode: stop waiting for a collective
    that cannot complete (another rank failed without launching it, or the ranks are out of
    step); not an error to report."""


class GroupBroken(Exception):
    """Raised by :meth:`LoneFailures.wait`: another rank of the group saw the collective being
    waited for fail (its ``broken`` :class:`~meshfuse.runtime.faults.board.Notice`), so it cannot
    complete; the waiting rank reports the same failure."""

    def __init__(self, notice: Notice):
        super().__init__(f"rank {notice.rank}: {notice.where}: {notice.error}")
        self.notice = notice


class LoneFailures:
    """The failure state of this process's ranks-in-step; one per communicator.

    Args:
        rank, size: this process's rank and the world size.
        store: the rendezvous store (None on one process).
        answer_s: how long a failing rank waits for the others' word (a callable: it follows
            the timeout).
    """

    def __init__(self, rank: int, size: int, store: dist.Store | None,
                 answer_s: Callable[[], float]):
        self._rank, self._size, self._store = rank, size, store
        self._answer_s = answer_s
        self.generation = 0
        self._world = tuple(range(size))
        self.scope = self._world  # the ranks of the call under way (see begin_call)
        self._counts: dict[tuple[int, ...], int] = {}  # calls begun, by scope
        self.board = Board(store if size > 1 else None, 0)
        self._acted_on = 0  # how many of the board's notices this rank has acted on
        self._later: list[Notice] = []  # read, about a call this rank has not begun yet
        self._reason: str | None = None  # why the ranks are out of step, once they are
        # calls (scope, number) where every rank failed alike, in step
        self._settled: set[tuple[tuple[int, ...], int]] = set()
        self.agreed_in = ((), 0)  # the last call in which this rank ran the inputs' agreement
        self._apart: ApartWaiter | None = None  # made on the first transfer waited apart

    @property
    def out_of_step(self) -> str | None:
        """Why this rank's process groups are out of step with the others', or None."""
        return self._reason

    @property
    def calls(self) -> int:
        """The number of the call under way: how many calls of its scope this rank began."""
        return self._counts.get(self.scope, 0)

    def begin_call(self, scope: Sequence[int] = ()) -> int:
        """Counts one ``execute`` call of a fusion whose ranks are ``scope`` (sorted; empty:
        the world) and returns its number among that scope's calls. Calls are counted by
        scope, not by process: every rank of a scope runs that scope's fusions in the same
        order, but ranks of different pipeline stages, say, run different numbers of calls
        of their own, so a count by process tells the same call by different numbers.

        Raises:
            CommunicationError: at once, when the ranks are out of step.
        """
        if self._reason is not None:
            raise CommunicationError(
                f"rank {self._rank}: the ranks are out of step since {self._reason}; end the "
                "job, or call Communicator.instance().recover() on every rank to start over"
            )
        self.scope = tuple(scope) or self._world
        self._counts[self.scope] = self.calls + 1
        return self.calls

    def restart(self, generation: int) -> None:
        """Forgets every failure: a fresh board for the groups of ``generation``."""
        self.generation, self.scope, self._counts = generation, self._world, {}
        self.board = Board(self._store if self._size > 1 else None, generation)
        self._acted_on, self._later = 0, []
        self._reason, self._settled, self.agreed_in = None, set(), ((), 0)
        self._apart = None  # (one still waiting for a transfer of the old groups ends alone)

    def wait(self, work: Any, group: Sequence[int], late: Callable[[], None] | None = None,
             agreeing: bool = False, settling: bool = False) -> None:
        """Waits for ``work`` (a torch.distributed Work of the gloo group of the ranks
        ``group``), reading the board while it is late; see the module doc. ``late`` runs once
        when it first is;
        ``agreeing``: the work is the agreement's (other ranks' ``agreeing`` notices are
        expected); ``settling``: this rank is on its own error path (stop waiting, raising
        :class:`Abandoned`, for a collective that cannot complete).

        Raises:
            MeshfuseError: the error a failed rank posted (marking this rank out of step).
            OutOfStep: another rank waits in the agreement of this call.
            GroupBroken: another rank of ``group`` saw its collective in this call fail.
            RuntimeError: torch's, when the collective itself failed.
        """
        if settling and self._reason is not None:
            raise Abandoned
        while True:
            try:
                work.wait(_SLICE)
                return
            except RuntimeError:
                if work.is_completed():  # it failed by itself: torch's error
                    work.wait()
                    return
            if late is not None:
                late()
                late = None
            self._read_board(frozenset(group), agreeing, settling)

    def wait_apart(self, work: Any, group: Sequence[int], settling: bool = False) -> None:
        """Waits for ``work``, a point-to-point transfer of gloo between the ranks
        ``group``, on a thread apart (:mod:`~meshfuse.runtime.faults.apart`), reading the
        board in the meantime as :meth:`wait` does: a transfer from a rank that failed alone
        raises that rank's error here rather than at the timeout.

        Raises:
            as :meth:`wait`; and what the transfer's own wait raised.
        """
        if settling and self._reason is not None:
            raise Abandoned  # its peer may never come: the ranks are out of step
        if self._apart is None:
            self._apart = ApartWaiter()
        waited = self._apart.submit(work)
        while not waited.wait(POLL_S):
            self._read_board(frozenset(group), False, settling)
        if waited.error is not None:
            raise waited.error

    def _unread(self) -> list[Notice]:
        """The notices about this call or an earlier one that this rank has not acted on yet
        (others may have been read by :meth:`~meshfuse.runtime.faults.board.Board.answers` or
        :meth:`reported_timeout`). A notice about a later call is kept for when this rank gets
        there: a rank still waiting for the end of a collective that the others already
        finished may read their notices about the next call (a rank failing in it)."""
        self.board.news()
        fresh = self._later + self.board.notices[self._acted_on:]
        self._acted_on = len(self.board.notices)
        self._later = [n for n in fresh if self._later_than_now(n)]
        return [n for n in fresh if not self._later_than_now(n)]

    def _later_than_now(self, notice: Notice) -> bool:
        """Whether ``notice`` is about a call of a scope of this rank that it has not begun
        yet (a notice of a scope this rank is not in is about now: it cannot tell)."""
        if self._rank not in notice.scope:
            return False
        return notice.call > self._counts.get(notice.scope, 0)

    def _now(self, notice: Notice) -> bool:
        """Whether ``notice`` is about the call under way."""
        return notice.scope == self.scope and notice.call == self.calls

    def _read_board(self, group: frozenset[int], agreeing: bool, settling: bool) -> None:
        for notice in self._unread():
            if notice.rank == self._rank:
                continue
            if notice.kind == BROKEN and self._now(notice) and \
                    frozenset(notice.group) == group:
                if settling:
                    raise Abandoned
                raise GroupBroken(notice)
            if notice.kind == FAILED and (notice.scope, notice.call) not in self._settled:
                if settling and self._now(notice):
                    raise Abandoned  # it failed too, before launching this one
                error = remote_error(notice.rank, *notice.error)
                self.board.post(Notice(self._rank, notice.call, BLOCKED, scope=notice.scope))
                self._reason = f"rank {notice.rank}'s error in call {notice.call}: {error}"
                raise error
            if notice.kind == AGREEING and self._now(notice) and not agreeing \
                    and self.agreed_in != (self.scope, self.calls) \
                    and (not notice.group or self._rank in notice.group):  # it agrees, not this
                if settling:
                    raise Abandoned
                raise OutOfStep(notice)

    def tell_broken(self, what: str, group: Sequence[int], failure: str, cause: str) -> None:
        """Tells the other ranks of ``group`` that its collective ``what`` failed here
        (``failure``: ``"timeout"`` or ``"peer"``; ``cause``: torch's text)."""
        self.board.post(Notice(self._rank, self.calls, BROKEN, (failure, cause), what,
                               group=tuple(group), scope=self.scope))

    def reported_timeout(self, group: Sequence[int], within_s: float = 1.0) -> Notice | None:
        """Another rank's ``broken`` notice of a timeout of ``group``'s collective in this
        call, if one is posted within ``within_s``: when a rank times out, gloo closes its
        connections, so the others of its group may see a peer close where the cause was that
        timeout (and may see it before that rank has posted its notice)."""
        deadline = time.monotonic() + within_s
        while True:
            self.board.news()
            found = next((n for n in self.board.notices
                          if n.kind == BROKEN and n.rank != self._rank
                          and n.call == self.calls and frozenset(n.group) == frozenset(group)
                          and n.error[0] == "timeout"), None)
            if found is not None or time.monotonic() > deadline or self._store is None:
                return found
            time.sleep(POLL_S)

    def told(self, error: Exception, call: int, where: str) -> Exception:
        """What this rank raises for ``error``, which it raised itself in ``call`` (of the
        scope under way) at ``where``: ``error``, once the others are told (nothing to tell
        for an error every rank raises anyway). Marks the ranks out of step unless every
        other rank of the world failed in the same call at the same place."""
        if self._size == 1 or is_shared(error):
            return error
        self.board.post(Notice(self._rank, call, FAILED, (type(error).__name__, str(error)),
                               where, scope=self.scope))
        others = [r for r in range(self._size) if r != self._rank]
        answers = self.board.answers(call, self.scope, others, self._answer_s())
        if len(answers) == len(others) and all(
                n.kind == FAILED and n.where == where for n in answers.values()):
            self._settled.add((self.scope, call))
        elif self._reason is None:
            self._reason = f"its own error in call {call}: {type(error).__name__}: {error}"
        return error

    def left_in_flight(self, error: Exception, call: int, where: str,
                       scope: tuple[int, ...]) -> None:
        """``error`` ended ``call`` of ``scope`` here with transfers of it still in flight (a
        pipeline step): the ranks are out of step whatever the others did, since a receive
        left posted would take a later call's message. The others are told, unless another
        rank told this error first (even one every rank of a stage raised: the other stages'
        ranks wait for that stage's messages)."""
        if self._size == 1:
            return
        if getattr(error, "failed_rank", None) is None:
            self.board.post(Notice(self._rank, call, FAILED,
                                   (type(error).__name__, str(error)), where, scope=scope))
        if self._reason is None:
            self._reason = f"its error in {where}: {type(error).__name__}: {error}"

    def agreeing(self, claim: Any, group: Sequence[int] = ()) -> Callable[[], None]:
        """Notes that the inputs' agreement (among the ranks ``group``; default the world)
        runs in this call; returns what it runs when its collective is late: post ``claim``
        for a rank of ``group`` running a cached program to compare with."""
        self.agreed_in = call = (self.scope, self.calls)
        return lambda: self.board.post(Notice(self._rank, call[1], AGREEING, claim=claim,
                                              group=tuple(group), scope=call[0]))
