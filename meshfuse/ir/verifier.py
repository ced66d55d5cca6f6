"""Checks of a fusion's schedule, run before anything executes (on every rank alike).

Each check raises a typed error that names the tensor and axis and says how to fix it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfuse.errors import ScheduleError, ShardingError
from meshfuse.ir.layout import logical_root
from meshfuse.ir.tensor_view import check_allocation

if TYPE_CHECKING:
    from meshfuse.ir.fusion import Fusion
    from meshfuse.ir.iter_domain import IterDomain
    from meshfuse.ir.parallel_type import ParallelType
    from meshfuse.ir.tensor_view import TensorView


def check_tensor_schedules(fusion: Fusion, world_size: int) -> None:
    """Each tensor's own schedule: device types, factors, mesh, allocation (run before the
    passes, so that errors name what the user wrote)."""
    for tv in fusion.tensors():
        _check_tensor(tv, world_size)


def check_schedule(fusion: Fusion, world_size: int) -> None:
    """Meshes, device parallel types and their factors, across all tensors."""
    check_tensor_schedules(fusion, world_size)
    # 0-d tensors (e.g. attention's RNG seed) are replicated wherever they are used.
    tensors = [tv for tv in fusion.tensors() if tv.logical]
    with_mesh = [tv for tv in tensors if tv.mesh is not None]
    if with_mesh and len(with_mesh) != len(tensors):
        without = [tv.name for tv in tensors if tv.mesh is None]
        raise ShardingError(
            f"{with_mesh[0].name} has a device mesh but {', '.join(without)} "
            f"{'has' if len(without) == 1 else 'have'} none; give every tensor a mesh "
            "(set_device_mesh) or none"
        )


def _check_tensor(tv: TensorView, world_size: int) -> None:
    for id_, pt in tv.parallel.items():
        if pt.is_device:
            _check_device_id(tv, id_, pt)
    if tv.mesh is not None:
        too_big = [d for d in tv.mesh.device_ids if d >= world_size]
        if too_big:
            raise ScheduleError(
                f"the mesh of {tv.name}, {tv.mesh!r}, has device {too_big[0]} but the world has "
                f"{world_size} processes; use a mesh of devices 0..{world_size - 1} or launch "
                "more processes"
            )
    if tv.allocation is not None:
        check_allocation(tv)


def _check_device_id(tv: TensorView, id_: IterDomain, pt: ParallelType) -> None:
    """Loop ID ``id_`` of ``tv``, parallelized on device type ``pt``, can be sharded: it is
    in the loop domain, on a mesh axis of its extent, and comes from one logical axis."""
    if id_ not in tv.loop:
        raise ScheduleError(f"{tv.name}: a parallelized ID is no longer in its loop domain")
    pos = tv.loop.index(id_)
    if tv.mesh is None:
        raise ScheduleError(
            f"axis {pos} of {tv.name} is parallelized on {pt.value} but {tv.name} has no "
            "device mesh; call set_device_mesh first"
        )
    try:
        axis = tv.mesh.axis_of(pt)
    except ScheduleError as e:
        raise ScheduleError(f"axis {pos} of {tv.name} is parallelized on {pt.name}: {e}") from None
    size = tv.mesh.shape[axis]
    if id_.is_broadcast and size != 1:
        raise ScheduleError(
            f"axis {pos} of {tv.name} is a broadcast axis (extent 1) parallelized on "
            f"{pt.value}, a mesh axis of {size} devices, which cannot share one element; "
            "parallelize it only over a mesh axis of one device, or shard the tensor it "
            "is broadcast against"
        )
    if id_.extent is not None and id_.extent != size:
        raise ScheduleError(
            f"axis {pos} of {tv.name} has extent {id_.extent} but is parallelized on "
            f"{pt.value}, a mesh axis of size {size}; split by {size} (outer_split(axis, "
            f"{size})) before parallelizing"
        )
    if id_.extent is None and id_ not in tv.logical:
        raise ScheduleError(
            f"axis {pos} of {tv.name} has a symbolic extent and is parallelized on "
            f"{pt.value}; split it by the mesh axis size {size} and parallelize the part "
            f"of extent {size}"
        )
    try:
        logical_root(tv, id_)
    except ScheduleError as e:
        raise ScheduleError(f"axis {pos} of {tv.name}: {e}") from None
