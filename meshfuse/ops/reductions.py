"""Reductions: ``sum``, ``max``, ``min``, ``mean``, ``prod`` and ``var_mean`` over any axes.

Shape rule: each reduced input axis becomes a *reduction* ID of the output (mapped from the
input axis, not materialized in the local tensor); with ``keepdim=True`` a broadcast ID of
extent 1 follows it, so the local tensor keeps the axis with extent 1, as in PyTorch.
A reduction over a sharded axis therefore shows up as a sharded reduction ID (a partial result).

``dtype`` (sum, mean, prod, max, min) is PyTorch's: the input is cast to it *before* reducing,
so ``sum(x_bf16, dtype=DataType.Float)`` accumulates in float32.
"""

from __future__ import annotations

import math

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError
from meshfuse.ir.iter_domain import IterType
from meshfuse.ops.registry import AxisSpec, OpDef, OutSpec, Vjp, attr, register, tensor
from meshfuse.ops.shape_rules import normalize_axes, require_tensor


def reduced_axes(op: str, x, dims, keepdim: bool) -> tuple[AxisSpec, ...]:
    """Output axes of a reduction of tensor argument 0 over ``dims``."""
    x = require_tensor(op, "x", x)
    dims = normalize_axes(op, dims, x.ndim)
    if not isinstance(keepdim, bool):
        raise DefinitionError(f"{op}: keepdim must be True or False, got {keepdim!r}")
    axes = []
    for a, (extent, kind) in enumerate(zip(x.shape, x.iter_types)):
        if a in dims:
            axes.append(AxisSpec(extent, IterType.Reduction, ((0, a),)))
            if keepdim:
                axes.append(AxisSpec(1, IterType.Broadcast))
        else:
            axes.append(AxisSpec(extent, kind, ((0, a),)))
    return tuple(axes)


def expand_back(d, g):
    """``g`` (shaped like a reduction's result) broadcast back to the reduced input's shape.
    With ``keepdim``, reduced axes of ``g`` that are no broadcast axes are squeezed first: a
    cotangent combined with a tensor of the same shape (``maximum(mean(x, keepdim=True),
    x[3:4])``) holds them as iteration axes of extent 1, which no broadcast expands."""
    x, ndim = d.arg("x"), d.ndim("x")
    dims = normalize_axes(d.expr.op.name, d.attrs["dims"], ndim)
    shape = [-1] * ndim
    for a in dims:
        shape[a] = x.materialized()[a].extent or d.shape("x")[a]
    if d.attrs["keepdim"]:
        if all(g.materialized()[a].is_broadcast for a in dims):
            return d.ops.broadcast_in_dim(g, shape, list(range(ndim)))
        g = d.ops.squeeze(g, dims=dims)
    return d.ops.broadcast_in_dim(g, shape, [a for a in range(ndim) if a not in dims])


def _sum_grads(d, grads):
    return {"x": lambda: expand_back(d, grads[0])}


def _extremum_grads(d, grads):
    """All of the gradient to the extremum, shared evenly among equal ones (as PyTorch)."""
    o, g = d.ops, grads[0]

    def grad():
        x = d.value("x")
        winner = o.eq(x, expand_back(d, d.out()))
        count = o.sum(o.cast(winner, g.dtype), dims=d.attrs["dims"], keepdim=d.attrs["keepdim"])
        return o.where(winner, expand_back(d, o.div(g, count)), 0.0)

    return {"x": grad}


def _prod_grads(d, grads):
    """``g * prod / x``, and at a zero of x the product of the others (zero if another is)."""
    o, g = d.ops, grads[0]
    dims, keepdim = d.attrs["dims"], d.attrs["keepdim"]

    def grad():
        x = d.value("x")
        zero = o.eq(x, 0)
        others = o.prod(o.where(zero, 1, x), dims=dims, keepdim=keepdim, dtype=d.attrs["dtype"])
        zeros = o.sum(o.cast(zero, g.dtype), dims=dims, keepdim=keepdim)
        at_zero = o.where(o.eq(zeros, 1), o.mul(g, others), 0.0)
        elsewhere = o.div(expand_back(d, o.mul(g, d.out())), x)
        return o.where(zero, expand_back(d, at_zero), elsewhere)

    return {"x": grad}


REDUCTION_GRADIENTS = {"max": _extremum_grads, "min": _extremum_grads, "prod": _prod_grads,
                       "sum": _sum_grads}


def _reduction(name: str, reduce_fn, doc: str, partial_reduce: str) -> OpDef:
    def infer(x, dims, keepdim, dtype):
        axes = reduced_axes(name, x, dims, keepdim)
        return [OutSpec(_default_dtype(name, _dtype_attr(name, dtype) or x.dtype), axes)]

    def impl(x, dims, keepdim, dtype):
        if dtype is not None and dtype is not DataType.Null:
            x = x.to(dtype.torch_dtype)
        dims = local_dims(x, dims)
        return reduce_fn(x, dims, keepdim) if dims else x.clone()

    params = (tensor("x"), attr("dims", None), attr("keepdim", False), attr("dtype", None))
    return OpDef(name, params, infer, impl, doc=doc, partial_reduce=partial_reduce,
                 vjp=Vjp(REDUCTION_GRADIENTS[name]), sharding=partial_rule(partial_reduce))


def partial_rule(partial_reduce: str) -> str:
    """The op reference's sharding line of a reduction whose partials combine by
    ``partial_reduce``."""
    return ("kept axes are sharded as x's; a reduced axis sharded in x makes a partial "
            f"result (P({partial_reduce})), reduced (allreduce or reduce-scatter) where read")


def local_dims(x: torch.Tensor, dims) -> tuple[int, ...]:
    """``dims`` as non-negative axes of ``x`` (``None``: all axes)."""
    if dims is None:
        return tuple(range(x.ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted(d % x.ndim for d in dims))


def _dtype_attr(name: str, dtype) -> DataType | None:
    """The cast a reduction's ``dtype`` asks for; None and nvFuser's ``DataType.Null`` ask for
    none."""
    if dtype is not None and not isinstance(dtype, DataType):
        raise DefinitionError(f"{name}: dtype must be a DataType or None, got {dtype!r}")
    return None if dtype is DataType.Null else dtype


def _default_dtype(name: str, dtype: DataType) -> DataType:
    """The result dtype of reduction ``name`` of a ``dtype`` tensor, as in PyTorch."""
    floating = dtype.is_floating or dtype.torch_dtype.is_complex
    # PyTorch sums integers and bools in int64; the mean of integers is not defined there.
    if name in ("sum", "prod") and not floating:
        return DataType.Int
    if name in ("mean", "var_mean") and not floating:
        raise DefinitionError(
            f"{name}: PyTorch has no {name} of {dtype.name} tensors; cast the input to a "
            "floating-point dtype first" + (" or pass dtype=" if name == "mean" else "")
        )
    return dtype


def _amax(x, dims, keepdim):
    if x.ndim and any(x.shape[d] == 0 for d in dims):
        return _identity_of(x, dims, keepdim, largest=False)
    return torch.amax(x, dim=dims, keepdim=keepdim) if x.ndim else x.clone()


def _amin(x, dims, keepdim):
    if x.ndim and any(x.shape[d] == 0 for d in dims):
        return _identity_of(x, dims, keepdim, largest=True)
    return torch.amin(x, dim=dims, keepdim=keepdim) if x.ndim else x.clone()


def _identity_of(x: torch.Tensor, dims, keepdim: bool, largest: bool) -> torch.Tensor:
    """The max (``largest=False``) or min reduction of a local shard that holds no element
    of the reduced axes (an uneven shard): the reduction's identity, which the reduction
    over the shards ignores."""
    shape = [1 if d in dims else n for d, n in enumerate(x.shape) if keepdim or d not in dims]
    fill = reduction_identity("min" if largest else "max", x.dtype)
    return torch.full(shape, fill, dtype=x.dtype, device=x.device)


def reduction_identity(reduce_op: str, dtype: torch.dtype) -> float | int | bool:
    """The value that reduction ``reduce_op`` (sum, prod, max, min) of ``dtype`` values
    ignores: what a device holding no part of a partial result contributes."""
    if reduce_op in ("sum", "prod"):
        return 0 if reduce_op == "sum" else 1
    largest = reduce_op == "min"  # min ignores the largest value
    if dtype.is_floating_point:
        return float("inf") if largest else float("-inf")
    if dtype == torch.bool:
        return largest
    info = torch.iinfo(dtype)
    return info.max if largest else info.min


def _prod(x, dims, keepdim):
    out = x
    for d in sorted(dims, reverse=True):
        out = torch.prod(out, dim=d, keepdim=keepdim)
    return out


REDUCTIONS = {
    "max": (_amax, "maximum over axes", "max"),
    "min": (_amin, "minimum over axes", "min"),
    "prod": (_prod, "product over axes", "prod"),
    "sum": (lambda x, d, k: torch.sum(x, dim=d, keepdim=k), "sum over axes", "sum"),
}

for _name, (_fn, _doc, _partial) in sorted(REDUCTIONS.items()):
    register(_reduction(_name, _fn, _doc, _partial))


def _mean_infer(x, dims, keepdim, dtype):
    axes = reduced_axes("mean", x, dims, keepdim)
    return [OutSpec(_default_dtype("mean", _dtype_attr("mean", dtype) or x.dtype), axes)]


def _mean(x, dims, keepdim, dtype, reduced_count):
    # The sum over the local elements divided by the *global* count: on a shard of the
    # reduced axes this is a partial mean that a sum over the shards completes.
    if dtype is not None and dtype is not DataType.Null:  # as PyTorch: cast, then reduce
        x = x.to(dtype.torch_dtype)
    dims = local_dims(x, dims)
    if not dims:
        return x.clone()
    low_precision = x.dtype in (torch.bfloat16, torch.float16)
    total = torch.sum(x, dim=dims, keepdim=keepdim, dtype=torch.float32 if low_precision else None)
    return (total / reduced_count).to(x.dtype)


def _mean_grads(d, grads):
    return {"x": lambda: expand_back(d, d.ops.div(grads[0], d.reduced_count()))}


register(OpDef(
    "mean", (tensor("x"), attr("dims", None), attr("keepdim", False), attr("dtype", None)),
    _mean_infer, _mean, doc="mean over axes", needs_reduced_count=True,
    sharding=partial_rule("sum") + "; each shard divides by the global count",
    vjp=Vjp(_mean_grads),
))


def _var_mean_infer(x, dims, correction, keepdim):
    axes = reduced_axes("var_mean", x, dims, keepdim)
    if not isinstance(correction, int | float) or isinstance(correction, bool):
        raise DefinitionError(f"var_mean: correction must be a number, got {correction!r}")
    dtype = _default_dtype("var_mean", x.dtype)
    return [OutSpec(dtype, axes), OutSpec(dtype, axes)]


def _var_mean(x, dims, correction, keepdim):
    var, mean = torch.var_mean(
        x, dim=local_dims(x, dims), correction=correction, keepdim=keepdim
    )
    return var, mean


def _var_mean_grads(d, grads):
    """d var / dx = 2 (x - mean) / (n - correction); d mean / dx = 1 / n."""
    o, (g_var, g_mean) = d.ops, grads
    n = d.reduced_count()

    def grad():
        result = None
        if g_var is not None:
            centered = o.sub(d.value("x"), expand_back(d, d.out(1)))
            dof = n - d.attrs["correction"]
            scale = 2.0 / dof if dof > 0 else math.inf  # as PyTorch: no degrees of freedom
            result = o.mul(expand_back(d, g_var), o.mul(centered, scale))
        if g_mean is not None:
            term = expand_back(d, o.div(g_mean, n))
            result = term if result is None else o.add(result, term)
        return result

    return {"x": grad}


register(OpDef(
    "var_mean",
    (tensor("x"), attr("dims", None), attr("correction", 1), attr("keepdim", False)),
    _var_mean_infer, _var_mean,
    doc="variance (with Bessel's correction by default) and mean over axes",
    sharding="kept axes are sharded as x's; a reduced axis sharded in x is gathered first "
    "(no partial variance)",
    partial_reduce=None, vjp=Vjp(_var_mean_grads),
))
