"""Where a benchmark runs: this process's rank and device, and the machine it runs on.

One process per device. Under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) each process
takes GPU ``LOCAL_RANK`` and NCCL; a plain ``python -m benchmarks.run`` is rank 0 of 1. Without
CUDA the processes use the CPU and gloo, and timings are wall-clock. The default process group
is initialized here, before meshfuse is used, so that meshfuse's ``Communicator`` adopts it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import CPU_BLAS_ENV_DEFAULTS, NCCL_ENV_DEFAULTS

PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=180)


@dataclasses.dataclass
class Context:
    """This process's place in the run, and helpers that every rank calls alike.

    Attributes:
        rank, world, local_rank: from torchrun, or 0, 1, 0.
        device: ``cuda:<local_rank>`` with CUDA, else the CPU.
        backend: ``"nccl"`` or ``"gloo"``.
        quick: tiny sizes and few iterations (smoke test).
    """

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    quick: bool
    _dtensor_mesh: Any = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        """Waits for this device's queued work (nothing to wait for on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Every rank reaches this point with its device idle."""
        self.sync()
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.local_rank])
        else:
            dist.barrier()
        self.sync()

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, indexed by rank (small picklable values only)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def dtensor_mesh(self):
        """The 1-D torch ``DeviceMesh`` of all ranks, created once."""
        if self._dtensor_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._dtensor_mesh = init_device_mesh(self.device.type, (self.world,))
        return self._dtensor_mesh

    def reset_memory(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_mib(self) -> float | None:
        if not self.cuda:
            return None
        return torch.cuda.max_memory_allocated(self.device) / 2**20

    def allocated_mib(self) -> float | None:
        """The memory of this device's live tensors now."""
        if not self.cuda:
            return None
        return torch.cuda.memory_allocated(self.device) / 2**20

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)


def setup(quick: bool, cpu: bool = False) -> Context:
    """Initializes torch.distributed (NCCL with CUDA, gloo without) and picks the device
    (``cpu``: the CPU and gloo even where CUDA is available)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if torch.cuda.is_available() and not cpu:
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(
                f"rank {rank} has local rank {local_rank} but this host has "
                f"{torch.cuda.device_count()} GPUs; launch one process per GPU"
            )
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    kwargs: dict[str, Any] = {"timeout": PROCESS_GROUP_TIMEOUT}
    if backend == "nccl":
        kwargs["device_id"] = device
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
        else:  # a single process: an in-memory store, no port
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    **kwargs)
    return Context(rank, world, local_rank, device, backend, quick)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _optional(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - environment facts are best effort
        return f"unavailable ({type(e).__name__})"


def _nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _git_commit() -> str:
    """The checkout's commit; ``MESHFUSE_COMMIT`` names it where the tree is a copy without
    git metadata (as on a lent GPU machine)."""
    if os.environ.get("MESHFUSE_COMMIT"):
        return os.environ["MESHFUSE_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, timeout=10, check=True)
    return out.stdout.strip()


def environment(ctx: Context) -> dict[str, Any]:
    """The facts a result needs to be compared with another: hardware and software versions."""
    cuda = torch.cuda.is_available()
    return {
        "gpu_name": torch.cuda.get_device_name(ctx.device) if cuda else None,
        "gpu_count": ctx.world if cuda else 0,
        "gpus_on_host": torch.cuda.device_count() if cuda else 0,
        "world_size": ctx.world,
        "device": str(ctx.device.type),
        "backend": ctx.backend,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": _optional(torch.backends.cudnn.version) if cuda else None,
        "nccl": _optional(_nccl_version),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "meshfuse_commit": _optional(_git_commit),
        "sdpa_backend_env": os.environ.get("MESHFUSE_SDPA_BACKEND", "auto"),
        "nccl_env": {k: os.environ.get(k) for k in NCCL_ENV_DEFAULTS},
        "cpu_blas_env": {k: os.environ.get(k) for k in CPU_BLAS_ENV_DEFAULTS},
    }


def machine_slug(env: dict[str, Any]) -> str:
    """``h200`` for "NVIDIA H200", ``cpu`` without a GPU: the middle of the file names."""
    name = env.get("gpu_name") or "cpu"
    name = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.IGNORECASE).lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"
