"""The strategies the planner searches, per mesh axis, and the layouts they make.

A layout gives each mesh axis one role:

- ``"tp"``: Megatron's tensor and sequence parallelism (column- and row-parallel linears,
  norms and the residual stream split on the sequence), on the last axis (where
  ``meshfuse.parallelize``'s styles shard);
- ``"cp"``: context parallelism, attention's sequence split, by ``ring``, ``allgather`` or
  ``alltoall`` (:mod:`meshfuse.parallel.context`);
- ``"dp"``: fully sharded data parallelism (FSDP; several ``dp`` axes shard over their
  product), the batch split;
- ``"ddp"``: replicated data parallelism (with a ``dp`` axis: HSDP's replicate dimension);
- ``"pp"``: pipeline stages (one per rank of the axis) under a schedule (``1f1b``,
  ``interleaved``: two virtual stages per rank).

At most one axis each for ``tp``, ``cp`` and ``pp``. A layout with ``tp`` runs its
collectives whole (the process group) or as stream loops beside their GEMMs whose blocks the
copy engines move (``overlap``: :mod:`meshfuse.parallel.overlap`, the runner's
``loop_transport="copy_engine"``). Recomputation is chosen per layer by the solver, not
here.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

ROLES = ("tp", "cp", "dp", "ddp", "pp")
CP_STRATEGIES = ("ring", "allgather", "alltoall")
SCHEDULES = ("1f1b", "interleaved")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One role per mesh axis (``shape``), the context strategy and the pipeline schedule
    when those roles are present."""

    shape: tuple[int, ...]
    roles: tuple[str, ...]
    cp_strategy: str | None = None
    schedule: str | None = None
    overlap: bool = False

    def size(self, role: str) -> int:
        """The ranks of ``role`` (the product of its axes' sizes; 1 without)."""
        return math.prod(n for n, r in zip(self.shape, self.roles) if r == role)

    def axes(self, role: str) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.roles) if r == role)

    def crosses_nodes(self, role: str, gpus_per_node: int) -> bool:
        """Whether a group of ``role``'s ranks spans nodes (ranks numbered row-major, the
        last axis fastest, nodes of ``gpus_per_node`` consecutive ranks)."""
        for i in self.axes(role):
            stride = math.prod(self.shape[i + 1:])
            if self.shape[i] > 1 and stride * self.shape[i] > gpus_per_node:
                return True
        return False

    def describe(self) -> str:
        parts = [f"{r}{n}" for n, r in zip(self.shape, self.roles)]
        extra = [s for s in (self.cp_strategy, self.schedule,
                             "copy-engine overlap" if self.overlap else None) if s]
        return "x".join(parts) + (f" ({', '.join(extra)})" if extra else "")


def enumerate_layouts(shape: Sequence[int], pipeline: bool = True, context: bool = True,
                      overlap: bool = True) -> list[Layout]:
    """Every layout of a mesh of ``shape`` (see the module doc); ``pipeline``, ``context``
    and ``overlap``: whether those roles, and TP's copy-engine loops, may be chosen."""
    shape = tuple(shape)
    roles = [r for r in ROLES if (pipeline or r != "pp") and (context or r != "cp")]
    layouts = []
    for assignment in itertools.product(roles, repeat=len(shape)):
        if any(assignment.count(r) > 1 for r in ("tp", "cp", "pp")):
            continue
        if "tp" in assignment and assignment.index("tp") != len(shape) - 1:
            continue
        cps = CP_STRATEGIES if "cp" in assignment else (None,)
        schedules = SCHEDULES if "pp" in assignment else (None,)
        overlaps = (False, True) if "tp" in assignment and overlap else (False,)
        for cp, schedule, loops in itertools.product(cps, schedules, overlaps):
            layouts.append(Layout(shape, assignment, cp, schedule, loops))
    return layouts


def megatron(shape: Sequence[int]) -> Layout:
    """The hand-written Megatron plan: TP+SP on the last axis, replicated data parallelism
    on the others."""
    return Layout(tuple(shape), ("ddp",) * (len(shape) - 1) + ("tp",))


def fsdp(shape: Sequence[int]) -> Layout:
    """Plain FSDP: every axis shards the parameters and splits the batch."""
    return Layout(tuple(shape), ("dp",) * len(shape))
