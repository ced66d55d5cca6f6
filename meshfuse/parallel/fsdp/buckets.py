"""One collective per layer: the gathers of a layer's parameters as one allgather, the
reductions of its gradients as one reduce-scatter (and one allreduce across replicas).

A member is one parameter's communication as the resharding plan has it (an ``allgather``
of its first axis over the shard dimension; a ``reduce_scatter`` of it, then perhaps an
``allreduce`` over the replicate dimension). A bucket lays its members side by side in one
flat buffer, each member's part of a rank padded to the longest (uneven shards: 5 rows over
3 ranks are 2, 2 and 1, each padded to 2), as FSDP2 does, runs one collective over it and
cuts each member's result back out.

Only block shards whose pieces lie in order along the axis are bucketed (what
:func:`~meshfuse.parallel.fsdp.transform.shard_fusion` makes); :func:`gather_member` and
:func:`reduce_member` return None for any other plan, which then runs alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshfuse.runtime.comm import collectives
from meshfuse.runtime.comm.collectives import Group
from meshfuse.runtime.comm.pending import Pending
from meshfuse.runtime.comm.reshard_plan import ReshardStep
from meshfuse.runtime.interpreter.bucketing import PendingPart

GroupOf = Callable[..., "Group | None"]  # (mesh, mesh_axis) -> this rank's group


@dataclasses.dataclass(frozen=True)
class Member:
    """One parameter's part of a bucket on this rank: the axis moved, each coordinate's
    extent along it, this rank's local shape (before a gather, after a reduction: the
    shard) and dtype."""

    axis: int
    sizes: tuple[int, ...]
    shard_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def longest(self) -> int:
        return max(self.sizes)

    @property
    def row(self) -> int:
        """Elements per index of the axis."""
        return math.prod(self.rest())

    @property
    def padded(self) -> int:
        """Elements of one coordinate's padded part."""
        return self.longest * self.row

    def rest(self) -> tuple[int, ...]:
        return tuple(n for a, n in enumerate(self.shard_shape) if a != self.axis)


def _pieces(step: ReshardStep, rank: int, spec) -> list[torch.Tensor]:
    coords = step.before.mesh.coordinate(rank)
    m, n = step.mesh_axis, step.before.shape[step.axis]
    size = step.before.mesh.shape[m]
    held = [spec.held(coords[:m] + (c,) + coords[m + 1:])[step.axis] for c in range(size)]
    return [torch.arange(n) if h is None else h for h in held]


def gather_member(plan: Sequence[ReshardStep], rank: int, shape, dtype) -> Member | None:
    """``plan`` (of a tensor of this rank's local ``shape``) as a bucket member, or None."""
    if len(plan) != 1 or plan[0].kind != "allgather" or plan[0].group_mesh is not None:
        return None
    step = plan[0]
    pieces = _pieces(step, rank, step.before)
    whole = step.after.held(step.before.mesh.coordinate(rank))[step.axis]
    whole = torch.arange(step.before.shape[step.axis]) if whole is None else whole
    if not torch.equal(torch.cat(pieces), whole):
        return None
    return Member(step.axis, tuple(len(p) for p in pieces), tuple(shape), dtype)


def reduce_member(plan: Sequence[ReshardStep], rank: int, shape, dtype) -> Member | None:
    """``plan`` (of a partial tensor of this rank's local ``shape``) as a bucket member:
    a reduce-scatter, perhaps followed by an allreduce; or None."""
    kinds = [s.kind for s in plan]
    if kinds not in (["reduce_scatter"], ["reduce_scatter", "allreduce"]) or \
            any(s.group_mesh is not None or s.reduce_op != "sum" for s in plan):
        return None
    step = plan[0]
    pieces = _pieces(step, rank, step.after)
    held = step.before.held(step.before.mesh.coordinate(rank))[step.axis]
    held = torch.arange(step.before.shape[step.axis]) if held is None else held
    if not torch.equal(torch.cat(pieces), held):
        return None
    coordinate = step.before.mesh.coordinate(rank)[step.mesh_axis]
    shard = list(shape)
    shard[step.axis] = len(pieces[coordinate])
    return Member(step.axis, tuple(len(p) for p in pieces), tuple(shard), dtype)


def allreduce_member(plan: Sequence[ReshardStep], rank: int, shape, dtype) -> Member | None:
    """``plan`` (of a partial tensor of this rank's local ``shape``) as a member of an
    allreduce bucket (HSDP's sum across replicas of a reduce-scattered shard), or None."""
    if [s.kind for s in plan] != ["allreduce"] or plan[0].reduce_op != "sum" or not shape:
        return None
    return Member(0, (shape[0],), tuple(shape), dtype)


def allreduce_call(members: Sequence[Member], group: Group, wide: torch.dtype | None = None
                   ) -> Callable[..., list]:
    """The implementation of an allreduce bucket: the members flattened into one buffer
    (in ``wide``, when given), summed by one allreduce, and cut back out."""
    sizes = [math.prod(m.shard_shape) for m in members]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def cut(flat: torch.Tensor, m: Member, offset: int, size: int) -> torch.Tensor:
        return flat[offset:offset + size].view(m.shard_shape).clone()

    def run(*partials: torch.Tensor) -> list:
        flat = torch.cat([x.reshape(-1) for x in partials])
        flat = flat if wide is None else flat.to(wide)
        summed = collectives.allreduce(flat, group, "sum", inplace=True, async_op=True)
        parts = [functools.partial(cut, m=m, offset=o, size=n)
                 for m, o, n in zip(members, offsets, sizes)]
        if not isinstance(summed, Pending):
            return [p(summed) for p in parts]
        return [PendingPart(summed, p) for p in parts]

    return run


def _padded_rows(x: torch.Tensor, axis: int, rows: int) -> torch.Tensor:
    """``x`` with ``axis`` outermost and padded with zeros to ``rows``, flattened."""
    y = x.movedim(axis, 0)
    if y.shape[0] < rows:
        y = torch.cat([y, y.new_zeros(rows - y.shape[0], *y.shape[1:])])
    return y.reshape(-1)


def gather_call(members: Sequence[Member], group: Group, account=None) -> Callable[..., list]:
    """The implementation of a gather bucket: called with the members' local shards, it
    launches one allgather and returns each member's gathered tensor (pending until read).
    When the first is read, all are cut out of the flat buffer, which is then freed: a
    layer's gathered parameters are alive from its first read to their last uses.
    ``account`` (a :class:`~meshfuse.parallel.fsdp.memory.GatheredBytes`) counts the flat
    buffer and the gathered tensors."""
    offsets = [sum(m.padded for m in members[:i]) for i in range(len(members))]
    total = sum(m.padded for m in members)

    def cut(flat: torch.Tensor, member: Member, offset: int) -> torch.Tensor:
        by_rank = flat.view(group.size, total)[:, offset:offset + member.padded]
        rows = by_rank.reshape(group.size, member.longest, *member.rest())
        out = torch.cat([rows[c, :n] for c, n in enumerate(member.sizes)])
        return out.movedim(0, member.axis)

    def run(*shards: torch.Tensor) -> list:
        send = torch.cat([_padded_rows(x, m.axis, m.longest) for x, m in zip(shards, members)])
        release = account.reserve(send.numel() * send.element_size() * group.size) \
            if account is not None else (lambda: None)

        def cut_all(flat: torch.Tensor) -> list[torch.Tensor]:
            outs = [cut(flat, m, o) for m, o in zip(members, offsets)]
            for out in outs if account is not None else ():
                account.add(out)
            release()
            return outs

        whole = collectives.allgather(send, 0, group, async_op=True)
        if not isinstance(whole, Pending):
            return cut_all(whole)
        whole.then(cut_all)
        return [PendingPart(whole, functools.partial(_item, i)) for i in range(len(members))]

    return run


class AheadOfStep:
    """A gather bucket's implementation that can also be launched ahead of its step, from
    outside its program (a model made of several fully sharded modules: the next module's
    gather under this module's compute). :meth:`prefetch` launches it on the parameter
    shards; the module *claims* it right before its program runs (``prefetch(...,
    claim=True)`` with the shards as they are then: launched anew if they changed); the
    step then takes the claimed result, and otherwise gathers what it is given."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call = call
        self._ahead: tuple[tuple, Any] | None = None
        self._claimed = False

    def prefetch(self, *shards: torch.Tensor, claim: bool = False) -> None:
        """Launches the gather of ``shards`` now (once for the same storages, versions and
        shapes); ``claim``: the next run of the step takes it, and it is waited for now
        (the parameters cut out of the bucket's buffer, which is freed: then the next
        module's gather is launched, so two modules' gathered parameters are alive)."""
        key = _identity(shards)
        if self._ahead is None or self._ahead[0] != key:
            self._drop()
            with torch.no_grad():  # as a program runs its steps
                self._ahead = (key, self.call(*shards))
        if claim:
            self._claimed = True
            self._wait()

    def _wait(self) -> None:
        values = self._ahead[1]
        with torch.no_grad():
            for v in values if isinstance(values, list) else [values]:
                if isinstance(v, Pending):
                    v.wait()

    def __call__(self, *shards: torch.Tensor):
        if self._ahead is not None and self._claimed:
            result, self._ahead, self._claimed = self._ahead[1], None, False
            return result
        self._drop()
        return self.call(*shards)

    def _drop(self) -> None:
        """Settles a launched gather no step took (its shards changed since)."""
        if self._ahead is not None:
            self._wait()
        self._ahead, self._claimed = None, False


def _identity(shards) -> tuple:
    return tuple((t.untyped_storage().data_ptr(), t.storage_offset(), t._version,
                  tuple(t.shape), t.dtype) for t in shards)


def _item(i: int, values: list) -> torch.Tensor:
    return values[i]


def reduce_call(members: Sequence[Member], group: Group, replicas: Group | None,
                wide: torch.dtype | None = None, summed: int | None = None,
                back: torch.dtype | None = None) -> Callable[..., list]:
    """The implementation of a reduction bucket: called with the members' partial tensors,
    it launches one reduce-scatter (then, across ``replicas``, one allreduce of the
    result: of its first ``summed`` members' shards, default all) and returns each member's
    reduced shard; with ``wide``, the partials are cast to it first, and the shards come
    back in it (the mixed-precision policy's ``reduce_dtype``: the program casts them to it
    next), or, with ``back``, cast to ``back`` (bf16 gradients summed in float32)."""
    offsets = [sum(m.padded for m in members[:i]) for i in range(len(members))]
    front = sum(m.padded for m in members[:len(members) if summed is None else summed])
    coordinate = group.coordinate

    def part(member: Member, offset: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def cut(flat: torch.Tensor) -> torch.Tensor:
            mine = flat[offset:offset + member.padded].view(member.longest, *member.rest())
            # a buffer of its own: the gradient holds its shard, not the padded bucket
            mine = mine[:member.sizes[coordinate]].movedim(0, member.axis)
            return mine.clone() if back is None else mine.to(back)
        return cut

    parts = [part(m, o) for m, o in zip(members, offsets)]

    def chunks(x: torch.Tensor, m: Member) -> torch.Tensor:
        """``x`` as one row per coordinate: that coordinate's part, padded."""
        split = x.movedim(m.axis, 0).split(list(m.sizes))
        return torch.stack([_padded_rows(p, 0, m.longest) for p in split])

    def run(*partials: torch.Tensor) -> list:
        send = torch.cat([chunks(x if wide is None else x.to(wide), m)
                          for x, m in zip(partials, members)], dim=1)
        reduced = collectives.reduce_scatter(send.reshape(-1), 0, group, "sum", async_op=True)
        if replicas is not None:
            across = _across(replicas, front)
            reduced = reduced.then(across) if isinstance(reduced, Pending) else across(reduced)
        if isinstance(reduced, Pending):
            return [PendingPart(reduced, p) for p in parts]
        return [p(reduced) for p in parts]

    return run


def _across(group: Group, front: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The sum of the first ``front`` elements of a reduced buffer across replicas (run
    when the reduce-scatter is read)."""
    def across(x: torch.Tensor) -> torch.Tensor:
        if front == x.numel():
            return collectives.allreduce(x, group, "sum", inplace=True)
        x[:front] = collectives.allreduce(x[:front], group, "sum")
        return x
    return across
