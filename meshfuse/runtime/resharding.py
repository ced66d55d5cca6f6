"""Lowering of a :class:`~meshfuse.ir.fusion.Reshard` to a plan of communications; running it.

A plan is data: a list of :class:`ReshardStep` records, one per mesh axis whose placement
changes, in the order: partial results reduced (allreduce, or reduce-scatter into a shard),
shards gathered (allgather), shards moved to another axis (all-to-all), replicated axes sliced
(local, no traffic). Each record holds the index order of its axis, so block and cyclic shards
use the same code.

Between two (1-D) meshes, the plan makes the tensor whole on the source mesh, sends it from
that mesh's first device (send/recv to one device, a broadcast to several, nothing when the
destination devices already hold it), and slices it there; each step names the mesh whose
ranks run it.

Collectives of a plan are launched asynchronously: the plan returns a
:class:`~meshfuse.runtime.collectives.Pending` result, which the executor waits for where it
is first read, so the computation in between overlaps the communication.

A logical axis that changes placement must be sharded by at most one mesh axis on each side
(composed shards of one axis over two mesh axes are moved only when they stay as they are).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from meshfuse.errors import ShardingError
from meshfuse.ir.fusion import partial_reduce_op
from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.layout import local_indices
from meshfuse.ir.placement import Partial, Replicate, Shard, placements
from meshfuse.ir.tensor_view import TensorView
from meshfuse.mesh import DeviceMesh
from meshfuse.runtime import collectives
from meshfuse.runtime.collectives import Group, Pending, resolved

PHASES = ("allreduce", "reduce_scatter", "allgather", "all_to_all", "slice")


@dataclasses.dataclass(frozen=True)
class ReshardStep:
    """One communication (or local slice) over mesh axis ``mesh_axis``.

    ``axis`` is the logical axis gathered, scattered or sliced (``None`` for an allreduce);
    ``to_axis`` the axis an all-to-all scatters. ``order`` lists, by coordinate, the global
    indices each coordinate holds along the communicated axis; ``to_order`` likewise for
    ``to_axis``.
    """

    kind: str
    mesh_axis: int
    axis: int | None = None
    to_axis: int | None = None
    reduce_op: str | None = None
    order: tuple[torch.Tensor, ...] = ()
    to_order: tuple[torch.Tensor, ...] = ()
    mesh: DeviceMesh | None = None  # the mesh of the group; None: the tensors' own mesh

    @property
    def in_blocks(self) -> bool:
        """True when coordinate ``c`` holds the ``c``-th contiguous block (no reordering)."""
        return _is_blocks(self.order)

    @property
    def to_blocks(self) -> bool:
        return _is_blocks(self.to_order)

    def __str__(self) -> str:
        where = f"mesh axis {self.mesh_axis}"
        if self.kind in ("broadcast", "send_recv"):
            return f"{self.kind} from rank {self.mesh.device_ids[0]} to {self.mesh!r}"
        if self.kind == "allreduce":
            return f"allreduce({self.reduce_op}) over {where}"
        if self.kind == "reduce_scatter":
            return f"reduce_scatter({self.reduce_op}) of axis {self.axis} over {where}"
        if self.kind == "all_to_all":
            return f"all_to_all axis {self.axis} -> {self.to_axis} over {where}"
        return f"{self.kind} of axis {self.axis} over {where}"


def plan_resharding(
    src: TensorView, dst: TensorView, extents: Mapping[IterDomain, int]
) -> list[ReshardStep]:
    """The steps that turn local shards of ``src`` into local shards of ``dst`` (same logical
    shape), on every rank of the mesh alike."""
    if src.mesh != dst.mesh:
        return _plan_between_meshes(src, dst, extents)
    before = placements(src, partial_reduce_op(src))
    after = placements(dst)
    steps = []
    for m, (a, b) in enumerate(zip(before, after)):
        if a == b or src.mesh.shape[m] == 1:
            continue
        steps.append(_step(src, dst, m, a, b, extents))
    for step in steps:
        for axis in (step.axis, step.to_axis):
            if axis is not None:
                _check_single_mesh_axis(src, dst, axis)
    return sorted(steps, key=lambda s: PHASES.index(s.kind))


def _plan_between_meshes(src: TensorView, dst: TensorView, extents) -> list[ReshardStep]:
    """From one mesh to another: make ``src`` whole on its mesh (allreduce, allgather), send
    it from the first device of that mesh to the devices of the other (send/recv for one
    device to one device, else a broadcast over both meshes' devices; none when every
    destination device already holds it), then slice it to ``dst``'s sharding there."""
    for tv in (src, dst):
        if tv.mesh.ndim != 1:
            raise ShardingError(
                f"set {src.name} -> {dst.name}: moving between meshes is supported for 1-D "
                f"meshes; {tv.name} is on {tv.mesh!r}"
            )
    whole_src = _replicated_like(src, src.mesh)
    whole_dst = _replicated_like(dst, dst.mesh)
    steps = [dataclasses.replace(t, mesh=src.mesh) for t in plan_resharding(src, whole_src, extents)]
    root = src.mesh.device_ids[0]
    if not set(dst.mesh.device_ids) <= set(src.mesh.device_ids):
        others = sorted((set(src.mesh.device_ids) | set(dst.mesh.device_ids)) - {root})
        receivers = [d for d in dst.mesh.device_ids if d != root]
        if src.mesh.size == 1 and len(receivers) == 1:
            steps.append(ReshardStep("send_recv", 0, mesh=DeviceMesh([root, *receivers])))
        else:  # root at coordinate 0 of the group's mesh
            steps.append(ReshardStep("broadcast", 0, mesh=DeviceMesh([root, *others])))
    return steps + [dataclasses.replace(t, mesh=dst.mesh)
                    for t in plan_resharding(whole_dst, dst, extents)]


def _replicated_like(tv: TensorView, mesh: DeviceMesh) -> TensorView:
    """An unregistered tensor over ``tv``'s logical IDs, whole on every device of ``mesh``."""
    whole = TensorView(tv.fusion, tv.logical, tv.dtype)
    whole.name = f"{tv.name}(whole)"
    whole.set_device_mesh(mesh)
    return whole


def _step(src, dst, m, a, b, extents) -> ReshardStep:
    name = f"set {src.name} -> {dst.name}, mesh axis {m}"
    if isinstance(a, Partial) and isinstance(b, Replicate):
        return ReshardStep("allreduce", m, reduce_op=a.reduce_op)
    if isinstance(a, Partial) and isinstance(b, Shard):
        return ReshardStep("reduce_scatter", m, b.axis, reduce_op=a.reduce_op,
                           order=_orders(dst, b, m, extents))
    if isinstance(a, Shard) and isinstance(b, Replicate):
        return ReshardStep("allgather", m, a.axis, order=_orders(src, a, m, extents))
    if isinstance(a, Shard) and isinstance(b, Shard) and a.axis != b.axis:
        return ReshardStep("all_to_all", m, a.axis, b.axis, order=_orders(src, a, m, extents),
                           to_order=_orders(dst, b, m, extents))
    if isinstance(a, Shard) and isinstance(b, Shard):
        # The same axis with another pattern (say block to cyclic): gather, then slice.
        raise ShardingError(f"{name}: changing the shard pattern of axis {a.axis} ({a} -> {b}) "
                            "is not supported yet; use one pattern for both tensors")
    if isinstance(a, Replicate) and isinstance(b, Shard):
        return ReshardStep("slice", m, b.axis, order=_orders(dst, b, m, extents))
    raise ShardingError(f"{name}: {a} -> {b} is not a resharding meshfuse can do; a partial "
                        "result comes only from a reduction over a sharded axis")


def _orders(tv: TensorView, shard: Shard, mesh_axis: int, extents) -> tuple[torch.Tensor, ...]:
    pt = tv.parallel[shard.id]
    logical_id = tv.materialized()[shard.axis]
    return tuple(local_indices(tv, logical_id, extents, {pt: c})
                 for c in range(tv.mesh.shape[mesh_axis]))


def _check_single_mesh_axis(src: TensorView, dst: TensorView, axis: int) -> None:
    for tv in (src, dst):
        sharding = [p for p in placements(tv) if isinstance(p, Shard) and p.axis == axis]
        if len(sharding) > 1:
            raise ShardingError(
                f"set {src.name} -> {dst.name}: axis {axis} of {tv.name} is sharded over "
                f"{len(sharding)} mesh axes; resharding such an axis is not supported yet"
            )


@dataclasses.dataclass(frozen=True)
class LoweredStep:
    """A step bound to this rank: its group and its index tensors on the right device."""

    step: ReshardStep
    group: Group
    by_owner: torch.Tensor | None  # reorders a full axis into owner chunks (None: blocks)
    to_global: torch.Tensor | None  # reorders owner chunks into global order (None: blocks)
    to_by_owner: torch.Tensor | None
    mine: torch.Tensor | tuple[int, int] | None  # a slice's indices, or (start, length)
    donated: bool = False  # the input is dead after this step: reduce it in place
    whole: Callable[[], torch.Tensor] | None = None  # a receiver's buffer: the whole tensor

    def __call__(self, x: torch.Tensor | Pending) -> torch.Tensor | Pending:
        """This step on ``x``. A gather, reduction or all-to-all is only launched: it returns
        a :class:`Pending` that the executor waits for where the result is first read, so
        that work not depending on it overlaps it. A local slice of a pending result is
        applied when it arrives."""
        step, group = self.step, self.group
        if step.kind == "slice":
            if isinstance(self.mine, tuple):
                return _then(x, lambda x: x.narrow(step.axis, *self.mine))
            return _then(x, lambda x: x.index_select(step.axis, self.mine))
        x = resolved(x)
        if step.kind in ("broadcast", "send_recv"):
            if group.coordinate != 0:  # a receiver: nothing of its own to send
                x = self.whole()
            if step.kind == "send_recv":
                return collectives.send_recv(x, group)
            return collectives.broadcast(x, 0, group)
        if step.kind == "allreduce":
            return collectives.allreduce(x, group, step.reduce_op, inplace=self.donated,
                                         async_op=True)
        if step.kind == "allgather":
            gathered = collectives.allgather(x, step.axis, group, async_op=True)
            return _then(gathered, lambda x: _reorder(x, step.axis, self.to_global))
        if step.kind == "reduce_scatter":
            return collectives.reduce_scatter(_reorder(x, step.axis, self.by_owner), step.axis,
                                              group, step.reduce_op, async_op=True)
        moved = collectives.all_to_all(_reorder(x, step.to_axis, self.to_by_owner), step.to_axis,
                                       step.axis, group, async_op=True)
        return _then(moved, lambda x: _reorder(x, step.axis, self.to_global))


def lower_step(step: ReshardStep, group: Group, device: torch.device,
               donated: bool = False,
               whole: Callable[[], torch.Tensor] | None = None) -> LoweredStep:
    """Binds ``step`` to this rank's ``group``, with its index tensors on ``device``;
    ``donated``: the step may overwrite its input (nothing reads it afterwards); ``whole``:
    makes an empty buffer of the whole tensor, for receivers between meshes."""
    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    by_owner = None if step.in_blocks else torch.cat(step.order)
    to_global = None if step.in_blocks else torch.argsort(torch.cat(step.order))
    to_by_owner = None if not step.to_order or step.to_blocks else torch.cat(step.to_order)
    mine = None
    if step.kind == "slice":
        index = step.order[group.coordinate]
        start = int(index[0]) if index.numel() else 0
        contiguous = torch.equal(index, torch.arange(start, start + index.numel()))
        mine = (start, index.numel()) if contiguous else index.to(device)
    return LoweredStep(step, group, on(by_owner), on(to_global), on(to_by_owner), mine, donated,
                       whole)


def _is_blocks(order: tuple[torch.Tensor, ...]) -> bool:
    if not order:
        return True
    flat = torch.cat(order)
    return bool(torch.equal(flat, torch.arange(flat.numel())))


def _then(x: torch.Tensor | Pending, fn) -> torch.Tensor | Pending:
    """``fn(x)``, or for a pending ``x`` ``fn`` of its result when it arrives."""
    return x.then(fn) if isinstance(x, Pending) else fn(x)


def _reorder(x: torch.Tensor, axis: int, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(axis, index)
