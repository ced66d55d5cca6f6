"""nvFuser's ``MultiDeviceExecutor`` API: a fusion run directly, with executor parameters.

``MultiDeviceExecutor(fd.fusion, params).run(inputs)`` is the same path as
``fd.execute(inputs)`` (one compiled fusion, one per-rank program per input signature) with
nvFuser's parameters:

- ``backend_type``: a :class:`CommunicatorBackend`. ``nccl`` is torch.distributed's process
  group (NCCL on GPUs, gloo on CPUs). ``cuda`` moves the blocks of stream loops' decomposed
  allgathers and reduce-scatters with the GPUs' copy engines through symmetric memory
  (:mod:`meshfuse.runtime.comm.copy_engine`); where that cannot run (a CPU, a torch without
  symmetric memory) and for every other communication, the process group: the results are
  the same (see ``docs/overlap.md``). ``ucc`` is refused.
- ``offset_stream_indexing_by_rank``: stream-parallel loops that gather their stream axis
  visit the blocks in ring order (chunk ``i`` on the device at coordinate ``c`` works on
  block ``(i + c) mod d``), with point-to-point transfers instead of broadcasts.
- ``use_allocation_cache``: accepted; PyTorch's caching allocator already reuses buffers.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import torch

from meshfuse.engine.runner import FusionRunner
from meshfuse.errors import InputError
from meshfuse.ir.fusion import Fusion


class CommunicatorBackend(enum.Enum):
    """The transport of communications (nvFuser's ``CommunicatorBackend``)."""

    nccl = "nccl"
    ucc = "ucc"
    cuda = "cuda"


@dataclasses.dataclass
class MultiDeviceExecutorParams:
    """Parameters of a :class:`MultiDeviceExecutor` (nvFuser's names and defaults)."""

    backend_type: CommunicatorBackend = CommunicatorBackend.nccl
    use_allocation_cache: bool = False
    offset_stream_indexing_by_rank: bool = False


class MultiDeviceExecutor:
    """Runs ``fusion`` on this rank's shards of its inputs.

    Example:
        >>> params = MultiDeviceExecutorParams()
        >>> params.offset_stream_indexing_by_rank = True
        >>> outputs = MultiDeviceExecutor(fd.fusion, params).run(local_inputs)
    """

    def __init__(self, fusion: Fusion, params: MultiDeviceExecutorParams | None = None):
        params = params or MultiDeviceExecutorParams()
        if not isinstance(params.backend_type, CommunicatorBackend) or \
                params.backend_type is CommunicatorBackend.ucc:
            raise InputError(
                f"MultiDeviceExecutor: backend_type {params.backend_type!r} is not available; "
                "use CommunicatorBackend.nccl or CommunicatorBackend.cuda")
        self.params = params
        self._runner = FusionRunner(fusion)
        self._runner.ring_order = params.offset_stream_indexing_by_rank
        self._runner.loop_transport = "copy_engine" \
            if params.backend_type is CommunicatorBackend.cuda else "process_group"

    def run(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        """This rank's outputs for this rank's ``inputs`` (local shards)."""
        return self._runner.execute(list(inputs))

    def explain(self, inputs: Sequence[Any] | None = None) -> str:
        """What ``fd.explain`` prints: shardings, communications and stream loops."""
        return self._runner.explain(inputs)

    def __str__(self) -> str:
        return self.explain()
