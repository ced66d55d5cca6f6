"""Shape ops: ``broadcast_in_dim``, ``expand``, ``squeeze``, ``permute``, ``reshape``,
``slice``, ``cat``, and ``slice_backward`` (the transpose of ``slice``, for its gradient).

Arguments that name extents or positions (``shape``, ``new_shape``, slice bounds) are *global*;
the implementations get the local output shapes from the runtime (``needs_out_shape``).
"""

from __future__ import annotations

import math

import torch

from meshfuse.errors import DefinitionError
from meshfuse.ir.iter_domain import IterType
from meshfuse.ops.registry import (
    AxisSpec,
    OpDef,
    OutSpec,
    TensorMeta,
    Vjp,
    attr,
    register,
    tensor,
    tensors,
)
from meshfuse.ops.shape_rules import (
    int_list,
    normalize_axes,
    normalize_axis,
    promote,
    require_tensor,
)


def _broadcast_in_dim_infer(x, shape, broadcast_dims):
    return broadcast_to("broadcast_in_dim", x, shape, broadcast_dims)


def broadcast_to(op: str, x, shape, broadcast_dims) -> list[OutSpec]:
    """``x``'s axes placed at ``broadcast_dims`` of ``shape``; the other output axes are new.

    A ``shape`` entry is a positive extent, or ``-1`` on an axis of ``x``: its extent. Only
    broadcast axes of ``x`` (extent 1) can take another extent.
    """
    x = require_tensor(op, "x", x)
    shape = int_list(op, "shape", shape)
    dims = int_list(op, "broadcast_dims", broadcast_dims)
    if len(dims) != x.ndim:
        raise DefinitionError(
            f"{op}: broadcast_dims {dims} must name one output axis for each of the "
            f"{x.ndim} input axes"
        )
    if sorted(set(dims)) != dims or any(not 0 <= d < len(shape) for d in dims):
        raise DefinitionError(
            f"{op}: broadcast_dims {dims} must be increasing axes of the {len(shape)}-axis "
            f"output shape {shape}"
        )
    axes = []
    for out_axis, extent in enumerate(shape):
        if extent == 0 or extent < -1 or (extent == -1 and out_axis not in dims):
            raise DefinitionError(
                f"{op}: output extent {extent} of axis {out_axis} of shape {shape} is invalid; "
                "use a positive extent (-1, keep the input's extent, only on an input axis)"
            )
        if out_axis not in dims:
            kind = IterType.Broadcast if extent == 1 else IterType.Iteration
            axes.append(AxisSpec(extent, kind))
            continue
        a = dims.index(out_axis)
        in_extent = x.shape[a]
        if x.is_broadcast(a):
            kind = IterType.Broadcast if extent in (1, -1) else IterType.Iteration
            axes.append(AxisSpec(abs(extent), kind, ((0, a),) if extent in (1, -1) else ()))
        else:
            if in_extent is not None and extent not in (-1, in_extent):
                raise DefinitionError(
                    f"{op}: input axis {a} has extent {in_extent} but output axis "
                    f"{out_axis} asks for {extent}; only broadcast axes (extent 1) can expand"
                )
            axes.append(AxisSpec(in_extent if extent == -1 else extent, x.iter_types[a],
                                 ((0, a),)))
    return [OutSpec(x.dtype, tuple(axes))]


def _broadcast_in_dim(x, shape, broadcast_dims, out_shapes):
    view = [1] * len(out_shapes[0])
    for a, out_axis in enumerate(broadcast_dims):
        view[out_axis] = x.shape[a]
    return x.reshape(view).expand(out_shapes[0])


def sum_broadcast(d, g, dims: list[int]):
    """The gradient of a broadcast of ``x`` whose axes went to output axes ``dims``: ``g``
    summed over the expanded axes (kept, extent 1) and the new axes (dropped)."""
    o = d.ops
    expanded = [out for a, out in enumerate(dims)
                if d.is_broadcast("x", a) and not g.materialized()[out].is_broadcast]
    if expanded:
        g = o.sum(g, dims=expanded, keepdim=True)
    new = [a for a in range(len(g.materialized())) if a not in dims]
    return o.sum(g, dims=new) if new else g


def _broadcast_in_dim_grads(d, grads):
    return {"x": lambda: sum_broadcast(d, grads[0], list(d.attrs["broadcast_dims"]))}


register(OpDef(
    "broadcast_in_dim", (tensor("x"), attr("shape"), attr("broadcast_dims")),
    _broadcast_in_dim_infer, _broadcast_in_dim, needs_out_shape=True,
    doc="places x's axes at broadcast_dims of shape; other axes are broadcast",
    vjp=Vjp(_broadcast_in_dim_grads, recompute=True),
))


def _expand_infer(x, shape):
    x = require_tensor("expand", "x", x)
    shape = int_list("expand", "shape", shape)
    if len(shape) < x.ndim:
        raise DefinitionError(
            f"expand: shape {shape} has fewer axes than x ({x.ndim}); give one extent per axis "
            "(-1 keeps one), new axes first"
        )
    return broadcast_to("expand", x, shape, list(range(len(shape) - x.ndim, len(shape))))


register(OpDef(
    "expand", (tensor("x"), attr("shape")), _expand_infer,
    lambda x, shape, out_shapes: x.expand(out_shapes[0]), needs_out_shape=True,
    doc="broadcast axes of extent 1 expanded to shape (PyTorch's expand)",
    vjp=Vjp(lambda d, grads: {"x": lambda: sum_broadcast(
        d, grads[0], list(range(len(d.attrs["shape"]) - d.ndim("x"), len(d.attrs["shape"]))))},
        recompute=True),
))


def _squeeze_infer(x, dims):
    x = require_tensor("squeeze", "x", x)
    if dims is None:  # every axis of (static) extent 1, as PyTorch's squeeze()
        dims = [a for a, e in enumerate(x.shape) if e == 1]
    dims = normalize_axes("squeeze", dims, x.ndim)
    for a in dims:
        if x.shape[a] != 1:
            raise DefinitionError(
                f"squeeze: axis {a} has extent {x.shape[a]}; only axes of extent 1 can be "
                "squeezed"
            )
    axes = [AxisSpec(e, k, ((0, a),)) for a, (e, k) in enumerate(zip(x.shape, x.iter_types))
            if a not in dims]
    return [OutSpec(x.dtype, tuple(axes))]


def _squeeze(x, dims, out_shapes):
    # A view with the output's local shape: a local extent of 1 need not be a squeezed axis
    # (a symbolic or sharded one), so dims=None cannot be left to torch's squeeze().
    return x.view(out_shapes[0])


def _squeeze_grads(d, grads):
    ndim, dims = d.ndim("x"), d.attrs["dims"]
    extents = [i.extent for i in d.arg("x").materialized()]
    dims = [a for a, e in enumerate(extents) if e == 1] if dims is None else \
        normalize_axes("squeeze", dims, ndim)
    shape = [1 if a in dims else -1 for a in range(ndim)]
    kept = [a for a in range(ndim) if a not in dims]
    return {"x": lambda: d.ops.broadcast_in_dim(grads[0], shape, kept)}


register(OpDef(
    "squeeze", (tensor("x"), attr("dims", None)), _squeeze_infer, _squeeze,
    needs_out_shape=True,
    doc="removes the given axes of extent 1 (dims=None: all axes of static extent 1)",
    vjp=Vjp(_squeeze_grads, recompute=True),
))


def _permute_infer(x, dims):
    x = require_tensor("permute", "x", x)
    dims = [normalize_axis("permute", d, x.ndim) for d in int_list("permute", "dims", dims)]
    if sorted(dims) != list(range(x.ndim)):
        raise DefinitionError(
            f"permute: dims {list(dims)} must be a permutation of range({x.ndim})"
        )
    axes = [AxisSpec(x.shape[d], x.iter_types[d], ((0, d),)) for d in dims]
    return [OutSpec(x.dtype, tuple(axes))]


register(OpDef(
    "permute", (tensor("x"), attr("dims")), _permute_infer,
    lambda x, dims: x.permute(*dims), doc="reorders axes (a view)",
    vjp=Vjp(lambda d, grads: {"x": lambda: d.ops.permute(grads[0], inverse_permutation(
        [normalize_axis("permute", a, d.ndim("x")) for a in d.attrs["dims"]]))},
        recompute=True),
))


def inverse_permutation(dims: list[int]) -> list[int]:
    inverse = [0] * len(dims)
    for position, axis in enumerate(dims):
        inverse[axis] = position
    return inverse


def reshape_groups(old: list[int], new: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pairs consecutive groups of old and new axes whose extents have equal products."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        gi, gj = [i] if i < len(old) else [], [j] if j < len(new) else []
        pi = old[i] if gi else 1
        pj = new[j] if gj else 1
        i, j = i + len(gi), j + len(gj)
        while pi != pj:
            if pi < pj and i < len(old):
                pi *= old[i]
                gi.append(i)
                i += 1
            elif j < len(new):
                pj *= new[j]
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def _reshape_infer(x, new_shape):
    x = require_tensor("reshape", "x", x)
    new = int_list("reshape", "new_shape", new_shape)
    if None in x.shape:
        raise DefinitionError(
            "reshape of a tensor with symbolic extents is not supported yet; declare its "
            "shape with static extents"
        )
    total = math.prod(x.shape)
    if new.count(-1) > 1 or any(e < -1 or e == 0 for e in new):
        raise DefinitionError(f"reshape: new_shape {new} may hold one -1 and positive extents")
    if -1 in new:
        rest = math.prod(e for e in new if e != -1)
        new[new.index(-1)] = total // rest if rest and total % rest == 0 else -1
    if math.prod(new) != total:
        raise DefinitionError(
            f"reshape: cannot reshape {list(x.shape)} ({total} elements) to {list(new_shape)}"
        )
    axes: list[AxisSpec | None] = [None] * len(new)
    for gi, gj in reshape_groups(list(x.shape), new):
        # Unchanged axes keep their identity. In a pure split ([T, H*E] -> [T, H, E]) or a
        # pure merge, the outermost axes of the two sides map too: a block shard of one is a
        # block shard of the other (propagation carries only block shards across them).
        mapped = len(gi) == 1 or len(gj) == 1
        for j in gj:
            kind = IterType.Broadcast if new[j] == 1 else IterType.Iteration
            outermost = j == gj[0] and gi and mapped
            axes[j] = AxisSpec(new[j], kind, ((0, gi[0]),) if outermost else ())
    return [OutSpec(x.dtype, tuple(axes))]


register(OpDef(
    "reshape", (tensor("x"), attr("new_shape")), _reshape_infer,
    lambda x, new_shape, out_shapes: x.reshape(out_shapes[0]), needs_out_shape=True,
    doc="a new shape with the same number of elements; unchanged axes keep their identity",
    vjp=Vjp(lambda d, grads: {"x": lambda: d.ops.reshape(grads[0], d.shape("x"))},
            recompute=True),
))


def _slice_infer(x, start_indices, end_indices, strides):
    x = require_tensor("slice", "x", x)
    return [OutSpec(x.dtype, window_axes("slice", x, start_indices, end_indices, strides))]


def window_axes(op: str, x: TensorMeta, start_indices, end_indices, strides) -> tuple:
    """The axes of the window ``[start, end)`` by ``strides`` of ``x`` (global bounds); a
    whole axis maps from ``x``'s."""
    n = x.ndim
    start_indices = int_list(op, "start_indices", start_indices)
    end_indices = int_list(op, "end_indices", end_indices)
    strides = [1] * n if strides is None else int_list(op, "strides", strides)
    if not len(start_indices) == len(end_indices) == len(strides) == n:
        raise DefinitionError(
            f"{op}: start_indices, end_indices and strides need {n} entries each, got "
            f"{len(start_indices)}, {len(end_indices)}, {len(strides)}"
        )
    axes = []
    for a, (start, end, step) in enumerate(zip(start_indices, end_indices, strides)):
        extent = x.shape[a]
        if step < 1:
            raise DefinitionError(f"{op}: stride {step} of axis {a} must be positive")
        if extent is None:
            raise DefinitionError(f"{op}: axis {a} has a symbolic extent; slicing needs it static")
        if not 0 <= start <= end <= extent:
            raise DefinitionError(
                f"{op}: bounds [{start}, {end}) of axis {a} must satisfy 0 <= start <= end <= "
                f"{extent}"
            )
        out = (end - start + step - 1) // step
        whole = (start, end, step) == (0, extent, 1)
        axes.append(AxisSpec(out, x.iter_types[a] if whole else IterType.Iteration,
                             ((0, a),) if whole else ()))
    return tuple(axes)


def _slice(x, start_indices, end_indices, strides):
    index = tuple(slice(s, e, st) for s, e, st in
                  zip(start_indices, end_indices, strides or [1] * x.ndim))
    return x[index]


def _slice_grads(d, grads):
    return {"x": lambda: d.ops.slice_backward(
        grads[0], d.shape("x"), d.attrs["start_indices"], d.attrs["end_indices"],
        d.attrs["strides"])}


register(OpDef(
    "slice", (tensor("x"), attr("start_indices"), attr("end_indices"), attr("strides", None)),
    _slice_infer, _slice, doc="a strided window of x (global bounds)",
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
    out[tuple(slice(None) if (s, e, st) == (0, n, 1) else slice(s, e, st)
              for s, e, st, n in bounds)] = grad
    return out


register(OpDef(
    "slice_backward",
    (tensor("grad"), attr("shape"), attr("start_indices"), attr("end_indices"),
     attr("strides", None)),
    _slice_backward_infer, _slice_backward, needs_out_shape=True,
    doc="zeros of shape with grad in the window of a slice (the transpose of slice)",
    vjp=Vjp(lambda d, grads: {"grad": lambda: d.ops.slice(
        grads[0], d.attrs["start_indices"], d.attrs["end_indices"], d.attrs["strides"])},
        recompute=True),
))


def _cat_infer(xs, dim):
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
            axes.append(AxisSpec(first.shape[a], first.iter_types[a],
                                 tuple((pos, a) for pos in range(len(xs)))))
    return [OutSpec(promote(*xs), tuple(axes))]


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
    "cat", (tensors("xs"), attr("dim")), _cat_infer,
    lambda xs, dim: torch.cat(xs, dim=dim), doc="concatenation along dim",
    vjp=Vjp(_cat_grads, recompute=True),
))
