"""The memory-bound parts of the routed SwiGLU experts, between their grouped GEMMs: the
SwiGLU product, its backward, and the combines that sum each token's slots.

Each is one pass over its rows: on CUDA a ``torch.compile``'d function (Inductor fuses the
casts, the products, the gathers by slot and the sums into one kernel: in bfloat16 the
backward reads ``h1``, ``h3`` and ``u`` once and writes ``p``, ``dh1``, ``dh3`` and the row
dots, where eager PyTorch makes about ten passes), eager PyTorch elsewhere (CPU ranks, float64
tests). ``MESHFUSE_MOE_FUSED=0`` keeps CUDA eager too. Half-precision values compute in
float32.

Notation (rows grouped by expert): ``h1 = x w1^T``, ``h3 = x w3^T``, ``hidden = silu(h1) *
h3``, the expert's output ``y = hidden w2^T``; a slot's routing weight ``s`` and the
cotangent ``g`` of its token. The backward of ``s * y`` is computed without ``y``:
``u = g w2`` (a GEMM the backward needs anyway), ``<g, y> = <u, hidden>`` (the weight's
gradient, a row dot), ``d hidden = s u``, ``p = s hidden`` (for ``w2``'s gradient ``g^T p``).
"""

from __future__ import annotations

import functools
import os

import torch

FUSED_ENV = "MESHFUSE_MOE_FUSED"


def _acc(t: torch.Tensor) -> torch.dtype:
    """The dtype ``t``'s arithmetic runs in: float32 for half precision, else its own."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _hidden(h1: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
    acc = _acc(h1)
    return (torch.nn.functional.silu(h1.to(acc)) * h3.to(acc)).to(h1.dtype)


def _backward(h1, h3, u, s):
    """``(p, dh1, dh3, ds)`` of the module doc, from the products ``h1``, ``h3`` ``[N, F]``,
    ``u = g w2`` ``[N, F]`` and the weights ``s`` ``[N]``; ``ds`` in the arithmetic dtype."""
    dtype, acc = h1.dtype, _acc(h1)
    h1, h3, u = h1.to(acc), h3.to(acc), u.to(acc)
    s = s.to(acc).unsqueeze(-1)
    sig = torch.sigmoid(h1)
    act = h1 * sig
    hidden = act * h3
    ds = (u * hidden).sum(-1)
    du = u * s
    dh1 = du * h3 * (sig * (1 + h1 * (1 - sig)))
    return (hidden * s).to(dtype), dh1.to(dtype), (du * act).to(dtype), ds


def _backward_saved(saved, order, u, s):
    """:func:`_backward` with ``h1``, ``h3`` read from ``saved`` ``[M, 2, F]`` (token-slot
    order) at the rows ``order`` (the gather fuses into the same pass)."""
    h = saved[order]
    return _backward(h[:, 0], h[:, 1], u, s)


def _combine(rows, inverse, weights):
    """``out[t] = sum_k weights[t, k] rows[inverse[t, k]]`` (``weights`` None: 1). The slots
    are summed one by one (``K`` is small and fixed): a pointwise pass over ``[T, H]`` whose
    loads run along the hidden axis; a reduction over ``K`` compiles to a strided one, about
    8x slower on an H200."""
    acc = _acc(rows)
    out = None
    for k in range(inverse.shape[1]):
        term = rows[inverse[:, k]].to(acc)
        if weights is not None:
            term = term * weights[:, k].to(acc).unsqueeze(-1)
        out = term if out is None else out + term
    return out.to(rows.dtype)


def _combine_pair(a, b, inverse):
    """``out[t] = sum_k a[inverse[t, k]] + b[inverse[t, k]]``, slot by slot as
    :func:`_combine`."""
    acc = _acc(a)
    out = None
    for k in range(inverse.shape[1]):
        term = a[inverse[:, k]].to(acc) + b[inverse[:, k]].to(acc)
        out = term if out is None else out + term
    return out.to(a.dtype)


@functools.cache
def _compiled(fn):
    # dynamic: an expert-parallel rank's row count changes with every routing
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _run(fn, rows: torch.Tensor, *args):
    """``fn(*args)``, compiled where ``rows`` (the pass's main operand) lives on CUDA and
    has rows (a compiled function would specialize on an empty one)."""
    if rows.is_cuda and rows.shape[0] > 0 and os.environ.get(FUSED_ENV, "1") != "0":
        return _compiled(fn)(*args)
    return fn(*args)


def hidden(h1: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
    """``silu(h1) * h3``, in ``h1``'s dtype."""
    return _run(_hidden, h1, h1, h3)


def backward(h1, h3, u, s) -> tuple:
    """``(p, dh1, dh3, ds)``: see the module doc and :func:`_backward`."""
    return _run(_backward, h1, h1, h3, u, s)


def backward_saved(saved: torch.Tensor, order: torch.Tensor, u, s) -> tuple:
    """:func:`backward` with the products of the slots ``order`` of ``saved``
    ``[*tokens, K, 2, F]`` (``moe_experts``' saved products, in token-slot order)."""
    return _run(_backward_saved, u, saved.reshape(-1, *saved.shape[-2:]), order, u, s)


def combine(rows: torch.Tensor, inverse: torch.Tensor, weights=None) -> torch.Tensor:
    """Each token's slots summed (weighted by ``weights [T, K]`` when given): ``rows [N, H]``
    are the slots sorted by expert, ``inverse [T, K]`` the row of each slot. One gather and
    sum (no atomics: every token has its ``K`` rows), in float32 for half precision."""
    return _run(_combine, rows, rows, inverse, weights)


def combine_pair(a: torch.Tensor, b: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """:func:`combine` of ``a + b`` without materializing the sum."""
    return _run(_combine_pair, a, a, b, inverse)
