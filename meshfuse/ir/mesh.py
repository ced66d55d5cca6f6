"""``DeviceMesh``: an immutable n-D array of device ids (ranks).

A mesh names the devices a tensor is spread over and how they are arranged. Device parallel
types map onto its axes from the back: ``mesh_x`` is the last axis, ``mesh_y`` the second to
last, ``mesh_z`` the third to last (see :class:`~meshfuse.ir.parallel_type.ParallelType`).
Coordinates and flat orders are row-major, like ``torch.Tensor``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshfuse.errors import ScheduleError, ShardingError
from meshfuse.ir.parallel_type import DEVICE_PARALLEL_TYPES, ParallelType


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class DeviceMesh:
    """An immutable, hashable n-D array of distinct device ids (ranks).

    Two meshes are equal when they have the same shape and the same ids in the same places.

    Args:
        devices: a ``range``, a (nested) list or tuple of ints, or an integer ``torch.Tensor``
            of at least one dimension. Ids must be distinct non-negative ints and nested lists
            rectangular.

    Raises:
        ScheduleError: if ``devices`` is empty, ragged, not integer, negative or has a repeat.

    Example:
        >>> mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
        >>> mesh
        DeviceMesh([[0, 1], [2, 3]])
        >>> mesh.coordinate(2), mesh.group_ranks(2, 1)
        ((1, 0), (2, 3))
    """

    shape: tuple[int, ...]
    device_ids: tuple[int, ...]
    _index: dict[int, int] = dataclasses.field(compare=False, hash=False)

    def __init__(self, devices: range | Sequence | torch.Tensor) -> None:
        shape, ids = _parse_devices(devices)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "_index", {d: i for i, d in enumerate(ids)})

    @property
    def ndim(self) -> int:
        """The number of mesh axes."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of devices."""
        return len(self.device_ids)

    @property
    def devices(self) -> torch.Tensor:
        """A new int64 tensor of :attr:`shape` holding the device ids."""
        return torch.tensor(self.device_ids, dtype=torch.int64).reshape(self.shape)

    def __contains__(self, rank: object) -> bool:
        return rank in self._index

    def __repr__(self) -> str:
        return f"DeviceMesh({_nested(self.device_ids, self.shape)})"

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The coordinate of ``rank`` in the mesh, one entry per mesh axis.

        Raises:
            ScheduleError: if ``rank`` is not in the mesh.

        Example:
            >>> DeviceMesh([[0, 1], [2, 3]]).coordinate(1)
            (0, 1)
        """
        if rank not in self._index:
            raise ScheduleError(
                f"device {rank!r} is not in {self!r}; use one of its devices {list(self.device_ids)}"
            )
        return _unravel(self._index[rank], self.shape)

    def rank_at(self, coord: Sequence[int]) -> int:
        """The device id at ``coord`` (one non-negative index per mesh axis).

        Raises:
            ScheduleError: if ``coord`` has the wrong length or is out of bounds.

        Example:
            >>> DeviceMesh([[0, 1], [2, 3]]).rank_at((1, 0))
            2
        """
        coord = tuple(coord)
        if len(coord) != self.ndim or any(
            not isinstance(c, int) or not 0 <= c < n for c, n in zip(coord, self.shape)
        ):
            raise ScheduleError(
                f"coordinate {coord} is not in {self!r} of shape {self.shape}; give {self.ndim} "
                f"indices, index i in [0, shape[i])"
            )
        flat = 0
        for c, n in zip(coord, self.shape):
            flat = flat * n + c
        return self.device_ids[flat]

    def axis_of(self, parallel_type: ParallelType) -> int:
        """The mesh axis that the device parallel type ``parallel_type`` runs over.

        Raises:
            ScheduleError: for a non-device type, or a mesh with too few axes for it.

        Example:
            >>> DeviceMesh([[0, 1], [2, 3]]).axis_of(ParallelType.mesh_y)
            0
        """
        try:
            return parallel_type.mesh_axis(self.ndim)
        except (ValueError, AttributeError):
            pass
        usable = " or ".join(t.name for t in DEVICE_PARALLEL_TYPES[: self.ndim])
        if not isinstance(parallel_type, ParallelType) or not parallel_type.is_device:
            raise ScheduleError(
                f"{parallel_type} is not a device parallel type; {self!r} takes {usable}"
            ) from None
        needed = DEVICE_PARALLEL_TYPES.index(parallel_type) + 1
        raise ScheduleError(
            f"{parallel_type.name} needs a mesh of at least {needed} axes; {self!r} has "
            f"{self.ndim}; use {usable} or a {needed}-D mesh"
        ) from None

    def axis_size(self, parallel_type: ParallelType) -> int:
        """The number of devices along the mesh axis of ``parallel_type``.

        Example:
            >>> DeviceMesh(torch.arange(6).reshape(2, 3)).axis_size(ParallelType.mesh_x)
            3
        """
        return self.shape[self.axis_of(parallel_type)]

    def group_ranks(self, rank: int, mesh_axis: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``rank`` except along ``mesh_axis``.

        They are ordered by their coordinate on ``mesh_axis``; ``rank`` is among them. This is
        the slice a collective over ``mesh_axis`` runs on.

        Raises:
            ScheduleError: if ``rank`` is not in the mesh or ``mesh_axis`` is out of range.

        Example:
            >>> DeviceMesh([[0, 1], [2, 3]]).group_ranks(1, 0)
            (1, 3)
        """
        axis = self._check_axis(mesh_axis)
        coord = list(self.coordinate(rank))
        group = []
        for c in range(self.shape[axis]):
            coord[axis] = c
            group.append(self.rank_at(coord))
        return tuple(group)

    def all_groups(self, mesh_axis: int) -> list[tuple[int, ...]]:
        """Every slice of the mesh along ``mesh_axis``, each as in :meth:`group_ranks`.

        The order is deterministic (row-major over the other axes), so that every process
        creates its process groups in the same order.

        Example:
            >>> DeviceMesh([[0, 1], [2, 3]]).all_groups(0)
            [(0, 2), (1, 3)]
        """
        axis = self._check_axis(mesh_axis)
        rows = self.devices.movedim(axis, -1).reshape(-1, self.shape[axis])
        return [tuple(row) for row in rows.tolist()]

    def shard_tensor(
        self,
        t: torch.Tensor,
        axis: int,
        parallel_type: ParallelType = ParallelType.mesh_x,
        rank: int | None = None,
    ) -> torch.Tensor:
        """The contiguous block of ``t`` along ``axis`` that ``rank`` holds.

        nvFuser's legacy frontend passed the rank third (``mesh.shard_tensor(t, 0, rank)``);
        an int in place of ``parallel_type`` is taken as the rank.

        With ``d`` devices on the mesh axis of ``parallel_type`` and extent ``n``, the device
        at coordinate ``c`` on that axis holds ``[c*q, (c+1)*q)`` with ``q = ceil(n/d)``,
        cut at ``n`` (an outer split of ``axis`` by ``d``; uneven extents give shorter or
        empty blocks at the end, as ``torch.chunk``; ranks that differ only on other mesh
        axes get the same block).

        Args:
            t: the global tensor.
            axis: the tensor axis to shard; negative counts from the end.
            parallel_type: the device parallel type whose mesh axis shards ``axis``.
            rank: the device; defaults to the torch.distributed rank, or 0 when
                torch.distributed is not initialized.

        Returns:
            A new tensor (not a view of ``t``) with the memory order (stride order) of ``t``.

        Raises:
            ShardingError: if ``axis`` is out of range or ``rank`` is not in the mesh.

        Example:
            >>> DeviceMesh(range(2)).shard_tensor(torch.arange(6).reshape(2, 3), 0, rank=1)
            tensor([[3, 4, 5]])
        """
        if isinstance(parallel_type, int) and not isinstance(parallel_type, bool):
            parallel_type, rank = ParallelType.mesh_x, parallel_type
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank not in self:
            raise ShardingError(
                f"cannot shard for device {rank}: it is not in {self!r}; pass a rank of the mesh"
            )
        if not -t.dim() <= axis < t.dim():
            raise ShardingError(
                f"axis {axis} is out of range for a tensor of shape {tuple(t.shape)}; "
                f"use an axis in [{-t.dim()}, {t.dim()})"
            )
        axis %= t.dim()
        mesh_axis = self.axis_of(parallel_type)
        d, n = self.shape[mesh_axis], t.shape[axis]
        block = -(-n // d)  # uneven extents: blocks of ceil(n / d), as torch.chunk
        start = min(self.coordinate(rank)[mesh_axis] * block, n)
        return _copy_keeping_layout(t.narrow(axis, start, min(block, n - start)))

    def _check_axis(self, mesh_axis: int) -> int:
        if isinstance(mesh_axis, bool) or not isinstance(mesh_axis, int):
            raise ScheduleError(
                f"mesh axis {mesh_axis!r} of {self!r} must be an int; for a parallel type pt "
                f"use mesh.axis_of(pt)"
            )
        if not -self.ndim <= mesh_axis < self.ndim:
            raise ScheduleError(
                f"mesh axis {mesh_axis} is out of range for {self!r} with {self.ndim} axes; "
                f"use an axis in [{-self.ndim}, {self.ndim})"
            )
        return mesh_axis % self.ndim


def _parse_devices(devices: object) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validates ``devices`` and returns its (shape, row-major ids)."""
    if isinstance(devices, torch.Tensor):
        if devices.dim() == 0:
            raise ScheduleError(
                f"DeviceMesh needs a tensor of at least 1 dimension, got the 0-D {devices!r}; "
                f"wrap it, e.g. DeviceMesh([{devices.item()}])"
            )
        if (
            devices.dtype.is_floating_point
            or devices.dtype.is_complex
            or devices.dtype == torch.bool
        ):
            raise ScheduleError(
                f"DeviceMesh needs an integer tensor of device ids, got dtype {devices.dtype}; "
                f"convert it with .long()"
            )
        devices = devices.tolist()
    elif isinstance(devices, range):
        devices = list(devices)
    if not isinstance(devices, (list, tuple)):
        raise ScheduleError(
            f"DeviceMesh takes a range, a (nested) list of ints or an integer tensor, got "
            f"{type(devices).__name__} {devices!r}"
        )
    shape = _shape_of(devices)
    ids = tuple(_flatten(devices))
    if not ids:
        raise ScheduleError(
            f"DeviceMesh({devices!r}) has no devices; give at least one, e.g. DeviceMesh([0])"
        )
    for d in ids:
        if isinstance(d, bool) or not isinstance(d, int):
            raise ScheduleError(
                f"device ids of a DeviceMesh must be ints, got {d!r} ({type(d).__name__}) in "
                f"{devices!r}"
            )
        if d < 0:
            raise ScheduleError(
                f"device ids of a DeviceMesh must be non-negative, got {d} in {devices!r}"
            )
    repeated = sorted(d for d, n in collections.Counter(ids).items() if n > 1)
    if repeated:
        raise ScheduleError(
            f"device ids of a DeviceMesh must be unique; {repeated} appear more than once in "
            f"{devices!r}; list each device once"
        )
    return shape, ids


def _shape_of(nested: list | tuple) -> tuple[int, ...]:
    """The shape of a rectangular nested list; ScheduleError naming the ragged row otherwise."""
    nested_rows = [isinstance(x, (list, tuple)) for x in nested]
    if not any(nested_rows):
        return (len(nested),)
    if not all(nested_rows):
        raise ScheduleError(
            f"DeviceMesh rows must all be lists or all be ints, got {list(nested)!r}; "
            f"make the nesting rectangular, e.g. [[0, 1], [2, 3]]"
        )
    inner = [_shape_of(row) for row in nested]
    for i, s in enumerate(inner):
        if s != inner[0]:
            raise ScheduleError(
                f"DeviceMesh must be rectangular: row {i} has shape {s} but row 0 has "
                f"{inner[0]} in {list(nested)!r}; give every row the same length"
            )
    return (len(nested), *inner[0])


def _flatten(nested: list | tuple):
    for x in nested:
        if isinstance(x, (list, tuple)):
            yield from _flatten(x)
        else:
            yield x


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coord = []
    for n in reversed(shape):
        flat, c = divmod(flat, n)
        coord.append(c)
    return tuple(reversed(coord))


def _nested(ids: tuple[int, ...], shape: tuple[int, ...]) -> list:
    if len(shape) == 1:
        return list(ids)
    step = math.prod(shape[1:])
    return [_nested(ids[i : i + step], shape[1:]) for i in range(0, len(ids), step)]


def _copy_keeping_layout(t: torch.Tensor) -> torch.Tensor:
    """A dense copy of ``t`` whose axes are laid out in memory in the order of ``t``'s strides."""
    # Stable sort, outermost first; ties (size-1 axes) keep their logical order.
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    inverse = [order.index(i) for i in range(t.dim())]
    return t.permute(order).contiguous().permute(inverse)
