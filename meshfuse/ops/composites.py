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
from meshfuse.ops.moe.losses import COMPOSITES as MOE_COMPOSITES

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


def cross_entropy(o, logits, target, reduction: str = "mean", ignore_index: int = -100,
                  label_smoothing: float = 0.0):
    """``torch.nn.functional.cross_entropy(logits, target, ...)``, classes on axis 1 of
    ``logits`` (axis 0 of a 1-D one).

    ``target`` holds class *indices* (an integer tensor of the logits' shape without the
    class axis; ``ignore_index`` marks rows left out) or class *probabilities* (the logits'
    shape). ``label_smoothing`` mixes the target with the uniform distribution, as PyTorch
    does; ``reduction`` is ``"mean"`` (over the rows not ignored), ``"sum"`` or ``"none"``.

    With indices, the loss is ``logsumexp(x) - x[target]`` per row, written with a max, a
    sum of exponentials and a ``take_along_axis``: where the class axis is sharded (loss
    parallel), each of them is a partial result over it, reduced across the vocabulary group
    as a vector of one value per row, and no rank holds more of the softmax than its shard.
    A sharded row axis sums the losses and the count of rows not ignored alike.
    """
    if reduction not in ("mean", "sum", "none"):
        raise DefinitionError(f"cross_entropy: reduction {reduction!r} must be 'mean', 'sum' "
                              "or 'none'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise DefinitionError(f"cross_entropy: label_smoothing {label_smoothing} must be in "
                              "[0, 1]")
    axis = 1 if logits.ndim > 1 else 0
    if _fused(logits, target, reduction):
        return _fused_cross_entropy(o, logits, target, reduction, ignore_index, label_smoothing)
    if target.dtype.is_floating:
        loss = _soft_cross_entropy(o, logits, target, axis, label_smoothing)
    else:
        loss = _index_cross_entropy(o, logits, target, axis, ignore_index, label_smoothing)
    if reduction == "sum" or (reduction == "mean" and target.dtype.is_floating):
        loss = o.sum(loss) if reduction == "sum" else o.mean(loss)
    elif reduction == "mean":  # over the rows not ignored (nan if every row is)
        # Each row's loss divided by the count, then summed, as the fused kernel does: the
        # result is a sum over the rows with either path (a static or a symbolic class
        # extent), so a schedule of it applies to both.
        kept = o.sum(o.cast(o.ne(target, ignore_index), DataType.Float))
        loss = o.sum(o.div(loss, kept))
    # nvFuser's promotion computes bf16 products in float: the loss in the logits' dtype.
    return loss if loss.dtype is logits.dtype else o.cast(loss, logits.dtype)


def _fused(logits, target, reduction: str) -> bool:
    """Whether ``cross_entropy_fwd`` (one kernel for the loss and its gradient) computes
    it: class indices, 2-D logits of a static class extent, a mean or a sum."""
    return (not target.dtype.is_floating and reduction in ("mean", "sum") and
            logits.ndim == 2 and target.ndim == 1 and
            logits.materialized()[1].extent is not None)


def _fused_cross_entropy(o, logits, target, reduction: str, ignore_index: int,
                         smoothing: float):
    """``cross_entropy_fwd``'s loss (its gradient, computed with it, is the backward's
    residual), divided by the count of rows not ignored for a mean."""
    count = o.sum(o.cast(o.ne(target, ignore_index), DataType.Float)) \
        if reduction == "mean" else 1.0
    loss, _, _ = o.cross_entropy_fwd(_unwidened(o, logits), target, count,
                                     ignore_index=ignore_index,
                                     label_smoothing=float(smoothing))
    return loss if loss.dtype is logits.dtype else o.cast(loss, logits.dtype)


def _unwidened(o, logits):
    """``logits`` itself, or where it is a float32 cast of bf16/fp16 values (perhaps then
    reshaped: ``F.cross_entropy(logits.float().view(-1, V), ...)``, as Hugging Face's
    losses are written), those values (reshaped alike). ``cross_entropy_fwd`` computes in
    float32 from half-precision logits, so the loss is the same, and writes the gradient in
    their dtype, which the cast's gradient would round it to anyway: the float32 copy of the
    logits is never made, and the backward keeps a half-precision gradient as its residual
    (half the bytes)."""
    shape = None
    source = logits
    if source.definition is not None and source.definition.op is not None and \
            source.definition.op.name == "reshape":
        shape = [i.extent for i in logits.logical]
        source = source.definition.args[0]
    cast = source.definition
    if cast is None or cast.op is None or cast.op.name != "cast" or \
            source.dtype is not DataType.Float:
        return logits
    narrow = cast.args[0]
    if narrow.dtype not in (DataType.BFloat16, DataType.Half) or None in (shape or [0]):
        return logits
    return narrow if shape is None else o.reshape(narrow, shape)


def _soft_cross_entropy(o, logits, target, axis: int, smoothing: float):
    """``-sum(target * log_softmax(logits))`` over the class axis, per row."""
    if target.ndim != logits.ndim:
        raise DefinitionError(
            f"cross_entropy: target {target.name} of probabilities must have the logits' "
            f"{logits.ndim} axes, got {target.ndim}")
    if smoothing:
        classes = logits.materialized()[axis].extent
        target = o.add(o.mul(target, 1.0 - smoothing), smoothing / classes)
    return o.neg(o.sum(o.mul(target, log_softmax(o, logits, axis)), [axis]))


def _index_cross_entropy(o, logits, target, axis: int, ignore_index: int, smoothing: float):
    """Per row, ``logsumexp(x) - sum(w * x)`` with ``w`` the target distribution (one-hot at
    the target, mixed with the uniform one by ``smoothing``), zero where ignored; in float32
    for half-precision logits.

    ``w`` comes from comparing the class positions (``iota``) with the target, so the whole
    loss is pointwise ops and three reductions over the classes: its gradient,
    ``softmax - w`` scaled, is pointwise too (the max only shifts the exponentials: a
    constant to differentiation). With the classes sharded, each reduction is partial over
    them: three allreduces of one value per row (loss parallel)."""
    if target.ndim != logits.ndim - 1:
        raise DefinitionError(
            f"cross_entropy: target {target.name} of class indices must have the logits' "
            f"shape without the class axis {axis} ({logits.ndim - 1} axes), got "
            f"{target.ndim}; pass class probabilities of the logits' shape otherwise")
    classes = logits.materialized()[axis].extent
    x = o.cast(logits, DataType.Float) if logits.dtype in _LOW_PRECISION else logits
    m = o.stop_gradient(o.max(x, [axis], keepdim=True))
    lse = o.add(o.log(o.sum(o.exp(o.sub(x, m)), [axis])), o.squeeze(m, [axis]))
    if classes is None:
        loss = o.sub(lse, _symbolic_target_term(o, x, target, axis, ignore_index, smoothing))
        return o.where(o.eq(target, ignore_index), 0.0, loss)
    n = logits.ndim
    rows = [a for a in range(n) if a != axis]
    at_target = o.eq(o.broadcast_in_dim(o.iota(classes), [1] * axis + [classes] +
                                        [1] * (n - axis - 1), [axis]),
                     o.broadcast_in_dim(target, [-1 if a != axis else 1 for a in range(n)],
                                        rows))
    uniform = smoothing / classes
    weighted = o.where(at_target, o.mul(x, 1.0 - smoothing + uniform), o.mul(x, uniform)) \
        if smoothing else o.where(at_target, x, 0.0)
    loss = o.sub(lse, o.sum(weighted, [axis]))
    # A target out of range matches no class: NaN, not a value (docs/cross_entropy.md).
    valid = o.logical_and(o.ge(target, 0), o.lt(target, classes))
    return o.where(o.eq(target, ignore_index), 0.0, o.where(valid, loss, float("nan")))


def _symbolic_target_term(o, x, target, axis: int, ignore_index: int, smoothing: float):
    """``sum(w * x)`` over a class axis of symbolic extent: ``x`` at the target
    (``take_along_axis``; an ignored row reads class 0, its loss is zeroed after) mixed
    with ``mean(x)`` (the uniform distribution's term, ``1/C`` bound with the extent)."""
    n = x.ndim
    rows = [a for a in range(n) if a != axis]
    safe = o.where(o.eq(target, ignore_index), o.mul(target, 0), target)
    index = o.broadcast_in_dim(safe, [1 if a == axis else -1 for a in range(n)], rows)
    picked = o.squeeze(o.take_along_axis(x, index, axis), [axis])
    if not smoothing:
        return picked
    return o.add(o.mul(picked, 1.0 - smoothing), o.mul(o.mean(x, [axis]), smoothing))


def chunk(o, x, chunks: int, dim: int = 0):
    """``torch.chunk(x, chunks, dim)``: ``split`` into pieces of ``ceil(extent / chunks)``
    (fewer pieces where that divides the extent into fewer); a tuple of tensors."""
    axis = _axis("chunk", x, dim)
    extent = x.materialized()[axis].extent
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise DefinitionError(f"chunk: chunks must be a positive int, got {chunks!r}")
    if extent is None:
        raise DefinitionError(f"chunk: axis {axis} of {x.name} has a symbolic extent; give it "
                              "a static one in define_tensor (the pieces' extents are part of "
                              "the fusion)")
    pieces = o.split(x, max(-(-extent // chunks), 1), axis)
    return pieces if isinstance(pieces, tuple) else (pieces,)


COMPOSITES: dict[str, Callable] = {
    "chunk": chunk,
    "cross_entropy": cross_entropy,
    "layer_norm": layer_norm,
    "log_softmax": log_softmax,
    "rms_norm": rms_norm,
    "softmax": softmax,
    **MOE_COMPOSITES,
}
