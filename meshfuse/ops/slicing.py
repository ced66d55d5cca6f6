"""Window and concatenation ops: ``slice``, ``slice_backward`` (the transpose of ``slice``,
for its gradient) and ``cat``.

Slice bounds and ``slice_backward``'s ``shape`` are *global*; the implementations get the local
output shapes from the runtime (``needs_out_shape``).
"""

from __future__ import annotations

import torch

from meshfuse.errors import DefinitionError
from meshfuse.ir.iter_domain import IterType
from meshfuse.ops.registry import (
    AxisSpec,
    OpDef,
    OutSpec,
    SymbolicSize,
    TensorMeta,
    Vjp,
    attr,
    register,
    tensor,
    tensors,
)
from meshfuse.ops.shape_rules import (
    int_list,
    normalize_axis,
    promote,
    require_tensor,
)


def _slice_infer(x, start_indices, end_indices, strides, manual_normalization):
    x = require_tensor("slice", "x", x)
    if manual_normalization not in (0, 1, False, True):
        raise DefinitionError(
            f"slice: manual_normalization must be 0 (negative indices count from the end, "
            f"bounds are clamped) or 1 (indices as given), got {manual_normalization!r}"
        )
    return [OutSpec(x.dtype, window_axes("slice", x, start_indices, end_indices, strides,
                                         normalize=not manual_normalization))]


def window_axes(op: str, x: TensorMeta, start_indices, end_indices, strides,
                normalize: bool = True) -> tuple:
    """The axes of the window ``[start, end)`` by ``strides`` of ``x`` (global bounds); a
    whole axis maps from ``x``'s. With ``normalize`` (nvFuser's default), negative bounds
    count from the end and bounds are clamped, as in Python; a :class:`SymbolicSize` end is
    the end of the axis."""
    n = x.ndim
    start_indices = int_list(op, "start_indices", start_indices)
    end_indices = int_list(op, "end_indices", end_indices, sizes=True)
    strides = [1] * n if strides is None else int_list(op, "strides", strides)
    if not len(start_indices) == len(end_indices) == len(strides) == n:
        raise DefinitionError(
            f"{op}: start_indices, end_indices and strides need {n} entries each, got "
            f"{len(start_indices)}, {len(end_indices)}, {len(strides)}"
        )
    axes = []
    for a, (start, end, step) in enumerate(zip(start_indices, end_indices, strides)):
        start, end = _slice_bounds(op, x, a, start, end, step, normalize)
        whole = (start, end, step) == (0, x.shape[a], 1)
        # A window of a symbolic axis has a symbolic extent (bound at execute, where this
        # rule runs again with the extents); it maps from no input axis (as any window).
        out = (end - start + step - 1) // step if None not in (end, x.shape[a]) else None
        axes.append(AxisSpec(out, x.iter_types[a] if whole else IterType.Iteration,
                             ((0, a),) if whole else ()))
    return tuple(axes)


def _slice_bounds(op: str, x: TensorMeta, a: int, start: int, end, step: int,
                  normalize: bool):
    """``[start, end)`` of axis ``a`` checked (and, with ``normalize``, made non-negative and
    clamped as Python does). A :class:`SymbolicSize` end is taken as the end of the axis
    (nvFuser programs slice to ``fd.ops.size`` of the same axis)."""
    extent = x.shape[a]
    if step < 1:
        raise DefinitionError(f"{op}: stride {step} of axis {a} must be positive")
    if isinstance(end, SymbolicSize) and extent is not None:
        end = extent  # the size of this axis, known once execute binds it
    if isinstance(end, SymbolicSize):
        if (start, step) == (0, 1):
            return 0, None  # the whole symbolic axis
        raise DefinitionError(
            f"{op}: axis {a} has a symbolic extent; a window of it ending at fd.ops.size "
            "starts at 0 with stride 1: pass a number as its end instead (negative ones "
            "count from the end)"
        )
    if extent is None:  # checked against the extent at execute, where it is bound
        if not normalize and not 0 <= start <= end:
            raise DefinitionError(
                f"{op}: bounds [{start}, {end}) of axis {a} must satisfy 0 <= start <= end")
        return start, end
    if normalize:
        start, end = (min(max(i + extent if i < 0 else i, 0), extent) for i in (start, end))
        end = max(end, start)
    if not 0 <= start <= end <= extent:
        raise DefinitionError(
            f"{op}: bounds [{start}, {end}) of axis {a} must satisfy 0 <= start <= end <= "
            f"{extent}"
        )
    return start, end


def _local_slice(start: int, end, step: int) -> slice:
    """A Python slice for global bounds (Python's own normalization matches nvFuser's)."""
    return slice(start, None if isinstance(end, SymbolicSize) else end, step)


def _slice(x, start_indices, end_indices, strides, manual_normalization):
    return x[tuple(_local_slice(s, e, st) for s, e, st in
                   zip(start_indices, end_indices, strides or [1] * x.ndim))]


def _slice_grads(d, grads):
    return {"x": lambda: d.ops.slice_backward(
        grads[0], d.shape("x"), d.attrs["start_indices"], d.attrs["end_indices"],
        d.attrs["strides"])}


register(OpDef(
    "slice", (tensor("x"), attr("start_indices"), attr("end_indices"), attr("strides", None),
              attr("manual_normalization", 0)),
    _slice_infer, _slice,
    doc="a strided window of x (global bounds; negative ones count from the end)",
    sharding="axes taken whole keep their sharding; a windowed axis is computed from x "
    "gathered on that axis",
    vjp=Vjp(_slice_grads, recompute=True),
))


def _slice_backward_infer(grad, shape, start_indices, end_indices, strides):
    grad = require_tensor("slice_backward", "grad", grad)
    shape = int_list("slice_backward", "shape", shape)
    window = window_axes("slice_backward", TensorMeta(tuple(shape), tuple(
        IterType.Broadcast if e == 1 else IterType.Iteration for e in shape), grad.dtype),
        start_indices, end_indices, strides)
    if grad.ndim != len(shape) or any(
            n is not None and n != a.extent for n, a in zip(grad.shape, window)):
        raise DefinitionError(
            f"slice_backward: grad has shape {list(grad.shape)}, but the window "
            f"[{start_indices}, {end_indices}) of {shape} has {[a.extent for a in window]}"
        )
    axes = [AxisSpec(e, grad.iter_types[a] if w.sources else
                     IterType.Broadcast if e == 1 else IterType.Iteration,
                     w.sources) for a, (e, w) in enumerate(zip(shape, window))]
    return [OutSpec(grad.dtype, tuple(axes))]


def _slice_backward(grad, shape, start_indices, end_indices, strides, out_shapes):
    # Windowed axes are whole on every rank (they map from no axis of grad, so they are
    # never sharded here); whole axes take grad's local extent.
    out = grad.new_zeros(out_shapes[0])
    bounds = zip(start_indices, end_indices, strides or [1] * grad.ndim, shape)
    out[tuple(slice(None) if (s, e, st) == (0, n, 1) else
              _local_slice(s, e, st) for s, e, st, n in bounds)] = grad
    return out


register(OpDef(
    "slice_backward",
    (tensor("grad"), attr("shape"), attr("start_indices"), attr("end_indices"),
     attr("strides", None)),
    _slice_backward_infer, _slice_backward, needs_out_shape=True,
    doc="zeros of shape with grad in the window of a slice (the transpose of slice)",
    sharding="axes taken whole keep grad's sharding; a windowed axis is whole on every rank",
    vjp=Vjp(lambda d, grads: {"grad": lambda: d.ops.slice(
        grads[0], d.attrs["start_indices"], d.attrs["end_indices"], d.attrs["strides"])},
        recompute=True),
))


def _cat_infer(xs, dim, manual_padding):
    if manual_padding not in (0, False):
        raise DefinitionError(
            f"cat: manual_padding={manual_padding!r} (inputs already padded to the output "
            "extent) is not supported; pass 0 and the unpadded tensors"
        )
    if not xs or not all(isinstance(m, TensorMeta) for m in xs):
        raise DefinitionError("cat: tensors must be a non-empty list of tensors")
    first = xs[0]
    dim = normalize_axis("cat", dim, first.ndim, "dim")
    for pos, m in enumerate(xs):
        if m.ndim != first.ndim:
            raise DefinitionError(
                f"cat: tensor {pos} has {m.ndim} axes, tensor 0 has {first.ndim}"
            )
        for a in range(m.ndim):
            known = None not in (m.shape[a], first.shape[a])
            if a != dim and known and m.shape[a] != first.shape[a]:
                raise DefinitionError(
                    f"cat: axis {a} of tensor {pos} has extent {m.shape[a]}, tensor 0 has "
                    f"{first.shape[a]}; only axis {dim} may differ"
                )
    extents = [m.shape[dim] for m in xs]
    axes = []
    for a in range(first.ndim):
        if a == dim:
            total = None if None in extents else sum(extents)
            axes.append(AxisSpec(total, IterType.Iteration))
        else:
            # Broadcast only where every input is: an expanded broadcast axis beside an
            # iteration axis gives an iteration axis, mapped from the inputs that have one
            # (the broadcast input is read whole there, as by a pointwise op).
            kinds = [m.iter_types[a] for m in xs]
            kind = next((k for k in kinds if k is not IterType.Broadcast), IterType.Broadcast)
            axes.append(AxisSpec(first.shape[a], kind,
                                 tuple((pos, a) for pos in range(len(xs)) if kinds[pos] is kind)))
    return [OutSpec(promote(*xs), tuple(axes))]


def _cat(xs, dim, manual_padding, out_shapes):
    """``torch.cat``; an input's expanded broadcast axis (its values repeat, whole on every
    rank) beside the others' sharded one is cut to this rank's extent of the output."""
    shape, dim = out_shapes[0], dim % len(out_shapes[0])
    fitted = []
    for x in xs:
        target = [x.shape[a] if a == dim else shape[a] for a in range(x.ndim)]
        if list(x.shape) != target:
            for a, (n, m) in enumerate(zip(x.shape, target)):
                if n != m:
                    x = x.narrow(a, 0, 1)
            x = x.expand(target)
        fitted.append(x)
    return torch.cat(fitted, dim=dim)


def _cat_grads(d, grads):
    """Each input's gradient is its window of ``g`` along ``dim``."""
    xs, g = d.arg("xs"), grads[0]
    ndim = d.ndim(xs[0])
    dim = normalize_axis("cat", d.attrs["dim"], ndim, "dim")
    shape = d.shape(g)
    thunks, offset = [], 0
    for x in xs:
        extent = d.shape(x)[dim]
        starts = [offset if a == dim else 0 for a in range(ndim)]
        ends = [offset + extent if a == dim else shape[a] for a in range(ndim)]
        thunks.append(lambda s=starts, e=ends: d.ops.slice(g, s, e))
        offset += extent
    return {"xs": thunks}


register(OpDef(
    "cat", (tensors("xs"), attr("dim"), attr("manual_padding", 0)), _cat_infer,
    _cat, needs_out_shape=True, doc="concatenation along dim",
    sharding="the other axes are sharded as the inputs'; the concatenated axis is computed "
    "whole (a sharded input is gathered on it first)",
    vjp=Vjp(_cat_grads, recompute=True),
))


def split_sizes(op: str, extent: int | None, sections, dim: int = 0) -> list[int]:
    """The extents of the pieces of axis ``dim`` of ``extent``: ``sections`` an int (pieces
    of that size, the last one shorter, as ``torch.split``) or a list of sizes summing to
    it."""
    if extent is None:
        raise DefinitionError(f"{op}: axis {dim} of x has a symbolic extent; give it a static "
                              "one in define_tensor (the pieces' extents are part of the "
                              "fusion)")
    if isinstance(sections, int) and not isinstance(sections, bool):
        if sections < 1:
            raise DefinitionError(f"{op}: split size {sections} must be positive")
        return [min(sections, extent - s) for s in range(0, extent, sections)] or [0]
    sizes = int_list(op, "sections", sections)
    if sum(sizes) != extent or any(n < 0 for n in sizes):
        raise DefinitionError(f"{op}: sizes {sizes} must be non-negative and sum to the "
                              f"extent {extent} of axis {dim} of x")
    return sizes


def _split_infer(x, sections, dim):
    x = require_tensor("split", "x", x)
    dim = normalize_axis("split", dim, x.ndim, "dim")
    outs = []
    for n in split_sizes("split", x.shape[dim], sections, dim):
        axes = [AxisSpec(n, IterType.Iteration) if a == dim else
                AxisSpec(x.shape[a], x.iter_types[a], ((0, a),)) for a in range(x.ndim)]
        outs.append(OutSpec(x.dtype, tuple(axes)))
    return outs


def _split(x, sections, dim):
    sizes = split_sizes("split", x.shape[dim], sections)
    return tuple(p.clone() for p in torch.split(x, sizes, dim))


def _split_grads(d, grads):
    """The pieces' gradients concatenated; where a piece has none (unused), the others'
    windows of zeros (``slice_backward``) added."""
    o = d.ops
    dim = normalize_axis("split", d.attrs["dim"], d.ndim("x"), "dim")
    if all(g is not None for g in grads):
        return {"x": lambda: o.cat(list(grads), dim)}

    def grad():
        shape, total, offset = d.shape("x"), None, 0
        for g, out in zip(grads, d.expr.outputs):
            n = out.materialized()[dim].extent
            if g is not None:
                starts = [offset if a == dim else 0 for a in range(len(shape))]
                ends = [offset + n if a == dim else shape[a] for a in range(len(shape))]
                part = o.slice_backward(g, shape, starts, ends)
                total = part if total is None else o.add(total, part)
            offset += n
        return total

    return {"x": grad}


register(OpDef(
    "split", (tensor("x"), attr("sections"), attr("dim", 0)), _split_infer, _split,
    doc="pieces of x along dim: of size sections each (the last shorter), or of the "
        "sizes listed (torch.split)",
    vjp=Vjp(_split_grads, recompute=True),
))
