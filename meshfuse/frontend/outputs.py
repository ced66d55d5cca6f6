"""``DistributedTensor``: what ``execute`` returns for each output.

It *is* this rank's local ``torch.Tensor`` (a zero-copy subclass view, so nvFuser's current
frontend's programs, which expect plain tensors, run unchanged), and it also answers nvFuser's
legacy ``DistributedTensor`` API: ``out.local`` (the plain local tensor), ``out.mesh`` and
``out.axis_sharded_on(parallel_type)`` (the output axis sharded on that parallel type, -1 if
none). Operations on it return plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType, device_parallel_type
from meshfuse.ir.placement import Shard, placements
from meshfuse.ir.tensor_view import TensorView


class Sharding:
    """How a fusion output lies on its mesh: nvFuser's ``Sharding`` (legacy frontend).

    ``axis_sharded_on(pt)`` is the output axis sharded on parallel type ``pt``, or -1 where
    the output is replicated (or partial) along that mesh axis.
    """

    def __init__(self, tv: TensorView) -> None:
        self.mesh: DeviceMesh | None = tv.mesh
        self._axes: dict[ParallelType, int] = {}
        if tv.mesh is None:
            return
        for mesh_axis, placement in enumerate(placements(tv)):
            if isinstance(placement, Shard):
                pt = device_parallel_type(mesh_axis, tv.mesh.ndim)
                self._axes[pt] = placement.axis

    def axis_sharded_on(self, parallel_type: ParallelType) -> int:
        return self._axes.get(parallel_type, -1)

    def __repr__(self) -> str:
        shards = ", ".join(f"{pt.value}: axis {a}" for pt, a in sorted(
            self._axes.items(), key=lambda item: item[0].value))
        return f"Sharding(mesh={self.mesh!r}, {shards or 'replicated'})"


class DistributedTensor(torch.Tensor):
    """A fusion output on this rank; see the module doc."""

    # Results of torch operations are plain tensors, not DistributedTensors.
    __torch_function__ = torch._C._disabled_torch_function_impl
    _sharding: Sharding | None = None

    @property
    def local(self) -> torch.Tensor:
        """This rank's part as a plain tensor (the same storage)."""
        return self.as_subclass(torch.Tensor)

    @property
    def mesh(self) -> DeviceMesh | None:
        """The output's device mesh (None for a single-device fusion)."""
        return None if self._sharding is None else self._sharding.mesh

    def axis_sharded_on(self, parallel_type: ParallelType) -> int:
        """The output axis sharded on ``parallel_type``, or -1 if none is."""
        return -1 if self._sharding is None else self._sharding.axis_sharded_on(parallel_type)


def as_distributed(outputs: Sequence[torch.Tensor],
                   shardings: Sequence[Sharding]) -> list[DistributedTensor]:
    """``outputs`` as DistributedTensors sharing their storage."""
    result = []
    for out, sharding in zip(outputs, shardings):
        wrapped = out.as_subclass(DistributedTensor)
        wrapped._sharding = sharding
        result.append(wrapped)
    return result
