"""Bucketed allreduces: small allreduces that nothing in the program waits for, run as one.

A backward pass reduces the gradient of every replicated parameter over the ranks that
computed partial sums of it (a layer norm's weight and bias under sequence parallelism: one
allreduce each). Such a gradient is an output of the program and no later step reads it, so
its allreduce need not run where it was planned: it can wait for the others and go with them.
Small allreduces cost their latency, not their bytes: ``n`` of them cost ``n`` launches and
``n`` latencies, one bucket of them one (DDP's gradient buckets, for the same reason).

:func:`plan_buckets` groups the allreduces that may be bucketed (:func:`bucketable`), in
launch order, by group, reduce op and dtype, into buckets of at most :data:`BUCKET_BYTES`;
it reads only the fusion and the bound shapes, so every rank of a group buckets alike.
:func:`run_in_buckets` rewrites a per-rank program: each bucket's members become one
communication step, placed where the last of them was (every member's input exists there),
whose implementation (:func:`bucket_call`) flattens the members' tensors into one buffer,
launches one allreduce of it and returns each member's result as a view of the reduced
buffer (a :class:`PendingPart` while the allreduce runs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from meshfuse.runtime.comm.pending import Pending
from meshfuse.runtime.comm.reshard_plan import ReshardStep
from meshfuse.runtime.interpreter.executor import RESHARD, Program, Step

# The most bytes one bucket reduces. Under about a megabyte an allreduce on NVLink or a
# network costs its latency more than its bytes, so a bucket costs about what one member
# did; larger gradients gain little from one launch and would wait for their bucket's last
# member instead of overlapping the steps in between.
BUCKET_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A bucketable allreduce: the slot of its result, the tensor's name, its plan step and
    its local shape and dtype."""

    slot: int
    name: str
    plan: ReshardStep
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Allreduces run as one; ``members`` in launch order."""

    members: tuple[Candidate, ...]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.members)


def bucketable(plan: Sequence[ReshardStep], read_later: bool, dead_input: bool) -> bool:
    """Whether a communication may join a bucket: its plan is one allreduce (a partial
    tensor made whole on every rank of one group); no expression reads its result
    (``read_later``: the result is a fusion output, or unused), so launching it later
    delays nothing; and its input is dead after it (``dead_input``), so holding the input
    until the bucket launches keeps nothing else alive."""
    return len(plan) == 1 and plan[0].kind == "allreduce" and dead_input and not read_later


def plan_buckets(candidates: Sequence[Candidate], limit: int = BUCKET_BYTES) -> list[Bucket]:
    """Buckets of two or more of ``candidates`` (bucketable allreduces, in launch order).
    Members of a bucket share the group (mesh and mesh axis), reduce op and dtype; a bucket
    holds at most ``limit`` bytes, filled in launch order (a larger tensor stays alone)."""
    filling: dict[tuple, list[Candidate]] = {}
    full: list[list[Candidate]] = []
    for c in candidates:
        if c.nbytes > limit:
            continue  # alone, where it was planned
        key = (c.plan.mesh, c.plan.mesh_axis, c.plan.reduce_op, c.dtype)
        members = filling.setdefault(key, [])
        if members and sum(m.nbytes for m in members) + c.nbytes > limit:
            full.append(members)
            members = filling[key] = []
        members.append(c)
    return [Bucket(tuple(m)) for m in [*full, *filling.values()] if len(m) > 1]


def run_in_buckets(steps: Sequence[Step], calls: Sequence[Callable], buckets: Sequence[Bucket],
                   rank: int) -> tuple[list[Step], list[Callable]]:
    """``steps`` and their ``calls`` with each bucket's member steps (those among the
    program's top-level steps: none inside a stream-parallel loop) replaced by one step,
    where the last of them was."""
    steps, calls = list(steps), list(calls)
    for bucket in buckets:
        at = {s.outputs[0]: k for k, s in enumerate(steps) if s.op == RESHARD and s.outputs}
        found = [(m, at[m.slot]) for m in bucket.members if m.slot in at]
        if len(found) < 2:
            continue
        members, places = [m for m, _ in found], [k for _, k in found]
        step, call = _bucket_step(Bucket(tuple(members)), [steps[k] for k in places],
                                  calls[places[0]], rank)
        steps[places[-1]], calls[places[-1]] = step, call
        for k in sorted(places[:-1], reverse=True):
            del steps[k], calls[k]
    return steps, calls


def _bucket_step(bucket: Bucket, member_steps: list[Step], head: Callable, rank: int
                 ) -> tuple[Step, Callable]:
    """The bucket's step: the members' inputs in, their results out, their inputs freed
    (each dead after its member, so after the bucket too); run by the first member's own
    allreduce, given the flat buffer."""
    plan = bucket.members[0].plan
    ranks = list(plan.mesh.group_ranks(rank, plan.mesh_axis))
    names = ", ".join(m.name for m in bucket.members)
    label = (f"{names} = reshard(...): one {plan} of {len(bucket.members)} tensors, "
             f"{bucket.nbytes} bytes (ranks {ranks})")
    step = Step(RESHARD, tuple(a for s in member_steps for a in s.args), {},
                tuple(m.slot for m in bucket.members),
                tuple(dict.fromkeys(f for s in member_steps for f in s.free)), label,
                tuple(m.plan for m in bucket.members))
    return step, bucket_call(head, [m.shape for m in bucket.members])


def bucket_lines(program: Program) -> list[str]:
    """``explain``'s lines on the buckets of ``program`` (the allreduces listed above that
    run as one)."""
    lines = [f"  {s.label}" for s in program.steps if s.op == RESHARD and len(s.outputs) > 1]
    return [f"allreduces run as one bucket on rank {program.rank}:", *lines] if lines else []


def bucket_call(reduce: Callable[[torch.Tensor], torch.Tensor | Pending],
                shapes: Sequence[tuple[int, ...]]) -> Callable[..., list]:
    """A bucket's implementation: called with its members' local tensors, it reduces them
    with ``reduce`` (one allreduce, which may reuse the buffer it is given) as one flat
    buffer and returns each member's result, a view of the reduced buffer (a
    :class:`PendingPart` while the allreduce runs)."""
    sizes = [math.prod(s) for s in shapes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def part(offset: int, size: int, shape) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda flat: flat[offset:offset + size].view(shape)

    parts = [part(o, n, s) for o, n, s in zip(offsets, sizes, shapes)]

    def run(*tensors: torch.Tensor) -> list:
        reduced = reduce(torch.cat([t.reshape(-1) for t in tensors]))
        if isinstance(reduced, Pending):
            return [PendingPart(reduced, p) for p in parts]
        return [p(reduced) for p in parts]

    return run


class PendingPart(Pending):
    """One member's result of a bucket in flight: a part of another
    :class:`~meshfuse.runtime.comm.pending.Pending`'s result. Waiting for it waits for the
    whole bucket, once (later waits, of this part or another, return at once)."""

    __slots__ = ("_part", "_whole")

    def __init__(self, whole: Pending, part: Callable[[torch.Tensor], torch.Tensor]) -> None:
        # Not registered as in flight: the whole is, and is waited for once.
        self._whole, self._part = whole, part
        self.label = whole.label

    def abandon(self) -> bool:
        return self._whole.abandon()

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Pending:
        part = self._part
        self._part = lambda flat: fn(part(flat))
        return self

    def wait(self) -> torch.Tensor:
        return self._part(self._whole.wait())
