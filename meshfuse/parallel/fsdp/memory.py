"""A rank's memory under fully sharded data parallelism, by kind, counted from the live
tensors (so on CPU ranks too).

- **gathered parameters**: every tensor a layer's gather bucket makes is counted from its
  creation until its storage is freed (:class:`GatheredBytes`, fed by
  :mod:`meshfuse.parallel.fsdp.program`); ``peak`` is the most alive at once;
- **parameters, gradients, optimizer state**: the bytes of this rank's shards, of their
  ``.grad`` and of the tensors the optimizer keeps for them (:func:`memory_account`);
- **activations**: what the caller measured (the residuals a forward saves for its
  backward).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable

import torch


class GatheredBytes:
    """The bytes of gathered parameters alive now (``live``) and at most (``peak``)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._counted: weakref.WeakSet = weakref.WeakSet()

    def add(self, t: torch.Tensor) -> None:
        """Counts ``t``'s storage until it is freed."""
        storage = t.untyped_storage()
        if storage in self._counted:
            return
        self._counted.add(storage)
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, size)

    def reserve(self, size: int):
        """Counts ``size`` bytes (a collective's buffer, not yet a tensor here) until the
        returned callable is called (once)."""
        self.live += size
        self.peak = max(self.peak, self.live)
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                self._release(size)
        return release

    def _release(self, size: int) -> None:
        self.live -= size

    def reset_peak(self) -> None:
        self.peak = self.live


# The account every fully sharded program of this process reports its gathers to.
GATHERED = GatheredBytes()


@dataclasses.dataclass(frozen=True)
class MemoryAccount:
    """Bytes on this rank, by kind (see the module doc)."""

    parameters: int
    gradients: int
    optimizer_state: int
    gathered_peak: int
    activations: int = 0

    @property
    def sharded_state(self) -> int:
        """Parameters, gradients and optimizer state: what FSDP divides by the ranks."""
        return self.parameters + self.gradients + self.optimizer_state

    def describe(self) -> str:
        mib = 1 << 20
        return (f"parameters {self.parameters / mib:.3f} MiB, gradients "
                f"{self.gradients / mib:.3f} MiB, optimizer state "
                f"{self.optimizer_state / mib:.3f} MiB, gathered parameters (peak) "
                f"{self.gathered_peak / mib:.3f} MiB, activations "
                f"{self.activations / mib:.3f} MiB")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(tensors: Iterable) -> int:
    """The bytes of the distinct storages of ``tensors`` (local shards of DTensors)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = _local(t).untyped_storage()
            if storage.data_ptr() not in seen or storage.nbytes() == 0:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def memory_account(parameters: Iterable[torch.Tensor],
                   optimizer: torch.optim.Optimizer | None = None,
                   gathered: GatheredBytes = GATHERED, activations: int = 0) -> MemoryAccount:
    """This rank's account: its parameter shards, their gradients, the optimizer's state
    for them, the peak of gathered parameters, and ``activations``."""
    params = list(parameters)
    state = [] if optimizer is None else [
        v for p in params for v in optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor) and v.dim() > 0]
    return MemoryAccount(nbytes(params), nbytes(p.grad for p in params if p.grad is not None),
                         nbytes(state), gathered.peak, activations)
