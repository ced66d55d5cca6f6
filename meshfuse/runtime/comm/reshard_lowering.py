"""Running a resharding plan: each :class:`~meshfuse.runtime.comm.reshard_plan.ReshardStep` bound to
this rank's group, with the index tensors of its shards on this rank's device.

A step's index arithmetic comes from the shardings before and after it: the global indices
each group member holds along the axes the step moves (:meth:`ShardingSpec.held`). Block
shards of equal sizes take the plain collectives; other owners are reordered locally around
them, and uneven shards pass their per-member extents (padded gathers and reduce-scatters,
all-to-all with per-member counts).

Collectives are launched asynchronously: a step returns a
:class:`~meshfuse.runtime.comm.pending.Pending` result, which the executor waits for where it
is first read, so the computation in between overlaps the communication.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import torch

from meshfuse.ir.fusion import Reshard
from meshfuse.ops.reductions import reduction_identity
from meshfuse.runtime.comm import collectives
from meshfuse.runtime.comm.collectives import Group, group_along
from meshfuse.runtime.comm.pending import Pending, resolved
from meshfuse.runtime.comm.reshard_plan import ReshardStep, plan_resharding

Index = torch.Tensor | None  # global indices held along an axis, ascending; None: all
Runner = Callable[[torch.Tensor | Pending], torch.Tensor | Pending]
Select = Callable[[torch.Tensor, int], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class LoweredStep:
    """A step bound to this rank: its group, and what it does to this rank's tensor."""

    step: ReshardStep
    group: Group
    run: Runner

    def __call__(self, x: torch.Tensor | Pending) -> torch.Tensor | Pending:
        return self.run(x)


def lower_step(step: ReshardStep, group: Group, device: torch.device,
               donated: bool = False,
               whole: Callable[[], torch.Tensor] | None = None) -> LoweredStep:
    """Binds ``step`` to this rank's ``group``, with its index tensors on ``device``;
    ``donated``: the step may overwrite its input (nothing reads it afterwards); ``whole``:
    makes an empty buffer of the whole tensor, for receivers between meshes."""
    if step.kind in ("broadcast", "send_recv"):
        return LoweredStep(step, group, _transfer(step, group, whole))
    rank = group.ranks[group.coordinate]
    member = _Members(step, step.before.mesh.coordinate(rank), group.size, device)
    lower = {
        "slice": _slice, "allgather": _allgather, "reduce_scatter": _reduce_scatter,
        "all_to_all": _all_to_all, "to_partial": _to_partial,
    }.get(step.kind)
    if lower is None:
        def run(x):
            return collectives.allreduce(resolved(x), group, step.reduce_op, inplace=donated,
                                         async_op=True)
        return LoweredStep(step, group, run)
    return LoweredStep(step, group, lower(step, group, member))


@dataclasses.dataclass(frozen=True)
class _Members:
    """The indices the members of a step's group hold, before and after it."""

    step: ReshardStep
    coords: tuple[int, ...]
    size: int
    device: torch.device

    def at(self, c: int) -> tuple[int, ...]:
        m = self.step.mesh_axis
        return self.coords[:m] + (c,) + self.coords[m + 1:]

    def before(self, c: int | None = None) -> list[Index]:
        return self.step.before.held(self.coords if c is None else self.at(c))

    def after(self, c: int | None = None) -> list[Index]:
        return self.step.after.held(self.coords if c is None else self.at(c))

    def on_device(self, index: Index) -> Index:
        return None if index is None else index.to(self.device)


def _slice(step: ReshardStep, group: Group, member: _Members) -> Runner:
    n = step.before.shape[step.axis]
    held, wanted = member.before()[step.axis], member.after()[step.axis]
    take = _selector(_unless_identity(_positions(held, wanted, n), _count(held, n)),
                     member.device)
    return lambda x: _then(x, lambda x: take(x, step.axis))


def _allgather(step: ReshardStep, group: Group, member: _Members) -> Runner:
    """Each member's part of ``axis`` (sizes may differ), concatenated, then in index order."""
    pieces = [member.before(c)[step.axis] for c in range(group.size)]
    sizes = [p.numel() for p in pieces]
    to_global = _selector(_sorting(torch.cat(pieces)), member.device)

    def run(x):
        gathered = collectives.allgather(resolved(x), step.axis, group, async_op=True,
                                         sizes=None if len(set(sizes)) == 1 else sizes)
        return _then(gathered, lambda x: to_global(x, step.axis))
    return run


def _reduce_scatter(step: ReshardStep, group: Group, member: _Members) -> Runner:
    """The part each member will hold, gathered into its chunk, then reduce-scattered."""
    held = member.before()[step.axis]
    parts = [_positions(held, member.after(c)[step.axis], step.before.shape[step.axis])
             for c in range(group.size)]
    sizes = [p.numel() for p in parts]
    by_owner = _selector(_unless_identity(torch.cat(parts)), member.device)

    def run(x):
        x = by_owner(resolved(x), step.axis)
        return collectives.reduce_scatter(x, step.axis, group, step.reduce_op, async_op=True,
                                          sizes=None if len(set(sizes)) == 1 else sizes)
    return run


def _all_to_all(step: ReshardStep, group: Group, member: _Members) -> Runner:
    """Each member sends member ``c`` what it holds of ``c``'s part (along the split axis,
    and along the concatenated one when its owners change); the parts received are
    concatenated along ``axis`` and put in index order."""
    cat_axis, split_axis = step.axis, step.to_axis
    axes = sorted({cat_axis, split_axis})
    mine = member.before()
    n = step.before.shape
    sends = [{a: _positions(mine[a], _meet(mine[a], member.after(c)[a]), n[a]) for a in axes}
             for c in range(group.size)]
    wanted = member.after()
    recv = [{a: _meet(member.before(c)[a], wanted[a]) for a in axes} for c in range(group.size)]
    to_global = _selector(_sorting(torch.cat([_full(r[cat_axis], n[cat_axis]) for r in recv])),
                          member.device)
    if cat_axis != split_axis and _even_blocks(sends, recv, split_axis, cat_axis):
        by_owner = _selector(_unless_identity(torch.cat([s[split_axis] for s in sends])),
                             member.device)

        def run(x):
            x = by_owner(resolved(x), split_axis)
            moved = collectives.all_to_all(x, split_axis, cat_axis, group, async_op=True)
            return _then(moved, lambda x: to_global(x, cat_axis))
        return run
    sends = [{a: member.on_device(i) for a, i in s.items()} for s in sends]

    def run(x):
        x = resolved(x)
        pieces = [_select(x, s) for s in sends]
        shapes = [[_count(r[a], n[a]) if a in r else x.shape[a] for a in range(x.ndim)]
                  for r in recv]
        moved = collectives.all_to_all_pieces(pieces, shapes, group, async_op=True)
        return _then(moved, lambda parts: to_global(torch.cat(parts, dim=cat_axis), cat_axis))
    return run


def _to_partial(step: ReshardStep, group: Group, member: _Members) -> Runner:
    """Coordinate 0 keeps the values; the others hold the reduction's identity."""
    if group.coordinate == 0:
        return lambda x: x
    return lambda x: _then(
        x, lambda x: torch.full_like(x, reduction_identity(step.reduce_op, x.dtype)))


def _transfer(step: ReshardStep, group: Group, whole: Callable[[], torch.Tensor]) -> Runner:
    def run(x):
        x = resolved(x)
        if group.coordinate != 0:  # a receiver: nothing of its own to send
            x = whole()
        if step.kind == "send_recv":
            return collectives.send_recv(x, group)
        return collectives.broadcast(x, 0, group)
    return run


# ----- index arithmetic ------------------------------------------------------------------

def _full(index: Index, n: int) -> torch.Tensor:
    return torch.arange(n) if index is None else index


def _count(index: Index, n: int) -> int:
    return n if index is None else index.numel()


def _meet(a: Index, b: Index) -> Index:
    """The indices in both (ascending)."""
    if a is None:
        return b
    if b is None:
        return a
    return a[torch.isin(a, b)]


def _positions(held: Index, wanted: Index, n: int) -> torch.Tensor:
    """Where the ``wanted`` indices are among the ``held`` ones (``wanted`` within ``held``)."""
    return torch.searchsorted(_full(held, n), _full(wanted, n))


def _sorting(order: torch.Tensor) -> torch.Tensor | None:
    """The permutation that puts ``order`` ascending (None: it is)."""
    return _unless_identity(torch.argsort(order))


def _unless_identity(index: torch.Tensor, n: int | None = None) -> torch.Tensor | None:
    """``index``, or None where it selects everything in order."""
    n = index.numel() if n is None else n
    if index.numel() == n and torch.equal(index, torch.arange(n)):
        return None
    return index


def _even_blocks(sends, recv, split_axis: int, cat_axis: int) -> bool:
    """Whether the plain all-to-all fits: equal parts to and from every member."""
    return (len({s[split_axis].numel() for s in sends}) == 1
            and len({None if r[cat_axis] is None else r[cat_axis].numel() for r in recv}) == 1
            and all(s[cat_axis].numel() == sends[0][cat_axis].numel() for s in sends)
            and all(torch.equal(s[cat_axis], torch.arange(s[cat_axis].numel())) for s in sends))


def _selector(index: torch.Tensor | None, device: torch.device) -> Select:
    """A function restricting a tensor to positions ``index`` along an axis: nothing for
    None, a narrow for a contiguous range, else an index_select (index on ``device``)."""
    if index is None:
        return lambda x, axis: x
    start, n = (int(index[0]) if index.numel() else 0), index.numel()
    if torch.equal(index, torch.arange(start, start + n)):
        return lambda x, axis: x.narrow(axis, start, n)
    index = index.to(device)
    return lambda x, axis: x.index_select(axis, index)


def _select(x: torch.Tensor, positions: dict[int, torch.Tensor]) -> torch.Tensor:
    for axis, index in positions.items():
        x = x.index_select(axis, index)
    return x


def _then(x: torch.Tensor | Pending, fn) -> torch.Tensor | Pending:
    """``fn(x)``, or for a pending ``x`` ``fn`` of its result when it arrives."""
    return x.then(fn) if isinstance(x, Pending) else fn(x)


def lower_reshard(expr: Reshard, extents: Mapping, donated: bool, communicator):
    """A communication's plan bound to ``communicator``'s rank: (implementation, plan steps,
    text), or None when no data moves; ``extents``: the bound global extents. ``donated``: its
    input is dead afterwards (not an input or output of the fusion, no later use), so its first
    step may reuse the buffer."""
    src, dst = expr.args[0], expr.outputs[0]
    if src.mesh is None:
        return None
    steps = plan_resharding(src, dst, extents)
    if not steps:
        return None
    whole = functools.partial(torch.empty, [extents[i] for i in src.materialized()],
                              dtype=src.dtype.torch_dtype, device=communicator.device)
    lowered = []
    for index, step in enumerate(steps):
        # Every rank takes part in creating a step's groups; members run the step.
        group = group_along(communicator, step.mesh or src.mesh, step.mesh_axis)
        if group is not None:
            lowered.append(lower_step(step, group, communicator.device,
                                      donated and index == 0, whole))
    keeps = communicator.rank in dst.mesh

    def reshard(x):
        for step in lowered:
            x = step(x)
        if keeps:
            return x
        resolved(x)  # a rank that only sends ends its part here
        return None

    text = "; ".join(f"{s.step.describe()} (ranks {list(s.group.ranks)})" for s in lowered)
    return reshard, tuple(s.step for s in lowered), text
