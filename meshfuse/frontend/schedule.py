"""``fd.sched``: the scheduling calls of nvFuser's legacy frontend, as the seed writes them.

Each call forwards to the same method on the TensorView, so both styles share one semantics:
``fd.sched.split(t, 1, d, False)`` is ``t.split(1, d, inner_split=False)``.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.ir.tensor_view import TensorView
from meshfuse.ops.user_tensor import rfactor


class Schedule:
    """The ``fd.sched`` namespace."""

    def _set_device_mesh(self, tv: TensorView, mesh: DeviceMesh) -> None:
        tv.set_device_mesh(mesh)

    set_device_mesh = _set_device_mesh

    def split(self, tv: TensorView, axis: int, factor: int, inner_split: bool = True) -> None:
        tv.split(axis, factor, inner_split)

    def merge(self, tv: TensorView, axis: int) -> None:
        """Merges loop axes ``axis`` and ``axis + 1``."""
        tv.merge(axis)

    def reorder(self, tv: TensorView, old_to_new: Mapping[int, int]) -> None:
        tv.reorder(old_to_new)

    def parallelize(self, tv: TensorView, axis: int, parallel_type: ParallelType) -> None:
        tv.parallelize(axis, parallel_type)

    def set_allocation_as_loop(self, tv: TensorView) -> None:
        tv.set_allocation_as_loop()

    def set_allocation_domain(self, tv: TensorView, ids, contiguity=True) -> None:
        tv.set_allocation_domain(ids, contiguity)

    def rfactor(self, tv: TensorView, dims) -> TensorView:
        """``tv.rfactor(dims)``: the new tensor reducing loop axes ``dims`` (see
        :mod:`meshfuse.ops.user_tensor`)."""
        return rfactor(tv, [dims] if isinstance(dims, int) else list(dims))
