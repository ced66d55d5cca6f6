"""``meshfuse.multidevice``: nvFuser's ``nvfuser_direct.multidevice`` names over meshfuse.

Programs written for nvFuser's current frontend (``import nvfuser_direct as nvfuser``) reach
the multi-device API here: ``nvfuser.multidevice.DeviceMesh``, ``nvfuser.multidevice.Communicator``
(with nvFuser's *methods* ``size()``, ``rank()``, ``local_size()``, ``local_rank()`` and
``barrier()``) and ``nvfuser.multidevice.shard_tensor(t, tv)``. ``Sharding`` is what nvFuser's
legacy frontend returned beside each output: a mesh and the axis sharded on each parallel
type.

meshfuse's own :class:`~meshfuse.runtime.comm.communicator.Communicator` has the same information
as properties (``comm.rank``); the class here only adapts the spelling.
"""

from __future__ import annotations

from typing import ClassVar

from meshfuse.frontend.multidevice_executor import (
    CommunicatorBackend,
    MultiDeviceExecutor,
    MultiDeviceExecutorParams,
)
from meshfuse.frontend.outputs import Sharding
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.runtime.comm import communicator as _runtime
from meshfuse.sharding import shard_tensor

__all__ = ["Communicator", "CommunicatorBackend", "DeviceMesh", "MultiDeviceExecutor",
           "MultiDeviceExecutorParams", "Sharding", "shard_tensor"]


class Communicator:
    """This process's rank and world, with nvFuser's method names.

    Example:
        >>> comm = Communicator.instance()
        >>> comm.rank(), comm.size()
        (0, 1)
    """

    _instance: ClassVar[Communicator | None] = None

    def __init__(self, runtime: _runtime.Communicator) -> None:
        self._runtime = runtime

    @classmethod
    def instance(cls) -> Communicator:
        """The communicator of this process (initializes torch.distributed on first use, see
        :meth:`meshfuse.runtime.comm.communicator.Communicator.instance`)."""
        runtime = _runtime.Communicator.instance()
        if cls._instance is None or cls._instance._runtime is not runtime:
            cls._instance = cls(runtime)
        return cls._instance

    def size(self) -> int:
        """The number of processes (the world size)."""
        return self._runtime.size

    def rank(self) -> int:
        """The global rank of this process (nvFuser calls it the device id)."""
        return self._runtime.rank

    def local_size(self) -> int:
        """The number of processes on this host."""
        return self._runtime.local_size

    def local_rank(self) -> int:
        """The rank of this process among those of its host (the index of its GPU)."""
        return self._runtime.local_rank

    def barrier(self) -> None:
        """Blocks until every rank reaches the barrier."""
        self._runtime.barrier()

    @property
    def runtime(self) -> _runtime.Communicator:
        """meshfuse's communicator (process groups, device, backend)."""
        return self._runtime
