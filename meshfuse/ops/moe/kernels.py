"""The torch side of the routed experts: token order by expert, grouped GEMMs and the SwiGLU
experts, forward and backward, written once over an *exchange*.

An exchange moves token rows between the ranks that hold the tokens and the ranks that hold
their experts. :class:`LocalExchange` is the one rank that holds every expert (nothing moves);
expert parallelism (:mod:`meshfuse.parallel.experts`) gives a ragged all-to-all one. Both
answer the same three questions, so forward and backward are one code path:

- ``plan(send_counts)``: from the number of token slots this rank routes to each expert
  (``[E]``), the :class:`Route` of the rows (for expert parallelism: one exchange of split
  sizes);
- ``dispatch(rows, route)``: rows in expert order to the ranks of their experts, arriving by
  (source rank, local expert);
- ``combine(rows, route)``: the transpose: rows in arrival order back to their sources, in
  the order ``dispatch`` took them.

Expert weights follow torchtitan's layout: ``w1``, ``w3`` ``[E, F, H]``, ``w2`` ``[E, H, F]``;
an expert computes ``(silu(x w1^T) * (x w3^T)) w2^T``.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Route:
    """Where this rank's token slots go and what it receives.

    Attributes:
        send_splits: rows sent to each rank of the group, by coordinate.
        recv_splits: rows received from each rank, by coordinate.
        expert_counts: rows each local expert computes (``[E_local]``, int64).
        by_expert: a permutation grouping the received rows by local expert (None: they
            arrive grouped already, as on one rank).
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    expert_counts: torch.Tensor
    by_expert: torch.Tensor | None


class LocalExchange:
    """Every expert on this rank: rows stay where they are."""

    first_expert = 0

    def plan(self, send_counts: torch.Tensor) -> Route:
        n = int(send_counts.sum())
        return Route((n,), (n,), send_counts, None)

    def dispatch(self, rows: torch.Tensor, route: Route) -> torch.Tensor:
        return rows

    def combine(self, rows: torch.Tensor, route: Route) -> torch.Tensor:
        return rows


LOCAL = LocalExchange()


def slot_order(indices: torch.Tensor, num_experts: int):
    """``(order, tokens, counts)``: the token slots (``indices [T, K]`` flattened) sorted by
    expert (stable, so a token's slots keep their order), the token of each sorted slot, and
    the slots per expert ``[E]``."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = torch.div(order, indices.shape[1], rounding_mode="floor")
    counts = torch.bincount(flat, minlength=num_experts)
    return order, tokens, counts


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                   offsets: torch.Tensor | None = None) -> torch.Tensor:
    """``x [N, a]`` by row groups (``counts [G]`` rows each, in order) times ``w[g]^T``
    (``w [G, b, a]``): ``[N, b]``. PyTorch's ``_grouped_mm`` on CUDA in bfloat16 (one kernel
    for every group), a loop of matmuls elsewhere.

    The kernel's operands (and those of its autograd backward: ``x^T``, the cotangent
    ``[N, b]``, ``w`` untransposed) need 16-byte aligned strides: ``a`` and ``b`` multiples
    of 8, ``x`` dense (the backward's rows are a column slice of the rows it receives: copied
    dense), ``w [G, b, a]`` dense and passed transposed (its last two strides ``1, a``),
    the group offsets int32 (``offsets``: ``counts``' cumulative sum, given by a caller
    that multiplies several times by one grouping). Other shapes, and no row at all, take
    the loop."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and \
            x.shape[0] > 0 and x.shape[1] % 8 == 0 and w.shape[1] % 8 == 0:
        if offsets is None:
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x.contiguous(), w.contiguous().transpose(-2, -1),
                                 offs=offsets)
    pieces = x.split(counts.tolist())
    if not pieces:
        return x.new_empty(0, w.shape[1])
    return torch.cat([piece @ w[group].t() for group, piece in enumerate(pieces)])


def swiglu_experts(x, w1, w2, w3, counts):
    """Each row of ``x`` (grouped by expert, ``counts`` rows each) through its expert."""
    offsets = torch.cumsum(counts, 0, dtype=torch.int32) if x.is_cuda else None
    hidden = torch.nn.functional.silu(grouped_matmul(x, w1, counts, offsets)) * \
        grouped_matmul(x, w3, counts, offsets)
    return grouped_matmul(hidden, w2, counts, offsets)


def _grouped(rows: torch.Tensor, route: Route) -> torch.Tensor:
    return rows if route.by_expert is None else rows[route.by_expert]


def _ungrouped(rows: torch.Tensor, route: Route) -> torch.Tensor:
    if route.by_expert is None:
        return rows
    out = torch.empty_like(rows)
    out[route.by_expert] = rows
    return out


def within_capacity(counts: torch.Tensor, capacity: int | None) -> torch.Tensor | None:
    """For rows grouped by expert (``counts`` each, in token order), whether each is among
    its expert's first ``capacity`` (None: no capacity, every row is kept)."""
    if capacity is None:
        return None
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(int(counts.sum()), device=counts.device) - \
        torch.repeat_interleave(starts, counts)
    return position < capacity


def _kept(rows: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return rows if keep is None else rows[keep]


def _restored(rows: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Rows of the kept positions back among all, zeros at the dropped ones."""
    if keep is None:
        return rows
    out = rows.new_zeros(keep.shape[0], *rows.shape[1:])
    out[keep] = rows
    return out


def _computed_counts(route: Route, capacity: int | None) -> torch.Tensor:
    counts = route.expert_counts
    return counts if capacity is None else counts.clamp(max=capacity)


def experts_forward(x, indices, weights, w1, w2, w3, num_experts: int, exchange=LOCAL,
                    capacity: int | None = None):
    """The routed experts' output ``[*tokens, H]`` (each token's slots weighted by ``weights
    [*tokens, K]`` and summed; ``x [*tokens, H]``, tokens in row-major order) and the rows each local expert computed (``[E_local]``, float32).
    With ``capacity``, an expert computes only its first ``capacity`` rows by token order
    (the others are dropped: they add nothing)."""
    shape = x.shape
    x, indices, weights = _flat(x), _flat(indices), _flat(weights)
    order, tokens, counts = slot_order(indices, num_experts)
    route = exchange.plan(counts)
    keep = within_capacity(route.expert_counts, capacity)
    computed = _computed_counts(route, capacity)
    received = _kept(_grouped(exchange.dispatch(x[tokens], route), route), keep)
    y = _ungrouped(_restored(swiglu_experts(received, w1, w2, w3, computed), keep), route)
    rows = exchange.combine(y, route)
    scale = weights.reshape(-1)[order].unsqueeze(1).to(rows.dtype)
    out = x.new_zeros(x.shape).index_add_(0, tokens, rows * scale)
    return out.reshape(shape), computed.to(torch.float32)


def experts_backward(grad, x, indices, weights, w1, w2, w3, num_experts: int, exchange=LOCAL,
                     capacity: int | None = None):
    """The gradients ``(x, weights, w1, w2, w3)`` of :func:`experts_forward`'s output given
    its cotangent ``grad [T, H]``: the token rows travel once more with their cotangents
    (the transposed combine) and their gradients come back (the transposed dispatch); the
    experts are recomputed where they live. Dropped rows get zero gradients."""
    shape, weights_shape, h = x.shape, weights.shape, x.shape[-1]
    grad, x, indices, weights = _flat(grad), _flat(x), _flat(indices), _flat(weights)
    order, tokens, counts = slot_order(indices, num_experts)
    route = exchange.plan(counts)
    keep = within_capacity(route.expert_counts, capacity)
    scale = weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)
    sent = torch.cat([x[tokens], grad[tokens].to(x.dtype), scale], 1)
    received = _kept(_grouped(exchange.dispatch(sent, route), route), keep)
    xr, gr, sr = received[:, :h], received[:, h:2 * h], received[:, 2 * h:]
    params = [t.detach().requires_grad_() for t in (xr, w1, w2, w3)]
    with torch.enable_grad():
        y = swiglu_experts(*params, _computed_counts(route, capacity))
        grads = _grads(y, params, gr * sr)
    grad_scale = (gr * y.detach()).sum(1, keepdim=True)
    back = _ungrouped(_restored(torch.cat([grads[0], grad_scale], 1), keep), route)
    back = exchange.combine(back, route)
    grad_x = x.new_zeros(x.shape).index_add_(0, tokens, back[:, :h])
    grad_weights = weights.new_empty(weights.numel())
    grad_weights[order] = back[:, h].to(weights.dtype)
    return (grad_x.reshape(shape), grad_weights.reshape(weights_shape), *grads[1:])


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[*tokens, n]`` as ``[T, n]`` (tokens in row-major order)."""
    return t.reshape(-1, t.shape[-1])


def _grads(y: torch.Tensor, params: list[torch.Tensor], cotangent: torch.Tensor) -> list:
    """``y``'s vector-Jacobian product with ``params``; zeros for a rank that computed
    nothing (no expert, or no row for any of its experts)."""
    if not y.requires_grad:
        return [torch.zeros_like(p) for p in params]
    grads = torch.autograd.grad(y, params, cotangent, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
