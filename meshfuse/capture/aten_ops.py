"""The table from PyTorch's ATen ops (as the capture sees them) to meshfuse ops.

One entry per ATen overload: a function ``f(o, out, *args, **kwargs)`` that adds the meshfuse
ops computing it to a fusion (``o`` is ``fd.ops``; ``out`` the traced output's fake tensor,
whose shape and dtype the rules may read; the arguments are the node's, with fusion tensors
for its tensor arguments). The meshfuse ops carry the shape, sharding and gradient rules, so
an entry is only the translation. An entry may carry a ``check(node, constants)`` saying why
this one call cannot be translated (a mask that is not causal); an ATen op absent from the
table, or refused by its check, becomes a graph break (:mod:`meshfuse.capture.partition`).

Every translated value takes the dtype the trace recorded (:func:`as_traced`): meshfuse's
arithmetic on bfloat16 or half returns float32 (nvFuser's rule), PyTorch's returns the
operands' dtype; without the cast back a bf16 model's values would drift to float32 and meet
a bf16 weight in a ``linear``.

To add an op: write its translation below and list it in ``TABLE`` (sorted by name).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.fx.operator_schemas import normalize_function

from meshfuse.dtypes import DataType
from meshfuse.ir.tensor_view import TensorView

aten = torch.ops.aten

__all__ = ["IDENTITIES", "TABLE", "Translation", "as_traced", "translation"]


@dataclasses.dataclass(frozen=True)
class Translation:
    """How one ATen overload becomes meshfuse ops."""

    emit: Callable[..., Any]
    check: Callable[[torch.fx.Node, Mapping[str, torch.Tensor]], str | None] | None = None


def _unary(name: str):
    return lambda o, out, x: getattr(o, name)(x)


def _binary(name: str):
    return lambda o, out, a, b: getattr(o, name)(a, b)


def _torch_broadcast(o, x: Any, shape: list) -> Any:
    """``x`` with every axis of extent 1 that meets another extent in ``shape`` (aligned on
    the right) made a broadcast axis. PyTorch broadcasts any axis of extent 1; meshfuse only
    broadcast axes, and an extent 1 that a computation made (``linear`` to one feature, a
    one-wide slice) is an ordinary axis until squeezed and put back as a broadcast one."""
    if not isinstance(x, TensorView):
        return x
    offset = len(shape) - x.ndim
    dims = [a for a, axis in enumerate(x.materialized())
            if axis.extent == 1 and not axis.is_broadcast and shape[offset + a] != 1]
    if not dims:
        return x
    kept = [a for a in range(x.ndim) if a not in dims]
    return o.broadcast_in_dim(o.squeeze(x, dims), [1 if a in dims else -1
                                                   for a in range(x.ndim)], kept)


def _broadcasting(emit: Callable[..., Any]) -> Callable[..., Any]:
    """A pointwise op's translation whose tensor operands broadcast as PyTorch's do
    (:func:`_torch_broadcast` against the traced output's shape)."""
    def broadcast_then_emit(o, out, *args, **kwargs):
        shape = list(out.shape)
        return emit(o, out, *(_torch_broadcast(o, a, shape) for a in args), **kwargs)
    return broadcast_then_emit


def _add(o, out, a, b, alpha=1):
    return o.add(a, b if alpha == 1 else o.mul(b, alpha))


def _sub(o, out, a, b, alpha=1):
    return o.sub(a, b if alpha == 1 else o.mul(b, alpha))


def _div(o, out, a, b, rounding_mode=None):
    return o.div(a, b)


def _rsub(o, out, a, b, alpha=1):
    return o.sub(b, a if alpha == 1 else o.mul(a, alpha))


def _cast(o, out, x, *args, **kwargs):
    """``to``/``_to_copy``/``type_as``: a cast where the dtype changes, else the value."""
    dtype = DataType.from_torch(out.dtype)
    return x if x.dtype is dtype else o.cast(x, dtype)


def _reshape(o, out, x, *shape_args):
    """view, reshape, unsqueeze, squeeze, flatten, unflatten: the traced output's shape."""
    return o.reshape(x, list(out.shape))


def _transpose(o, out, x, a, b):
    dims = list(range(x.ndim))
    dims[a], dims[b] = dims[b], dims[a]
    return o.permute(x, dims)


def _t(o, out, x):
    return o.permute(x, list(range(x.ndim))[::-1])


def _permute(o, out, x, dims):
    return o.permute(x, [d % x.ndim for d in dims])


def _expand(o, out, x, shape, implicit=False):
    return o.expand(_torch_broadcast(o, x, list(out.shape)), list(out.shape))


def _clamped(o, x, dim: int, start, end) -> tuple[Any, Any]:
    """A slice's ``start``/``end`` along ``dim`` as PyTorch reads them (None: the ends; an
    end past the extent: the extent)."""
    extent = o.size(x, dim)
    return 0 if start is None else start, extent if end is None or end > extent else end


def _bounds(o, x, dim: int, start, end) -> tuple[list, list]:
    """``o.slice``'s starts and ends for ``x[start:end]`` along ``dim``, the rest whole."""
    starts, ends = [0] * x.ndim, list(o.shape(x))
    starts[dim], ends[dim] = start, end
    return starts, ends


def _slice(o, out, x, dim=0, start=None, end=None, step=1):
    dim %= x.ndim
    starts, ends = _bounds(o, x, dim, *_clamped(o, x, dim, start, end))
    strides = [1] * x.ndim
    strides[dim] = step
    return o.slice(x, starts, ends, strides)


def _split(o, out, x, sizes, dim=0):
    """``split``/``split_with_sizes``/``chunk`` as slices (a tuple the getitems read)."""
    dim %= x.ndim
    bounds = [0]
    for piece in out:
        bounds.append(bounds[-1] + piece.shape[dim])
    return tuple(o.slice(x, *_bounds(o, x, dim, start, end))
                 for start, end in itertools.pairwise(bounds))


def _pad(o, out, x, pad, mode="constant", value=None):
    """Constant padding (``F.pad``'s pairs, last axis first) as a ``cat`` with a block of
    ``value`` made from a slice of ``x`` times 0 (meshfuse has no ``full``)."""
    value = 0 if value is None else value
    value = value if x.dtype.is_floating else int(value)
    for i in range(0, len(pad), 2):
        dim, before, after = x.ndim - 1 - i // 2, pad[i], pad[i + 1]
        if not before and not after:
            continue
        starts, ends = [0] * x.ndim, list(o.shape(x))
        ends[dim] = 1
        unit = o.add(o.mul(o.slice(x, starts, ends), 0), value)
        blocks = []
        for width in (before, after):
            shape = list(o.shape(x))
            shape[dim] = width
            blocks.append(o.expand(_torch_broadcast(o, unit, shape), shape) if width else None)
        x = o.cat([b for b in (blocks[0], x, blocks[1]) if b is not None], dim)
    return x


def _constant_pad_nd(o, out, x, pad, value=0):
    return _pad(o, out, x, pad, "constant", value)


def _pad_check(node: torch.fx.Node, constants) -> str | None:
    pad, mode = node.args[1], "constant"
    if node.target is aten.pad.default:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    if mode != "constant":
        return f"pad in mode {mode!r} (meshfuse pads only with a constant)"
    if any(not isinstance(p, int) or p < 0 for p in pad):
        return "pad with negative or symbolic widths"
    if any(node.args[0].meta["val"].shape[-1 - i // 2] == 0 for i in range(len(pad))):
        return "pad of an empty axis"
    return None


def _cat(o, out, xs, dim=0):
    return o.cat(list(xs), dim % out.dim())


def _stack(o, out, xs, dim=0):
    """``xs`` each given an axis of extent 1 at ``dim``, concatenated along it."""
    dim %= out.dim()
    shape = [-1] * (out.dim() - 1)
    shape.insert(dim, 1)
    kept = [a for a in range(out.dim()) if a != dim]
    parts = [o.broadcast_in_dim(x, shape, kept) for x in xs]
    return parts[0] if len(parts) == 1 else o.cat(parts, dim)


def _softplus(o, out, x, beta=1, threshold=20):
    """``log(1 + exp(beta x)) / beta``, and ``x`` itself where ``beta x > threshold`` (as
    PyTorch). The exponential reads ``beta x`` capped at the threshold, so that where the
    linear branch is taken neither it nor its gradient overflows (a ``where``, not a
    ``minimum``: that would halve the gradient at the threshold)."""
    scaled = o.mul(x, beta) if beta != 1 else x
    linear = o.gt(scaled, threshold)
    soft = o.log1p(o.exp(o.where(linear, float(threshold), scaled)))
    return o.where(linear, x, o.div(soft, beta) if beta != 1 else soft)


def _first(value) -> Any:
    """A one-dimensional convolution's ``stride``/``padding``/``dilation``: an int or [int]."""
    return value[0] if isinstance(value, list | tuple) else value


def _depthwise_conv1d(o, out, x, weight, bias=None, stride=1, padding=0, dilation=1,
                      groups=1):
    """A depthwise one-dimensional convolution (one filter per channel: the short causal
    convolution of Mamba-style and gated delta-net layers), ``x`` ``(batch, channels,
    length)`` or ``(channels, length)``, as the sum over the filter's taps of a shifted slice
    of ``x`` (padded) times that tap's weight per channel: channel-parallel where the
    channels are sharded."""
    gap, length = _first(dilation), out.shape[-1]
    if _first(padding):
        x = _pad(o, out, x, [_first(padding)] * 2)
    channels, taps = o.shape(weight)[0], o.shape(weight)[-1]

    def per_channel(values):  # (channels,) broadcast along x's other axes, kept where it lies
        return o.broadcast_in_dim(values, [-1, 1] if x.ndim == 2 else [1, -1, 1],
                                  [x.ndim - 2])

    total = None
    for k in range(taps):
        starts, ends = _bounds(o, x, x.ndim - 1, k * gap, k * gap + length)
        tap = o.squeeze(o.slice(weight, [0, 0, k], [channels, 1, k + 1]), [1, 2])
        term = o.mul(o.slice(x, starts, ends), per_channel(tap))
        total = term if total is None else o.add(total, term)
    return total if bias is None else o.add(total, per_channel(bias))


_MAX_TAPS = 16  # a longer filter is a convolution to run as one, not a sum of slices


def _conv1d_check(node: torch.fx.Node, constants) -> str | None:
    bound = normalize_function(node.target, node.args, node.kwargs,
                               normalize_to_only_use_kwargs=True).kwargs  # defaults filled
    x, weight = bound["input"].meta["val"], bound["weight"].meta["val"]
    stride, padding, dilation, groups = (bound[name] for name in
                                         ("stride", "padding", "dilation", "groups"))
    if x.dim() not in (2, 3) or weight.dim() != 3:
        return "conv1d of an input that is not (batch, channels, length)"
    if groups != x.shape[-2] or weight.shape[0] != groups or weight.shape[1] != 1:
        return "conv1d other than depthwise (meshfuse has no convolution: only one filter " \
               "per channel runs as slices)"
    if _first(stride) != 1 or not all(isinstance(_first(v), int) for v in (padding, dilation)):
        return "conv1d with a stride, or a padding by name"
    if weight.shape[-1] > _MAX_TAPS:
        return f"conv1d of more than {_MAX_TAPS} taps"
    return None


def _copy(o, out, x, src, non_blocking=False):
    """Functional ``copy`` (what functionalization makes of ``x[...] = src``): ``src``
    broadcast to ``x``'s shape and cast to its dtype; ``x``'s values are not read."""
    if list(o.shape(src)) != list(out.shape):
        src = o.expand(src, list(out.shape))
    return _cast(o, out, src)


def _slice_scatter(o, out, x, src, dim=0, start=None, end=None, step=1):
    """``x`` with ``src`` written over ``x[start:end]`` along ``dim``: the kept parts of
    ``x`` and ``src`` concatenated."""
    dim %= x.ndim
    start, end = _clamped(o, x, dim, start, end)
    parts = [o.slice(x, *_bounds(o, x, dim, lo, hi))
             for lo, hi in ((0, start), (end, o.size(x, dim))) if hi > lo]
    parts.insert(1 if start > 0 else 0, _cast(o, out, src))
    return parts[0] if len(parts) == 1 else o.cat(parts, dim)


def _slice_scatter_check(node: torch.fx.Node, constants) -> str | None:
    args = [*node.args, None, None, None, None][2:6]
    dim, start, end, step = (node.kwargs.get(k, a) for k, a in
                             zip(("dim", "start", "end", "step"), args))
    x = node.args[0].meta["val"]
    if step not in (None, 1):
        return "slice_scatter with a step"
    if any(v is not None and not isinstance(v, int) for v in (dim, start, end)) or \
            (start or 0) < 0 or (end is not None and end < 0):
        return "slice_scatter with negative or symbolic bounds"
    if not isinstance(x.shape[(dim or 0) % x.ndim], int):
        return "slice_scatter on an axis of symbolic extent"
    return None


def _reduce(name: str):
    def emit(o, out, x, dims=None, keepdim=False, dtype=None):
        dims = list(range(x.ndim)) if dims is None or dims == [] else [d % x.ndim for d in dims]
        result = getattr(o, name)(x, dims, keepdim)
        return _cast(o, out, result)
    return emit


def _linear(o, out, x, weight, bias=None):
    return o.linear(x, weight, bias)


def _addmm(o, out, bias, a, b, beta=1, alpha=1):
    product = o.matmul(a, b)
    product = product if alpha == 1 else o.mul(product, alpha)
    return o.add(product, bias if beta == 1 else o.mul(bias, beta))


def _softmax(name: str):
    def emit(o, out, x, dim, *rest, **kwargs):
        return _cast(o, out, getattr(o, name)(x, dim % x.ndim))
    return emit


def _gelu(o, out, x, approximate="none"):
    return o.gelu(x, approximate=approximate)


def _where(o, out, cond, a, b):
    return o.where(cond, a, b)


def _layer_norm(o, out, x, shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return o.layer_norm(x, weight, bias, eps, len(shape))


def _rms_norm(o, out, x, shape, weight=None, eps=None):
    return o.rms_norm(x, weight, eps, len(shape))


def _pow(o, out, a, b):
    return o.pow(a, b)


def _sdpa(o, out, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    causal = is_causal or attn_mask is not None  # a mask only where its check found it causal
    return o.sdpfa_fwd(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)[0]


@functools.lru_cache(maxsize=8)
def _causal(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """The causal mask (one per shape: every layer's attention checks its mask)."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril()


def _sdpa_check(node: torch.fx.Node, constants: Mapping[str, torch.Tensor]) -> str | None:
    """A mask is taken only when it is a constant of the trace equal to the causal mask."""
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if mask is None:
        return None
    value = constants.get(getattr(mask, "name", None))
    if value is None:
        return "its attention mask depends on the inputs (meshfuse's attention takes " \
               "is_causal, not a mask)"
    q, k = node.args[0].meta["val"], node.args[1].meta["val"]
    causal = _causal(q.shape[-2], k.shape[-2], value.device)
    if value.dtype is not torch.bool or not bool((value == causal).all()):
        return "its attention mask is not the causal mask (meshfuse's attention takes " \
               "is_causal, not a mask)"
    return None


def _embedding(o, out, weight, indices, padding_idx=-1, scale_grad_by_freq=False,
               sparse=False):
    """ATen's ``padding_idx`` -1 means none (the module's negative ones arrive normalized)."""
    return o.embedding_fwd(indices, weight, None if padding_idx == -1 else padding_idx)


def _embedding_check(node: torch.fx.Node, constants) -> str | None:
    flags = list(node.args[3:5]) + [node.kwargs.get(k) for k in ("scale_grad_by_freq",
                                                                  "sparse")]
    return "embedding with scale_grad_by_freq or sparse" if any(flags) else None


_REDUCTIONS = ("none", "mean", "sum")  # ATen's Reduction enum, by value


def _cross_entropy(o, out, logits, target, weight=None, reduction=1, ignore_index=-100,
                   label_smoothing=0.0):
    return o.cross_entropy(logits, target, reduction=_REDUCTIONS[reduction],
                           ignore_index=ignore_index, label_smoothing=label_smoothing)


def _cross_entropy_check(node: torch.fx.Node, constants) -> str | None:
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    return "cross entropy with class weights" if weight is not None else None


def _dropout(o, out, x, p, train):
    return x


def _dropout_check(node: torch.fx.Node, constants) -> str | None:
    p, train = node.args[1], node.args[2]
    return "dropout in training mode with p > 0" if train and p else None


_COMPARISONS = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
_UNARY = ("abs", "cos", "cosh", "erf", "exp", "expm1", "log", "log1p", "log2", "neg",
          "reciprocal", "relu", "rsqrt", "sigmoid", "silu", "sin", "sinh", "sqrt", "tan",
          "tanh", "sign", "floor", "ceil", "round")

TABLE: dict[Any, Translation] = {
    aten._softmax.default: Translation(_softmax("softmax")),
    aten._log_softmax.default: Translation(_softmax("log_softmax")),
    aten._to_copy.default: Translation(_cast),
    aten._unsafe_view.default: Translation(_reshape),
    aten.add.Scalar: Translation(_broadcasting(_add)),
    aten.add.Tensor: Translation(_broadcasting(_add)),
    aten.addmm.default: Translation(_addmm),
    aten.amax.default: Translation(_reduce("max")),
    aten.amin.default: Translation(_reduce("min")),
    aten.bmm.default: Translation(_binary("matmul")),
    aten.cat.default: Translation(_cat),
    aten.copy.default: Translation(_copy),
    aten.cross_entropy_loss.default: Translation(_cross_entropy, _cross_entropy_check),
    aten.div.Scalar: Translation(_broadcasting(_div)),
    aten.div.Tensor: Translation(_broadcasting(_div)),
    aten.detach.default: Translation(_unary("stop_gradient")),
    aten.dropout.default: Translation(_dropout, _dropout_check),
    aten.embedding.default: Translation(_embedding, _embedding_check),
    aten.expand.default: Translation(_expand),
    aten.flatten.using_ints: Translation(_reshape),
    aten.gelu.default: Translation(_gelu),
    aten.layer_norm.default: Translation(_layer_norm),
    aten.linear.default: Translation(_linear),
    aten.log_softmax.int: Translation(_softmax("log_softmax")),
    aten.logical_and.default: Translation(_broadcasting(_binary("logical_and"))),
    aten.logical_or.default: Translation(_broadcasting(_binary("logical_or"))),
    aten.matmul.default: Translation(_binary("matmul")),
    aten.maximum.default: Translation(_broadcasting(_binary("maximum"))),
    aten.mean.default: Translation(_reduce("mean")),
    aten.mean.dim: Translation(_reduce("mean")),
    aten.minimum.default: Translation(_broadcasting(_binary("minimum"))),
    aten.mm.default: Translation(_binary("matmul")),
    aten.mul.Scalar: Translation(_broadcasting(_binary("mul"))),
    aten.mul.Tensor: Translation(_broadcasting(_binary("mul"))),
    aten.pad.default: Translation(_pad, _pad_check),
    aten.permute.default: Translation(_permute),
    aten.pow.Scalar: Translation(_broadcasting(_pow)),
    aten.pow.Tensor_Scalar: Translation(_broadcasting(_pow)),
    aten.pow.Tensor_Tensor: Translation(_broadcasting(_pow)),
    aten.reshape.default: Translation(_reshape),
    aten.rms_norm.default: Translation(_rms_norm),
    aten.rsub.Scalar: Translation(_broadcasting(_rsub)),
    aten.scaled_dot_product_attention.default: Translation(_sdpa, _sdpa_check),
    aten.slice.Tensor: Translation(_slice),
    aten.slice_scatter.default: Translation(_slice_scatter, _slice_scatter_check),
    aten.softmax.int: Translation(_softmax("softmax")),
    aten.softplus.default: Translation(_softplus),
    aten.stack.default: Translation(_stack),
    aten.split.Tensor: Translation(_split),
    aten.split_with_sizes.default: Translation(_split),
    aten.chunk.default: Translation(_split),
    aten.constant_pad_nd.default: Translation(_constant_pad_nd, _pad_check),
    aten.conv1d.default: Translation(_depthwise_conv1d, _conv1d_check),
    aten.squeeze.dim: Translation(_reshape),
    aten.squeeze.dims: Translation(_reshape),
    aten.sub.Scalar: Translation(_broadcasting(_sub)),
    aten.sub.Tensor: Translation(_broadcasting(_sub)),
    aten.sum.default: Translation(_reduce("sum")),
    aten.sum.dim_IntList: Translation(_reduce("sum")),
    aten.t.default: Translation(_t),
    aten.to.device: Translation(_cast),
    aten.to.dtype: Translation(_cast),
    aten.to.dtype_layout: Translation(_cast),
    aten.transpose.int: Translation(_transpose),
    aten.type_as.default: Translation(_cast),
    aten.unflatten.int: Translation(_reshape),
    aten.unsqueeze.default: Translation(_reshape),
    aten.view.default: Translation(_reshape),
    aten.where.self: Translation(_broadcasting(_where)),
    **{getattr(aten, name).default: Translation(_unary(name)) for name in _UNARY},
    **{getattr(getattr(aten, name), kind): Translation(_broadcasting(_binary(op)))
       for name, op in _COMPARISONS.items() for kind in ("Tensor", "Scalar")},
}

# Ops that return their input (for a forward: no copy, no gradient change).
IDENTITIES = frozenset({aten.alias.default, aten.clone.default, aten.contiguous.default,
                        aten.lift_fresh_copy.default})

# Ops with no value, dropped from the program.
DROPPED = frozenset({aten._assert_tensor_metadata.default, aten._assert_scalar.default,
                     aten.sym_constrain_range_for_size.default})

_GETITEM = operator.getitem


def translation(node: torch.fx.Node, constants: Mapping[str, torch.Tensor]
                ) -> tuple[Translation | None, str | None]:
    """The translation of ``node`` and None, or None and why it has none (a graph break)."""
    if node.target is _GETITEM:
        return Translation(lambda o, out, xs, i: xs[i]), None
    if any(_is_complex(n) for n in (node, *node.all_input_nodes)):
        return None, "meshfuse has no complex tensors"
    entry = TABLE.get(node.target)
    if entry is None:
        return None, "meshfuse has no rule for it"
    reason = entry.check(node, constants) if entry.check is not None else None
    return (None, reason) if reason else (entry, None)


def as_traced(o, out: Any, value: Any) -> Any:
    """``value`` (a translation's result) cast to the dtype of ``out`` (the traced value)
    where they differ, element-wise for a tuple (``split``)."""
    if isinstance(value, tuple | list) and isinstance(out, tuple | list):
        return type(value)(as_traced(o, t, v) for t, v in zip(out, value, strict=True))
    if not isinstance(out, torch.Tensor) or not isinstance(value, TensorView):
        return value
    return _cast(o, out, value)


def _is_complex(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_complex()
