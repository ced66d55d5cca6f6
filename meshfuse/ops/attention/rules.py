"""Attention's planning rules: which input axes the kernels need whole, how a backward with
per-shard dropout replays its forward's sharding and RNG state, and each rank's dropout site.

These read an ``sdpfa_fwd``/``sdpfa_bwd`` expression of the fusion (its arguments, its
forward through the seed it reads) and never run a kernel; :mod:`meshfuse.ops.attention.declaration`
registers them with the two ops.
"""

from __future__ import annotations

from meshfuse.errors import ShardingError
from meshfuse.ir.placement import shard_signature
from meshfuse.ir.tensor_view import Scalar
from meshfuse.ops.attention.dropout import SHARD, attention_site, resolve_mode
from meshfuse.ops.attention.groups import gathered_kv_heads, kv_head_index
from meshfuse.ops.attention.sequence import sequence_parallel


def whole_axes(expr) -> set:
    """The input axes attention computes on whole (its sharding rule): the head dims and,
    in the forward, the key/value sequence (a softmax over them is not a sum of the shards'
    results); with a causal mask, or one not known before execute, the query sequence too (a
    shard's mask would need its offset). Batch and heads shard freely; so does the query
    sequence of non-causal attention, whose backward then sums the key/value gradients of
    the query shards (their reduction over the query sequence is a partial result), and the
    key sequence of a backward without mask or dropout (q_grad is then the partial sum).
    Grouped key/value heads sharded otherwise than by groups are needed whole too
    (:mod:`meshfuse.ops.attention.groups`)."""
    args = dict(zip((p.name for p in expr.op.params), expr.args))
    q, k, v = args["q"], args["k"], args["v"]
    lead = len(q.materialized()) - 4  # leading axes before [b, h, s, e]
    seq, dim = lead + 2, lead + 3

    def axis(t, a):
        return t.materialized()[a]

    whole = {axis(k, seq), axis(v, seq), axis(q, dim), axis(k, dim)}
    ring = sequence_parallel(expr) is not None
    if ring:  # a context-parallel strategy moves the sequence shards itself
        whole = {axis(q, dim), axis(k, dim)}
    rows = [q]
    causal = _arg(expr, "is_causal") is not False
    if expr.op.name == "sdpfa_bwd":
        grad, attn = args["grad_attn"], args["attn"]
        whole |= {axis(v, dim), axis(grad, dim), axis(attn, dim)}
        rows += [grad, attn, args["log_sumexp"]]
        if not causal and _arg(expr, "dropout_p") == 0.0:
            # On a key shard q_grad is a partial sum (the log-sum-exp makes each block's
            # probabilities exact); neither mask knows a key shard's offset.
            whole -= {axis(k, seq), axis(v, seq)}
    if ring:
        whole -= {axis(k, seq), axis(v, seq)}
    elif causal:
        whole |= {axis(t, seq) for t in rows}
    return whole | gathered_kv_heads(expr)


def _raw(expr, name: str):
    """The argument ``name`` of ``expr`` as given (a Val or a Python value)."""
    return expr.args[[p.name for p in expr.op.params].index(name)]


def _arg(expr, name: str):
    """The argument's constant value (None for a scalar input); tensors as they are."""
    value = _raw(expr, name)
    return value.value if isinstance(value, Scalar) else value


def replayed_sharding(expr):
    """A backward with per-shard dropout streams replays its forward's: ``q_grad`` must lie
    on batch, heads and query sequence (every axis but the head dim) as the forward's
    attention output did, for each rank to redraw the masks its forward drew."""
    forward = _forward_of(expr)
    if expr.op.name != "sdpfa_bwd" or forward is None or _arg(expr, "dropout_p") == 0.0 \
            or _bwd_mode(expr) != SHARD:
        return None
    return forward.outputs[0], tuple(range(len(_raw(expr, "q").logical) - 1))


def check_sharding(expr) -> None:
    """A backward with per-shard dropout streams must be sharded as its forward was (the
    engine makes it so: see ``replayed_sharding``)."""
    replayed = replayed_sharding(expr)
    if replayed is None:
        return
    source, axes = replayed
    if any(shard_signature(source, source.logical[a]) !=
           shard_signature(expr.outputs[0], expr.outputs[0].logical[a]) for a in axes):
        raise ShardingError(
            f"sdpfa_bwd: {expr.outputs[0].name} is sharded otherwise than "
            f"{source.name} on batch, heads or sequence, so the per-shard dropout "
            "streams of the forward cannot be replayed; schedule both alike, or use "
            "dropout_mode='global'"
        )


def _forward_of(expr):
    """The ``sdpfa_fwd`` whose seed an ``sdpfa_bwd`` reads, or None."""
    seed = _arg(expr, "seed") if expr.op.name == "sdpfa_bwd" else None
    forward = getattr(seed, "definition", None)
    while forward is not None and (forward.op is None or forward.op.name == "set"):
        forward = getattr(forward.args[0], "definition", None)  # through copies of the seed
    return forward if forward is not None and forward.op.name == "sdpfa_fwd" else None

def _bwd_mode(expr) -> str:
    """The backward's dropout mode: its own, else its forward's, else the default."""
    mode = _arg(expr, "dropout_mode")
    forward = _forward_of(expr)
    if mode is None and forward is not None:
        mode = _arg(forward, "dropout_mode")
    return resolve_mode("sdpfa_bwd", mode)


def _seed_arg(expr, name: str):
    """A seed argument for ``explain``: its constant value, or the scalar input itself."""
    value = _raw(expr, name)
    return value.value if isinstance(value, Scalar) and value.is_constant else value


def localize(expr, here):
    """This rank's dropout site (its shard's position in the global ``[..., B, H, S, Skv]``)
    and, with grouped-query heads, which of its key/value heads serve its query heads."""
    attrs, note = _localize(expr, here)
    q, k = _raw(expr, "q"), _raw(expr, "k")
    heads, kv_heads = q.materialized()[-3], k.materialized()[-3]
    if here.extents is not None and here.extents[heads] != here.extents[kv_heads]:
        index = kv_head_index(here.index(q).axis(q.ndim - 3), here.index(k).axis(k.ndim - 3),
                              here.extents[heads], here.extents[kv_heads])
        if index is not None:
            attrs = {**attrs, "kv_heads": index}
    return attrs, note


def _localize(expr, here):
    backward = expr.op.name == "sdpfa_bwd"
    mode = _bwd_mode(expr) if backward else resolve_mode("sdpfa_fwd", _arg(expr, "dropout_mode"))
    k = expr.args[2 if backward else 1]
    kv_length = here.index(k).extents[-2]
    site = attention_site(mode, here.index(expr.outputs[0]), kv_length)
    if sequence_parallel(expr) is not None:
        # Its strategy adds the record of its ring (meshfuse.parallel.context); the
        # strategy's transfers are listed with explain's communications.
        return {"site": site}, ""
    p = _arg(expr, "dropout_p")
    if p == 0.0:
        return {"site": site}, ""
    forward = _forward_of(expr) if backward else expr
    if forward is None:
        return {"site": site}, f"dropout {mode} mode, the seed and offset given as inputs"
    note = site.describe(*(_seed_arg(forward, name) for name in ("rng_seed", "rng_offset")))
    # A context-parallel forward returns its seed and offset in nvFuser's form.
    attrs = {"site": site, "kernel_form": sequence_parallel(forward) is None and
             state_stays_inside(forward)}
    return attrs, note if not backward else f"replays the forward's {note}"


_REPLAYED_SCALARS = ("dropout_p", "is_causal")  # equal in a backward that replays a forward


def state_stays_inside(forward) -> bool:
    """Whether ``forward``'s RNG state may travel in its kernel's own form: it is no fusion
    output, and every reader is an ``sdpfa_bwd`` taking it directly, with the forward's q,
    k, v, dropout_p, is_causal and mode (so it binds the forward's kernel). Decided once per
    signature, alike for the forward and its backwards."""
    seed, offset = forward.outputs[2], forward.outputs[3]
    fusion = seed.fusion
    if any(t in fusion.outputs() for t in (seed, offset)):
        return False
    uses = fusion.uses()
    readers = uses.get(seed, []) + uses.get(offset, [])
    return bool(readers) and all(_replays(forward, e) for e in readers)


def _replays(forward, expr) -> bool:
    if getattr(getattr(expr, "op", None), "name", None) != "sdpfa_bwd":
        return False
    expected = {n: _raw(forward, n) for n in ("q", "k", "v")}
    expected.update(seed=forward.outputs[2], offset=forward.outputs[3])
    if any(_raw(expr, n) is not t for n, t in expected.items()):
        return False
    if not all(_raw(expr, n) is _raw(forward, n) or
               (_arg(forward, n) is not None and _arg(expr, n) == _arg(forward, n))
               for n in _REPLAYED_SCALARS):
        return False
    return _bwd_mode(expr) == resolve_mode("sdpfa_fwd", _arg(forward, "dropout_mode"))
