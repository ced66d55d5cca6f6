"""Context-parallel attention: the runtime of an ``sdpfa_fwd``/``sdpfa_bwd`` step whose record
carries a :class:`~meshfuse.parallel.context.record.ContextParallel` (that module describes the
strategies); every collective goes through :mod:`meshfuse.runtime.comm.collectives`.

**Ring**, forward, on each rank: at step ``s`` it holds the key/value block of position
``p - s``; it launches that block's transfer to the next rank (``ring_shift``) *before*
computing its queries against it, so the transfer runs under the kernels, then waits for
the block of the previous rank. After ``n`` steps (``n - 1`` transfers of k and v) every
query has met every key; the blocks' outputs are merged by their log-sum-exp. Backward: k
and v travel the same way; at step ``s >= 1`` a rank computes its queries' gradients against
the block it holds (dq stays) and adds the block's dk/dv to the block's accumulators, which
then go to the next rank: after the last step that is the block's home. The accumulators
begin at step 1 (in the inputs' dtype on a ring of two, where each sum has two terms, else
float32: :attr:`~meshfuse.parallel.context.record.ContextParallel.sums_in_input_dtype`); the
gradients of a rank's own block never travel. That block's kernels run in
``own_parts`` parts (of the batch, or of the heads): the first at step 0, under the first k/v
transfer, the others after the last step, under the accumulators' trip home; the own parts
and the arriving sums are then added, rounded once to the inputs' dtype. On a ring of two a
backward thus moves k/v once and the sums once, and no transfer waits after the kernels.

**Dropout** (ring and all-gather): every kernel call runs the math kernel with the keep mask
of its block (:class:`~meshfuse.parallel.context.blocks.BlockDropout`), drawn from the forward's
seed and offset and the block's global position; the forward returns that seed and offset,
and the backward draws each block's mask again from them.

**All-gather**: k and v gathered (both in flight at once), this rank's queries against every
position's block; the backward reduce-scatters dk and dv (float32).

**All-to-all** (Ulysses): q, k, v (and in the backward the output gradient, output and
log-sum-exp) go from sequence-sharded to head-sharded, the kernel runs on whole sequences
(rows put in global order when the layout is a zig-zag), and the results come back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from meshfuse.ir.fusion import Expr
from meshfuse.ops.attention.dropout import no_rng_state, rng_state, seed_and_offset
from meshfuse.ops.attention.groups import with_kv_heads
from meshfuse.ops.attention.sequence import (
    ALLGATHER,
    ALLTOALL,
    ENV_VAR,
    RING,
    sequence_mesh_axis,
    sequence_parallel,
)
from meshfuse.ops.random.declaration import resolve_seed
from meshfuse.parallel.context.blocks import (
    BlockDropout,
    Merged,
    add_key_gradients,
    backward_blocks,
    block_backward,
    block_forward,
    forward_blocks,
    sums_dtype,
)
from meshfuse.parallel.context.record import COMPILED, TRANSPORT_VAR, Block, ContextParallel
from meshfuse.passes.localization import Local
from meshfuse.runtime.comm.collectives import (
    Group,
    all_to_all,
    allgather,
    reduce_scatter,
    ring_shift,
)
from meshfuse.runtime.comm.pending import resolved
from meshfuse.runtime.interpreter.agreement import Fact


def _shape(t: torch.Tensor, rows: int) -> tuple[int, ...]:
    return (*t.shape[:-2], rows, t.shape[-1])


def _check_local(record: ContextParallel, op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        keyed = name in ("k", "v")
        rows = (record.key_length if keyed else record.length)(record.position)
        assert t.shape[-2] == rows, (
            f"{op}: {name} holds {t.shape[-2]} sequence rows, its ring record {rows}")


def _merged(record: ContextParallel, q, v) -> Merged:
    return Merged(q, v, sums_dtype(record, q), record.merge == COMPILED)


def ring_forward(q, k, v, scale, causal: bool, record: ContextParallel, group: Group,
                 dropout: BlockDropout | None = None):
    """This rank's ``(attn, log_sumexp)`` of ring attention (see the module doc)."""
    _check_local(record, "sdpfa_fwd", q=q, k=k, v=v)
    merged, transport = _merged(record, q, v), record.transport
    block = (k, v)
    for step in range(record.size):
        pending = None
        if step < record.size - 1:
            rows = record.key_length(record.holder(step + 1))
            pending = ring_shift(block, [_shape(k, rows), _shape(v, rows)], group,
                                 transport=transport, slot=f"forward{step % 2}")
        forward_blocks(q, *block, scale, causal, record, record.holder(step), merged, dropout)
        if pending is not None:
            block = pending.wait()
    return merged.result(q.dtype)


def ring_backward(grad, q, k, v, attn, lse, scale, causal: bool, record: ContextParallel,
                  group: Group, dropout: BlockDropout | None = None):
    """This rank's ``(dq, dk, dv)`` of ring attention (see the module doc)."""
    _check_local(record, "sdpfa_bwd", grad_attn=grad, q=q, k=k, v=v, attn=attn)
    dtype = sums_dtype(record, q)  # the inputs' on a ring of two: no float32 sums at all
    own = _OwnBlock(grad, q, k, v, attn, lse, scale, causal, record, dropout, dtype)
    if record.size == 1:
        own.compute(0, record.own_parts)
        return own.joined(None, (None, None))
    transport = record.transport
    pending = ring_shift((k, v), _block_shapes(k, v, record, 1), group, transport=transport,
                         slot="backward0")
    own.compute(0, 1)  # the first part of this rank's own block hides the first transfer
    dq, sums, block = None, None, pending.wait()
    for step in range(1, record.size):
        last = step == record.size - 1
        if not last:
            pending = ring_shift(block, _block_shapes(k, v, record, step + 1), group,
                                 transport=transport, slot=f"backward{step % 2}")
        dq, partial = backward_blocks(grad, q, *block, attn, lse, scale, causal, record,
                                      record.holder(step), dq, dropout)
        # The block's sums arrived while the kernels ran; they go on to the next rank, which
        # is the block's home after the last step.
        travelling = add_key_gradients(partial, sums.wait() if sums is not None
                                       else (None, None), block, dtype)
        sums = ring_shift(travelling, _block_shapes(k, v, record, step + 1), group,
                          transport=transport, slot="home" if last else f"sums{step % 2}")
        if not last:
            block = pending.wait()
    own.compute(1, record.own_parts)  # the rest of the own block hides the trip home
    return own.joined(dq, sums.wait())


def _block_shapes(k, v, record: ContextParallel, step: int) -> list[tuple[int, ...]]:
    """The shapes of k and v (or of their sums) of the block this rank holds at ``step``
    (``step == size``: its own)."""
    rows = record.key_length(record.holder(step))
    return [_shape(k, rows), _shape(v, rows)]


class _OwnBlock:
    """The gradients of this rank's queries against its own key/value block, computed in
    ``record.own_parts`` equal parts of the batch (of the heads when the batch is 1; of the
    query heads and of the key/value heads that serve them alike), and joined at the end with
    the sums of the other blocks: :meth:`joined`. The dk/dv of the own block never travel."""

    def __init__(self, grad, q, k, v, attn, lse, scale, causal, record, dropout, dtype):
        self._args = (grad, q, k, v, attn, lse)
        self._call = (scale, causal, record)
        self._dropout, self._dtype = dropout, dtype
        axis = 0 if q.shape[0] > 1 else 1
        self._parts = list(zip(_parts(q.shape[axis], record.own_parts, axis),
                               _parts(k.shape[axis], record.own_parts, axis)))
        self._results: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def compute(self, first: int, stop: int) -> None:
        """Launches the kernels of parts ``first`` to ``stop - 1``."""
        grad, q, k, v, attn, lse = self._args
        scale, causal, record = self._call
        for rows, keys in self._parts[first:stop]:
            dq, partial = backward_blocks(grad[rows], q[rows], k[keys], v[keys], attn[rows],
                                          lse[rows], scale, causal, record, record.position,
                                          None, self._dropout)
            if dq is None:  # no kernel reached these rows (cross attention: they see no key)
                dq = torch.zeros(q[rows].shape, dtype=self._dtype, device=q.device)
            sums = add_key_gradients(partial, (None, None), (k[keys], v[keys]), self._dtype)
            self._results.append((dq, sums))

    def joined(self, dq: torch.Tensor | None, sums) -> tuple[torch.Tensor, ...]:
        """``(dq, dk, dv)`` in the inputs' dtypes: the own block's part results plus ``dq``,
        the other blocks' query gradients, and ``sums``, the dk/dv sums of this rank's block
        from the other ranks (None where there are none)."""
        _, q, k, v, _, _ = self._args
        if len(self._results) == 1 and dq is None and sums[0] is None:
            own_dq, own_sums = self._results[0]
            return own_dq.to(q.dtype), *(s.to(t.dtype) for s, t in zip(own_sums, (k, v)))
        out = [torch.empty_like(t) for t in (q, k, v)]
        for (rows, keys), (own_dq, own_sums) in zip(self._parts, self._results):
            for total, index, part, other in ((out[0], rows, own_dq, dq),
                                              (out[1], keys, own_sums[0], sums[0]),
                                              (out[2], keys, own_sums[1], sums[1])):
                if other is None:
                    total[index].copy_(part)
                else:  # one rounding to the output's dtype
                    torch.add(other[index], part, out=total[index])
        return tuple(out)


def _parts(extent: int, count: int, axis: int) -> list[tuple[slice, ...]]:
    """``count`` equal slices of ``extent`` on ``axis``, as indices of a tensor."""
    assert extent % count == 0, (extent, count)
    size = extent // count
    return [(slice(None),) * axis + (slice(i * size, (i + 1) * size),) for i in range(count)]


def _finished(dq: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The query gradient in q's dtype (zeros when no kernel reached a row: no rows)."""
    return torch.zeros_like(q) if dq is None else dq.to(q.dtype)


# ----------------------------------------------------------------------------------------------
# All-gather: k and v gathered, this rank's queries against every position's block


def _positions(record: ContextParallel, t: torch.Tensor):
    """The gathered k or v ``t`` (positions' blocks concatenated by coordinate) cut per
    position."""
    return t.split(_key_sizes(record), dim=-2)


def _key_sizes(record: ContextParallel) -> list[int]:
    return [record.key_length(c) for c in range(record.size)]


def allgather_forward(q, k, v, scale, causal: bool, record: ContextParallel, group: Group,
                      dropout: BlockDropout | None = None):
    """``(attn, log_sumexp)`` with k and v gathered (both gathers in flight at once)."""
    sizes = _key_sizes(record)
    pending = [allgather(t, t.ndim - 2, group, async_op=True, sizes=sizes) for t in (k, v)]
    keys, values = (_positions(record, resolved(p)) for p in pending)
    merged = _merged(record, q, v)
    for c in range(record.size):
        forward_blocks(q, keys[c], values[c], scale, causal, record, c, merged, dropout)
    return merged.result(q.dtype)


def allgather_backward(grad, q, k, v, attn, lse, scale, causal: bool, record: ContextParallel,
                       group: Group, dropout: BlockDropout | None = None):
    """``(dq, dk, dv)`` with k and v gathered and dk, dv reduce-scattered (float32)."""
    sizes = _key_sizes(record)
    pending = [allgather(t, t.ndim - 2, group, async_op=True, sizes=sizes) for t in (k, v)]
    keys, values = (_positions(record, resolved(p)) for p in pending)
    dq, sums, dtype = None, [], torch.float  # a reduce-scatter sums in float32 again
    for c in range(record.size):
        dq, parts = backward_blocks(grad, q, keys[c], values[c], attn, lse, scale, causal,
                                    record, c, dq, dropout)
        sums.append(add_key_gradients(parts, (None, None), (keys[c], values[c]), dtype))
    dk, dv = (reduce_scatter(torch.cat([s[i] for s in sums], dim=-2), k.ndim - 2, group,
                             "sum", sizes=sizes) for i in (0, 1))
    return _finished(dq, q), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------------
# All-to-all (Ulysses): sequence-sharded to head-sharded, whole sequences, and back


def _to_heads(t: torch.Tensor, record: ContextParallel, group: Group, order) -> torch.Tensor:
    """``[B, H, S_p, E]`` (or ``[B, H, S_p]``) sharded on the sequence -> ``[B, H/n, S, E]``
    whole sequences in global row order."""
    full = resolved(all_to_all(t, 1, 2, group))
    return full if order is None else full.index_select(2, order)


def _to_sequence(t: torch.Tensor, record: ContextParallel, group: Group, inverse):
    if inverse is not None:
        t = t.index_select(2, inverse)
    return resolved(all_to_all(t, 2, 1, group))


def _row_order(rows, device):
    """Global row order of the positions' ``rows`` (the record's query or key rows)
    concatenated by coordinate (None: already in order), and its inverse."""
    rows = torch.cat([torch.arange(a, b) for position in rows for a, b in position])
    if torch.equal(rows, torch.arange(len(rows))):
        return None, None
    order = torch.argsort(rows).to(device)
    return order, rows.to(device)


def alltoall_forward(q, k, v, scale, causal: bool, record: ContextParallel, group: Group,
                     dropout: None = None):
    """``(attn, log_sumexp)`` computed on whole sequences of ``1/n`` of the heads."""
    order, inverse = _row_order(record.rows, q.device)
    key_order, _ = _row_order(record.keys, q.device)
    qh = _to_heads(q, record, group, order)
    kh, vh = (_to_heads(t, record, group, key_order) for t in (k, v))
    attn, lse = block_forward(qh, kh, vh, scale, Block.DIAGONAL if causal else Block.FULL)
    lse = _to_sequence(lse.unsqueeze(-1), record, group, inverse).squeeze(-1)
    return _to_sequence(attn, record, group, inverse), lse


def alltoall_backward(grad, q, k, v, attn, lse, scale, causal: bool, record: ContextParallel,
                      group: Group, dropout: None = None):
    """``(dq, dk, dv)`` on whole sequences of ``1/n`` of the heads."""
    order, inverse = _row_order(record.rows, q.device)
    key_order, key_inverse = _row_order(record.keys, q.device)
    gh, qh, kh, vh, ah = (_to_heads(t, record, group, key_order if t is k or t is v else order)
                          for t in (grad, q, k, v, attn))  # in the order explain plans
    lse_h = _to_heads(lse.unsqueeze(-1), record, group, order).squeeze(-1)
    dq, dk, dv = block_backward(gh, qh, kh, vh, ah, lse_h, scale,
                                Block.DIAGONAL if causal else Block.FULL)
    return (_to_sequence(dq, record, group, inverse),
            *(_to_sequence(g, record, group, key_inverse) for g in (dk, dv)))


_FORWARD = {RING: ring_forward, ALLGATHER: allgather_forward, ALLTOALL: alltoall_forward}
_BACKWARD = {RING: ring_backward, ALLGATHER: allgather_backward, ALLTOALL: alltoall_backward}


def forward_step(group: Group):
    """The implementation of a context-parallel ``sdpfa_fwd`` record on this rank (the op's
    signature; the record, ``context``, says which strategy)."""
    def run(q, k, v, dropout_p, is_causal, scale, rng_seed=None, rng_offset=None,
            dropout_mode=None, context_parallel=None, *, site=None, context=None):
        dropout, state = None, no_rng_state(q.device)
        if float(dropout_p) > 0.0:
            seed, offset = resolve_seed("sdpfa_fwd", rng_seed, rng_offset)
            dropout, state = BlockDropout(float(dropout_p), seed, offset, site), \
                rng_state(seed, offset, q.device)
        attn, lse = _FORWARD[_strategy(context)](q, k, v, _scale(scale), bool(is_causal),
                                                  context, group, dropout)
        return (attn, lse, *state)
    return run


def backward_step(group: Group):
    """The implementation of a context-parallel ``sdpfa_bwd`` record on this rank."""
    def run(grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset,
            scale=None, dropout_mode=None, context_parallel=None, *, site=None, context=None):
        dropout = None
        if float(dropout_p) > 0.0:  # the forward's seed and offset: every block's mask again
            dropout = BlockDropout(float(dropout_p), *seed_and_offset(seed, offset), site)
        return _BACKWARD[_strategy(context)](grad_attn, q, k, v, attn, log_sumexp,
                                             _scale(scale), bool(is_causal), context, group,
                                             dropout)
    return run


def _strategy(record: ContextParallel) -> str:
    """The record's strategy; on a mesh axis of one device, the ring of one step (no
    communication at all)."""
    return record.strategy if record.size > 1 else RING


def _scale(scale) -> float | None:
    return None if scale is None else float(scale)


def agreed_facts(exprs: Sequence[Expr], local: Mapping[Expr, Local]) -> list[Fact]:
    """What the ranks of each context-parallel attention among ``exprs`` (a fusion's, in
    order) that this rank runs (``local``, its localized program) must hold alike
    before its first transfer: the strategy and how the ring's blocks travel. Both come from
    the environment (``MESHFUSE_CONTEXT_PARALLEL`` when the fusion is built,
    ``MESHFUSE_CP_TRANSPORT`` when its program is), which one rank may set otherwise; ranks
    that differ would wait for each other's transfers forever. (The merge and the parts of
    the own block are the rank's own business: they change no transfer.)"""
    facts = []
    for index, expr in enumerate(exprs):
        record = local[expr].attrs.get("context") if expr in local else None
        if not isinstance(record, ContextParallel) or record.size == 1:
            continue
        value = (record.strategy, record.transport if record.strategy == RING else None)
        shown = f"strategy {record.strategy!r}" + (
            f" with transport {record.transport!r}" if record.strategy == RING else "")
        facts.append(Fact(
            f"the context parallelism of {expr.op.name} (op {index}), which {ENV_VAR} and "
            f"{TRANSPORT_VAR} must set alike on every rank", value, shown))
    return facts


def lower_attention(expr, group_of):
    """A context-parallel attention's implementation bound to its group on this rank, or None
    for any other op (and on a rank outside the group). ``group_of(mesh, mesh_axis)``: this
    rank's group there (every rank takes part in creating it), None outside the mesh."""
    if sequence_parallel(expr) is None:
        return None
    group = group_of(*sequence_mesh_axis(expr))
    if group is None:
        return None
    backward = expr.op.name == "sdpfa_bwd"
    step = backward_step if backward else forward_step
    return with_kv_heads(step(group), backward)
