"""Composite ops: normalizations and losses written once with fusion ops, so they fuse.

``fd.ops.softmax(x, dim)``, ``log_softmax``, ``layer_norm``, ``rms_norm`` and
``cross_entropy`` add the pointwise ops and reductions they are made of to the fusion (no
registry entry of their own): their sharding follows from those ops' rules, autodiff
differentiates them through those ops' VJPs, and with ``execute(compile=True)`` each becomes
part of one fused segment. Like PyTorch, half-precision inputs are computed in float32 and the
result is cast back to the input's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError

_LOW_PRECISION = (DataType.Half, DataType.BFloat16)


def _axis(op: str, x, dim: int) -> int:
    """``dim`` of ``x`` made non-negative; a DefinitionError naming the op if out of range."""
    if not -x.ndim <= dim < x.ndim:
        raise DefinitionError(f"{op}: dim {dim} is out of range for {x.name} of {x.ndim} axes; "
                              f"choose one in [{-x.ndim}, {x.ndim - 1}]")
    return dim % x.ndim


def _computed(o, x, body: Callable):
    """``body(x)`` in float32 for a half-precision ``x``, cast back to its dtype."""
    if x.dtype not in _LOW_PRECISION:
        return body(x)
    return o.cast(body(o.cast(x, DataType.Float)), x.dtype)


def softmax(o, x, dim: int = -1):
    """``torch.softmax(x, dim)``: ``exp(x - max) / sum(exp(x - max))`` over ``dim``."""
    axis = _axis("softmax", x, dim)

    def body(t):
        e = o.exp(o.sub(t, o.max(t, [axis], keepdim=True)))
        return o.div(e, o.sum(e, [axis], keepdim=True))

    return _computed(o, x, body)


def log_softmax(o, x, dim: int = -1):
    """``torch.log_softmax(x, dim)``: ``x - max - log(sum(exp(x - max)))`` over ``dim``."""
    axis = _axis("log_softmax", x, dim)

    def body(t):
        shifted = o.sub(t, o.max(t, [axis], keepdim=True))
        return o.sub(shifted, o.log(o.sum(o.exp(shifted), [axis], keepdim=True)))

    return _computed(o, x, body)


def _last_axes(op: str, x, normalized_ndim: int) -> list[int]:
    if not 1 <= normalized_ndim <= x.ndim:
        raise DefinitionError(f"{op}: normalized_ndim {normalized_ndim} must be in "
                              f"[1, {x.ndim}] for {x.name} of {x.ndim} axes")
    return list(range(x.ndim - normalized_ndim, x.ndim))


def layer_norm(o, x, weight=None, bias=None, eps: float = 1e-5, normalized_ndim: int = 1):
    """``torch.nn.functional.layer_norm`` over the last ``normalized_ndim`` axes (the shape of
    ``weight`` and ``bias``, when given): ``(x - mean) / sqrt(var + eps) * weight + bias``,
    with the biased variance."""
    axes = _last_axes("layer_norm", x, normalized_ndim)

    def body(t):
        var, mean = o.var_mean(t, axes, correction=0, keepdim=True)
        y = o.mul(o.sub(t, mean), o.rsqrt(o.add(var, eps)))
        y = y if weight is None else o.mul(y, weight)
        return y if bias is None else o.add(y, bias)

    return _computed(o, x, body)


def rms_norm(o, x, weight=None, eps: float | None = None, normalized_ndim: int = 1):
    """``torch.nn.functional.rms_norm`` over the last ``normalized_ndim`` axes:
    ``x / sqrt(mean(x**2) + eps) * weight``; ``eps`` None is the input dtype's epsilon, as in
    PyTorch."""
    axes = _last_axes("rms_norm", x, normalized_ndim)
    eps = torch.finfo(x.dtype.torch_dtype).eps if eps is None else eps

    def body(t):
        y = o.mul(t, o.rsqrt(o.add(o.mean(o.mul(t, t), axes, keepdim=True), eps)))
        return y if weight is None else o.mul(y, weight)

    return _computed(o, x, body)


def cross_entropy(o, logits, target, reduction: str = "mean"):
    """``torch.nn.functional.cross_entropy(logits, target)`` for class *probabilities*
    ``target`` (same shape as ``logits [N, C]``, classes on axis 1): ``-sum(target *
    log_softmax(logits, 1), 1)``, then averaged (``"mean"``), summed (``"sum"``) or kept per
    sample (``"none"``). Class indices need a gather, which meshfuse has no op for yet: pass
    one-hot probabilities instead."""
    if not target.dtype.is_floating:
        raise DefinitionError(
            f"cross_entropy: target {target.name} is {target.dtype.name}; pass class "
            "probabilities (one-hot for class indices) of the logits' shape")
    if reduction not in ("mean", "sum", "none"):
        raise DefinitionError(f"cross_entropy: reduction {reduction!r} must be 'mean', 'sum' "
                              "or 'none'")
    loss = o.neg(o.sum(o.mul(target, log_softmax(o, logits, 1 if logits.ndim > 1 else 0)),
                       [1 if logits.ndim > 1 else 0]))
    if reduction != "none":
        loss = o.mean(loss) if reduction == "mean" else o.sum(loss)
    # nvFuser's promotion computes bf16 products in float: the loss in the logits' dtype.
    return loss if loss.dtype is logits.dtype else o.cast(loss, logits.dtype)


COMPOSITES: dict[str, Callable] = {
    "cross_entropy": cross_entropy,
    "layer_norm": layer_norm,
    "log_softmax": log_softmax,
    "rms_norm": rms_norm,
    "softmax": softmax,
}
