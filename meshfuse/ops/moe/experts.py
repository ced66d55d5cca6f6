"""``moe_experts`` and ``moe_experts_bwd``: the routed SwiGLU experts of a mixture-of-experts
layer, each token's top-k slots computed by their experts and summed with their weights.

Arguments: tokens ``x [*tokens, H]`` (one token axis ``[T]``, or several: ``[B, S]`` as
torchtitan's and Hugging Face's blocks pass them), the routing ``indices [*tokens, K]``
(int) and ``weights [*tokens, K]`` (:mod:`meshfuse.ops.moe.routing`), the expert weights
``w1``, ``w3`` ``[E, F, H]``, ``w2`` ``[E, H, F]``, and ``capacity``: None (dropless, the
default) or the rows an expert computes at most, its first by token order (row-major; the
others are dropped: they add nothing to their token).
Outputs: ``[*tokens, H]``, the rows each expert computed, ``[E]``, and ``saved [*tokens, K,
2, F]``: the products ``x w1^T`` and ``x w3^T`` of each token slot (its expert's), in
token-slot order, the residual ``moe_experts_bwd`` reads instead of recomputing them
(docs/experts.md). ``saved`` is computed only where something reads it. The VJP reads it on
one rank's experts without a capacity; expert-parallel (EP x DP included), the rows are
computed on the experts' ranks (bringing them back would cost one more all-to-all of ``2 F``
values a row), and the backward recomputes the products there instead (the op returns them,
with that exchange, only to a fusion that reads them itself).

Domain map: the output's tokens and hidden axis follow ``x``'s; the experts' ffn axis ``F``
is a reduction of the output (sharded: each rank's part is a partial sum, tensor
parallelism); the counts' expert axis follows the weights' and reduces over the tokens
(tokens sharded: partial counts); ``saved``'s tokens follow ``x``'s, its slots ``indices``'
and its ``F`` the weights' (sharded ffn: each rank saves its part). The hidden axes, ``K``
and, unless expert parallelism runs the op, the experts are needed whole.

Expert parallelism: where the weights' expert axis is block-sharded over a mesh axis that
also shards the tokens, the op runs expert-parallel (:func:`expert_parallel`): each rank
keeps its experts, its tokens travel to the ranks of their experts and back (a ragged
all-to-all, lowered by :mod:`meshfuse.parallel.experts`). Its ``plan`` rule makes the
counts (and the backward's weight gradients) complete there: each rank's experts saw every
token routed to them. Token axes also split over other mesh axes (data parallelism, EP x
DP: each coordinate there an expert group of its own tokens) leave them partial over those
(:func:`own_partials`), reduced after the op.
"""

from __future__ import annotations

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError, ShardingError
from meshfuse.ir.iter_domain import IterType
from meshfuse.ir.layout import device_ids
from meshfuse.ir.tensor_view import TensorView
from meshfuse.ops.moe import kernels
from meshfuse.ops.registry import AxisSpec, Kind, OpDef, OutSpec, Param, Vjp, attr, register, tensor
from meshfuse.ops.shape_rules import require_tensor

_WEIGHTS = ("w1", "w2", "w3")


def _check(op: str, x, indices, weights, w1, w2, w3) -> tuple:
    """Checks the arguments; returns ``(token shape, K, H, E, F)`` (None where symbolic)."""
    metas = {"x": x, "indices": indices, "weights": weights, "w1": w1, "w2": w2, "w3": w3}
    for name, m in metas.items():
        require_tensor(op, name, m)
    if x.ndim < 2:
        raise DefinitionError(f"{op}: x must be [..., T, H] (2 axes or more), got {x.ndim}")
    ranks = {"indices": x.ndim, "weights": x.ndim, "w1": 3, "w2": 3, "w3": 3}
    for name, n in ranks.items():
        if metas[name].ndim != n:
            raise DefinitionError(f"{op}: {name} must have {n} axes, got {metas[name].ndim}")
    if indices.dtype not in (DataType.Int, DataType.Int32):
        raise DefinitionError(f"{op}: indices must be integers, got {indices.dtype.name}")
    if len({x.dtype, w1.dtype, w2.dtype, w3.dtype}) > 1 or not x.dtype.is_floating:
        raise DefinitionError(f"{op}: x, w1, w2 and w3 must have one floating dtype")
    t, h = tuple(x.shape[:-1]), x.shape[-1]
    k, e, f = indices.shape[-1], w1.shape[0], w1.shape[1]
    expected = {"indices": (*t, k), "weights": (*t, k), "w1": (e, f, h), "w2": (e, h, f),
                "w3": (e, f, h)}
    for name, shape in expected.items():
        for axis, (got, want) in enumerate(zip(metas[name].shape, shape)):
            if None not in (got, want) and got != want:
                raise DefinitionError(
                    f"{op}: axis {axis} of {name} has {got} but {want} was expected (x "
                    "[*tokens, H], indices and weights [*tokens, K], w1 and w3 [E, F, H], "
                    "w2 [E, H, F])")
    return t, k, h, e, f


def _token_axes(t: tuple, metas: tuple, iter_type=None, extra=None) -> tuple:
    """One axis per token axis, mapped from that axis of the inputs ``0, 1, ...`` (the
    tensors ``metas`` give its kind: iteration, or ``iter_type``) and, where ``extra`` is
    given (:func:`_saved_sources`), of ``moe_experts_bwd``'s ``saved``."""
    extra = extra or (lambda *pairs: ())
    return tuple(AxisSpec(n, iter_type or metas[0].iter_types[i],
                          (*((j, i) for j in range(len(metas))), *extra((7, i))))
                 for i, n in enumerate(t))


def _check_capacity(op: str, capacity) -> None:
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool)
                                 or capacity < 0):
        raise DefinitionError(f"{op}: capacity must be None (dropless) or the rows an expert "
                              f"computes at most, an int >= 0; got {capacity!r}")


def _experts_infer(x, indices, weights, w1, w2, w3, capacity):
    t, _, h, e, f = _check("moe_experts", x, indices, weights, w1, w2, w3)
    _check_capacity("moe_experts", capacity)
    last = x.ndim - 1
    out = (*_token_axes(t, (x, indices, weights)),
           AxisSpec(h, x.iter_types[last], ((0, last),)),
           AxisSpec(f, IterType.Reduction, ((3, 1), (4, 2), (5, 1))))
    counts = (AxisSpec(e, w1.iter_types[0], ((3, 0), (4, 0), (5, 0))),
              *_token_axes(t, (x, indices, weights), IterType.Reduction))
    return [OutSpec(x.dtype, out), OutSpec(DataType.Float, counts),
            OutSpec(x.dtype, _saved_axes(x, indices, weights, w1))]


def _saved_axes(x, indices, weights, w1) -> tuple:
    """``saved [*tokens, K, 2, F]``'s axes: the token axes follow ``x``'s, ``K``
    ``indices``', ``F`` the weights'."""
    t, last = tuple(x.shape[:-1]), indices.ndim - 1
    return (*_token_axes(t, (x, indices, weights)),
            AxisSpec(indices.shape[-1], indices.iter_types[last], ((1, last), (2, last))),
            AxisSpec(2), AxisSpec(w1.shape[1], w1.iter_types[1], ((3, 1), (4, 2), (5, 1))))


def _experts(x, indices, weights, w1, w2, w3, capacity, residual: bool = False):
    return kernels.experts_forward(x, indices, weights, w1, w2, w3, w1.shape[0],
                                   capacity=capacity, residual=residual)


def saves_products(expr) -> bool:
    """Whether ``moe_experts``' backward reads the products the forward saved: on one rank's
    experts (not expert-parallel) without a capacity (which drops rows: the backward
    recomputes the kept ones)."""
    return expert_parallel(expr) is None and _args(expr)["capacity"] is None


def _read(tv: TensorView) -> bool:
    """Whether anything reads ``tv``: an expression of its fusion, or the fusion's caller."""
    fusion = tv.fusion
    return tv in fusion.outputs() or bool(fusion.uses().get(tv))


def localize(expr, here):
    """Computes ``saved`` where it is read (the derived forward returns it to the backward);
    a forward alone skips it."""
    if _read(expr.outputs[2]):
        return {"residual": True}, "saves h1, h3"
    return {}, ""


def _args(expr) -> dict:
    return dict(zip((p.name for p in expr.op.params), expr.args))


def _mesh_types(tv: TensorView, axis: int) -> list:
    """The device parallel types splitting axis ``axis`` (of the materialized axes: a
    cotangent may carry a reduction axis of extent 1 before them)."""
    return [pt for _, pt in device_ids(tv).get(tv.materialized()[axis], [])]


def _on_one_device(tv: TensorView, axis: int) -> bool:
    """Whether ``axis`` of ``tv`` is split over mesh axes of one device only (its shard is
    the whole axis)."""
    return all(tv.mesh.axis_size(pt) == 1 for pt in _mesh_types(tv, axis))


def _token_types(tv: TensorView) -> list:
    """The device parallel types splitting the token axes of ``tv`` (all but its last)."""
    return [pt for axis in range(len(tv.materialized()) - 1) for pt in _mesh_types(tv, axis)]


def expert_parallel(expr):
    """The device parallel type the op's experts are split over, expert-parallel (its tokens
    sharded over the same mesh axis), or None."""
    if getattr(expr, "op", None) is None or expr.op.name not in EXPERT_OPS:
        return None
    args = _args(expr)
    expert_types = _mesh_types(args["w1"], 0)
    if len(expert_types) != 1 or expert_types[0] not in _token_types(args["x"]):
        return None
    return expert_types[0]


def _tokens(expr) -> set:
    """The token axes of the op's token inputs (x, indices, weights, grad)."""
    args = _args(expr)
    return {i for n in ("x", "indices", "weights", "grad") if n in args
            for i in args[n].materialized()[:-1]}


def whole_axes(expr) -> set:
    """Hidden axes, the slots and (unless expert-parallel) the experts, needed whole."""
    args = _args(expr)
    whole = {args[n].materialized()[-1] for n in ("x", "indices", "weights", "grad")
             if n in args}
    whole |= {args["w1"].materialized()[2], args["w3"].materialized()[2],
              args["w2"].materialized()[1]}
    if args.get("saved") is not None:  # its slots and its pair of products
        whole |= set(args["saved"].materialized()[-3:-1])
    if expert_parallel(expr) is None:
        whole |= {args[n].materialized()[0] for n in _WEIGHTS
                  if not _on_one_device(args[n], 0)}
        if args["capacity"] is not None:  # a capacity counts rows in global token order
            whole |= _tokens(expr)
    return whole


def check_sharding(expr) -> None:
    """Expert parallelism needs the three weights' experts split alike, in blocks; with a
    capacity, the tokens in blocks over the expert axis only (ranks hold them in order)."""
    pt = expert_parallel(expr)
    if pt is None:
        return
    args = _args(expr)
    x = args["x"]
    if args["capacity"] is not None and not _in_token_order(x, pt):
        raise ShardingError(
            f"{expr.op.name}: with a capacity, the tokens of {x.name} must be split in blocks "
            f"(an outer split) of one axis over {pt.value} only, the token axes before it of "
            "extent 1, so that ranks hold them in token order and see every token routed to "
            "their experts; drop the capacity or the other splits (data parallelism would "
            "drop rows per replica)")
    for name in _WEIGHTS:
        tv = args[name]
        if _mesh_types(tv, 0) != [pt] or not _block_split(tv):
            raise ShardingError(
                f"{expr.op.name}: {name} ({tv.name}) must have its experts (axis 0) split in "
                f"blocks over {pt.value} like w1's for expert parallelism; split it with "
                "inner_split=False over the same mesh axis")


def _block_split(tv: TensorView, axis: int = 0) -> bool:
    splits = [t for t in tv.transforms if getattr(t, "in_id", None) is tv.materialized()[axis]]
    return len(splits) == 1 and not splits[0].inner_split and not splits[0].zigzag


def _in_token_order(x: TensorView, pt) -> bool:
    """Whether the ranks along ``pt`` hold ``x``'s tokens in row-major order, in blocks: one
    token axis split over ``pt`` only, in blocks, the axes before it of extent 1."""
    axes = [a for a in range(len(x.materialized()) - 1) if _mesh_types(x, a)]
    return (len(axes) == 1 and _mesh_types(x, axes[0]) == [pt] and _block_split(x, axes[0])
            and all(x.materialized()[a].extent == 1 for a in range(axes[0])))


def plan(expr) -> None:
    """Expert-parallel: the per-expert outputs (counts, weight gradients) are complete over
    the expert mesh axis (each rank's experts received every token routed to them), so
    their reductions over the tokens map from nothing; the tokens' other mesh axes (data
    parallelism: each coordinate its own tokens) leave them partial there
    (:func:`own_partials`), reduced after the op. Outputs the user pinned keep their
    schedule (the engine reduces into it)."""
    if expert_parallel(expr) is None or all(
            expr.id_map.get(out_id) == () for _, reductions in _per_expert_reductions(expr)
            for out_id in reductions):
        return  # (planned on the build already: see pipeline.concretize)
    pinned = getattr(expr.tensor_outputs[0].fusion, "user_scheduled", set())
    for out, reductions in _per_expert_reductions(expr):
        for out_id in reductions:
            expr.id_map[out_id] = ()
            if out not in pinned:
                for leaf, _ in device_ids(out).get(out_id, []):
                    del out.parallel[leaf]
        if out not in pinned:
            own_partials(expr, out)


def _per_expert_reductions(expr) -> list:
    """``(output, its reductions over the token axes, in order)`` of the per-expert
    outputs."""
    return [(expr.tensor_outputs[out], expr.tensor_outputs[out].logical[first:])
            for out, first in _TOKEN_REDUCTIONS[expr.op.name].items()]


def own_partials(expr, out) -> None:
    """Expert-parallel with the tokens also split over other mesh axes (EP x DP): ``out``'s
    reductions over the tokens partial over those (each token axis's reduction split in
    blocks over the mesh axes, other than the experts', that split that axis of ``x``)."""
    pt = expert_parallel(expr)
    x = _args(expr)["x"]
    if pt is None or out.mesh != x.mesh:
        return
    used = {p for p in out.parallel.values() if p.is_device}
    reductions = dict(_per_expert_reductions(expr)).get(
        next((o for o in expr.tensor_outputs if o.logical == out.logical), None), ())
    for axis, out_id in enumerate(reductions):
        data = [t for t in _mesh_types(x, axis) if t != pt and t not in used and
                x.mesh.axis_size(t) > 1]
        if out_id not in out.loop or device_ids(out).get(out_id) or not data:
            continue
        pos = out.loop.index(out_id)
        for dp in data:
            out.split(pos, x.mesh.axis_size(dp), inner_split=False)
            out.parallelize(pos, dp)
            pos += 1


def _experts_grads(d, grads):
    computed = []

    def gradient(index: int):
        if grads[0] is None:
            return None
        if not computed:
            saved = d.out(2) if saves_products(d.expr) else None
            computed.extend(d.ops.moe_experts_bwd(
                grads[0], *(d.value(n) for n in ("x", "indices", "weights", *_WEIGHTS)),
                d.attrs["capacity"], saved))
        return computed[index]

    return {name: (lambda i=i: gradient(i))
            for i, name in enumerate(("x", "weights", *_WEIGHTS))}


EXPERT_OPS = ("moe_experts", "moe_experts_bwd")
# per-expert output -> its first logical axis that reduces over the tokens (one per token axis)
_TOKEN_REDUCTIONS = {"moe_experts": {1: 1}, "moe_experts_bwd": {2: 3, 3: 3, 4: 3}}
_PARAMS = (tensor("x"), tensor("indices"), tensor("weights"), *map(tensor, _WEIGHTS),
           attr("capacity", None))

register(OpDef(
    "moe_experts", _PARAMS, _experts_infer, _experts,
    doc="routed SwiGLU experts: each token's top-k slots through their experts, weighted "
    "and summed; also the rows each expert computed and the slots' saved products",
    sharding="tokens shard freely; F sharded: partial sums (expert TP); experts sharded "
    "over a mesh axis that shards the tokens: expert parallel (ragged all-to-all), else "
    "gathered",
    prefer_inputs=(3, 4, 5), output_layout="contiguous", whole_axes=whole_axes,
    check_sharding=check_sharding, plan=plan, own_partials=own_partials,
    vjp=Vjp(_experts_grads, differentiable=(0,)), localize=localize,
))


def _bwd_infer(grad, x, indices, weights, w1, w2, w3, capacity, saved=None):
    t, k, h, e, f = _check("moe_experts_bwd", x, indices, weights, w1, w2, w3)
    _check_capacity("moe_experts_bwd", capacity)
    require_tensor("moe_experts_bwd", "grad", grad)
    if grad.ndim != x.ndim or any(None not in (a, b) and a != b
                                  for a, b in zip(grad.shape, (*t, h))):
        raise DefinitionError(f"moe_experts_bwd: grad must be [*tokens, H] = {[*t, h]}, got "
                              f"{list(grad.shape)}")
    _check_saved(saved, capacity, x, (*t, k, 2, f))
    extra, n = _saved_sources(saved), len(t)
    last, args = x.ndim - 1, (grad, x, indices, weights)
    rf = AxisSpec(f, IterType.Reduction, ((4, 1), (5, 2), (6, 1), *extra((7, n + 2))))
    rt = _token_axes(t, args, IterType.Reduction, extra)
    experts = AxisSpec(e, w1.iter_types[0], ((4, 0), (5, 0), (6, 0)))
    ffn = AxisSpec(f, w1.iter_types[1], ((4, 1), (5, 2), (6, 1), *extra((7, n + 2))))
    hidden = AxisSpec(h, w1.iter_types[2], ((4, 2), (5, 1), (6, 2)))
    gx = (*_token_axes(t, args, extra=extra),
          AxisSpec(h, x.iter_types[last], ((1, last), (0, last))), rf)
    gweights = (*_token_axes(t, args, extra=extra),
                AxisSpec(k, weights.iter_types[last], ((3, last), (2, last), *extra((7, n)))),
                rf)
    return [OutSpec(x.dtype, gx), OutSpec(weights.dtype, gweights),
            OutSpec(x.dtype, (experts, ffn, hidden, *rt)),
            OutSpec(x.dtype, (experts, hidden, ffn, *rt)),
            OutSpec(x.dtype, (experts, ffn, hidden, *rt))]


def _saved_sources(saved):
    """``saved``'s axes as sources of the gradients' (position 7 among the tensors), when
    given."""
    def extra(*pairs) -> tuple:
        return pairs if saved is not None else ()
    return extra


def _check_saved(saved, capacity, x, shape: tuple) -> None:
    if saved is None:
        return
    require_tensor("moe_experts_bwd", "saved", saved)
    if capacity is not None:
        raise DefinitionError("moe_experts_bwd: saved products come with capacity=None only "
                              "(moe_experts saves none where it drops rows)")
    if saved.dtype != x.dtype or saved.ndim != len(shape) or any(
            None not in (a, b) and a != b for a, b in zip(saved.shape, shape)):
        raise DefinitionError(
            f"moe_experts_bwd: saved must be moe_experts' third output, [*tokens, K, 2, F] = "
            f"{list(shape)} of x's dtype; got {list(saved.shape)} {saved.dtype.name}")


def _experts_bwd(grad, x, indices, weights, w1, w2, w3, capacity, saved=None):
    return kernels.experts_backward(grad, x, indices, weights, w1, w2, w3, w1.shape[0],
                                    capacity=capacity, saved=saved)


register(OpDef(
    "moe_experts_bwd", (tensor("grad"), *_PARAMS, Param("saved", Kind.TENSOR, None)),
    _bwd_infer, _experts_bwd,
    doc="gradients of moe_experts: (x, weights, w1, w2, w3), from moe_experts' saved "
    "products where given (else recomputed)",
    sharding="as moe_experts; the weight gradients reduce over the tokens (partial where "
    "tokens are sharded, complete on expert-parallel ranks)",
    prefer_inputs=(4, 5, 6), output_layout="contiguous", whole_axes=whole_axes,
    check_sharding=check_sharding, plan=plan, own_partials=own_partials,
))
