"""Context parallelism: picks the strategy of every sequence-sharded attention (a build pass).

Runs after sharding propagation, before resharding. For each ``sdpfa_fwd``/``sdpfa_bwd``
whose query sequence is sharded it decides a strategy
(:mod:`meshfuse.ops.context_parallel`) and writes it into the expression's
``context_parallel`` argument, so the compiled fusion prints it:

- ``"ring"``, when q, k and v (and in the backward the output gradient, the output and the
  log-sum-exp) are all sharded alike on their sequence axis by one block split over one
  mesh axis, the two sequences are of one static extent, and there is no dropout. The
  expression's domain map is then rewritten: the key/value sequence maps onto the query
  sequence (a rank's keys are the rows of its queries' positions), and the reductions over
  the sequences are no longer partial on that mesh axis (the ring completes them). Resharding
  thus keeps k and v where they are; the runtime passes them around.
- ``"allgather"`` otherwise, or when asked for: k and v are gathered by the resharding pass
  (the op's sharding rule needs their sequence whole).

A strategy asked for that cannot run (``context_parallel="ring"`` on a layout the ring does
not take) is a :class:`~meshfuse.errors.ShardingError` saying why.
"""

from __future__ import annotations

from meshfuse.errors import ShardingError
from meshfuse.ir.fusion import Expr, Fusion, Reshard
from meshfuse.ir.placement import shard_signature
from meshfuse.ir.printer import format_expr
from meshfuse.ir.tensor_view import Scalar, TensorView
from meshfuse.ops.context_parallel import ALLGATHER, AUTO, RING, requested_strategy

ATTENTION = ("sdpfa_fwd", "sdpfa_bwd")
_ROWS = {"sdpfa_fwd": ("q",), "sdpfa_bwd": ("grad_attn", "q", "attn", "log_sumexp")}
_KEYS = ("k", "v")


def plan_context_parallel(fusion: Fusion) -> None:
    """Decides the strategy of each sequence-sharded attention of ``fusion`` (in place, on
    the compiler's private copy); see the module doc."""
    for expr in fusion.exprs:
        if isinstance(expr, Reshard) or expr.op.name not in ATTENTION:
            continue
        if not _sequence_sharded(_tensor(expr, "q")):
            continue
        wanted = requested_strategy(expr.op.name, _value(expr, "context_parallel"))
        why_not = _why_not_ring(expr)
        if wanted == RING and why_not is not None:
            raise ShardingError(f"{format_expr(expr)}: context_parallel='ring' cannot run: "
                                f"{why_not}; shard them alike or use 'allgather'")
        strategy = RING if wanted in (RING, AUTO) and why_not is None else ALLGATHER
        _set_arg(expr, "context_parallel", strategy)
        if strategy == RING:
            _map_sequences_together(expr)


def strategy_of(expr: Expr) -> str | None:
    """The strategy the pass chose for ``expr`` (None: not a sequence-sharded attention)."""
    if isinstance(expr, Reshard) or expr.op is None or expr.op.name not in ATTENTION:
        return None
    value = _value(expr, "context_parallel")
    return value if value in (RING, ALLGATHER) else None


def sequence_axis(expr: Expr) -> tuple:
    """``(mesh, mesh axis)`` the query sequence of a ring attention is sharded over."""
    q = _tensor(expr, "q")
    (pt, _), = shard_signature(q, q.logical[-2])
    return q.mesh, q.mesh.axis_of(_parallel_type(q, pt))


def _parallel_type(tv: TensorView, value: str):
    return next(pt for pt in tv.parallel.values() if pt.value == value)


def _why_not_ring(expr: Expr) -> str | None:
    """Why a ring cannot run ``expr``, or None."""
    q = _tensor(expr, "q")
    names = _ROWS[expr.op.name] + _KEYS
    if len(q.logical) != 4:
        return "q has leading axes before [batch, heads, sequence, head_dim]"
    signature = shard_signature(q, q.logical[-2])
    if len(signature) != 1 or len(signature[0][1]) != 1 or signature[0][1][0][2]:
        return "the query sequence is not sharded by one block split over one mesh axis"
    for name in names:
        tv = _tensor(expr, name)
        if tv.mesh != q.mesh or shard_signature(tv, tv.logical[2]) != signature:
            return f"{tv.name} ({name}) is not sharded on its sequence as q ({q.name}) is"
    s_q, s_kv = q.logical[-2].extent, _tensor(expr, "k").logical[-2].extent
    if s_q is None or s_q != s_kv:
        return f"the query and key sequences are not of one static extent ({s_q}, {s_kv})"
    if _value(expr, "dropout_p") != 0.0:
        return "dropout_p is not a constant 0"
    return None


def _map_sequences_together(expr: Expr) -> None:
    """The domain map of a ring attention: each output's sequence maps from the query and
    the key sequences both, and no reduction maps from a sequence (the ring completes it)."""
    rows = {_tensor(expr, n).logical[2] for n in _ROWS[expr.op.name]}  # lse is [b, h, s]
    keys = {_tensor(expr, n).logical[2] for n in _KEYS}
    sequences = rows | keys
    id_map = {}
    for out_id, sources in expr.id_map.items():
        if out_id.is_reduction:
            sources = tuple(s for s in sources if s not in sequences)
        elif set(sources) & sequences:
            sources = sources + tuple(sorted(sequences - set(sources), key=_order(expr)))
        id_map[out_id] = sources
    expr.id_map = id_map


def _order(expr: Expr):
    ids = [i for t in expr.tensor_inputs for i in t.logical]
    return ids.index


def _sequence_sharded(tv: TensorView) -> bool:
    return tv.mesh is not None and len(tv.logical) >= 4 and \
        bool(shard_signature(tv, tv.logical[-2]))


def _position(expr: Expr, name: str) -> int:
    return [p.name for p in expr.op.params].index(name)


def _tensor(expr: Expr, name: str) -> TensorView:
    return expr.args[_position(expr, name)]


def _value(expr: Expr, name: str):
    value = expr.args[_position(expr, name)]
    return value.value if isinstance(value, Scalar) else value


def _set_arg(expr: Expr, name: str, value) -> None:
    args = list(expr.args)
    args[_position(expr, name)] = value
    expr.args = tuple(args)
