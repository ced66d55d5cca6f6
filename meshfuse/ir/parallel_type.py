"""``ParallelType``: how a loop IterDomain is executed."""

import enum


class ParallelType(enum.Enum):
    """How a loop IterDomain runs: serially, or spread over one axis of the device mesh.

    ``mesh_x`` is the *last* axis of the device mesh, ``mesh_y`` the second to last and
    ``mesh_z`` the third to last. ``DIDx``/``DIDy``/``DIDz`` are nvFuser's names for them.
    ``Stream`` (nvFuser's ``stream``) runs a loop axis as a host loop over chunks, each on
    its own CUDA stream (see ``docs/overlap.md``).
    """

    Serial = "S"
    mesh_x = "DIDx"
    mesh_y = "DIDy"
    mesh_z = "DIDz"
    Stream = "Stream"

    # nvFuser's names, as aliases of the same members.
    DIDx = "DIDx"  # noqa: PIE796 (an alias of mesh_x)
    DIDy = "DIDy"  # noqa: PIE796
    DIDz = "DIDz"  # noqa: PIE796
    stream = "Stream"  # noqa: PIE796 (nvFuser's name of Stream)

    @property
    def is_device(self) -> bool:
        """True for the device parallel types (``mesh_x``, ``mesh_y``, ``mesh_z``)."""
        return self in DEVICE_PARALLEL_TYPES

    def mesh_axis(self, mesh_ndim: int) -> int:
        """The axis of an ``mesh_ndim``-D mesh this device parallel type runs over.

        Raises:
            ValueError: for a non-device type, or a mesh with too few axes.
        """
        if not self.is_device:
            raise ValueError(f"{self.value} is not a device parallel type")
        back = DEVICE_PARALLEL_TYPES.index(self) + 1
        if back > mesh_ndim:
            raise ValueError(f"{self.value} needs a mesh of at least {back} axes; it has {mesh_ndim}")
        return mesh_ndim - back


DEVICE_PARALLEL_TYPES = (ParallelType.mesh_x, ParallelType.mesh_y, ParallelType.mesh_z)


def device_parallel_type(mesh_axis: int, mesh_ndim: int) -> ParallelType:
    """The device parallel type that runs over ``mesh_axis`` of a ``mesh_ndim``-D mesh
    (``mesh_x`` the last axis, ``mesh_y`` the one before, ``mesh_z`` the one before that)."""
    return DEVICE_PARALLEL_TYPES[mesh_ndim - 1 - mesh_axis]
