"""The notice board: what a rank tells the others when it cannot meet them in a collective.

A rank that raises an error the others do not share (its own input, option or kernel failed
while they went on into the program's collectives) leaves them waiting for it. Rather than let
them wait for the timeout, it posts a :class:`Notice` in torch.distributed's rendezvous store
(the TCP store every rank already reaches; no process group, so nothing queues behind a
collective). A rank waiting for a collective reads the board now and then
(:data:`POLL_S`) and raises the error it finds there. Reading costs one store round trip, and
only happens while a collective is already late: a call whose collectives complete at once
never touches the store.

Four kinds of notice, each about one *call*: its *scope* (the ranks of the fusion it runs) and
its number among the ``execute`` calls of that scope (the same on every rank of the scope in a
job in step; a count by process is not: ranks of different pipeline stages run different numbers
of calls of their own):

- ``failed``: the poster raised ``error`` (type name, text) in that call, at ``where`` (a step
  of its program, or before running it);
- ``blocked``: the poster was waiting in a collective of its program when it read another
  rank's ``failed`` notice of that call (it raises that rank's error);
- ``agreeing``: the poster has been waiting in the cross-rank agreement of a new input
  signature (:mod:`meshfuse.runtime.interpreter.agreement`) for longer than a poll, with ``claim``
  (what it holds): a rank that reads it while running a cached program is out of step with it, and
  can name the difference;
- ``broken``: a collective of the poster's ``group`` failed under it (``error``: the kind of
  failure, ``"timeout"`` or ``"peer"``, and torch's text; ``where``: the collective). The
  other ranks of that group waiting for it need not wait for their own timeout: it cannot
  complete (at 4 gloo ranks, only the dead rank's neighbours see its connection close).

The board of a *generation* of process groups (see
:meth:`~meshfuse.runtime.comm.communicator.Communicator.recover`) has its own keys.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

POLL_S = 0.05  # how often a rank waiting for a late collective, or for answers, reads the board
FAILED, BLOCKED, AGREEING, BROKEN = "failed", "blocked", "agreeing", "broken"


@dataclasses.dataclass(frozen=True)
class Notice:
    """What one rank posts about one call; see the module doc.

    Attributes:
        rank: the poster.
        call: the call it is about.
        kind: ``"failed"``, ``"blocked"``, ``"agreeing"`` or ``"broken"``.
        error: for ``failed``, the error raised: (type name, text); for ``broken``, (kind of
            failure, torch's text).
        where: for ``failed``, where in the call: ``"before running"`` or ``"step N"``; for
            ``broken``, the collective.
        claim: for ``agreeing``, the poster's facts (an ``agreement.Claim``).
        group: for ``broken``, the ranks of the collective's group; for ``agreeing``, the
            ranks that agree (empty: the world).
        scope: the ranks whose calls ``call`` counts (sorted).
    """

    rank: int
    call: int
    kind: str
    error: tuple[str, str] | None = None
    where: str = ""
    claim: Any = None
    group: tuple[int, ...] = ()
    scope: tuple[int, ...] = ()


class Board:
    """The notices of one generation, in a store shared by every rank.

    Args:
        store: torch.distributed's rendezvous store (``None``: no board; posts are dropped and
            nothing is ever read, as on one process).
        generation: the generation of process groups it belongs to.
    """

    def __init__(self, store: dist.Store | None, generation: int):
        self._store = store
        self._prefix = f"meshfuse/board/{generation}"
        self._seen = 0  # notices read so far, in posting order
        self.notices: list[Notice] = []

    def post(self, notice: Notice) -> None:
        """Adds ``notice`` for every rank to read; a store that is gone is ignored (the others
        then learn of the failure from their collective's own error)."""
        if self._store is None:
            return
        try:
            index = self._store.add(f"{self._prefix}/count", 1)
            self._store.set(f"{self._prefix}/{index}", pickle.dumps(notice))
        except (RuntimeError, ValueError):
            pass

    def news(self) -> list[Notice]:
        """The notices posted since the last read (this rank's own included), also appended
        to :attr:`notices`; one store round trip when there are none."""
        if self._store is None:
            return []
        try:
            count = self._store.add(f"{self._prefix}/count", 0)
            fresh = []
            while self._seen < count:
                key = f"{self._prefix}/{self._seen + 1}"
                if not self._store.check([key]):  # counted, not yet written: next time
                    break
                fresh.append(pickle.loads(self._store.get(key)))
                self._seen += 1
        except (RuntimeError, ValueError):
            return []
        self.notices.extend(fresh)
        return fresh

    def answers(self, call: int, scope: tuple[int, ...], others: Sequence[int],
                limit_s: float) -> dict[int, Notice]:
        """The ``failed`` or ``blocked`` notice of each of ``others`` about ``call`` of
        ``scope``, waiting up to ``limit_s`` for all of them; the ranks that posted none within
        it are missing (they finished the call without waiting for anyone)."""
        deadline = time.monotonic() + limit_s
        while True:
            self.news()
            found = {n.rank: n for n in self.notices
                     if n.call == call and n.scope == scope and n.kind in (FAILED, BLOCKED)
                     and n.rank in others}
            if len(found) == len(others) or time.monotonic() > deadline or self._store is None:
                return found
            time.sleep(POLL_S)

    def roll_call(self, key: str, rank: int, ranks: Sequence[int],
                  limit_s: float) -> tuple[int, ...] | None:
        """The ranks among ``ranks`` that do not answer a roll call named ``key`` within
        ``limit_s``: each caller writes its rank, then waits for the others'. None when the
        store cannot be reached (it lives in rank 0's process, which may be gone)."""
        if self._store is None:
            return None
        key = f"{self._prefix}/roll_call/{key}"
        try:
            self._store.set(f"{key}/{rank}", b"here")
            missing = [r for r in ranks if r != rank]
            deadline = time.monotonic() + limit_s
            while missing:
                missing = [r for r in missing if not self._store.check([f"{key}/{r}"])]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
            return tuple(missing)
        except (RuntimeError, ValueError):
            return None
