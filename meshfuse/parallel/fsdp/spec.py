"""What fully sharded data parallelism is asked to do: a mesh with named dimensions, the
mixed-precision policy, and the options, as small immutable values.

A :class:`NamedMesh` is a :class:`~meshfuse.ir.mesh.DeviceMesh` whose axes have names
(``dp``, ``tp``, ``cp``...), as torch's ``init_device_mesh(..., mesh_dim_names=...)`` gives
them; a schedule names a dimension and gets its mesh axis and device parallel type.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from meshfuse.errors import ScheduleError
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType, device_parallel_type


@dataclasses.dataclass(frozen=True)
class NamedMesh:
    """A device mesh whose axes have names.

    Example:
        >>> mesh = NamedMesh(DeviceMesh(torch.arange(4).reshape(2, 2)), ("dp", "tp"))
        >>> mesh.axis("tp"), mesh.parallel_type("dp")
        (1, <ParallelType.mesh_y: 'DIDy'>)
    """

    mesh: DeviceMesh
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.names) != self.mesh.ndim or len(set(self.names)) != len(self.names):
            raise ScheduleError(
                f"a mesh of shape {list(self.mesh.shape)} needs {self.mesh.ndim} distinct "
                f"dimension names, got {list(self.names)}")

    @classmethod
    def of(cls, mesh, names: Sequence[str] | None = None) -> NamedMesh:
        """``mesh`` as a NamedMesh: a NamedMesh, a meshfuse ``DeviceMesh`` with ``names``, or
        a torch ``DeviceMesh`` with ``mesh_dim_names``."""
        if isinstance(mesh, NamedMesh):
            return mesh
        if isinstance(mesh, DeviceMesh):
            if names is None:
                raise ScheduleError("a meshfuse DeviceMesh has no dimension names: pass "
                                    "names=('dp', ...), one per mesh axis")
            return cls(mesh, tuple(names))
        dims = getattr(mesh, "mesh_dim_names", None) if names is None else names
        if dims is None:
            raise ScheduleError("the torch DeviceMesh has no mesh_dim_names: create it with "
                                "init_device_mesh(..., mesh_dim_names=('dp', ...))")
        return cls(DeviceMesh(mesh.mesh), tuple(dims))

    @classmethod
    def parse(cls, text: str, world_size: int) -> NamedMesh:
        """A mesh over ranks ``0..world_size-1`` from ``"dp=2,tp=2"`` (outermost first).

        Raises:
            ScheduleError: a malformed text, or sizes whose product is not ``world_size``.
        """
        sizes: dict[str, int] = {}
        for part in filter(None, text.replace(" ", "").split(",")):
            name, _, size = part.partition("=")
            if not name or not size.isdigit() or int(size) < 1 or name in sizes:
                raise ScheduleError(f"bad mesh {text!r}: write NAME=SIZE pairs such as "
                                    "dp=2,tp=2, each name once, sizes positive")
            sizes[name] = int(size)
        if not sizes:
            raise ScheduleError(f"bad mesh {text!r}: write NAME=SIZE pairs such as dp=2,tp=2")
        if math.prod(sizes.values()) != world_size:
            raise ScheduleError(
                f"mesh {text!r} has {math.prod(sizes.values())} devices but there are "
                f"{world_size} ranks; make the sizes multiply to {world_size}")
        ids = torch.arange(world_size).reshape(tuple(sizes.values()))
        return cls(DeviceMesh(ids), tuple(sizes))

    def axis(self, name: str) -> int:
        """The mesh axis named ``name``."""
        if name not in self.names:
            raise ScheduleError(f"the mesh has no dimension {name!r}; its dimensions are "
                                f"{list(self.names)}")
        return self.names.index(name)

    def size(self, name: str) -> int:
        return self.mesh.shape[self.axis(name)]

    def parallel_type(self, name: str) -> ParallelType:
        """The device parallel type that runs over dimension ``name``."""
        return device_parallel_type(self.axis(name), self.mesh.ndim)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Which dtypes parameters are gathered and computed in, and gradients reduced in (as
    FSDP2's ``MixedPrecisionPolicy``); None keeps the parameter's own dtype.

    ``param_dtype``: parameters are cast to it before their gather (the gather moves half
    the bytes in bf16) and the layer computes in it (its floating inputs are cast too).
    ``reduce_dtype``: the gradients' reduce-scatter (and allreduce across replicas) runs in
    it; the result is cast to the parameter's dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclasses.dataclass(frozen=True)
class FsdpOptions:
    """The options of :func:`~meshfuse.parallel.fsdp.transform.shard_fusion`.

    Attributes:
        shard: the mesh dimension parameters are sharded over and the batch is split over.
        replicate: for HSDP, a mesh dimension the parameters are replicated over and the
            batch split over (their gradients are allreduced across it); None for FSDP.
        reshard_after_forward: drop each layer's gathered parameters after their last use in
            the forward and gather them again in the backward (True), or keep them for the
            backward (False).
        mp_policy: the mixed-precision policy.
    """

    shard: str = "dp"
    replicate: str | None = None
    reshard_after_forward: bool = True
    mp_policy: MixedPrecision = MixedPrecision()

    @property
    def remat(self) -> str:
        """The derived backward's rematerialization policy these options ask for."""
        return "recompute_gathers" if self.reshard_after_forward else "recompute_fused"
