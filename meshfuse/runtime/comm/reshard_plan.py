"""Resharding plans: the steps that turn one sharding of a tensor into another.

A plan is data: a list of :class:`ReshardStep` records, each one collective (or local step)
over one mesh axis, that :mod:`meshfuse.runtime.comm.reshard_lowering` binds to a rank and runs.
Both ends of a plan are :class:`ShardingSpec` values: a placement per mesh axis (``R``,
``S(i)``, ``P(op)``) plus, for each shard, the mesh coordinate that owns each global index of
its axis. Owners describe every schedule alike: block (outer split) and cyclic (inner split)
shards, several splits of one axis over several mesh axes, uneven splits.

**One mesh.** A device holds, along each axis, the indices whose owner on every mesh axis
sharding that axis is the device's coordinate there. A step changes the placement of one mesh
axis only, so any mix of the two ends' placements is a sharding the tensor can pass through,
and the plan has (at most) one step per mesh axis that differs, ordered so that the tensor
shrinks before it grows:

=============  ========================  =================================================
 phase          placement change           step (over the changing mesh axis)
=============  ========================  =================================================
 1              ``R -> S(i)``              ``slice``: local, no traffic
 2              ``P -> S(i)``              ``reduce_scatter``
 3              ``S(i) -> S(j)``           ``all_to_all`` (``j == i``: the owners change,
                                           e.g. block to cyclic; each device sends only
                                           what another device will hold)
 4              ``P -> R``                 ``allreduce``
 5              ``S(i) -> R``              ``allgather``
 6              ``R -> P``                 ``to_partial``: local (coordinate 0 keeps the
                                           values, the others hold the reduction's identity);
                                           ``S -> P`` and ``P(a) -> P(b)`` pass through ``R``
=============  ========================  =================================================

A mesh axis of one device never communicates. These are DTensor's choices for each mesh axis;
the owners let any intermediate mix be exact, so nothing is ever made whole to be sliced again.

**Between meshes.** The tensor is made whole on its mesh (the steps above), sent from that
mesh's first device to the devices of the other mesh that lack it (send/recv to one device,
a broadcast to several, nothing when the destination devices hold it already), and sliced to
the destination's sharding there. Meshes of any rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from meshfuse.ir.fusion import partial_reduce_op
from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.layout import split_indices
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.placement import Partial, Placement, Replicate, Shard, placements
from meshfuse.ir.tensor_view import TensorView

PHASES = ("slice", "reduce_scatter", "all_to_all", "allreduce", "allgather", "to_partial")


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingSpec:
    """How a tensor of global ``shape`` lies on ``mesh``.

    ``placements`` has one entry per mesh axis; ``owners[m]`` is, for a :class:`Shard` on mesh
    axis ``m``, the coordinate on ``m`` that owns each global index of the sharded axis
    (``None`` otherwise).
    """

    mesh: DeviceMesh
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    owners: tuple[torch.Tensor | None, ...]

    @staticmethod
    def of(tv: TensorView, extents: Mapping[IterDomain, int],
           reduce_op: str = "sum") -> ShardingSpec:
        """``tv``'s sharding with the bound ``extents`` (derived IDs included); a partial
        ``tv`` reduces with ``reduce_op``."""
        logical = tv.materialized()
        chosen = placements(tv, reduce_op)
        owners = tuple(
            split_indices(tv, logical[p.axis], extents)[p.id] if isinstance(p, Shard) else None
            for p in chosen
        )
        return ShardingSpec(tv.mesh, tuple(extents[i] for i in logical), chosen, owners)

    @staticmethod
    def replicated(mesh: DeviceMesh, shape: Sequence[int]) -> ShardingSpec:
        return ShardingSpec(mesh, tuple(shape), (Replicate(),) * mesh.ndim, (None,) * mesh.ndim)

    def held(self, coords: Sequence[int]) -> list[torch.Tensor | None]:
        """Per axis, the global indices (ascending) that the device at mesh coordinates
        ``coords`` holds; ``None`` for an axis it holds whole."""
        masks: dict[int, torch.Tensor] = {}
        for m, (p, owner) in enumerate(zip(self.placements, self.owners)):
            if isinstance(p, Shard):
                mine = owner == coords[m]
                masks[p.axis] = mine & masks[p.axis] if p.axis in masks else mine
        return [torch.nonzero(masks[a]).flatten() if a in masks else None
                for a in range(len(self.shape))]

    def same_on(self, m: int, other: ShardingSpec) -> bool:
        """Whether mesh axis ``m`` places the tensor alike in ``self`` and ``other``."""
        a, b = self.placements[m], other.placements[m]
        if isinstance(a, Shard) and isinstance(b, Shard):
            return a.axis == b.axis and torch.equal(self.owners[m], other.owners[m])
        return a == b

    def with_axis(self, m: int, placement: Placement,
                  owner: torch.Tensor | None = None) -> ShardingSpec:
        """This sharding with mesh axis ``m`` changed to ``placement`` (with ``owner``)."""
        return dataclasses.replace(
            self,
            placements=self.placements[:m] + (placement,) + self.placements[m + 1:],
            owners=self.owners[:m] + (owner,) + self.owners[m + 1:],
        )

    def __str__(self) -> str:
        return f"[{', '.join(map(str, self.placements))}]"


@dataclasses.dataclass(frozen=True)
class ReshardStep:
    """One collective (or local step) of a plan, over mesh axis ``mesh_axis`` of ``mesh``.

    ``axis`` is the logical axis gathered, sliced, reduce-scattered into, or that an
    all-to-all concatenates; ``to_axis`` the axis an all-to-all splits. ``before`` and
    ``after`` are the tensor's shardings around the step. For a transfer between meshes
    (``broadcast``, ``send_recv``) ``mesh`` is the 1-D group whose coordinate 0 sends.
    """

    kind: str
    mesh_axis: int
    before: ShardingSpec
    after: ShardingSpec
    axis: int | None = None
    to_axis: int | None = None
    reduce_op: str | None = None
    group_mesh: DeviceMesh | None = None

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh whose axis ``mesh_axis`` the step's group runs along."""
        return self.group_mesh or self.before.mesh

    def __str__(self) -> str:
        if self.kind in ("broadcast", "send_recv"):
            return f"{self.kind} from rank {self.mesh.device_ids[0]} to {self.mesh!r}"
        what = {
            "allreduce": f"allreduce({self.reduce_op})",
            "reduce_scatter": f"reduce_scatter({self.reduce_op}) of axis {self.axis}",
            "all_to_all": f"all_to_all axis {self.axis} -> {self.to_axis}",
            "to_partial": f"to_partial({self.reduce_op})",
        }.get(self.kind, f"{self.kind} of axis {self.axis}")
        return f"{what} over mesh axis {self.mesh_axis}"

    def describe(self) -> str:
        """``str(self)`` and the placements before and after, e.g. ``all_to_all axis 1 ->
        0 over mesh axis 0: [S(1)c, S(0)] -> [S(0), S(0)]``."""
        if self.kind in ("broadcast", "send_recv"):
            return str(self)
        return f"{self}: {self.before} -> {self.after}"


def plan_resharding(
    src: TensorView, dst: TensorView, extents: Mapping[IterDomain, int]
) -> list[ReshardStep]:
    """The steps that turn local shards of ``src`` into local shards of ``dst`` (same logical
    shape), on every rank alike; see the module doc. A partial ``dst`` combines as ``src``
    does (a ``max`` stays a pending ``max``)."""
    reduce_op = partial_reduce_op(src)
    return plan(ShardingSpec.of(src, extents, reduce_op),
                ShardingSpec.of(dst, extents, reduce_op))


def plan(before: ShardingSpec, after: ShardingSpec) -> list[ReshardStep]:
    """The steps from ``before`` to ``after`` (on one mesh or two); see the module doc."""
    if before.mesh != after.mesh:
        return _plan_between_meshes(before, after)
    state, changes = before, []
    for m in range(before.mesh.ndim):
        if before.same_on(m, after):
            continue
        if before.mesh.shape[m] == 1:  # one device: already as wanted
            state = state.with_axis(m, after.placements[m], after.owners[m])
        else:
            changes.append(m)
    steps: list[ReshardStep] = []
    pending = [(_phase(before.placements[m], after.placements[m]), m) for m in changes]
    while pending:
        pending.sort()
        _, m = pending.pop(0)
        step = _step(state, after, m)
        steps.append(step)
        state = step.after
        if not state.same_on(m, after):  # a change through R: its second step comes later
            pending.append((_phase(state.placements[m], after.placements[m]), m))
    return steps


def _phase(a: Placement, b: Placement) -> int:
    """The position in the order of the module doc of the first step from ``a`` to ``b``."""
    kinds = {
        (Replicate, Shard): "slice", (Partial, Shard): "reduce_scatter",
        (Shard, Shard): "all_to_all", (Partial, Replicate): "allreduce",
        (Shard, Replicate): "allgather", (Replicate, Partial): "to_partial",
        (Shard, Partial): "allgather", (Partial, Partial): "allreduce",
    }
    return PHASES.index(kinds[type(a), type(b)])


def _step(state: ShardingSpec, target: ShardingSpec, m: int) -> ReshardStep:
    """The first step that brings mesh axis ``m`` of ``state`` towards ``target``."""
    a, b = state.placements[m], target.placements[m]
    make = {"mesh_axis": m, "before": state}
    whole = state.with_axis(m, Replicate())
    if isinstance(a, Partial):
        if isinstance(b, Shard):
            return ReshardStep("reduce_scatter", **make, after=target_on(state, target, m),
                               axis=b.axis, reduce_op=a.reduce_op)
        return ReshardStep("allreduce", **make, after=whole, reduce_op=a.reduce_op)
    if isinstance(a, Shard):
        if isinstance(b, Shard):
            return ReshardStep("all_to_all", **make, after=target_on(state, target, m),
                               axis=a.axis, to_axis=b.axis)
        return ReshardStep("allgather", **make, after=whole, axis=a.axis)
    if isinstance(b, Shard):
        return ReshardStep("slice", **make, after=target_on(state, target, m), axis=b.axis)
    return ReshardStep("to_partial", **make, after=target_on(state, target, m),
                       reduce_op=b.reduce_op)


def target_on(state: ShardingSpec, target: ShardingSpec, m: int) -> ShardingSpec:
    """``state`` with mesh axis ``m`` placed as in ``target``."""
    return state.with_axis(m, target.placements[m], target.owners[m])


def _plan_between_meshes(before: ShardingSpec, after: ShardingSpec) -> list[ReshardStep]:
    """Whole on the source mesh, sent from its first device to the destination devices that
    lack it (send/recv to one device, else a broadcast over both meshes' devices), then
    sliced to ``after`` there."""
    whole_src = ShardingSpec.replicated(before.mesh, before.shape)
    whole_dst = ShardingSpec.replicated(after.mesh, after.shape)
    steps = plan(before, whole_src)
    src_ids, dst_ids = before.mesh.device_ids, after.mesh.device_ids
    root = src_ids[0]
    if not set(dst_ids) <= set(src_ids):
        others = sorted((set(src_ids) | set(dst_ids)) - {root})
        receivers = [d for d in dst_ids if d != root]
        if before.mesh.size == 1 and len(receivers) == 1:
            kind, group = "send_recv", DeviceMesh([root, *receivers])
        else:  # root at coordinate 0 of the group's mesh
            kind, group = "broadcast", DeviceMesh([root, *others])
        steps.append(ReshardStep(kind, 0, whole_src, whole_dst, group_mesh=group))
    return steps + plan(whole_dst, after)
