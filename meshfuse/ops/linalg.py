"""Matrix products: ``matmul`` (PyTorch's broadcasting semantics) and ``linear``.

The contracted axis is a reduction ID of the output (last in its logical domain), mapped from
both operands' contracted axes, so that a sharded contraction shows up as a partial result.
"""

from __future__ import annotations

import torch

from meshfuse.errors import DefinitionError
from meshfuse.ir.iter_domain import IterType
from meshfuse.ops.registry import (
    AxisSpec,
    Kind,
    OpDef,
    OutSpec,
    Param,
    TensorMeta,
    Vjp,
    register,
    tensor,
)
from meshfuse.ops.shape_rules import broadcast_axes, promote, require_tensor


def _check_dtypes(op: str, **operands: TensorMeta) -> None:
    """PyTorch's matrix products do not promote: every operand must have one dtype."""
    dtypes = {name: m.dtype for name, m in operands.items()}
    if len(set(dtypes.values())) > 1:
        shown = ", ".join(f"{name} is {d.name}" for name, d in dtypes.items())
        raise DefinitionError(f"{op}: operands must have one dtype, but {shown}; cast them")


def _check_contraction(op: str, a: TensorMeta, ka: int, b: TensorMeta, kb: int) -> int | None:
    ea, eb = a.shape[ka], b.shape[kb]
    if None not in (ea, eb) and ea != eb:
        raise DefinitionError(
            f"{op}: contracted extents differ: axis {ka} of the first operand has {ea}, axis "
            f"{kb} of the second has {eb}"
        )
    return ea if ea is not None else eb


def _matmul_infer(a, b):
    a, b = require_tensor("matmul", "a", a), require_tensor("matmul", "b", b)
    if a.ndim == 0 or b.ndim == 0:
        raise DefinitionError("matmul: operands must have at least one axis")
    _check_dtypes("matmul", a=a, b=b)
    ka, kb = a.ndim - 1, max(b.ndim - 2, 0)
    k = _check_contraction("matmul", a, ka, b, kb)
    batch_a = TensorMeta(a.shape[:-2], a.iter_types[:-2], a.dtype) if a.ndim > 2 else None
    batch_b = TensorMeta(b.shape[:-2], b.iter_types[:-2], b.dtype) if b.ndim > 2 else None
    batch = broadcast_axes("matmul", [m for m in (batch_a, batch_b) if m is not None])
    if batch_a is None and batch_b is not None:
        batch = tuple(AxisSpec(s.extent, s.iter_type, tuple((1, ax) for _, ax in s.sources))
                      for s in batch)
    axes = list(batch)
    if a.ndim >= 2:
        axes.append(AxisSpec(a.shape[-2], a.iter_types[-2], ((0, a.ndim - 2),)))
    if b.ndim >= 2:
        axes.append(AxisSpec(b.shape[-1], b.iter_types[-1], ((1, b.ndim - 1),)))
    axes.append(AxisSpec(k, IterType.Reduction, ((0, ka), (1, kb))))
    return [OutSpec(promote(a, b), tuple(axes))]


def transposed(o, x):
    """``x`` with its last two axes swapped."""
    n = len(x.materialized())
    return o.permute(x, list(range(n - 2)) + [n - 1, n - 2])


def _matmul_grads(d, grads):
    """``ga = g @ b^T``, ``gb = a^T @ g``, with 1-D operands made matrices first (a row,
    a column) and the batch axes summed down to each operand's."""
    o, g = d.ops, grads[0]
    na, nb = d.ndim("a"), d.ndim("b")
    n = len(g.materialized())
    if na == 1 and nb == 1:
        g = o.broadcast_in_dim(g, [1, 1], [])
    elif na == 1:  # g lacks the row axis
        g = o.broadcast_in_dim(g, [-1] * (n - 1) + [1, -1], list(range(n - 1)) + [n])
    elif nb == 1:  # g lacks the column axis
        g = o.broadcast_in_dim(g, [-1] * n + [1], list(range(n)))

    def matrix(name):
        x = d.value(name)
        if d.ndim(name) >= 2:
            return x
        return o.broadcast_in_dim(x, [1, -1], [1]) if name == "a" else \
            o.broadcast_in_dim(x, [-1, 1], [0])

    def grad_a():
        a = matrix("a")
        ga = d.sum_to(o.matmul(g, transposed(o, matrix("b"))), a)
        return o.squeeze(ga, [0]) if na == 1 else ga

    def grad_b():
        b = matrix("b")
        gb = d.sum_to(o.matmul(transposed(o, matrix("a")), g), b)
        return o.squeeze(gb, [1]) if nb == 1 else gb

    return {"a": grad_a, "b": grad_b}


register(OpDef(
    "matmul", (tensor("a"), tensor("b")), _matmul_infer, torch.matmul, output_layout="contiguous",
    doc="matrix product with PyTorch's batching and broadcasting",
    vjp=Vjp(_matmul_grads),
))


def _linear_infer(x, weight, bias):
    x = require_tensor("linear", "x", x)
    weight = require_tensor("linear", "weight", weight)
    if weight.ndim != 2 or x.ndim < 1:
        raise DefinitionError(
            f"linear: weight must be [out_features, in_features] (got {weight.ndim} axes) and "
            f"x must have at least one axis"
        )
    k = _check_contraction("linear", x, x.ndim - 1, weight, 1)
    axes = [AxisSpec(e, t, ((0, a),)) for a, (e, t) in
            enumerate(zip(x.shape[:-1], x.iter_types[:-1]))]
    out_sources = ((1, 0),)
    if bias is not None:
        bias = require_tensor("linear", "bias", bias)
        if bias.ndim != 1 or None not in (bias.shape[0], weight.shape[0]) and \
                bias.shape[0] != weight.shape[0]:
            raise DefinitionError(
                f"linear: bias must be [out_features] = [{weight.shape[0]}], got {list(bias.shape)}"
            )
        out_sources = ((1, 0), (2, 0))
    _check_dtypes("linear", x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    axes.append(AxisSpec(weight.shape[0], IterType.Iteration, out_sources))
    axes.append(AxisSpec(k, IterType.Reduction, ((0, x.ndim - 1), (1, 1))))
    return [OutSpec(promote(x, weight), tuple(axes))]


def _weight_grad(d, g):
    """``sum over tokens of g^T x``: one matmul of ``[N, T] x [T, K]``. Leading axes of
    extent 1 are squeezed away; several token axes stay a batch of matmuls, then a sum (a
    reshape merging them would lose a sequence axis's sharding)."""
    o, x = d.ops, d.value("x")
    n = d.ndim("x")
    if n == 1:
        return o.mul(o.broadcast_in_dim(g, [-1, 1], [0]), o.broadcast_in_dim(x, [1, -1], [1]))
    ones = [a for a in range(n - 1) if d.is_broadcast("x", a)]
    if ones and len(ones) < n - 1:
        g, x = o.squeeze(g, ones), o.squeeze(x, ones)
        n -= len(ones)
    product = o.matmul(transposed(o, g), x)
    return o.sum(product, dims=list(range(n - 2))) if n > 2 else product


def _linear_grads(d, grads):
    o, g = d.ops, grads[0]
    return {
        "x": lambda: o.matmul(g, d.value("weight")),
        "weight": lambda: _weight_grad(d, g),
        "bias": lambda: o.sum(g, dims=list(range(len(g.materialized()) - 1)))
        if len(g.materialized()) > 1 else g,
    }


register(OpDef(
    "linear", (tensor("x"), tensor("weight"), Param("bias", Kind.TENSOR, None)), _linear_infer,
    lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias),
    doc="x @ weight.T + bias",
    prefer_inputs=(1, 2), output_layout="contiguous",
    partial_addends=(2,), vjp=Vjp(_linear_grads),
))
