"""Ring attention: the runtime of an ``sdpfa_fwd``/``sdpfa_bwd`` step whose record carries a
:class:`~meshfuse.ops.context_parallel.ContextParallel` (see that module for the strategy).

Forward, on each rank of the ring: at step ``s`` it holds the key/value block of position
``p - s``; it launches that block's transfer to the next rank (``ring_shift``) *before*
computing its queries against it, so the transfer runs under the kernels, then waits for
the block of the previous rank. After ``n`` steps (``n - 1`` transfers of k and v) every
query has met every key; the blocks' outputs are merged by their log-sum-exp.

Backward: k and v travel the same way, each with float32 accumulators of its dk and dv. At
each step a rank computes its queries' gradients against the block it holds (dq stays,
the block's dk/dv partial sums are added to the block's accumulators, which then go to the
next rank); the last transfer brings each accumulator home: ``n - 1`` transfers of k and v
and ``n`` of dk and dv.
"""

from __future__ import annotations

import torch

from meshfuse.ops.attention_dropout import no_rng_state
from meshfuse.ops.context_parallel import (
    ContextParallel,
    Merged,
    backward_blocks,
    forward_blocks,
)
from meshfuse.runtime.collectives import Group, ring_shift


def _shape(t: torch.Tensor, rows: int) -> tuple[int, ...]:
    return (*t.shape[:-2], rows, t.shape[-1])


def _check_local(record: ContextParallel, op: str, **tensors: torch.Tensor) -> None:
    rows = record.length(record.position)
    for name, t in tensors.items():
        assert t.shape[-2] == rows, (
            f"{op}: {name} holds {t.shape[-2]} sequence rows, its ring record {rows}")


def ring_forward(q, k, v, scale, causal: bool, record: ContextParallel, group: Group):
    """This rank's ``(attn, log_sumexp)`` of ring attention (see the module doc)."""
    _check_local(record, "sdpfa_fwd", q=q, k=k, v=v)
    merged = Merged(q, v)
    block = (k, v)
    for step in range(record.size):
        pending = None
        if step < record.size - 1:
            rows = record.length(record.holder(step + 1))
            pending = ring_shift(block, [_shape(k, rows), _shape(v, rows)], group)
        forward_blocks(q, *block, scale, causal, record, record.holder(step), merged)
        if pending is not None:
            block = pending.wait()
    return merged.result(q.dtype)


def ring_backward(grad, q, k, v, attn, lse, scale, causal: bool, record: ContextParallel,
                  group: Group):
    """This rank's ``(dq, dk, dv)`` of ring attention (see the module doc)."""
    _check_local(record, "sdpfa_bwd", grad_attn=grad, q=q, k=k, v=v, attn=attn)
    dq = torch.zeros(q.shape, dtype=torch.float, device=q.device)
    block, sums = (k, v), None
    for step in range(record.size):
        pending = None
        if step < record.size - 1:
            rows = record.length(record.holder(step + 1))
            pending = ring_shift(block, [_shape(k, rows), _shape(v, rows)], group)
        partial = backward_blocks(grad, q, *block, attn, lse, scale, causal, record,
                                  record.holder(step), dq)
        own = sums.wait() if sums is not None else \
            [torch.zeros(t.shape, dtype=torch.float, device=t.device) for t in block]
        if partial is not None:
            own[0].add_(partial[0])
            own[1].add_(partial[1])
        if record.size == 1:
            return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)
        # The accumulators follow their block to the next rank (the last step: home).
        rows = record.length(record.holder(step + 1))
        sums = ring_shift(own, [_shape(k, rows), _shape(v, rows)], group)
        if pending is not None:
            block = pending.wait()
    dk, dv = sums.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def forward_step(group: Group):
    """The implementation of a ring ``sdpfa_fwd`` record on this rank (its signature)."""
    def run(q, k, v, dropout_p, is_causal, scale, rng_seed=None, rng_offset=None,
            dropout_mode=None, context_parallel=None, *, site=None, context=None):
        attn, lse = ring_forward(q, k, v, _scale(scale), bool(is_causal), context, group)
        return (attn, lse, *no_rng_state(q.device))
    return run


def backward_step(group: Group):
    """The implementation of a ring ``sdpfa_bwd`` record on this rank (its signature)."""
    def run(grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset,
            scale=None, dropout_mode=None, context_parallel=None, *, site=None, context=None):
        return ring_backward(grad_attn, q, k, v, attn, log_sumexp, _scale(scale),
                             bool(is_causal), context, group)
    return run


def _scale(scale) -> float | None:
    return None if scale is None else float(scale)
