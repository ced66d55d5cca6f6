"""``Communicator``: this process's place in the world, and waiting for its collectives.

One process runs per device. The communicator finds its rank from, in order: a default process
group someone already initialized, or the launcher's variables
(:mod:`meshfuse.runtime.comm.launch_env`; one process when there are none), and picks the backend
there (NCCL with CUDA, else gloo).

Every process group meshfuse uses (:mod:`meshfuse.runtime.comm.process_groups`: one per mesh
slice, created on first use) has meshfuse's timeout (:mod:`meshfuse.runtime.faults.failures`): the
default group when meshfuse initializes torch.distributed, else a copy of the world of its
own, so that a group the user owns keeps the user's settings. Every wait for a collective goes
through :meth:`Communicator.wait`, which on gloo also learns of an error raised on one rank only
(:mod:`meshfuse.runtime.faults.lone_failures`). After such an error, :meth:`Communicator.recover`
starts the groups over. At exit, meshfuse waits for the collectives it launched and destroys what it
created, never a group the user owns.

Together with ``process_groups.py`` and ``collectives.py`` beside it (and the rendezvous
store, read by ``board.py``), these are the only modules of meshfuse that call torch.distributed.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import pickle
import time
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch
import torch.distributed as dist

from meshfuse.errors import CommunicationError
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.runtime.comm.launch_env import choose_backend, launch_info_from_env
from meshfuse.runtime.comm.process_groups import ProcessGroups
from meshfuse.runtime.comm.retired_groups import keep_until_timed_out
from meshfuse.runtime.faults.failures import CollectiveFailed, kind_of_failure, timeout_from_env
from meshfuse.runtime.faults.lone_failures import GroupBroken, LoneFailures

_MPI_DEFAULT_ADDR = "127.0.0.1"
_MPI_DEFAULT_PORT = "29500"
# How long a survivor of a failed collective waits for the other survivors to answer the roll
# call: they detect the same failure within about the same time.
ROLL_CALL_S = 3.0


def current_rank() -> int:
    """The torch.distributed rank of this process, or 0 when torch.distributed is not set up.

    Unlike :meth:`Communicator.instance`, this never initializes torch.distributed.
    """
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Communicator:
    """This process's rank, device and process groups; one per process.

    Get it with :meth:`instance`, which initializes torch.distributed on first use (or adopts a
    default process group that is already initialized). Every rank must make the same
    :meth:`group` calls in the same order, as torch's ``new_group`` is collective over the
    world.

    Example:
        >>> comm = Communicator.instance()
        >>> comm.rank, comm.size, comm.backend
        (0, 1, 'gloo')
    """

    _instance: ClassVar[Communicator | None] = None
    _failure: ClassVar[CommunicationError | None] = None
    # Run at exit before the groups are destroyed (the collectives module settles the
    # collectives still in flight); see :meth:`before_shutdown`.
    _before_shutdown: ClassVar[list[Callable[[], None]]] = []

    @classmethod
    def before_shutdown(cls, fn: Callable[[], None]) -> None:
        """Runs ``fn`` at exit, before the process groups meshfuse created are destroyed."""
        cls._before_shutdown.append(fn)

    @classmethod
    def instance(cls) -> Communicator:
        """The communicator of this process, created on first call.

        Raises:
            CommunicationError: if torch.distributed cannot be initialized; later calls raise
                the same error at once rather than wait for the rendezvous again.
        """
        if cls._instance is None:
            if cls._failure is not None:
                raise cls._failure
            try:
                cls._instance = cls()
            except CommunicationError as e:
                cls._failure = e
                raise
        return cls._instance

    def __init__(self) -> None:
        if not dist.is_available():
            raise CommunicationError(
                "torch.distributed is not available in this build of torch; install a torch "
                "built with distributed support"
            )
        self._default_timeout = timeout_from_env()
        self._timeout = self._default_timeout
        self._roll_calls = 0
        # Whether meshfuse initialized the default group (and may use and destroy it).
        self._owns_default = not dist.is_initialized()
        if self._owns_default:
            self._init_default_group()
        else:
            self._adopt_default_group()
        self.process_groups = ProcessGroups(
            self._rank, self._size, self._timedelta(), self.translated,
            world_is_default=self._owns_default and self._backend == "nccl")
        self.lone = LoneFailures(self._rank, self._size, _default_store(),
                                 lambda: min(ROLL_CALL_S, self._timeout))
        atexit.register(self._shutdown)

    def _adopt_default_group(self) -> None:
        self._rank, self._size = dist.get_rank(), dist.get_world_size()
        self._backend = str(dist.get_backend())
        info = launch_info_from_env()
        same = info.launcher != "none" and (info.rank, info.size) == (self._rank, self._size)
        self._local_rank = info.local_rank if same else self._rank
        self._local_size = info.local_size if same else self._size
        if self._backend == "nccl":
            self._local_rank = torch.cuda.current_device()

    def _init_default_group(self) -> None:
        info = launch_info_from_env()
        backend = choose_backend()
        self._rank, self._size = info.rank, info.size
        self._local_rank, self._local_size = info.local_rank, info.local_size
        self._backend = backend
        kwargs = {}
        if backend == "nccl":
            if info.local_rank >= torch.cuda.device_count():
                raise CommunicationError(
                    f"rank {info.rank} has local rank {info.local_rank} but this host has "
                    f"{torch.cuda.device_count()} GPUs; launch at most one process per GPU, "
                    f"e.g. torchrun --nproc-per-node {torch.cuda.device_count()}"
                )
            torch.cuda.set_device(info.local_rank)
            kwargs["device_id"] = torch.device("cuda", info.local_rank)
        try:
            if info.launcher == "none":
                # An in-memory store: a single process needs no port.
                dist.init_process_group(
                    backend, store=dist.HashStore(), rank=0, world_size=1,
                    timeout=self._timedelta(), **kwargs
                )
            else:
                if info.launcher == "mpirun":
                    os.environ.setdefault("MASTER_ADDR", _MPI_DEFAULT_ADDR)
                    os.environ.setdefault("MASTER_PORT", _MPI_DEFAULT_PORT)
                dist.init_process_group(
                    backend, init_method="env://", rank=info.rank, world_size=info.size,
                    timeout=self._timedelta(), **kwargs
                )
        except Exception as e:
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise CommunicationError(
                f"rank {info.rank} of {info.size} ({info.launcher}) could not initialize "
                f"torch.distributed with {backend} at {where}: {e}; check that every rank was "
                f"launched with the same MASTER_ADDR/MASTER_PORT and world size"
            ) from e

    @property
    def rank(self) -> int:
        """The global rank of this process."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of processes (the world size)."""
        return self._size

    @property
    def local_rank(self) -> int:
        """The rank of this process among those of its host; the index of its GPU."""
        return self._local_rank

    @property
    def local_size(self) -> int:
        """The number of processes on this host."""
        return self._local_size

    @property
    def backend(self) -> str:
        """The torch.distributed backend, e.g. ``"nccl"`` or ``"gloo"``."""
        return self._backend

    @property
    def device(self) -> torch.device:
        """The device of this process: its GPU with NCCL, else the CPU."""
        if self._backend == "nccl":
            return torch.device("cuda", self._local_rank)
        return torch.device("cpu")

    @property
    def timeout(self) -> float:
        """The timeout of meshfuse's collectives now, in seconds."""
        return self._timeout

    def set_timeout(self, seconds: float | None) -> None:
        """Makes ``seconds`` (None: ``$MESHFUSE_TIMEOUT`` or its default) the timeout of every
        process group meshfuse uses, now and later. Costs nothing when it does not change."""
        seconds = self._default_timeout if seconds is None else seconds
        if seconds == self._timeout:
            return
        self._timeout = seconds
        self.process_groups.set_timeout(self._timedelta())

    def _timedelta(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self._timeout)

    def barrier(self) -> None:
        """Blocks until every rank of the world reaches the barrier."""
        with self.translated("barrier", range(self._size)):
            dist.barrier(group=self.process_groups.world())

    def group(self, mesh: DeviceMesh, mesh_axis: int | ParallelType) -> dist.ProcessGroup:
        """The process group of the slice of ``mesh`` along ``mesh_axis`` that holds this rank.

        On the first call for a (mesh, axis), every slice of that axis
        (``mesh.all_groups(mesh_axis)``) gets its process group, in a fixed order, and is
        cached; every rank must therefore make the same calls in the same order. A slice that
        is the whole world in rank order is the default (world) group. As torch orders a
        group's ranks by global rank, a slice listed out of that order (``DeviceMesh([1, 0])``)
        has group ranks that differ from its mesh coordinates: use :meth:`allgather` or reorder
        by ``mesh.group_ranks``.

        Args:
            mesh: the device mesh; its ids must be ranks of the world.
            mesh_axis: a mesh axis, or a device parallel type (its mesh axis).

        Raises:
            CommunicationError: if the mesh has a device outside the world, or this rank is not
                in the mesh (after the groups were created, so no other rank hangs).
        """
        group = self.process_groups.of_slice(mesh, mesh_axis)
        if group is None:
            raise CommunicationError(
                f"rank {self._rank} is not in {mesh!r}, so it has no group along mesh axis "
                f"{mesh_axis}; only ranks of the mesh may run its collectives"
            )
        return group

    def group_if_member(
        self, mesh: DeviceMesh, mesh_axis: int | ParallelType
    ) -> dist.ProcessGroup | None:
        """Like :meth:`group`, but a rank outside ``mesh`` gets None (after taking part in
        creating the groups, which every rank must do)."""
        return self.process_groups.of_slice(mesh, mesh_axis)

    def allgather(
        self, tensor: torch.Tensor, mesh: DeviceMesh, mesh_axis: int | ParallelType
    ) -> list[torch.Tensor]:
        """The ``tensor`` of every rank of this rank's slice along ``mesh_axis``, in slice order.

        Every rank of the slice must pass a tensor of the same shape and dtype on
        :attr:`device`.
        """
        if isinstance(mesh_axis, ParallelType):
            mesh_axis = mesh.axis_of(mesh_axis)
        group = self.group(mesh, mesh_axis)
        ranks = mesh.group_ranks(self._rank, mesh_axis)
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in ranks]
        with self.translated(f"allgather over mesh axis {mesh_axis} of {mesh!r}", ranks):
            dist.all_gather(out, tensor, group=group)
        by_rank = dict(zip(sorted(ranks), out))  # torch orders a group by global rank
        return [by_rank[r] for r in ranks]

    def allgather_object(self, obj: object,
                         ranks: tuple[int, ...] | None = None) -> list[object]:
        """The ``obj`` of every rank of ``ranks`` (sorted; default the world), in that order.

        For cross-rank consistency checks of small metadata, over the agreement's group of
        those ranks (:meth:`ProcessGroups.agreement`). Ranks may pass objects of different
        sizes and types. An object that cannot be pickled makes every rank raise, not hang.

        Raises:
            CommunicationError: on every rank, if some rank's object cannot be pickled.
        """
        ranks = self._agreeing_ranks(ranks)
        try:
            payload = (True, pickle.dumps(obj))
        except Exception as e:  # noqa: BLE001 - pickling runs user code; tell every rank
            payload = (False, f"{type(e).__name__}: {e}")
        gathered: list = [None] * len(ranks)
        with self.translated("allgather_object", ranks):
            dist.all_gather_object(gathered, payload,
                                   group=self.process_groups.agreement(ranks))
        bad = [(r, msg) for r, (ok, msg) in zip(ranks, gathered) if not ok]
        if bad:
            detail = "; ".join(f"rank {r}: {msg}" for r, msg in bad)
            raise CommunicationError(
                f"allgather_object: ranks {[r for r, _ in bad]} passed objects that cannot be "
                f"pickled ({detail}); pass picklable values such as tuples of ints and strings"
            )
        return [pickle.loads(data) for _, data in gathered]

    def agreement_allgather(self, tensor: torch.Tensor, late: Callable[[], None] | None = None,
                            ranks: tuple[int, ...] | None = None) -> list[torch.Tensor]:
        """The ``tensor`` (same shape and dtype on each, on the CPU) of every rank of
        ``ranks`` (sorted, this rank among them; default the world), in that order, over a
        gloo group of their own (so that it never pairs with a program's collective on a
        rank out of step; ranks outside ``ranks`` take no part); ``late`` runs once if the
        others are late."""
        ranks = self._agreeing_ranks(ranks)
        out = [torch.empty_like(tensor) for _ in ranks]
        with self.translated("the cross-rank agreement's allgather", ranks):
            work = dist.all_gather(out, tensor.contiguous(),
                                   group=self.process_groups.agreement(ranks), async_op=True)
        self.wait(work, "the cross-rank agreement's allgather", ranks, late, agreeing=True)
        return out

    def _agreeing_ranks(self, ranks: tuple[int, ...] | None) -> tuple[int, ...]:
        ranks = tuple(range(self._size)) if ranks is None else tuple(sorted(ranks))
        if self._rank not in ranks:
            raise CommunicationError(
                f"rank {self._rank} is not among ranks {list(ranks)}, so it cannot take part "
                "in their agreement; only those ranks may call it"
            )
        return ranks

    def wait(self, work: dist.Work, what: str, ranks: tuple[int, ...],
             late: Callable[[], None] | None = None, agreeing: bool = False,
             settling: bool = False, point_to_point: bool = False) -> None:
        """Waits for a collective meshfuse launched (``what`` among ``ranks``). On gloo, while
        it is late, reads what a failing rank told (:meth:`LoneFailures.wait
        <meshfuse.runtime.faults.lone_failures.LoneFailures.wait>`, whose arguments these are); on
        NCCL the host does not wait. ``point_to_point`` sends and receives cannot be waited
        for in slices on gloo (a wait with a time limit that runs out gives the transfer up
        and closes the connection): a thread apart waits for them whole while this one reads
        the board (:meth:`LoneFailures.wait_apart
        <meshfuse.runtime.faults.lone_failures.LoneFailures.wait_apart>`).

        Raises:
            CollectiveFailed: if the collective failed.
            MeshfuseError: the error of another rank that failed without joining it.
        """
        with self.translated(what, ranks):
            if point_to_point and self._size > 1 and self._backend == "gloo":
                self.lone.wait_apart(work, ranks, settling)
            elif self._size == 1 or not hasattr(work, "is_completed") or point_to_point or \
                    (self._backend == "nccl" and not agreeing):
                work.wait()
            else:
                try:
                    self.lone.wait(work, ranks, late, agreeing, settling)
                except GroupBroken as told:
                    raise self.failure(what, ranks, told) from None

    @property
    def generation(self) -> int:
        """How many times :meth:`recover` started the process groups over."""
        return self.lone.generation

    def recover(self) -> None:
        """Starts meshfuse's process groups over, on every rank (each must call it), after a
        failure left the ranks out of step (see ``docs/reliability.md``): the collectives
        still pending are dropped, the groups meshfuse created are destroyed (never the
        default group: from now on meshfuse uses a world group of its own), and fusions build
        their programs again on their next call.

        Raises:
            CommunicationError: if the other ranks do not call it within the timeout.
        """
        for fn in Communicator._before_shutdown:  # drops what cannot complete any more
            fn()
        self._meet(f"meshfuse/recover/{self.lone.generation}")
        self._align_group_names(f"meshfuse/recover/{self.lone.generation}/groups")
        retired = self.process_groups.retire()
        keep_until_timed_out(retired, self._timeout + ROLL_CALL_S)
        self.lone.restart(self.lone.generation + 1)

    def _align_group_names(self, key: str) -> None:
        """Makes every rank name its next process group alike: torch names a new group by
        how many this process created, so a group one rank created alone (a failure between
        two creations, or a bug) pairs every later creation wrongly, and it hangs. The ranks
        (all in :meth:`recover`) take the largest count, through the rendezvous store."""
        store = _default_store()
        if store is None:
            return
        world = dist.distributed_c10d._world
        store.set(f"{key}/{self._rank}", str(world.group_count))
        counts = [int(store.get(f"{key}/{r}")) for r in range(self._size)]
        world.group_count = max(counts)

    def _meet(self, key: str) -> None:
        """Waits (through the rendezvous store, no process group) until every rank of the
        world got here."""
        store = _default_store()
        if store is None:
            return
        store.add(key, 1)
        deadline = time.monotonic() + self._timeout
        while int(store.add(key, 0)) < self._size:
            if time.monotonic() > deadline:
                raise CommunicationError(
                    f"rank {self._rank}: recover() waited {self._timeout:g} s for the other "
                    "ranks; every rank must call it"
                )
            time.sleep(0.01)

    @contextlib.contextmanager
    def translated(self, what: str, ranks) -> Iterator[None]:
        """Turns a failure of the torch.distributed calls of the block into a
        :class:`~meshfuse.runtime.faults.failures.CollectiveFailed` naming ``what`` and
        ``ranks``."""
        try:
            yield
        except CommunicationError:
            raise
        except (RuntimeError, ValueError) as e:  # torch's DistError family, and gloo's
            raise self.failure(what, tuple(ranks), e) from e

    def failure(self, what: str, ranks: tuple[int, ...], error: BaseException) -> CollectiveFailed:
        """The error of a failed collective (``what`` among ``ranks``): ``error`` is torch's
        (this rank then tells the group's other ranks, who may still be waiting), or the
        :class:`~meshfuse.runtime.faults.lone_failures.GroupBroken` of another rank that told first.
        A roll call then tells which of ``ranks`` are missing."""
        if isinstance(error, GroupBroken):
            kind, text = error.notice.error
            cause = f"rank {error.notice.rank} saw it fail first: {text}"
        else:
            kind, cause = kind_of_failure(str(error)), str(error)
            self.lone.tell_broken(what, ranks, kind, cause)
        absent = self.absent_ranks(ranks)
        timed_out = self.lone.reported_timeout(ranks) if kind == "peer" else None
        if timed_out is not None:  # the peer closed its connection when it timed out
            kind, cause = "timeout", f"rank {timed_out.rank} timed out first: {timed_out.error[1]}"
        return CollectiveFailed(what, tuple(ranks), self._rank, kind, absent, self._timeout,
                                cause)

    def absent_ranks(self, ranks: tuple[int, ...]) -> tuple[int, ...] | None:
        """The ranks among ``ranks`` that do not answer a roll call within a few seconds.

        Called by every survivor of a failed collective: each writes its rank under the
        failure's key into the rendezvous store and waits for the others' (at most
        :data:`ROLL_CALL_S`, or the timeout if shorter). A rank that exited, crashed or is stuck
        elsewhere does not answer. None when the store cannot be reached (it lives in rank 0's
        process, which may be the one that went away).
        """
        self._roll_calls += 1
        return self.lone.board.roll_call(str(self._roll_calls), self._rank, ranks,
                                         min(ROLL_CALL_S, self._timeout))

    def _shutdown(self) -> None:
        """At exit: waits for the collectives meshfuse launched, then destroys the groups it
        created (all of them with the default group, when meshfuse created that)."""
        for fn in Communicator._before_shutdown:
            fn()
        if dist.is_initialized():  # else the user destroyed every group already
            if self._owns_default:
                dist.destroy_process_group()
            else:
                for group in self.process_groups.own():
                    dist.destroy_process_group(group)
        # Free the groups now, while torch's threads still run normally, rather than in the
        # interpreter's last garbage collection (where tearing down gloo can block).
        self.process_groups.by_ranks.clear()
        gc.collect()


def _default_store() -> dist.Store | None:
    """torch.distributed's rendezvous store, or None (one process, or none reachable)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
