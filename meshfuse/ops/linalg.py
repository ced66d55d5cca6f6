"""Matrix products: ``matmul`` (PyTorch's broadcasting semantics) and ``linear``.

The contracted axis is a reduction ID of the output (last in its logical domain), mapped from
both operands' contracted axes, so that a sharded contraction shows up as a partial result.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError, ShardingError
from meshfuse.ir.iter_domain import IterType
from meshfuse.ir.layout import device_ids
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


def _matmul(a, b, out_shapes=None):
    """``torch.matmul(a, b)``, with nvFuser's expanded broadcast batch axes: given the local
    output shape (``out_shapes``, where an operand has an expanded broadcast axis), a batch
    axis of an operand whose local extent is neither 1 nor the output's is an expanded
    broadcast (every element the same, its local extent the global one next to a shard): it
    is cut to one element and the product expanded back to the output's shape."""
    if out_shapes is None:
        return torch.matmul(a, b)
    shape = tuple(out_shapes[0])
    batch = shape[:len(shape) - (a.ndim >= 2) - (b.ndim >= 2)]

    def cut(x):
        for axis in range(x.ndim - 2):
            if x.shape[axis] not in (1, batch[axis + len(batch) - (x.ndim - 2)]):
                x = x.narrow(axis, 0, 1)
        return x

    result = torch.matmul(cut(a), cut(b))
    return result.expand(shape) if tuple(result.shape) != shape else result


register(OpDef(
    "matmul", (tensor("a"), tensor("b")), _matmul_infer, _matmul, output_layout="contiguous",
    doc="matrix product with PyTorch's batching and broadcasting",
    sharding="'...mk,...kn->...mn': batch, m and n axes sharded as the operands' (column "
    "and row parallel); a sharded k makes a partial sum",
    vjp=Vjp(_matmul_grads), expands_broadcasts=True,
))


def _linear_infer(x, weight, bias):
    """``x [..., k]`` times ``weight [*lead, n, k]`` (transposed), plus ``bias [*lead, n]``:
    ``[*lead, ..., n]``. A weight with leading axes (nvFuser's ``[d, e, e]`` with a logical
    device axis ``d``) puts them first in the output."""
    x = require_tensor("linear", "x", x)
    weight = require_tensor("linear", "weight", weight)
    if weight.ndim < 2 or x.ndim < 1:
        raise DefinitionError(
            f"linear: weight must be [..., out_features, in_features] (got {weight.ndim} axes) "
            "and x must have at least one axis"
        )
    lead = weight.ndim - 2
    k = _check_contraction("linear", x, x.ndim - 1, weight, weight.ndim - 1)
    has_bias = bias is not None
    if has_bias:
        bias = require_tensor("linear", "bias", bias)
        expected = (*weight.shape[:lead], weight.shape[-2])
        if bias.ndim != lead + 1 or any(None not in (b, w) and b != w
                                        for b, w in zip(bias.shape, expected)):
            raise DefinitionError(
                f"linear: bias must be [..., out_features] = {list(expected)}, got "
                f"{list(bias.shape)}"
            )
    _check_dtypes("linear", x=x, weight=weight, **({"bias": bias} if has_bias else {}))

    def from_weight(axis: int, bias_axis: int) -> AxisSpec:
        sources = ((1, axis), (2, bias_axis)) if has_bias else ((1, axis),)
        return AxisSpec(weight.shape[axis], weight.iter_types[axis], sources)

    axes = [from_weight(a, a) for a in range(lead)]
    axes += [AxisSpec(e, t, ((0, a),)) for a, (e, t) in
             enumerate(zip(x.shape[:-1], x.iter_types[:-1]))]
    axes.append(dataclasses.replace(from_weight(lead, lead), iter_type=IterType.Iteration))
    axes.append(AxisSpec(k, IterType.Reduction, ((0, x.ndim - 1), (1, weight.ndim - 1))))
    return [OutSpec(promote(x, weight), tuple(axes))]


def _linear(x, weight, bias, dropped_addends=()):
    """``x @ weight.T + bias``. On a rank that leaves the bias of a partial result out
    (``dropped_addends``: coordinate 0 adds it), a zero bias is added instead, so that every
    rank runs one kernel: PyTorch's ``addmm``, cuBLAS's GEMM with a bias epilogue (DTensor's
    row-parallel linear calls it on every rank too, with its share of the bias), not a
    plain ``mm`` beside coordinate 0's ``addmm``."""
    if weight.ndim == 2:
        if dropped_addends:
            bias = weight.new_zeros(weight.shape[0])
        return torch.nn.functional.linear(x, weight, bias)
    lead = weight.shape[:-2]
    # explicit extents: a shard may be empty (no rows, no leading index, no features)
    count, tokens = math.prod(lead), math.prod(x.shape[:-1])
    rows = x.reshape(1, tokens, x.shape[-1])                    # [1, m, k]
    out = torch.matmul(rows, weight.reshape(count, *weight.shape[-2:]).transpose(-1, -2))
    if bias is not None:                                         # [L, m, n] + [L, 1, n]
        out = out + bias.reshape(count, 1, bias.shape[-1])
    return out.reshape(*lead, *x.shape[:-1], weight.shape[-2])


def _weight_grad(d, g):
    """``sum over tokens of g^T x``: one matmul of ``[N, T] x [T, K]``, the token axes
    merged (as torch's autograd computes a linear's weight gradient: one GEMM, no copy of
    a transposed operand). Leading broadcast axes of extent 1 are squeezed away. Where the
    token axes cannot be merged (one of them sharded over devices, symbolic, or an expanded
    broadcast), they stay a batch of matmuls, then a sum: a batch of weight-sized products
    (a GPT layer's batch of 2 wrote and read twice its weights' bytes more, and held them)."""
    o, x = d.ops, d.value("x")
    n = d.ndim("x")
    if n == 1:
        return o.mul(o.broadcast_in_dim(g, [-1, 1], [0]), o.broadcast_in_dim(x, [1, -1], [1]))
    if n > 2 and _tokens_mergeable(d, n - 1):
        tokens = math.prod(d.shape("x")[:n - 1])
        g = o.reshape(g, [tokens, g.materialized()[-1].extent])
        x = o.reshape(x, [tokens, x.materialized()[-1].extent])
        return o.matmul(transposed(o, g), x)
    ones = [a for a in range(n - 1) if d.is_broadcast_of_one("x", a)]
    if ones and len(ones) < n - 1:
        g, x = o.squeeze(g, ones), o.squeeze(x, ones)
        n -= len(ones)
    product = o.matmul(transposed(o, g), x)
    return o.sum(product, dims=list(range(n - 2))) if n > 2 else product


def _tokens_mergeable(d, count: int) -> bool:
    """Whether the first ``count`` axes of the linear's ``x`` and of its output (its token
    axes) may be merged by a reshape: static extents, none broadcast, none split over
    devices (a merge would make each rank's part no block of the merged axis)."""
    x, out = d.arg("x"), d.expr.outputs[0]
    for tv in (x, out):
        ids = tv.materialized()[:count]
        if any(i.extent is None or i.is_broadcast for i in ids):
            return False
        if any(d.is_sharded(tv, a) for a in range(count)):
            return False
    return True


def _lead_linear_grads(d, g):
    """The gradients of a linear whose weight ``[*lead, n, k]`` has leading axes (its output
    is ``[*lead, ..., n]``, one linear per leading index): ``x``'s sums the products
    ``g[l] @ weight[l]`` over the leading axes; ``weight[l]``'s is ``g[l]^T x`` summed over
    the tokens; ``bias[l]``'s is ``g[l]`` summed over the tokens. The weight meets the
    token axes through axes of extent 1 (matmul's broadcasting), ``x`` meets the leading
    axes alike."""
    o, x, w = d.ops, d.value("x"), d.value("weight")
    lead, n = d.ndim("weight") - 2, d.ndim("x")
    leads, tokens = list(range(lead)), list(range(lead, lead + n - 1))
    # the extents broadcast_in_dim keeps: given (an expanded broadcast axis of x keeps its
    # extent, which -1 would make 1), -1 where symbolic
    xs, ws, gs = ([-1 if i.extent is None else i.extent for i in t.materialized()]
                  for t in (x, w, g))

    def grad_x():
        if n == 1:  # g is [*lead, n]: rows of one token
            rows = o.broadcast_in_dim(g, gs[:lead] + [1, gs[lead]], leads + [lead + 1])
            return o.squeeze(o.sum(o.matmul(rows, w), dims=leads), [0])
        weight = o.broadcast_in_dim(w, ws[:lead] + [1] * (n - 2) + ws[lead:],
                                    leads + [lead + n - 2, lead + n - 1])
        return o.sum(o.matmul(g, weight), dims=leads)

    def grad_weight():
        if n == 1:  # an outer product per leading index
            column = o.broadcast_in_dim(g, gs + [1], list(range(lead + 1)))
            row = o.broadcast_in_dim(x, [1] * (lead + 1) + xs, [lead + 1])
            return o.mul(column, row)
        tokens_x = o.broadcast_in_dim(x, [1] * lead + xs, list(range(lead, lead + n)))
        product = o.matmul(transposed(o, g), tokens_x)  # [*lead, *tokens[:-1], n, k]
        return o.sum(product, dims=tokens[:-1]) if n > 2 else product

    return {
        "x": grad_x,
        "weight": grad_weight,
        "bias": lambda: o.sum(g, dims=tokens) if tokens else g,
    }


def _linear_grads(d, grads):
    o, g = d.ops, grads[0]
    if d.ndim("weight") > 2:
        return _lead_linear_grads(d, g)
    return {
        "x": lambda: o.matmul(g, d.value("weight")),
        "weight": lambda: _weight_grad(d, g),
        "bias": lambda: o.sum(g, dims=list(range(len(g.materialized()) - 1)))
        if len(g.materialized()) > 1 else g,
    }


register(OpDef(
    "linear", (tensor("x"), tensor("weight"), Param("bias", Kind.TENSOR, None)), _linear_infer,
    _linear,
    doc="x @ weight.T + bias (weight [..., n, k]: leading axes come first)",
    sharding="'...k,nk->...n': x's axes and weight's n sharded as given (propagation prefers "
    "the weight's sharding); a sharded k makes a partial sum, the bias added on one rank",
    prefer_inputs=(1, 2), output_layout="contiguous",
    partial_addends=(2,), vjp=Vjp(_linear_grads),
))


def _grouped_mm_infer(mat1, mat2, offsets):
    """``mat1 [m, k]`` by groups of rows: rows ``offsets[g-1]:offsets[g]`` times ``mat2[g]``
    (``[G, k, n]``) give ``[m, n]`` (PyTorch's ``_grouped_mm``, MoE experts)."""
    mat1 = require_tensor("grouped_mm", "mat1", mat1)
    mat2 = require_tensor("grouped_mm", "mat2", mat2)
    offsets = require_tensor("grouped_mm", "offsets", offsets)
    if mat1.ndim != 2 or mat2.ndim != 3 or offsets.ndim != 1:
        raise DefinitionError(
            f"grouped_mm: supports mat1 [m, k], mat2 [groups, k, n] and offsets [groups]; got "
            f"{mat1.ndim}, {mat2.ndim} and {offsets.ndim} axes"
        )
    if offsets.dtype not in (DataType.Int32, DataType.Int):
        raise DefinitionError(
            f"grouped_mm: offsets must be Int32 (cumulative row ends), got {offsets.dtype.name}"
        )
    for a, b, what in ((mat2.shape[0], offsets.shape[0], "groups of mat2 and offsets"),):
        if None not in (a, b) and a != b:
            raise DefinitionError(f"grouped_mm: {what} differ: {a} and {b}")
    _check_dtypes("grouped_mm", mat1=mat1, mat2=mat2)
    k = _check_contraction("grouped_mm", mat1, 1, mat2, 1)
    axes = (
        AxisSpec(mat1.shape[0], mat1.iter_types[0], ((0, 0),)),
        AxisSpec(mat2.shape[2], mat2.iter_types[2], ((1, 2),)),
        AxisSpec(k, IterType.Reduction, ((0, 1), (1, 1))),
    )
    return [OutSpec(mat1.dtype, axes)]


def _grouped_mm(mat1, mat2, offsets):
    out = mat1.new_empty(mat1.shape[0], mat2.shape[2])
    start = 0
    for group, end in enumerate(offsets.tolist()):
        torch.matmul(mat1[start:end], mat2[group], out=out[start:end])
        start = end
    return out


def _check_grouped_sharding(expr) -> None:
    """Rows and groups stay whole: offsets count rows of the whole ``mat1``, and a group's
    rows must meet its expert's weights."""
    mat1, mat2, offsets = expr.args
    for tv, axis, what in ((mat1, 0, "the rows (axis 0) of mat1"),
                           (mat2, 0, "the groups (axis 0) of mat2"),
                           (offsets, 0, "the offsets")):
        if device_ids(tv).get(tv.logical[axis]):
            raise ShardingError(
                f"grouped_mm: {what} ({tv.name}) are sharded; offsets index the rows of the "
                "whole mat1, so shard k (row parallel) or n (column parallel) instead"
            )


register(OpDef(
    "grouped_mm", (tensor("mat1"), tensor("mat2"), tensor("offsets")), _grouped_mm_infer,
    _grouped_mm, output_layout="contiguous", check_sharding=_check_grouped_sharding,
    doc="grouped matrix product: row groups of mat1 (ends in offsets) times mat2[group]",
    sharding="k sharded: a partial sum (row parallel); n sharded: column parallel; the "
    "rows of mat1, the groups and the offsets must stay whole (else ShardingError)",
))
