"""Shape ops: ``broadcast_in_dim``, ``broadcast``, ``stride_order``, ``expand``,
``squeeze``, ``permute`` and ``reshape`` (windows and concatenation: :mod:`meshfuse.ops.slicing`).

Arguments that name extents or positions (``shape``, ``new_shape``, slice bounds) are *global*;
the implementations get the local output shapes from the runtime (``needs_out_shape``).
"""

from __future__ import annotations

import math

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
)
from meshfuse.ops.shape_rules import (
    int_list,
    normalize_axes,
    normalize_axis,
    require_tensor,
    same_axes,
)


def _broadcast_in_dim_infer(x, shape, broadcast_dims):
    return broadcast_to("broadcast_in_dim", x, shape, broadcast_dims)


def broadcast_to(op: str, x, shape, broadcast_dims) -> list[OutSpec]:
    """``x``'s axes placed at ``broadcast_dims`` of ``shape``; the other output axes are new.

    A ``shape`` entry is a positive extent, ``-1`` or a :class:`SymbolicSize` (on an axis of
    ``x``: its extent; on a new axis, a symbolic size makes a broadcast axis, which the ops
    it meets expand). Only broadcast axes of ``x`` (extent 1) can take another extent.
    ``broadcast_dims`` may count from the end (``-1`` is the last output axis).
    """
    x = require_tensor(op, "x", x)
    shape = int_list(op, "shape", shape, sizes=True)
    dims = _broadcast_dims(op, int_list(op, "broadcast_dims", broadcast_dims), shape, x.ndim)
    axes = []
    for out_axis, extent in enumerate(shape):
        if isinstance(extent, SymbolicSize):
            extent = -1 if out_axis in dims else 1
        elif extent == 0 or extent < -1 or (extent == -1 and out_axis not in dims):
            raise DefinitionError(
                f"{op}: output extent {extent} of axis {out_axis} of shape {shape} is invalid; "
                "use a positive extent (-1, keep the input's extent, only on an input axis)"
            )
        if out_axis not in dims:
            # A new axis is a broadcast axis; of an extent above 1, an *expanded* one (as in
            # nvFuser): it has that extent where it is an output or reduced, and broadcasts
            # like extent 1 against the other operands of a pointwise op.
            axes.append(AxisSpec(extent, IterType.Broadcast))
            continue
        a = dims.index(out_axis)
        in_extent = x.shape[a]
        if x.is_broadcast(a):
            if extent == -1:  # kept as it is: an expanded broadcast keeps its extent
                axes.append(AxisSpec(in_extent or 1, IterType.Broadcast, ((0, a),)))
                continue
            kind = IterType.Broadcast if extent == 1 else IterType.Iteration
            axes.append(AxisSpec(extent, kind, ((0, a),) if extent == 1 else ()))
        else:
            if in_extent is not None and extent not in (-1, in_extent):
                raise DefinitionError(
                    f"{op}: input axis {a} has extent {in_extent} but output axis "
                    f"{out_axis} asks for {extent}; only broadcast axes (extent 1) can expand"
                )
            axes.append(AxisSpec(in_extent if extent == -1 else extent, x.iter_types[a],
                                 ((0, a),)))
    return [OutSpec(x.dtype, tuple(axes))]


def _broadcast_dims(op: str, given: list[int], shape: list, ndim: int) -> list[int]:
    """``given`` (axes of the output ``shape``, from the end where negative) as increasing
    output axes, one for each of the ``ndim`` input axes; else a DefinitionError."""
    if any(not -len(shape) <= d < len(shape) for d in given):
        raise DefinitionError(
            f"{op}: broadcast_dims {given} must be axes of the {len(shape)}-axis output shape "
            f"{shape}, in [{-len(shape)}, {len(shape)})"
        )
    dims = [d % len(shape) for d in given]
    if len(dims) != ndim:
        raise DefinitionError(
            f"{op}: broadcast_dims {dims} must name one output axis for each of the "
            f"{ndim} input axes"
        )
    if sorted(set(dims)) != dims:
        raise DefinitionError(
            f"{op}: broadcast_dims {dims} must be increasing axes of the {len(shape)}-axis "
            f"output shape {shape}"
        )
    return dims


def _broadcast_in_dim(x, shape, broadcast_dims, out_shapes):
    view = [1] * len(out_shapes[0])
    for a, out_axis in enumerate(broadcast_dims):
        view[out_axis % len(view)] = x.shape[a]
    x = x.reshape(view)
    for axis, (n, m) in enumerate(zip(view, out_shapes[0])):
        if n not in (1, m):  # an expanded broadcast axis made an iteration axis (the shape
            x = x.narrow(axis, 0, 1)  # rule allows no other): its values repeat; this
            # rank's part of it (a shard of the output) is any m of them
    return x.expand(out_shapes[0])


def sum_broadcast(d, g, dims: list[int]):
    """The gradient of a broadcast of ``x`` whose axes went to output axes ``dims``: ``g``
    summed over the axes this broadcast expanded (``x``'s broadcast axes of extent 1: kept,
    extent 1) and over the new axes (dropped). An axis of ``g`` that is an expanded
    broadcast itself holds that many (equal) gradients: summed too.

    An axis ``x`` already has as an expanded broadcast (extent above 1) is not summed: like
    any tensor, ``x`` has a gradient per element there (as :func:`~meshfuse.autodiff.context.sum_to`
    has it), summed once, by the broadcast that made the axis. (Summed here too, it came as
    one value for the axis's elements: added to another use's per-element gradient, or
    multiplied by an operand's values along the axis, it counted that many times over.)"""
    o = d.ops
    expanded = [out for a, out in enumerate(dims)
                if d.is_broadcast_of_one("x", a) and g.materialized()[out].extent != 1]
    if expanded:
        g = o.sum(g, dims=expanded, keepdim=True)
    new = [a for a in range(len(g.materialized())) if a not in dims]
    return o.sum(g, dims=new) if new else g


def _broadcast_in_dim_grads(d, grads):
    n = len(d.attrs["shape"])
    return {"x": lambda: sum_broadcast(d, grads[0], [b % n for b in d.attrs["broadcast_dims"]])}


register(OpDef(
    "broadcast_in_dim", (tensor("x"), attr("shape"), attr("broadcast_dims")),
    _broadcast_in_dim_infer, _broadcast_in_dim, needs_out_shape=True,
    doc="places x's axes at broadcast_dims of shape; other axes are broadcast",
    sharding="x's axes keep their sharding at their new positions; a new axis is replicated "
    "(a sharding pinned on it slices locally)",
    vjp=Vjp(_broadcast_in_dim_grads, recompute=True),
    view=True,
))


def _broadcast_infer(x, is_broadcast_dim):
    x = require_tensor("broadcast", "x", x)
    flags = list(is_broadcast_dim) if isinstance(is_broadcast_dim, list | tuple) else None
    if flags is None or not all(isinstance(f, bool) for f in flags) or \
            flags.count(False) != x.ndim:
        raise DefinitionError(
            f"broadcast: is_broadcast_dim must be a list of bools, one per output axis, with "
            f"one False for each of the {x.ndim} input axes; got {is_broadcast_dim!r}"
        )
    kept = iter(range(x.ndim))
    axes = []
    for new in flags:
        if new:
            axes.append(AxisSpec(1, IterType.Broadcast))
        else:
            a = next(kept)
            axes.append(AxisSpec(x.shape[a], x.iter_types[a], ((0, a),)))
    return [OutSpec(x.dtype, tuple(axes))]


def _broadcast(x, is_broadcast_dim, out_shapes):
    return x.reshape(out_shapes[0])


register(OpDef(
    "broadcast", (tensor("x"), attr("is_broadcast_dim")), _broadcast_infer, _broadcast,
    needs_out_shape=True,
    doc="new broadcast axes (extent 1) where is_broadcast_dim is True (nvFuser's broadcast)",
    sharding="x's axes keep their sharding; the new axes (extent 1) are not sharded",
    vjp=Vjp(lambda d, grads: {"x": lambda: d.ops.squeeze(grads[0], dims=[
        a for a, new in enumerate(d.attrs["is_broadcast_dim"]) if new])}, recompute=True),
    view=True,
))


def _stride_order_infer(x, stride_order):
    x = require_tensor("stride_order", "x", x)
    order = int_list("stride_order", "stride_order", stride_order)
    if sorted(order) != list(range(x.ndim)):
        raise DefinitionError(
            f"stride_order: {order} must be a permutation of range({x.ndim}) (one rank per "
            "axis, 0 = innermost)"
        )
    return [OutSpec(x.dtype, same_axes(0, x))]


def memory_order(stride_order) -> list[int]:
    """Axes outermost first, for ``stride_order[i]`` = rank of axis ``i`` from the innermost."""
    return sorted(range(len(stride_order)), key=lambda a: -stride_order[a])


def _stride_order(x, stride_order):
    order = memory_order(stride_order)
    return x.permute(order).contiguous().permute([order.index(a) for a in range(x.ndim)])


register(OpDef(
    "stride_order", (tensor("x"), attr("stride_order")), _stride_order_infer, _stride_order,
    doc="x's values laid out in memory in stride_order (rank of each axis, 0 = innermost)",
    sharding="elementwise: the output is sharded as its input",
    vjp=Vjp(lambda d, grads: {"x": lambda: grads[0]}, recompute=True),
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
    sharding="x's axes keep their sharding; an expanded axis is replicated (a sharding "
    "pinned on it slices locally)",
    vjp=Vjp(lambda d, grads: {"x": lambda: sum_broadcast(
        d, grads[0], list(range(len(d.attrs["shape"]) - d.ndim("x"), len(d.attrs["shape"]))))},
        recompute=True),
    view=True,
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
    sharding="the remaining axes keep their sharding",
    vjp=Vjp(_squeeze_grads, recompute=True),
    view=True,
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
    sharding="each axis keeps its sharding at its new position",
    vjp=Vjp(lambda d, grads: {"x": lambda: d.ops.permute(grads[0], inverse_permutation(
        [normalize_axis("permute", a, d.ndim("x")) for a in d.attrs["dims"]]))},
        recompute=True),
    view=True,
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
    if new.count(-1) > 1 or any(e < -1 or e == 0 for e in new):
        raise DefinitionError(f"reshape: new_shape {new} may hold one -1 and positive extents")
    if None in x.shape:
        return [OutSpec(x.dtype, _symbolic_reshape(x, new))]
    total = math.prod(x.shape)
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


def _symbolic_reshape(x: TensorMeta, new: list[int]) -> tuple[AxisSpec, ...]:
    """Output axes of a reshape of ``x`` with symbolic extents (bound at execute, when the
    static rule runs again and checks the element counts). Groups of static axes of equal
    products at either end map as in the static rule (an equal axis keeps its identity, a
    pure split or merge maps its outermost axes); the axes between map as a merge into the
    one ``-1`` (``[-1, -1, e] -> [-1, e]``) or a split of one symbolic axis (its outermost
    part mapped), and otherwise to no input axis (a sharded input axis there is gathered
    first, as for any reshape that mixes axes)."""
    lead, i, j = _static_groups(list(x.shape), new)
    rear, ri, rj = _static_groups(list(reversed(x.shape[i:])), list(reversed(new[j:])))
    old_end, new_end = x.ndim - ri, len(new) - rj
    trail = [([old_end + ri - 1 - a for a in reversed(ga)],
              [new_end + rj - 1 - b for b in reversed(gb)]) for ga, gb in reversed(rear)]
    axes = [spec for group in lead for spec in _group_specs(x, new, *group)]
    old_mid, new_mid = range(i, old_end), range(j, new_end)
    mapped = old_mid and (len(old_mid) == 1 or [new[b] for b in new_mid] == [-1])
    for b in new_mid:
        extent = None if new[b] == -1 else new[b]
        kind = IterType.Broadcast if extent == 1 else IterType.Iteration
        outermost = mapped and b == new_mid[0]
        axes.append(AxisSpec(extent, kind, ((0, old_mid[0]),) if outermost else ()))
    axes += [spec for group in trail for spec in _group_specs(x, new, *group)]
    return tuple(axes)


def _static_groups(old: list, new: list[int]) -> tuple[list, int, int]:
    """The leading groups of static axes of ``old`` and ``new`` whose extents have equal
    products, as ``(old axes, new axes)`` pairs, and the numbers of old and new axes they
    take; the first symbolic extent (None, -1) stops them."""
    groups, i, j = [], 0, 0
    while i < len(old) and j < len(new) and old[i] is not None and new[j] != -1:
        gi, gj, pi, pj = [i], [j], old[i], new[j]
        while pi != pj:
            a, b = gi[-1] + 1, gj[-1] + 1
            if pi < pj and a < len(old) and old[a] is not None:
                pi *= old[a]
                gi.append(a)
            elif pj < pi and b < len(new) and new[b] != -1:
                pj *= new[b]
                gj.append(b)
            else:
                return groups, i, j
        groups.append((gi, gj))
        i, j = gi[-1] + 1, gj[-1] + 1
    return groups, i, j


def _group_specs(x: TensorMeta, new: list[int], gi: list[int],
                 gj: list[int]) -> list[AxisSpec]:
    """The output axes of one group of equal static products: an unchanged axis keeps its
    identity and kind; in a pure split or merge the outermost axes map."""
    if len(gi) == 1 and len(gj) == 1:
        return [AxisSpec(x.shape[gi[0]], x.iter_types[gi[0]], ((0, gi[0]),))]
    mapped = len(gi) == 1 or len(gj) == 1
    return [AxisSpec(new[b], IterType.Broadcast if new[b] == 1 else IterType.Iteration,
                     ((0, gi[0]),) if mapped and b == gj[0] else ()) for b in gj]


register(OpDef(
    "reshape", (tensor("x"), attr("new_shape")), _reshape_infer,
    lambda x, new_shape, out_shapes: x.reshape(out_shapes[0]), needs_out_shape=True,
    doc="a new shape with the same number of elements; unchanged axes keep their identity",
    sharding="unchanged axes keep their sharding; in a pure split or merge the outermost "
    "axes map (a block shard carries over); an axis that mixes others is gathered first",
    vjp=Vjp(lambda d, grads: {"x": lambda: d.ops.reshape(grads[0], d.shape("x"))},
            recompute=True),
    view=True,
))
