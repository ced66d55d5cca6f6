"""What a failed collective means to the user: the timeout, and the error every survivor raises.

meshfuse bounds every wait on another rank by one timeout: ``execute(..., timeout=seconds)``,
else ``$MESHFUSE_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S` (5 minutes; torch's own defaults
are 10 minutes for NCCL and 30 for gloo). The communicator gives it to torch.distributed as
the timeout of every process group it creates; torch enforces it (gloo fails the collective,
NCCL's watchdog aborts it).

When torch reports a collective as failed (timed out, or a peer's connection closed or reset
because its process exited), meshfuse raises a :class:`CollectiveFailed`, a
:class:`~meshfuse.errors.CommunicationError` that says which collective (the program step,
e.g. ``T7 = reshard(T5, [P] -> [R]): allreduce(sum) over mesh axis 0``), among which ranks,
what happened, and which ranks did not answer a roll call taken right after the failure (see
:meth:`~meshfuse.runtime.comm.communicator.Communicator.absent_ranks`): the dead or stuck ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from meshfuse import errors
from meshfuse.errors import CommunicationError, ExecutionError, InputError, MeshfuseError

TIMEOUT_ENV = "MESHFUSE_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0

# Fragments of the messages torch (gloo, NCCL, the TCP store) gives for each kind of failure.
_TIMED_OUT = ("timed out", "timeout", "watchdog caught collective operation timeout")
_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "read error",
    "write error",
    "failed to recv",
    "remote process exited",
    "ncclremoteerror",
    "communicator was aborted",
)


def timeout_from_env(env: Mapping[str, str] | None = None) -> float:
    """``$MESHFUSE_TIMEOUT`` in seconds, or :data:`DEFAULT_TIMEOUT_S` when it is unset.

    Raises:
        CommunicationError: if it is set to something other than a positive number.
    """
    env = os.environ if env is None else env
    text = env.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise CommunicationError(
            f"{TIMEOUT_ENV}={text!r} is not a positive number of seconds; set it to e.g. 300 "
            "or unset it"
        )
    return seconds


def checked_timeout(seconds: object) -> float:
    """``execute(..., timeout=seconds)``'s value, checked.

    Raises:
        InputError: if it is not a positive number.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise InputError(
            f"execute(timeout={seconds!r}): the timeout is a positive number of seconds "
            f"(or None for ${TIMEOUT_ENV}, default {DEFAULT_TIMEOUT_S:g})"
        )
    return float(seconds)


def kind_of_failure(message: str) -> str:
    """``"timeout"``, ``"peer"`` (a peer's connection went away) or ``"other"``."""
    text = message.lower()
    if any(f in text for f in _PEER_GONE):
        return "peer"
    if any(f in text for f in _TIMED_OUT):
        return "timeout"
    return "other"


class CollectiveFailed(CommunicationError):
    """A collective did not complete: it timed out, or a rank of its group went away.

    Attributes:
        what: the collective, e.g. ``"allreduce(sum) over mesh axis 0"``; once the program
            step is known, the step (``"step 3 (T7 = reshard(T5, [P] -> [R]): allreduce(sum) ...)"``).
        ranks: the ranks of its group.
        rank: the rank that raises.
        failure: ``"timeout"``, ``"peer"`` or ``"other"``.
        absent: the ranks of the group that did not answer the roll call after the failure
            (dead, or stuck elsewhere); None when it could not be taken.
        timeout_s: the timeout in force.
        cause: torch's message.
    """

    def __init__(self, what: str, ranks: Sequence[int], rank: int, failure: str,
                 absent: Sequence[int] | None, timeout_s: float, cause: str):
        self.what, self.ranks, self.rank = what, tuple(ranks), rank
        self.failure, self.timeout_s, self.cause = failure, timeout_s, cause
        self.absent = None if absent is None else tuple(absent)
        super().__init__(self._message())

    def at_step(self, step: str) -> CollectiveFailed:
        """The same failure, naming the program ``step`` that ran the collective."""
        return CollectiveFailed(step, self.ranks, self.rank, self.failure, self.absent,
                                self.timeout_s, self.cause)

    def _message(self) -> str:
        head = f"rank {self.rank}: {self.what} among ranks {list(self.ranks)}"
        absent = self._absent_text()
        if self.failure == "timeout":
            return (
                f"{head} timed out after {self.timeout_s:g} s; {absent}. A rank that is only "
                f"slow needs a longer timeout: execute(..., timeout=seconds) or "
                f"${TIMEOUT_ENV}. torch: {_short(self.cause)}"
            )
        if self.failure == "peer":
            return (
                f"{head} failed: a peer closed its connection; {absent}. Its own output says "
                f"why it stopped. torch: {_short(self.cause)}"
            )
        return f"{head} failed; {absent}. torch: {_short(self.cause)}"

    def _absent_text(self) -> str:
        if self.absent is None:
            return "which rank is missing could not be told (the rendezvous store is gone too)"
        if not self.absent:
            return ("every rank of the group answered a roll call afterwards: one was late, "
                    "or ran another collective (do all ranks run the same program?)")
        names = ", ".join(str(r) for r in self.absent)
        verb = "was" if len(self.absent) == 1 else "were"
        return (f"rank{'s' if len(self.absent) > 1 else ''} {names} {verb} not there (exited, "
                f"crashed, or stuck elsewhere)")


def _short(message: str, limit: int = 300) -> str:
    """torch's message on one line, without the C++ source location and the advice."""
    text = " ".join(message.split())
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text if len(text) <= limit else text[:limit] + "..."


# ----- an error raised on one rank, told to the others ---------------------------------------

_SHARED = "_meshfuse_every_rank"  # set on an error every rank raises alike (see shared())


def shared(error: BaseException) -> BaseException:
    """Marks ``error`` as raised on every rank alike (by the cross-rank agreement): nothing
    more to tell the others. Returns it."""
    setattr(error, _SHARED, True)
    return error


def is_shared(error: BaseException) -> bool:
    """Whether every rank raises ``error`` (or its own copy of it) without being told: marked
    :func:`shared`, or a communication error (every rank of a failed collective sees it)."""
    return getattr(error, _SHARED, False) or isinstance(error, CommunicationError)


def remote_error(rank: int, name: str, text: str, also: Sequence[int] = ()) -> MeshfuseError:
    """The error ``rank`` raised (type ``name``, message ``text``), to raise on another rank:
    the same meshfuse error type, its message prefixed with the rank (and ``also``, other
    ranks that failed too); an error of another type is an ExecutionError naming it. The
    result is marked :func:`shared` and has ``failed_rank``."""
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, MeshfuseError)) or \
            cls.__init__ is not Exception.__init__:
        cls, text = ExecutionError, f"{name}: {text}"
    more = f" (and {'ranks' if len(also) > 1 else 'rank'} {', '.join(map(str, also))})" \
        if also else ""
    own = f"rank {rank}, "
    text = text[len(own):] if text.startswith(own) and not more else text
    error = cls(f"rank {rank}{more}: {text}")
    error.failed_rank = rank
    return shared(error)


class OutOfStep(CommunicationError):
    """Raised while this rank waits in a collective of a cached program, when another rank is
    waiting in the cross-rank agreement of the same call: their inputs differ (a new signature
    there, a cached one here). The runner turns it into the InputError naming the difference.

    Attributes:
        notice: the other rank's ``agreeing`` notice
        (:class:`~meshfuse.runtime.faults.board.Notice`), with its claim.
    """

    def __init__(self, notice):
        self.notice = notice
        super().__init__(
            f"rank {notice.rank} is checking a new input signature (call {notice.call}) while "
            "this rank runs the program of a signature it has seen: the ranks passed inputs of "
            "different shapes"
        )
