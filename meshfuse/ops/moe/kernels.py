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
an expert computes ``(silu(x w1^T) * (x w3^T)) w2^T``. Tokens may have several axes
(``x [*tokens, H]``, ``indices`` and ``weights [*tokens, K]``): the kernels flatten them in
row-major order and give the outputs (and the saved products ``[*tokens, K, 2, F]``) back in
that shape.

Work per step (``N = T K`` slots; docs/experts.md): the forward runs three grouped GEMMs
(``h1``, ``h3``, ``y``), the backward six (``u = g w2``, the three weight gradients, the two
products back to the rows): the expert's output is never recomputed (the routing weight's
gradient ``<g, y>`` is ``<g w2, hidden>``, :mod:`meshfuse.ops.moe.swiglu`), and where the
forward saved its products ``h1``, ``h3`` (one rank's experts, no capacity) neither are they.
Each token's slots are summed by a gather over its ``K`` rows (no atomics). On one rank
nothing is copied for an exchange, and nothing reads a value back to the host (no capacity).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from meshfuse.ops.moe import swiglu


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
        # no splits (nothing moves): counting the rows would read them back to the host,
        # which a CUDA graph cannot capture
        return Route((), (), send_counts, None)

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


@dataclasses.dataclass(frozen=True)
class Slots:
    """The token slots sorted by expert, computed on the device without reading anything back.

    Attributes:
        order: the slot (``indices`` flattened) at each sorted position (stable).
        tokens: the token of each sorted slot.
        counts: the slots per expert (``[E]``, int64).
        inverse: the sorted position of each slot, ``[T, K]`` (``order``'s inverse).
    """

    order: torch.Tensor
    tokens: torch.Tensor
    counts: torch.Tensor
    inverse: torch.Tensor


def slots(indices: torch.Tensor, num_experts: int) -> Slots:
    """:class:`Slots` of ``indices [T, K]`` over ``num_experts`` experts."""
    flat = indices.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    tokens = torch.div(order, indices.shape[1], rounding_mode="floor")
    bounds = torch.searchsorted(flat[order], torch.arange(num_experts + 1, device=flat.device))
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                      device=flat.device))
    return Slots(order, tokens, bounds.diff(), inverse.view(indices.shape))


class Groups:
    """Rows grouped by expert, ``counts`` each (``[G]``, int64), in order: the offsets a
    grouped GEMM kernel takes (computed once), the sizes a loop takes."""

    def __init__(self, counts: torch.Tensor):
        self.counts = counts

    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        return torch.cumsum(self.counts, 0, dtype=torch.int32)

    @functools.cached_property
    def sizes(self) -> list[int]:
        return self.counts.tolist()


def _kernel_operand(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``torch._grouped_mm`` takes it (data 16-byte aligned, one of the last two axes
    of unit stride and the other's a multiple of 16 bytes), copied only where its strides
    are not; None where no layout of its shape is (a size not a multiple of 16 bytes)."""
    align = 16 // t.element_size()

    def ready(v: torch.Tensor) -> bool:
        (rows, cols), (s_rows, s_cols) = v.shape[-2:], v.stride()[-2:]
        if v.data_ptr() % 16:
            return False
        if s_cols == 1 and s_rows >= max(1, cols):
            return s_rows % align == 0
        return s_rows == 1 and s_cols >= max(1, rows) and s_cols % align == 0

    if ready(t):
        return t
    dense = t.contiguous()
    return dense if ready(dense) else None


def _on_kernel(a: torch.Tensor, b: torch.Tensor):
    """``(a, b)`` for ``torch._grouped_mm`` (CUDA, bfloat16, rows present), or None: the
    loop of matmuls then."""
    if not (a.is_cuda and a.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")) or \
            0 in a.shape or 0 in b.shape:
        return None
    a, b = _kernel_operand(a), _kernel_operand(b)
    return None if a is None or b is None else (a, b)


def grouped_rows_mm(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``a [N, k]`` by row groups times ``b[g]`` (``b [G, k, n]``): ``[N, n]``. PyTorch's
    ``_grouped_mm`` on CUDA in bfloat16 (one kernel for every group) where it is eligible:
    rows present, every operand 16-byte aligned in one of the layouts it takes (``k`` and
    ``n`` multiples of 8 in bfloat16; an operand is copied dense only where its strides are
    not, :func:`_kernel_operand`); a loop of matmuls elsewhere."""
    operands = _on_kernel(a, b)
    if operands is not None:
        out = torch._grouped_mm(*operands, offs=groups.offsets)
        return out if out.is_contiguous() else out.contiguous()
    pieces = a.split(groups.sizes)
    if not pieces or a.shape[0] == 0:
        return a.new_zeros(a.shape[0], b.shape[-1])
    return torch.cat([piece @ b[g] for g, piece in enumerate(pieces)])


def grouped_outer(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Per group, ``a_g^T b_g`` over its rows (``a [N, m]``, ``b [N, n]``): ``[G, m, n]``
    (zeros for an empty group): the weight gradients. ``_grouped_mm`` takes ``a`` transposed
    (column-major) and ``b`` row-major, the form that allows empty groups."""
    operands = _on_kernel(_rows_dense(a), _rows_dense(b))
    if operands is not None and operands[0].stride(1) == 1 and operands[1].stride(1) == 1:
        return torch._grouped_mm(operands[0].t(), operands[1], offs=groups.offsets)
    out = a.new_zeros(len(groups.sizes), a.shape[1], b.shape[1])
    start = 0
    for g, n in enumerate(groups.sizes):
        if n:
            out[g] = a[start:start + n].t() @ b[start:start + n]
        start += n
    return out


def _rows_dense(t: torch.Tensor) -> torch.Tensor:
    """``t [N, m]`` row-major with a 16-byte aligned row stride (copied only if it is not)."""
    aligned = t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
    return t if aligned or not t.is_cuda else t.contiguous()


def swiglu_experts(x, w1, w2, w3, counts):
    """Each row of ``x`` (grouped by expert, ``counts`` rows each) through its expert."""
    groups = Groups(counts)
    h1, h3 = _products(x, w1, w3, groups)
    return grouped_rows_mm(torch.nn.functional.silu(h1) * h3, w2.transpose(-2, -1), groups)


def _products(rows, w1, w3, groups: Groups):
    """``(rows w1^T, rows w3^T)``, each row by its expert."""
    return (grouped_rows_mm(rows, w1.transpose(-2, -1), groups),
            grouped_rows_mm(rows, w3.transpose(-2, -1), groups))


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


def saved_products(x: torch.Tensor, slot_shape, w1: torch.Tensor) -> torch.Tensor:
    """An empty stand-in for ``moe_experts``' saved products ``[*tokens, K, 2, F]`` where
    nothing reads them (a stride-0 view of one zero: no memory)."""
    return x.new_zeros(()).expand(*slot_shape, 2, w1.shape[1])


def _save(h1, h3, order: torch.Tensor, slot_shape) -> torch.Tensor:
    """The products of the sorted rows ``h1``, ``h3`` in token-slot order, ``[*tokens, K, 2,
    F]`` (``indices [*tokens, K]``)."""
    saved = h1.new_empty(order.numel(), 2, h1.shape[1])
    saved[:, 0].index_copy_(0, order, h1)
    saved[:, 1].index_copy_(0, order, h3)
    return saved.view(*slot_shape, 2, h1.shape[1])


def experts_forward(x, indices, weights, w1, w2, w3, num_experts: int, exchange=LOCAL,
                    capacity: int | None = None, residual: bool = False):
    """The routed experts' output ``[*tokens, H]`` (each token's slots weighted by ``weights
    [*tokens, K]`` and summed; ``x [*tokens, H]``, the token axes flattened row-major), the
    rows each local expert computed (``[E_local]``, float32) and the products ``h1``, ``h3``
    of every slot in token-slot order (``[*tokens, K, 2, F]``, for the backward) where ``residual`` (expert-parallel, they come back with one more exchange),
    else an empty stand-in. With ``capacity``, an expert computes only its first
    ``capacity`` rows by token order (the others are dropped: they add nothing)."""
    shape, slot_shape = x.shape, indices.shape
    x, indices, weights = _flat(x), _flat(indices), _flat(weights)
    sl = slots(indices, num_experts)
    route = exchange.plan(sl.counts)
    keep = within_capacity(route.expert_counts, capacity)
    groups = Groups(_computed_counts(route, capacity))
    rows = _grouped(exchange.dispatch(x.index_select(0, sl.tokens), route), route)
    if residual:  # every slot's products (a dropped one's too: they are its values)
        h1, h3 = _products(rows, w1, w3, groups if keep is None else
                           Groups(route.expert_counts))
        saved = _save(*_returned(h1, h3, exchange, route), sl.order, slot_shape)
        h1, h3 = _kept(h1, keep), _kept(h3, keep)
    else:
        saved = saved_products(x, slot_shape, w1)
        h1, h3 = _products(_kept(rows, keep), w1, w3, groups)
    del rows
    y = grouped_rows_mm(swiglu.hidden(h1, h3), w2.transpose(-2, -1), groups)
    y = exchange.combine(_ungrouped(_restored(y, keep), route), route)
    out = swiglu.combine(y, sl.inverse, weights).reshape(shape)
    return out, groups.counts.to(torch.float32), saved


def _returned(h1, h3, exchange, route: Route) -> tuple:
    """The products of the rows an expert-parallel rank computed, back on their tokens'
    ranks in sorted-slot order (one exchange); on one rank, as they are."""
    if isinstance(exchange, LocalExchange):
        return h1, h3
    back = exchange.combine(_ungrouped(torch.cat([h1, h3], 1), route), route)
    return back[:, :h1.shape[1]], back[:, h1.shape[1]:]


def experts_backward(grad, x, indices, weights, w1, w2, w3, num_experts: int, exchange=LOCAL,
                     capacity: int | None = None, saved: torch.Tensor | None = None):
    """The gradients ``(x, weights, w1, w2, w3)`` of :func:`experts_forward`'s output given
    its cotangent ``grad [*tokens, H]``, with the forward's ``saved`` products (one rank's experts,
    no capacity) or recomputing them where the experts live. Expert-parallel, the token rows
    travel once more with their cotangents and weights (the transposed combine) and their
    gradients come back (the transposed dispatch). Dropped rows get zero gradients."""
    shape, weights_shape = x.shape, weights.shape
    grad, x, indices, weights = _flat(grad), _flat(x), _flat(indices), _flat(weights)
    sl = slots(indices, num_experts)
    route = exchange.plan(sl.counts)
    keep = within_capacity(route.expert_counts, capacity)
    groups = Groups(_computed_counts(route, capacity))
    scale = weights.reshape(-1)[sl.order]
    local = isinstance(exchange, LocalExchange)
    if local:
        xr, gr = x.index_select(0, sl.tokens), grad.index_select(0, sl.tokens).to(x.dtype)
        xr, gr, sr = _kept(xr, keep), _kept(gr, keep), _kept(scale, keep)
    else:
        xr, gr, sr = _arrived(exchange, route, keep, sl.tokens, x, grad, scale)
    if saved is not None:
        assert local and keep is None, "saved products on one rank without capacity only"
        products = functools.partial(swiglu.backward_saved, saved, sl.order)
    else:
        products = functools.partial(swiglu.backward, *_products(xr, w1, w3, groups))
    dxa, dxb, ds, *weight_grads = _expert_backward(xr, gr, sr, products, w1, w2, w3, groups)
    if local:
        grad_x = swiglu.combine_pair(_restored(dxa, keep), _restored(dxb, keep), sl.inverse)
        ds = _restored(ds, keep)
    else:
        back = _restored(torch.cat([dxa + dxb, ds.unsqueeze(1).to(dxa.dtype)], 1), keep)
        back = exchange.combine(_ungrouped(back, route), route)
        h = x.shape[1]
        grad_x, ds = swiglu.combine(back[:, :h], sl.inverse), back[:, h]
    grad_weights = ds[sl.inverse].to(weights.dtype).reshape(weights_shape)
    return (grad_x.reshape(shape), grad_weights, *weight_grads)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[*tokens, n]`` as ``[T, n]`` (tokens in row-major order)."""
    return t.reshape(-1, t.shape[-1])


def _arrived(exchange, route: Route, keep, tokens, x, grad, scale):
    """Expert-parallel: each slot's token row, cotangent and weight sent in one exchange to
    its expert's rank; the rows it receives, grouped by local expert, as ``(x, g, s)``."""
    h = x.shape[1]
    sent = torch.cat([x[tokens], grad[tokens].to(x.dtype), scale.unsqueeze(1).to(x.dtype)], 1)
    received = _kept(_grouped(exchange.dispatch(sent, route), route), keep)
    # dense rows: each feeds three grouped GEMMs, which take aligned strides only
    return received[:, :h].contiguous(), received[:, h:2 * h].contiguous(), received[:, 2 * h]


def _expert_backward(xr, gr, sr, products, w1, w2, w3, groups: Groups):
    """``(dx_a, dx_b, ds, dw1, dw2, dw3)`` on rows grouped by expert (``xr`` the token rows,
    ``gr`` their cotangents, ``sr`` their weights): the rows' gradient is ``dx_a + dx_b``
    (the two products' parts), ``ds`` the weights'. ``products(u, s)`` gives ``(p, dh1, dh3,
    ds)`` (:func:`meshfuse.ops.moe.swiglu.backward`). Six grouped GEMMs."""
    p, dh1, dh3, ds = products(grouped_rows_mm(gr, w2, groups), sr)
    dw2 = grouped_outer(gr, p, groups)
    del p
    dw1, dw3 = grouped_outer(dh1, xr, groups), grouped_outer(dh3, xr, groups)
    dxa, dxb = grouped_rows_mm(dh1, w1, groups), grouped_rows_mm(dh3, w3, groups)
    return dxa, dxb, ds, dw1, dw2, dw3
