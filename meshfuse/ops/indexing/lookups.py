"""Indexing ops: ``take_along_axis``, ``gather``, ``index_select`` and ``embedding_fwd``
(lookups at integer positions), and the scatter-adds of their gradients,
``take_along_axis_backward`` and ``index_select_backward``.

Sharding rule, one for the four lookups: an output axis that is an axis of the index maps
from it (and from the same axis of the looked-up tensor where their extents agree), and the
*indexed axis* of the looked-up tensor becomes a reduction axis of the output. Where that axis
is sharded (a vocabulary split of an embedding table, of a model's logits), each rank looks up
the positions it holds and writes zeros elsewhere: a partial sum over the indexed axis, which
an allreduce completes (or a reduce-scatter, onto an output sharded on another axis).
Positions are global on every rank; the implementations get the global positions of the
indexed axis held locally from ``localize``.

The scatter-adds add ``grad`` into zeros shaped like ``like`` (the looked-up tensor): their
output axes map from ``like``'s (so the gradient of a vocabulary shard is computed on that
shard, positions outside it dropped), and the axes of the index that are summed over become
reduction axes (a token axis split over ranks gives partial sums of the gradient).
"""

from __future__ import annotations

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError
from meshfuse.ir.iter_domain import IterType
from meshfuse.ops.indexing.checks import index_check
from meshfuse.ops.registry import (
    AxisSpec,
    OpDef,
    OutSpec,
    TensorMeta,
    Vjp,
    attr,
    register,
    scalar,
    tensor,
)
from meshfuse.ops.shape_rules import normalize_axis, require_tensor

INDEX_DTYPES = (DataType.Int, DataType.Int32)


def _iota_infer(length, start, step, dtype):
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise DefinitionError(f"iota: length must be a non-negative int, got {length!r}")
    for name, value in (("start", start), ("step", step)):
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise DefinitionError(f"iota: {name} must be a number, got {value!r}")
    if dtype not in (*INDEX_DTYPES, DataType.Float, DataType.Double):
        raise DefinitionError(f"iota: dtype must be Int, Int32, Float or Double, got {dtype!r}")
    kind = IterType.Broadcast if length == 1 else IterType.Iteration
    return [OutSpec(dtype, (AxisSpec(length, kind),))]


def _iota(length, start, step, dtype, held=None, device=None):
    positions = torch.arange(length, device=device) if held is None else held.to(device)
    return (positions * step + start).to(dtype.torch_dtype)


def _localize_iota(expr, here):
    held = here.index(expr.outputs[0]).indices[0]
    note = "" if held is None else f"the {len(held)} positions held here"
    return {"held": held, "device": here.device}, note


register(OpDef(
    "iota", (attr("length"), attr("start", 0), attr("step", 1), attr("dtype", DataType.Int)),
    _iota_infer, _iota, localize=_localize_iota,
    doc="start + step * [0, 1, ..., length - 1]; a shard holds its own global positions",
    vjp=Vjp(lambda d, grads: {}, differentiable=()),
))


def _require_index(op: str, index) -> TensorMeta:
    index = require_tensor(op, "index", index)
    if index.dtype not in INDEX_DTYPES:
        raise DefinitionError(
            f"{op}: index must be an integer tensor (DataType.Int or DataType.Int32), got "
            f"{index.dtype.name}; cast it with fd.ops.cast(index, DataType.Int)")
    return index


def _axis(extent, kind, sources) -> AxisSpec:
    return AxisSpec(extent, kind, tuple(sources))


def _along_axes(op: str, arg: TensorMeta, index: TensorMeta, dim: int,
                same_extents: bool) -> tuple[AxisSpec, ...]:
    """The output axes of ``take_along_axis`` (``same_extents``) or ``gather``: index's
    shape; an axis other than ``dim`` maps from both where the extents agree; ``arg``'s
    ``dim`` becomes a reduction axis (last)."""
    if arg.ndim != index.ndim:
        raise DefinitionError(f"{op}: arg has {arg.ndim} axes and index {index.ndim}; "
                              "they need as many")
    axes = []
    for a in range(arg.ndim):
        n, m = arg.shape[a], index.shape[a]
        sources = [(1, a)]
        bad = None not in (n, m) and (
            m > n or (same_extents and m != n and not index.is_broadcast(a)))
        if a != dim and bad:
            rule = "equal to arg's (or 1)" if same_extents else "at most arg's"
            raise DefinitionError(
                f"{op}: axis {a} of index has extent {m}, of arg {n}; it must be {rule} "
                f"on every axis but dim {dim}; expand arg (fd.ops.expand) or slice index")
        # take_along_axis's extents are equal off dim (checked again once bound): a
        # symbolic one maps too. gather's may differ once bound: only static equal extents
        # map; elsewhere arg's axis is whole here and read at index's positions (`rows`).
        same = (n == m and n is not None) or (same_extents and not index.is_broadcast(a))
        if a != dim and same and not arg.is_broadcast(a):
            sources.append((0, a))
        if a != dim and same_extents and index.is_broadcast(a):
            # torch's take_along_dim broadcasts index's axis of extent 1 to arg's.
            axes.append(_axis(n, arg.iter_types[a], [(0, a), (1, a)]))
            continue
        axes.append(_axis(m, index.iter_types[a], sources))
    axes.append(AxisSpec(arg.shape[dim], IterType.Reduction, ((0, dim),)))
    return tuple(axes)


def _along_infer(op: str, same_extents: bool):
    def infer(arg, index, dim):
        arg, index = require_tensor(op, "arg", arg), _require_index(op, index)
        dim = normalize_axis(op, dim, arg.ndim, "dim")
        return [OutSpec(arg.dtype, _along_axes(op, arg, index, dim, same_extents))]
    return infer


def held_positions(index: torch.Tensor, held: torch.Tensor | None):
    """Local positions of the global ``index`` values along an axis of which this rank
    holds the global positions ``held`` (ascending; None: the whole axis), and the mask of
    the values held here (None: all are)."""
    index = index.long()
    if held is None:
        return index, None
    held = held.to(index.device)
    if held.numel() == 0:
        return torch.zeros_like(index), torch.zeros_like(index, dtype=torch.bool)
    pos = torch.searchsorted(held, index.contiguous()).clamp_(max=held.numel() - 1)
    mask = held[pos] == index
    return torch.where(mask, pos, 0), mask


def _masked(out: torch.Tensor, mask: torch.Tensor | None, dims: int) -> torch.Tensor:
    """``out`` with zeros where ``mask`` (broadcast over ``dims`` trailing axes) is False."""
    if mask is None:
        return out
    return out.masked_fill(~mask.view(*mask.shape, *([1] * dims)), 0)


def _localize_arg(dim_of):
    """``localize`` of a lookup: the global positions of the indexed axis held here (and,
    with ``MESHFUSE_CHECK_INDICES=1``, the check of the index values)."""
    def localize(expr, here):
        embedding = expr.op.name == "embedding_fwd"
        arg, index = expr.args[1 if embedding else 0], expr.args[0 if embedding else 1]
        dim = dim_of(expr)
        held = here.index(arg).indices[dim]
        note = "" if held is None else (
            f"looks up the {len(held)} positions of axis {dim} of {arg.name} held here")
        return {"held": held, **index_check(expr.op.name, index, arg, dim, here.extents)}, note
    return localize


def _held_rows(expr, here, whole, out_axes) -> dict[int, torch.Tensor]:
    """Global positions held here of each output axis in ``out_axes`` that is split and not
    mapped from the same axis of the tensor argument ``whole`` (which is then whole on that
    axis: resharding gathers it): the rows of ``whole`` to read (a gather's index shorter
    than its arg, split on that axis) or to write into."""
    out, whole = expr.outputs[0].materialized(), whole.materialized()  # local axes only
    held = here.index(expr.outputs[0]).indices
    return {a: held[a] for a in out_axes
            if whole[a] not in expr.id_map.get(out[a], ())
            and not whole[a].is_broadcast and held[a] is not None}


def _rows_of(t: torch.Tensor, rows) -> torch.Tensor:
    """``t`` at the global positions ``rows`` ({axis: positions}) of its whole axes."""
    for a, pos in (rows or {}).items():
        t = t.index_select(a, pos.to(t.device))
    return t


def _localize_along(expr, here):
    """``localize`` of take_along_axis and gather: the positions of ``dim`` held here
    (``held``), and arg's rows at the positions of the output's split unmapped axes
    (``rows``)."""
    attrs, note = _localize_arg(lambda e: e.attrs["dim"] % len(e.args[0].materialized()))(
        expr, here)
    arg = expr.args[0]
    dim = expr.attrs["dim"] % len(arg.materialized())
    rows = _held_rows(expr, here, arg, [a for a in range(len(arg.materialized())) if a != dim])
    return ({**attrs, "rows": rows} if rows else attrs), note


def _take_along_axis(arg, index, dim, held=None, rows=None, check=None):
    if check is not None:
        check(index)
    arg = _rows_of(arg, rows)
    index, mask = held_positions(index, held)
    # Broadcast axes of extent 1 (arg's or index's) meet as in a pointwise op.
    shape = [n if m == 1 and a != dim % arg.ndim else m
             for a, (n, m) in enumerate(zip(arg.shape, index.shape))]
    shape_arg = [n if a == dim % arg.ndim else s for a, (n, s) in
                 enumerate(zip(arg.shape, shape))]
    if arg.shape[dim] == 0:  # an empty shard of dim (uneven): no position held here
        return arg.new_zeros(shape)
    out = torch.gather(arg.expand(shape_arg), dim, index.expand(shape))
    return out if mask is None else out.masked_fill(~mask.expand(shape), 0)


def _gather(arg, index, dim, held=None, rows=None, check=None):
    if check is not None:
        check(index)
    arg = _rows_of(arg, rows)
    index, mask = held_positions(index, held)
    if arg.shape[dim] == 0:  # an empty shard of dim (uneven)
        return arg.new_zeros(index.shape)
    out = torch.gather(arg, dim, index)
    return out if mask is None else out.masked_fill(~mask, 0)


def _along_grads(aligned: bool):
    def grads_of(d, grads):
        return {"arg": lambda: d.ops.take_along_axis_backward(
            grads[0], d.value("index"), d.value("arg"), d.attrs["dim"], aligned)}
    return grads_of


for _name, _same, _impl, _doc in (
        ("take_along_axis", True, _take_along_axis,
         "arg at the positions index gives along dim (other axes: extents equal)"),
        ("gather", False, _gather,
         "arg at the positions index gives along dim (index's other extents at most arg's)")):
    register(OpDef(
        _name, (tensor("arg"), tensor("index"), attr("dim")), _along_infer(_name, _same),
        _impl, doc=_doc + "; a sharded dim gives partial sums (zeros off the shard)",
        prefer_inputs=(0,), localize=_localize_along, vjp=Vjp(_along_grads(_same)),
    ))


def _along_backward_infer(grad, index, like, dim, aligned):
    op = "take_along_axis_backward"
    grad, like = require_tensor(op, "grad", grad), require_tensor(op, "like", like)
    index = _require_index(op, index)
    dim = normalize_axis(op, dim, like.ndim, "dim")
    if not isinstance(aligned, bool):
        raise DefinitionError(f"{op}: aligned must be True or False, got {aligned!r}")
    if not grad.ndim == index.ndim == like.ndim or any(
            None not in (g, i) and g != i and not index.is_broadcast(a)
            for a, (g, i) in enumerate(zip(grad.shape, index.shape))):
        raise DefinitionError(f"{op}: grad {list(grad.shape)} and index "
                              f"{list(index.shape)} must have one shape, of like's rank "
                              f"{like.ndim}")
    axes = []
    for a in range(like.ndim):
        # An axis where grad may be shorter than like (a gather's) is whole here, and its
        # rows added at the positions of like's held here (`rows`).
        n, m = like.shape[a], grad.shape[a]
        same = (n == m and n is not None) or (aligned and not grad.is_broadcast(a))
        sources = [(2, a)] if a == dim or same else []
        if a != dim and same:
            sources += [(0, a), (1, a)]
        axes.append(_axis(like.shape[a], like.iter_types[a], sources))
    axes.append(AxisSpec(grad.shape[dim], IterType.Reduction, ((0, dim), (1, dim))))
    return [OutSpec(like.dtype, tuple(axes))]


def _localize_out(dim_of):
    """``localize`` of a scatter-add: the global positions of ``dim`` of its output held
    here (the shard of ``like`` it writes)."""
    def localize(expr, here):
        dim = dim_of(expr)
        held = here.index(expr.outputs[0]).indices[dim]
        note = "" if held is None else (
            f"adds into the {len(held)} positions of axis {dim} held here")
        return {"held": held}, note
    return localize


def _localize_along_backward(expr, here):
    """``localize`` of take_along_axis_backward: the positions of ``dim`` held here, and
    those of the output's split axes that grad (whole there) adds into (``rows``)."""
    dim = expr.attrs["dim"] % len(expr.args[2].materialized())
    attrs, note = _localize_out(lambda e: dim)(expr, here)
    grad = expr.args[0]
    rows = _held_rows(expr, here, grad,
                      [a for a in range(len(grad.materialized())) if a != dim])
    return ({**attrs, "rows": rows} if rows else attrs), note


def _rows_into(grad, index, rows):
    """grad and index at the held positions ``rows`` of the output's axes (zeros of grad
    past grad's extent: a gather's index shorter than its arg adds nothing there)."""
    for a, pos in (rows or {}).items():
        pos = pos.to(grad.device)
        inside = pos < grad.shape[a]
        pos = torch.where(inside, pos, 0)
        keep = inside.view(*([1] * a), -1, *([1] * (grad.ndim - a - 1)))
        grad = grad.index_select(a, pos).masked_fill(~keep, 0)
        index = index.index_select(a, pos)
    return grad, index


def _take_along_axis_backward(grad, index, like, dim, aligned, out_shapes, held=None,
                              rows=None):
    index, mask = held_positions(index, held)
    out = grad.new_zeros(out_shapes[0])
    if out.shape[dim] == 0:  # an empty shard of dim (uneven): nothing lands here
        return out
    shape = torch.broadcast_shapes(grad.shape, index.shape)
    grad, index = grad.expand(shape), index.expand(shape)
    if mask is not None:
        grad = grad.masked_fill(~mask.expand(shape), 0)
    grad, index = _rows_into(grad, index, rows)
    return out.scatter_add_(dim, index, grad)


register(OpDef(
    "take_along_axis_backward",
    (tensor("grad"), tensor("index"), tensor("like"), attr("dim"), attr("aligned", False)),
    _along_backward_infer, _take_along_axis_backward, needs_out_shape=True,
    doc="zeros shaped like `like` with grad added at index along dim (the transpose of "
        "take_along_axis and gather; `aligned`: grad's other extents are like's, as "
        "take_along_axis's)",
    localize=_localize_along_backward,
    vjp=Vjp(lambda d, grads: {"grad": lambda: getattr(
        d.ops, "take_along_axis" if d.attrs["aligned"] else "gather")(
            grads[0], d.value("index"), d.attrs["dim"])}),
))


def _select_axes(arg: TensorMeta, index: TensorMeta, dim: int,
                 arg_pos: int = 0) -> tuple[AxisSpec, ...]:
    """``arg``'s axes with ``dim`` replaced by ``index``'s axes; ``dim`` a reduction (last).
    ``arg`` is tensor argument ``arg_pos`` (0 or 1), ``index`` the other."""
    i = 1 - arg_pos
    axes = [_axis(arg.shape[a], arg.iter_types[a], [(arg_pos, a)]) for a in range(dim)]
    axes += [_axis(index.shape[a], index.iter_types[a], [(i, a)]) for a in range(index.ndim)]
    axes += [_axis(arg.shape[a], arg.iter_types[a], [(arg_pos, a)])
             for a in range(dim + 1, arg.ndim)]
    axes.append(AxisSpec(arg.shape[dim], IterType.Reduction, ((arg_pos, dim),)))
    return tuple(axes)


def _index_select_infer(arg, index, dim):
    arg, index = require_tensor("index_select", "arg", arg), _require_index("index_select", index)
    dim = normalize_axis("index_select", dim, arg.ndim, "dim")
    return [OutSpec(arg.dtype, _select_axes(arg, index, dim))]


def select_rows(arg, index, dim, held=None, check=None):
    """``arg`` at ``index`` (any shape) along ``dim``: ``index``'s axes replace ``dim``."""
    if check is not None:
        check(index)
    dim %= arg.ndim
    pos, mask = held_positions(index, held)
    if arg.shape[dim] == 0:  # an empty shard of dim (uneven)
        return arg.new_zeros(*arg.shape[:dim], *index.shape, *arg.shape[dim + 1:])
    out = arg.index_select(dim, pos.reshape(-1))
    out = out.view(*arg.shape[:dim], *index.shape, *arg.shape[dim + 1:])
    if mask is None:
        return out
    keep = mask.view(*([1] * dim), *mask.shape, *([1] * (arg.ndim - dim - 1)))
    return out.masked_fill(~keep, 0)


def _index_select_grads(d, grads):
    return {"arg": lambda: d.ops.index_select_backward(
        grads[0], d.value("index"), d.value("arg"), d.attrs["dim"])}


register(OpDef(
    "index_select", (tensor("arg"), tensor("index"), attr("dim")), _index_select_infer,
    select_rows, prefer_inputs=(0,),
    doc="arg's slices at the positions of index along dim (index's axes replace dim: "
        "torch's for a 1-D index); a sharded dim gives partial sums (zeros off the shard)",
    localize=_localize_arg(lambda e: e.attrs["dim"] % len(e.args[0].materialized())),
    vjp=Vjp(_index_select_grads),
))


def _select_backward_infer(grad, index, like, dim):
    op = "index_select_backward"
    grad, like = require_tensor(op, "grad", grad), require_tensor(op, "like", like)
    index = _require_index(op, index)
    dim = normalize_axis(op, dim, like.ndim, "dim")
    expected = _select_axes(like, index, dim)[:-1]
    if grad.ndim != len(expected) or any(
            None not in (n, a.extent) and n != a.extent for n, a in zip(grad.shape, expected)):
        raise DefinitionError(f"{op}: grad has shape {list(grad.shape)}, but like "
                              f"{list(like.shape)} looked up at index {list(index.shape)} "
                              f"along {dim} has {[a.extent for a in expected]}")
    shift = index.ndim - 1
    axes = [_axis(like.shape[a], like.iter_types[a],
                  [(2, a)] + ([] if a == dim else [(0, a if a < dim else a + shift)]))
            for a in range(like.ndim)]
    axes += [AxisSpec(index.shape[k], IterType.Reduction, ((0, dim + k), (1, k)))
             for k in range(index.ndim)]
    return [OutSpec(like.dtype, tuple(axes))]


def _index_select_backward(grad, index, like, dim, out_shapes, held=None):
    dim %= len(out_shapes[0])
    pos, mask = held_positions(index, held)
    if out_shapes[0][dim] == 0:  # an empty shard of dim (uneven)
        return grad.new_zeros(out_shapes[0])
    if mask is not None:
        keep = mask.view(*([1] * dim), *mask.shape, *([1] * (grad.ndim - dim - mask.ndim)))
        grad = grad.masked_fill(~keep, 0)
    shape = list(out_shapes[0])
    shape[dim] = pos.numel()
    out = grad.new_zeros(out_shapes[0])
    return out.index_add_(dim, pos.reshape(-1), grad.reshape(shape))


register(OpDef(
    "index_select_backward",
    (tensor("grad"), tensor("index"), tensor("like"), attr("dim")),
    _select_backward_infer, _index_select_backward, needs_out_shape=True,
    doc="zeros shaped like `like` with grad's slices added at index along dim (the "
        "transpose of index_select and embedding_fwd)",
    localize=_localize_out(lambda e: e.attrs["dim"] % len(e.args[2].materialized())),
    vjp=Vjp(lambda d, grads: {"grad": lambda: d.ops.index_select(
        grads[0], d.value("index"), d.attrs["dim"])}),
))


def _constant(op: str, name: str, meta, allowed) -> object:
    """The static value of scalar argument ``name``; a DefinitionError unless allowed."""
    value = getattr(meta, "value", meta)
    if value not in allowed:
        raise DefinitionError(f"{op}: {name}={value!r} is not supported; pass one of "
                              f"{sorted(allowed, key=repr)} (None for the default)")
    return value


def _embedding_infer(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                     sparse):
    op = "embedding_fwd"
    index = _require_index(op, input)
    weight = require_tensor(op, "weight", weight)
    if weight.ndim != 2:
        raise DefinitionError(f"{op}: weight must be [num_embeddings, embedding_dim], got "
                              f"{weight.ndim} axes")
    _constant(op, "max_norm", max_norm, {None})  # it renormalizes weight in place in torch
    _constant(op, "scale_grad_by_freq", scale_grad_by_freq, {None, False})
    _constant(op, "sparse", sparse, {None, False})
    return [OutSpec(weight.dtype, _select_axes(weight, index, 0, arg_pos=1))]


def _embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse,
               held=None, check=None):
    return select_rows(weight, input, 0, held, check)


def _embedding_grads(d, grads):
    """``index_select_backward`` of the gradient, the rows of ``padding_idx`` left out (as
    PyTorch: they get no gradient)."""
    o, g = d.ops, grads[0]

    def grad():
        index, pad = d.value("input"), d.value("padding_idx")
        gw = g
        if pad is not None:
            if isinstance(pad, int) and pad < 0:
                pad += d.shape("weight")[0]
            n = len(d.arg("input").materialized())
            hit = o.broadcast_in_dim(o.eq(index, pad), [-1] * n + [1], list(range(n)))
            gw = o.where(hit, 0.0, g)
        return o.index_select_backward(gw, index, d.value("weight"), 0)

    return {"weight": grad}


register(OpDef(
    "embedding_fwd",
    (tensor("input"), tensor("weight"), scalar("padding_idx", None), scalar("max_norm", None),
     scalar("norm_type", None), scalar("scale_grad_by_freq", None), scalar("sparse", None)),
    _embedding_infer, _embedding,
    doc="rows of weight [V, E] at the integer input (any shape): input's shape + [E]; a "
        "vocabulary-sharded weight gives partial sums (zeros off the shard)",
    localize=_localize_arg(lambda e: 0), vjp=Vjp(_embedding_grads), prefer_inputs=(1,),
))
