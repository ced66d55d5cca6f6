"""Where this process sits among the processes a launcher started, and which backend it uses.

The rank comes from torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``), else Open MPI's (``OMPI_COMM_WORLD_*``), else the process is the only
one (rank 0 of 1). The backend is NCCL (one GPU per process) when CUDA is available and gloo
otherwise; ``MESHFUSE_BACKEND`` overrides the choice.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from meshfuse.errors import CommunicationError

BACKEND_ENV = "MESHFUSE_BACKEND"


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
