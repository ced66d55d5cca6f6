"""``Communicator``: this process's place in the world, and the process groups of mesh slices.

One process runs per device. The communicator finds its rank from, in order: a default process
group someone already initialized, torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), Open MPI's (``OMPI_COMM_WORLD_*``), or else it is the only
process (rank 0 of 1). The backend is NCCL (one GPU per process) when CUDA is available and gloo
otherwise; the environment variable ``MESHFUSE_BACKEND`` overrides the choice.

Together with ``collectives.py`` beside it, this is the only module of meshfuse that calls
torch.distributed.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
from collections.abc import Mapping
from typing import ClassVar

import torch
import torch.distributed as dist

from meshfuse.errors import CommunicationError
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.mesh import DeviceMesh

BACKEND_ENV = "MESHFUSE_BACKEND"
_MPI_DEFAULT_ADDR = "127.0.0.1"
_MPI_DEFAULT_PORT = "29500"


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """Where a process sits among the processes a launcher started.

    Attributes:
        rank: the global rank, in ``[0, size)``.
        size: the number of processes (the world size).
        local_rank: the rank among the processes of this host; it picks the GPU.
        local_size: the number of processes on this host.
        launcher: ``"torchrun"``, ``"mpirun"`` or ``"none"`` (a single process).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str


def launch_info_from_env(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Reads the launcher's variables from ``env`` (default ``os.environ``).

    torchrun's ``RANK``/``WORLD_SIZE`` win over Open MPI's ``OMPI_COMM_WORLD_RANK``/``_SIZE``;
    without either, the process is rank 0 of 1. A missing local rank/size defaults to the global
    one (a single host).

    Raises:
        CommunicationError: if only one of rank/size is set, a value is not an integer, or the
            values are inconsistent (e.g. rank >= size).

    Example:
        >>> launch_info_from_env({"RANK": "1", "WORLD_SIZE": "2"})
        LaunchInfo(rank=1, size=2, local_rank=1, local_size=2, launcher='torchrun')
    """
    env = os.environ if env is None else env
    for launcher, prefix, rank_var, size_var, local_rank_var, local_size_var in (
        ("torchrun", "", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        ("mpirun", "OMPI_COMM_WORLD_", "RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE"),
    ):
        names = [prefix + v for v in (rank_var, size_var, local_rank_var, local_size_var)]
        if names[0] not in env and names[1] not in env:
            continue
        for name in names[:2]:
            if name not in env:
                other = names[1] if name == names[0] else names[0]
                raise CommunicationError(
                    f"{other} is set but {name} is not; launch with {launcher}, which sets both, "
                    f"or set both"
                )
        rank, size = _int_var(env, names[0]), _int_var(env, names[1])
        local_rank = _int_var(env, names[2]) if names[2] in env else rank
        local_size = _int_var(env, names[3]) if names[3] in env else size
        if not (0 <= rank < size and 0 <= local_rank < local_size <= size):
            raise CommunicationError(
                f"inconsistent {launcher} variables: {names[0]}={rank}, {names[1]}={size}, "
                f"{names[2]}={local_rank}, {names[3]}={local_size}; need 0 <= rank < size and "
                f"0 <= local rank < local size <= size"
            )
        return LaunchInfo(rank, size, local_rank, local_size, launcher)
    return LaunchInfo(0, 1, 0, 1, "none")


def _int_var(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise CommunicationError(
            f"{name}={env[name]!r} is not an integer; unset it or let the launcher set it"
        ) from None


def choose_backend(env: Mapping[str, str] | None = None, cuda_available: bool | None = None) -> str:
    """The torch.distributed backend: ``$MESHFUSE_BACKEND``, else NCCL with CUDA, else gloo.

    Raises:
        CommunicationError: if ``MESHFUSE_BACKEND`` names an unknown backend, or NCCL without CUDA.
    """
    env = os.environ if env is None else env
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    backend = env.get(BACKEND_ENV, "").strip().lower()
    if not backend:
        return "nccl" if cuda_available else "gloo"
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    if backend not in known:
        raise CommunicationError(f"{BACKEND_ENV}={backend!r} is not a backend; use one of {known}")
    if backend == "nccl" and not cuda_available:
        raise CommunicationError(
            f"{BACKEND_ENV}=nccl but CUDA is not available; unset {BACKEND_ENV} or set it to gloo"
        )
    return backend


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
        # Process groups by their ranks, and the (mesh, axis) slicings already created.
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._slicings: set[tuple[DeviceMesh, int]] = set()
        if dist.is_initialized():
            self._adopt_default_group()
        else:
            self._init_default_group()

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
                    backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs
                )
            else:
                if info.launcher == "mpirun":
                    os.environ.setdefault("MASTER_ADDR", _MPI_DEFAULT_ADDR)
                    os.environ.setdefault("MASTER_PORT", _MPI_DEFAULT_PORT)
                dist.init_process_group(
                    backend, init_method="env://", rank=info.rank, world_size=info.size, **kwargs
                )
        except Exception as e:
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise CommunicationError(
                f"rank {info.rank} of {info.size} ({info.launcher}) could not initialize "
                f"torch.distributed with {backend} at {where}: {e}; check that every rank was "
                f"launched with the same MASTER_ADDR/MASTER_PORT and world size"
            ) from e
        atexit.register(_destroy_default_group)

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

    def barrier(self) -> None:
        """Blocks until every rank of the world reaches the barrier."""
        dist.barrier()

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
        key = self._ensure_groups(mesh, mesh_axis)
        if self._rank not in mesh:
            raise CommunicationError(
                f"rank {self._rank} is not in {mesh!r}, so it has no group along mesh axis "
                f"{mesh_axis}; only ranks of the mesh may run its collectives"
            )
        return self._groups[mesh.group_ranks(self._rank, key[1])]

    def _ensure_groups(self, mesh: DeviceMesh, mesh_axis: int | ParallelType) -> tuple:
        """Creates (once) the process groups of every slice of ``mesh`` along ``mesh_axis``."""
        if isinstance(mesh_axis, ParallelType):
            mesh_axis = mesh.axis_of(mesh_axis)
        key = (mesh, mesh_axis % mesh.ndim)
        if key not in self._slicings:
            self._check_mesh(mesh)
            for ranks in mesh.all_groups(key[1]):
                if ranks not in self._groups:
                    self._groups[ranks] = self._new_group(ranks)
            self._slicings.add(key)
        return key

    def group_if_member(
        self, mesh: DeviceMesh, mesh_axis: int | ParallelType
    ) -> dist.ProcessGroup | None:
        """Like :meth:`group`, but a rank outside ``mesh`` gets None (after taking part in
        creating the groups, which every rank must do)."""
        key = self._ensure_groups(mesh, mesh_axis)
        if self._rank not in mesh:
            return None
        return self._groups[mesh.group_ranks(self._rank, key[1])]

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
        dist.all_gather(out, tensor, group=group)
        by_rank = dict(zip(sorted(ranks), out))  # torch orders a group by global rank
        return [by_rank[r] for r in ranks]

    def allgather_object(self, obj: object) -> list[object]:
        """The ``obj`` of every rank of the world, indexed by rank.

        For cross-rank consistency checks of small metadata. Ranks may pass objects of different
        sizes and types. An object that cannot be pickled makes every rank raise, not hang.

        Raises:
            CommunicationError: on every rank, if some rank's object cannot be pickled.
        """
        try:
            payload = (True, pickle.dumps(obj))
        except Exception as e:  # noqa: BLE001 - pickling runs user code; tell every rank
            payload = (False, f"{type(e).__name__}: {e}")
        gathered: list = [None] * self._size
        dist.all_gather_object(gathered, payload)
        bad = [(r, msg) for r, (ok, msg) in enumerate(gathered) if not ok]
        if bad:
            detail = "; ".join(f"rank {r}: {msg}" for r, msg in bad)
            raise CommunicationError(
                f"allgather_object: ranks {[r for r, _ in bad]} passed objects that cannot be "
                f"pickled ({detail}); pass picklable values such as tuples of ints and strings"
            )
        return [pickle.loads(data) for _, data in gathered]

    def _check_mesh(self, mesh: DeviceMesh) -> None:
        outside = [d for d in mesh.device_ids if d >= self._size]
        if outside:
            raise CommunicationError(
                f"{mesh!r} has device {outside[0]} but the world has {self._size} processes; "
                f"use devices below {self._size} or launch {max(mesh.device_ids) + 1} processes"
            )

    def _new_group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        if ranks == tuple(range(self._size)):
            return dist.group.WORLD
        return dist.new_group(list(ranks))


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
