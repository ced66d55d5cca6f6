"""Context parallelism: picks the strategy of every sequence-sharded attention (a build pass).

Runs after sharding propagation, before resharding. For each ``sdpfa_fwd``/``sdpfa_bwd``
whose query sequence is sharded it decides a strategy (:mod:`meshfuse.parallel.context.record`)
and writes it into the expression's ``context_parallel`` argument, so the compiled fusion
prints it.

When q, k and v are all sharded alike on their sequence axis by one block or zig-zag split
over one mesh axis (in the backward the output gradient, the output and the log-sum-exp
may be sharded otherwise: their sequences are mapped onto q's like k's, so resharding puts
them as q is), with static sequence extents (the key sequence may be of another length, cross
attention, on a block split) and a constant dropout_p, the attention runs context-parallel
itself: ``ring``, ``allgather`` or ``alltoall`` (when the local heads divide
over the ranks, the ranks hold equal blocks and there is no dropout), the one of least
estimated time
(:mod:`meshfuse.parallel.context.cost`) unless one is asked for. Its domain map is then
rewritten: the key/value sequence maps onto the query sequence (a rank's keys are the rows of
its queries' positions) and no reduction maps from a sequence (the strategy completes it).
Resharding thus keeps q, k and v where they are; the runtime moves the blocks.

Otherwise the strategy is ``allgather`` done by the engine: the op's sharding rule needs the
key/value sequence whole, and resharding gathers it (causal attention: the query sequence
too). Asking for ``ring`` or ``alltoall`` where it cannot run is a
:class:`~meshfuse.errors.ShardingError` saying why.
"""

from __future__ import annotations

import torch

from meshfuse.errors import ShardingError
from meshfuse.ir.fusion import Expr, Fusion, Reshard
from meshfuse.ir.layout import shard_factor
from meshfuse.ir.placement import shard_signature
from meshfuse.ir.printer import format_expr
from meshfuse.ir.tensor_view import Scalar, TensorView
from meshfuse.ops.attention.groups import replicated_kv_axes
from meshfuse.ops.attention.sequence import (
    ALLGATHER,
    ALLTOALL,
    ATTENTION,
    AUTO,
    RING,
    STRATEGIES,
    requested_strategy,
)
from meshfuse.parallel.context.cost import Problem, choose, machine
from meshfuse.passes.pipeline import register_strategy_pass

_ROWS = {"sdpfa_fwd": ("q",), "sdpfa_bwd": ("grad_attn", "q", "attn", "log_sumexp")}
_KEYS = ("k", "v")


@register_strategy_pass
def plan_context_parallel(fusion: Fusion) -> None:
    """Decides the strategy of each sequence-sharded attention of ``fusion`` (in place, on
    the compiler's private copy); see the module doc."""
    for expr in fusion.exprs:
        if isinstance(expr, Reshard) or expr.op.name not in ATTENTION:
            continue
        if not _sequence_sharded(_tensor(expr, "q")):
            continue
        wanted = requested_strategy(expr.op.name, _value(expr, "context_parallel"))
        why_not = _why_not_sequence_parallel(expr)
        if why_not is None:
            strategy = _strategy(expr, wanted)
            _map_sequences_together(expr)
        elif wanted in (RING, ALLTOALL):
            raise ShardingError(f"{format_expr(expr)}: context_parallel={wanted!r} cannot run: "
                                f"{why_not}; shard them alike or use 'allgather'")
        else:
            strategy = ALLGATHER  # the engine gathers k and v
        _set_arg(expr, "context_parallel", strategy)


def _strategy(expr: Expr, wanted: str) -> str:
    """The strategy asked for, or the estimate's choice among those that can run."""
    why_not_alltoall = _why_not_alltoall(expr)
    if wanted == ALLTOALL and why_not_alltoall is not None:
        raise ShardingError(f"{format_expr(expr)}: context_parallel='alltoall' cannot run: "
                            f"{why_not_alltoall}; use 'ring' or 'allgather'")
    if wanted != AUTO:
        return wanted
    allowed = STRATEGIES if why_not_alltoall is None else (RING, ALLGATHER)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return choose(problem(expr), machine(device), allowed)[0]


def problem(expr: Expr) -> Problem:
    """What the cost estimate needs to know of a sequence-sharded attention (symbolic batch
    or head extents count as 1)."""
    q, v = _tensor(expr, "q"), _tensor(expr, "v")
    b, h, s, e = (i.extent or 1 for i in q.materialized())
    s_kv = _tensor(expr, "k").materialized()[2].extent or s
    causal = _value(expr, "is_causal") is not False
    zigzag = any(step[1] == "zigzag" for _, path in shard_signature(q, q.logical[2])
                 for step in path)
    kv_heads = (v.materialized()[1].extent or h) // shard_factor(v, v.materialized()[1])
    return Problem(b // shard_factor(q, q.logical[0]), h // shard_factor(q, q.logical[1]), s,
                   e, v.logical[3].extent or e, q.dtype.torch_dtype.itemsize,
                   _axis_size(q), causal, expr.op.name == "sdpfa_bwd", zigzag, kv_heads, s_kv)


def _axis_size(q: TensorView) -> int:
    return shard_factor(q, q.logical[2])


def _why_not_sequence_parallel(expr: Expr) -> str | None:
    """Why the attention cannot run context-parallel itself, or None."""
    q = _tensor(expr, "q")
    if len(q.materialized()) != 4:
        return "q has leading axes before [batch, heads, sequence, head_dim]"
    signature = shard_signature(q, q.logical[2])
    if len(signature) != 1 or len(signature[0][1]) != 1 or signature[0][1][0][2]:
        return ("the query sequence is not sharded by one block or zig-zag split over one "
                "mesh axis")
    for name in _KEYS:  # the other query rows (a backward's) are resharded as q if need be
        tv = _tensor(expr, name)
        if tv.mesh != q.mesh or shard_signature(tv, tv.logical[2]) != signature:
            return f"{tv.name} ({name}) is not sharded on its sequence as q ({q.name}) is"
    out = expr.outputs[0]  # on another mesh, the attention runs there (q moved whole)
    if out.mesh is not None and out.mesh != q.mesh:
        return (f"its output {out.name} lies on another mesh than q ({q.name}): the "
                "attention runs there, on q moved whole")
    s_q, s_kv = q.logical[2].extent, _tensor(expr, "k").materialized()[2].extent
    if s_q is None or s_kv is None:
        return f"the query and key sequence extents are not static ({s_q}, {s_kv})"
    if s_q != s_kv:
        return _why_not_cross(signature, s_q, s_kv, _axis_size(q))
    if _value(expr, "dropout_p") is None:
        return "dropout_p is not a constant"
    return None


def _why_not_cross(signature, s_q: int, s_kv: int, n: int) -> str | None:
    """Why cross attention (sequences of lengths ``s_q`` and ``s_kv``, split alike over ``n``
    ranks by ``signature``) cannot run context-parallel, or None: it needs a block split
    into ``n`` blocks of each sequence (a zig-zag split balances causal work of equal
    lengths only; the split of one sequence is carried to the other only as equal blocks)."""
    if any(step[1] == "zigzag" for _, path in signature for step in path):
        return (f"the query and key sequences have different lengths ({s_q}, {s_kv}) and a "
                "zig-zag split, which balances causal work of equal lengths only; cross "
                "attention runs context-parallel on a block split")
    if s_q % n or s_kv % n:
        return (f"the query and key sequences have different lengths ({s_q}, {s_kv}) that do "
                f"not both divide over {n} ranks; cross attention runs context-parallel on "
                "equal blocks of each")
    return None


def _why_not_alltoall(expr: Expr) -> str | None:
    q = _tensor(expr, "q")
    n, s = _axis_size(q), q.logical[2].extent
    if replicated_kv_axes(expr, q, {name: _tensor(expr, name) for name in _KEYS}):
        return ("the key/value heads are replicated where the query heads are sharded (a "
                "rank computes with those its query heads need)")
    for tv in (q, _tensor(expr, "k")):  # query heads, and key/value heads (GQA: fewer)
        axis = tv.materialized()[1]
        if axis.extent is None:
            return "the head count is symbolic"
        local = axis.extent // shard_factor(tv, axis)
        if axis.extent % shard_factor(tv, axis) or local % n:
            return f"the {local} local heads of {tv.name} do not divide over {n} ranks"
    for extent in {s, _tensor(expr, "k").materialized()[2].extent}:
        if extent % n:
            return f"the sequence of {extent} does not divide over {n} ranks (blocks must be equal)"
    if _value(expr, "dropout_p") != 0.0:
        return "it has no dropout (the ring and the all-gather have)"
    return None


def _map_sequences_together(expr: Expr) -> None:
    """The domain map of a context-parallel attention: each output's sequence maps from the
    query and the key sequences both, and no reduction maps from a sequence."""
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
    if name in expr.attrs:
        expr.attrs[name] = value
