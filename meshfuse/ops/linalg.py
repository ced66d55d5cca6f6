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


register(OpDef(
    "matmul", (tensor("a"), tensor("b")), _matmul_infer, torch.matmul, output_layout="contiguous",
    doc="matrix product with PyTorch's batching and broadcasting",
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


register(OpDef(
    "linear", (tensor("x"), tensor("weight"), Param("bias", Kind.TENSOR, None)), _linear_infer,
    lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias),
    doc="x @ weight.T + bias",
    prefer_inputs=(1, 2), output_layout="contiguous",
    partial_addends=(2,),
))
