"""Attention split along the sequence: which ``sdpfa_fwd``/``sdpfa_bwd`` run context-parallel
themselves, and the strategy names their ``context_parallel`` argument takes.

This is the attention op's side of context parallelism, what its declaration and rules need:
the strategies themselves (the ring, the all-gather, the all-to-all), their planning, kernels
and communications are the package :mod:`meshfuse.parallel.context`.
"""

from __future__ import annotations

import os

from meshfuse.errors import DefinitionError
from meshfuse.ir.layout import device_ids

ENV_VAR = "MESHFUSE_CONTEXT_PARALLEL"
RING, ALLGATHER, ALLTOALL, AUTO = "ring", "allgather", "alltoall", "auto"
STRATEGIES = (RING, ALLGATHER, ALLTOALL)


def requested_strategy(op: str, value: str | None) -> str:
    """The strategy asked for: ``value`` (the op's ``context_parallel`` argument), else
    ``MESHFUSE_CONTEXT_PARALLEL``, else ``"auto"`` (the cost estimate picks)."""
    where = f"context_parallel={value!r}"
    if value is None:
        value = os.environ.get(ENV_VAR, "").strip().lower() or AUTO
        where = f"{ENV_VAR}={value!r}"
    if value not in STRATEGIES + (AUTO,):
        raise DefinitionError(
            f"{op}: {where} is not a context-parallel strategy; use one of "
            f"{', '.join(repr(s) for s in STRATEGIES + (AUTO,))}")
    return value


ATTENTION = ("sdpfa_fwd", "sdpfa_bwd")


def argument(expr, name: str):
    return expr.args[[p.name for p in expr.op.params].index(name)]


def sequence_parallel(expr) -> str | None:
    """The strategy of an attention that runs context-parallel itself (its sequences mapped
    together by :mod:`meshfuse.parallel.context.planning`), else None (an attention whose
    key/value sequence, if sharded, the engine gathers)."""
    if getattr(expr, "op", None) is None or expr.op.name not in ATTENTION:
        return None
    q, k = argument(expr, "q"), argument(expr, "k")
    if len(q.materialized()) != 4:
        return None
    out = expr.outputs[0]
    if k.logical[2] not in expr.id_map.get(out.logical[2], ()):
        return None
    return argument(expr, "context_parallel")


def sequence_mesh_axis(expr) -> tuple:
    """``(mesh, mesh axis)`` the query sequence of a context-parallel attention is sharded
    over."""
    q = argument(expr, "q")
    (_, pt), = device_ids(q)[q.logical[-2]]
    return q.mesh, q.mesh.axis_of(pt)
