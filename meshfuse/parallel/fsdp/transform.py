"""``shard_fusion``: a fusion rewritten for fully sharded data parallelism.

The user's fusion (read, never changed) computes with whole parameters, at global shapes,
and may carry a tensor-, sequence- or context-parallel schedule on a :class:`NamedMesh`. The
result is a new fusion with the same inputs in the same positions and the same outputs:

- each parameter input is its **storage**: sharded on its first axis over the ``shard``
  dimension (within whatever part the user's schedule gives the rank, uneven shards
  allowed), replicated over ``replicate`` (HSDP);
- its first use reads the **gathered** parameter: ``set`` of the storage (of its cast to
  ``mp_policy.param_dtype`` first), scheduled as the user scheduled the parameter, so
  resharding gathers it over ``shard`` before use, and a derived backward reduce-scatters
  its gradient (and allreduces it across ``replicate``);
- each batch input is split on its first axis over ``replicate`` then ``shard``; propagation
  carries the split through the activations;
- with ``mp_policy.param_dtype``, the floating operands of matrix products (linear, matmul,
  attention) are cast to it, as ``torch.autocast`` does; the other ops compute as the fusion
  says (a pointwise op on bf16 computes in float, as in nvFuser).

The layers (one list of parameters each) are recorded for the program builder
(:func:`meshfuse.parallel.fsdp.layers.register_layers`): one gather per layer, issued a layer
ahead (:mod:`meshfuse.parallel.fsdp.program`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError, ScheduleError
from meshfuse.ir.fusion import Expr, Fusion
from meshfuse.ir.iter_domain import Merge, Split
from meshfuse.ir.tensor_view import Allocation, Scalar, TensorView, Val
from meshfuse.ops.namespace import add_op
from meshfuse.ops.registry import lookup
from meshfuse.parallel.fsdp.layers import register_layers
from meshfuse.parallel.fsdp.spec import FsdpOptions, NamedMesh
from meshfuse.passes.schedule_copy import copy_schedule

# The ops that run in the mixed-precision policy's param_dtype (as torch.autocast runs
# matrix products in low precision); the others compute as the fusion says.
_MATRIX_PRODUCTS = ("linear", "matmul", "sdpfa_fwd")


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedFusion:
    """The result of :func:`shard_fusion`.

    Attributes:
        fusion: the new fusion (inputs and outputs in the user's order).
        mesh: the named mesh.
        options: the options it was built with.
        layers: per layer, the storage inputs of its parameters (tensors of ``fusion``).
        inputs: each input of the user's fusion -> its input in ``fusion``.
    """

    fusion: Fusion
    mesh: NamedMesh
    options: FsdpOptions
    layers: tuple[tuple[TensorView, ...], ...]
    inputs: dict[Val, Val]

    def storage(self, user_tv: TensorView) -> TensorView:
        """The input of ``fusion`` that holds ``user_tv`` (a parameter's storage)."""
        return self.inputs[user_tv]


def shard_fusion(fusion: Fusion, mesh: NamedMesh, layers: Sequence[Sequence[TensorView]],
                 batch: Sequence[TensorView], options: FsdpOptions | None = None
                 ) -> ShardedFusion:
    """``fusion`` made fully sharded data parallel; see the module doc.

    Args:
        fusion: the user's fusion, defined (and optionally scheduled on ``mesh.mesh``).
        mesh: the mesh, with the dimensions ``options.shard`` (and ``options.replicate``).
        layers: the parameter inputs of each layer, in the order the layers run.
        batch: the inputs whose first axis is the batch (tokens).
        options: see :class:`FsdpOptions`.

    Raises:
        DefinitionError: a parameter that is no floating tensor input, a batch tensor that
            is no tensor input, or a parameter named twice.
        ScheduleError: a dimension the mesh lacks, ``replicate`` equal to ``shard``, a
            tensor scheduled on another mesh, a parameter with no first axis to shard.
    """
    options = options or FsdpOptions()
    param_layer = _checked(fusion, mesh, layers, batch, options)
    new = Fusion()
    mapped: dict[Val, Val] = {}
    for v in fusion.inputs():
        mapped[v] = new.add_input(_fresh_input(new, v))
    used: dict[Val, Val] = dict(mapped)  # what the user's ops read in place of each input
    pd = options.mp_policy.param_dtype
    for v in fusion.inputs():
        if v in param_layer:
            used[v] = _gathered(new, v, mapped[v], mesh, pd)
    pinned = _replay(fusion, new, used, None if pd is None else DataType.from_torch(pd))
    for v in fusion.inputs():
        if isinstance(v, TensorView):
            _schedule_input(v, mapped[v], used[v], mesh, options, v in param_layer, v in batch)
    _split_pinned_batch(new, [mapped[x] for x in batch], pinned, mesh, options)
    storages = tuple(tuple(mapped[p] for p in layer) for layer in layers)
    register_layers(new, {mapped[p]: k for p, k in param_layer.items()},
                    options.mp_policy.reduce_dtype)
    return ShardedFusion(new, mesh, options, storages, mapped)


def _checked(fusion: Fusion, mesh: NamedMesh, layers, batch, options: FsdpOptions
             ) -> dict[TensorView, int]:
    """The layer of each parameter, after checking the arguments (see shard_fusion)."""
    mesh.axis(options.shard)
    if options.replicate is not None and mesh.axis(options.replicate) == mesh.axis(options.shard):
        raise ScheduleError(f"replicate={options.replicate!r} is the shard dimension; HSDP "
                            "replicates over another mesh dimension than it shards over")
    inputs = fusion.inputs()
    param_layer: dict[TensorView, int] = {}
    for k, layer in enumerate(layers):
        for p in layer:
            _check_input(p, inputs, f"layer {k}'s parameter")
            if p in param_layer:
                raise DefinitionError(f"parameter {p.name} is in layers {param_layer[p]} and "
                                      f"{k}; give each parameter to one layer")
            if not p.materialized() or p.materialized()[0].is_broadcast:
                raise ScheduleError(f"parameter {p.name} has no first axis to shard (shape "
                                    f"{[i.extent for i in p.materialized()]}); leave it out "
                                    "of the layers (it stays replicated)")
            param_layer[p] = k
    for x in batch:
        _check_input(x, inputs, "batch input", floating=False)
        if x in param_layer:
            raise DefinitionError(f"{x.name} is both a parameter and a batch input")
    for tv in fusion.tensors():
        if tv.mesh is not None and tv.mesh != mesh.mesh:
            raise ScheduleError(f"{tv.name} is scheduled on {tv.mesh!r}, not on the mesh "
                                f"{mesh.mesh!r} it is sharded over; schedule every tensor on "
                                "that one mesh")
    return param_layer


def _check_input(tv, inputs, what: str, floating: bool = True) -> None:
    if not isinstance(tv, TensorView) or tv not in inputs or \
            (floating and not tv.dtype.is_floating):
        kind = "a floating tensor" if floating else "a tensor"
        raise DefinitionError(f"{what} {getattr(tv, 'name', tv)!r} is not {kind} input of "
                              "the fusion; pass tensors made by its define_tensor")


def _fresh_input(new: Fusion, v: Val) -> Val:
    if not isinstance(v, TensorView):
        return Scalar(v.dtype)
    tv = TensorView(new, [i.like() for i in v.logical], v.dtype)
    ids = dict(zip(v.logical, tv.logical))
    if v.allocation is not None and all(i in ids for i in v.allocation.ids):
        tv.allocation = Allocation(tuple(ids[i] for i in v.allocation.ids),
                                   v.allocation.contiguity)
    tv.is_cpu = v.is_cpu
    return tv


def _gathered(new: Fusion, user: TensorView, storage: TensorView, mesh: NamedMesh,
              param_dtype) -> TensorView:
    """The gathered parameter the user's ops read: ``set`` of the storage (cast first to
    ``param_dtype``), scheduled as the user scheduled ``user`` (else replicated)."""
    source = storage
    if param_dtype is not None and DataType.from_torch(param_dtype) is not storage.dtype:
        source = add_op(new, lookup("cast"), [storage, DataType.from_torch(param_dtype)], {})
    gathered = add_op(new, lookup("set"), [source], {})
    if user.is_scheduled:
        copy_schedule(user, gathered)
    else:
        gathered.set_device_mesh(mesh.mesh)
    return gathered


def _replay(fusion: Fusion, new: Fusion, used: dict[Val, Val],
            compute: DataType | None = None) -> list[TensorView]:
    """The user's ops in ``new`` over ``used``; user-scheduled results keep their schedule
    (they are returned). With ``compute``, the floating operands of matrix products are
    cast to it first."""
    mapped = dict(used)
    pinned: list[TensorView] = []

    for expr in fusion.exprs:
        args = [new.copied_arg(a, mapped) for a in expr.args]
        if compute is not None and expr.op.name in _MATRIX_PRODUCTS:
            args = [add_op(new, lookup("cast"), [a, compute], {})
                    if isinstance(a, TensorView) and a.dtype.is_floating and
                    a.dtype is not compute else a for a in args]
        outs = add_op(new, expr.op, args, {})
        outs = outs if isinstance(outs, tuple) else (outs,)
        mapped.update(zip(expr.outputs, outs))
        for old, out in zip(expr.outputs, outs):
            if isinstance(old, TensorView) and old.is_scheduled:
                copy_schedule(old, out)
                pinned.append(out)
    for out in fusion.outputs():
        new.add_output(mapped[out])
    return pinned


def carry_batch(exprs: Sequence[Expr], carried: set) -> None:
    """Adds to ``carried`` (the IDs that are the batch axis) the output axes of ``exprs``,
    in order, that carry it (:func:`_carries`)."""
    for expr in exprs:
        for out in expr.outputs:
            if isinstance(out, TensorView):
                carried.update(i for i in out.logical if not i.is_reduction and
                               _carries(expr, i, carried))


def _carries(expr, out_id, carried: set) -> bool:
    """Whether ``expr``'s output axis ``out_id`` is the batch axis: one of the input axes
    its domain map takes it from is (``carried``), and no two come from one input (a
    merge)."""
    sources = expr.id_map.get(out_id, ())
    if not any(i in carried for i in sources):
        return False
    owners = [k for k, a in enumerate(expr.inputs) if isinstance(a, TensorView)
              for i in a.logical if i in sources]
    return len(owners) == len(set(owners))


def _split_pinned_batch(new: Fusion, batch: Sequence[TensorView], pinned: Sequence[TensorView],
                        mesh: NamedMesh, options: FsdpOptions) -> None:
    """Splits the batch axis of the activations the user scheduled (a sequence-parallel
    residual stream, pinned ``[R, S(1)]`` over ``tp``) over the data-parallel dimensions,
    as the batch inputs are: else the pin would gather the batch. The batch axis of a
    tensor is the one the ops' domain maps carry from a batch input's first axis (an axis
    merged with others of the same tensor is left as the user scheduled it)."""
    carried = {x.materialized()[0] for x in batch if x.materialized()}
    carry_batch(new.exprs, carried)
    dims = [d for d in (options.replicate, options.shard) if d is not None and mesh.size(d) > 1]
    for tv in pinned:
        axes = [a for a, i in enumerate(tv.materialized()) if i in carried]
        if len(axes) != 1 or tv.mesh != mesh.mesh:
            continue
        for name in dims:
            if mesh.parallel_type(name) not in tv.parallel.values():
                shard_axis(tv, mesh, name, axes[0])


def _schedule_input(user: TensorView, tv: TensorView, used: Val, mesh: NamedMesh,
                    options: FsdpOptions, is_param: bool, is_batch: bool) -> None:
    """The schedule of input ``tv`` of the new fusion: the user's, plus the shard of the
    first axis over the data-parallel dimensions (of a parameter's storage, over
    ``shard``; of a batch input, over ``replicate`` then ``shard``)."""
    if user.is_scheduled:
        copy_schedule(user, tv)
    else:
        tv.set_device_mesh(mesh.mesh)
    dims = [options.shard] if is_param else \
        [d for d in (options.replicate, options.shard) if d is not None] if is_batch else []
    for name in dims:
        if mesh.size(name) > 1:
            shard_first_axis(tv, mesh, name)
    if used is not tv and isinstance(used, TensorView) and not used.is_scheduled:
        copy_schedule(tv, used)  # a cast of the input, before its gather: sharded alike


def shard_first_axis(tv: TensorView, mesh: NamedMesh, name: str) -> None:
    """Shards ``tv``'s first axis over mesh dimension ``name``; see :func:`shard_axis`."""
    shard_axis(tv, mesh, name, 0)


def shard_axis(tv: TensorView, mesh: NamedMesh, name: str, axis: int) -> None:
    """Shards ``tv``'s materialized axis ``axis`` over mesh dimension ``name``, within the
    part of it that its schedule already gives a device (an outer split of the outermost
    loop ID of that axis that is not device-parallel).

    Raises:
        ScheduleError: the axis was merged with another, or ``name``'s parallel type
            already shards ``tv``.
    """
    first = tv.materialized()[axis]
    kind = mesh.parallel_type(name)
    if kind in tv.parallel.values():
        raise ScheduleError(f"{tv.name} is already sharded over {name!r} ({kind.value}); a "
                            "dimension can split one axis of a tensor only")
    family = {first}
    for t in tv.transforms:
        if isinstance(t, Split) and t.in_id in family:
            family |= {t.outer, t.inner}
        elif isinstance(t, Merge) and (t.outer in family or t.inner in family):
            raise ScheduleError(f"{tv.name}'s axis {axis} is merged with another in its "
                                "schedule; shard it before merging, or leave it unmerged")
    leaf = next(i for i in tv.loop if i in family and i not in tv.parallel)
    pos = tv.loop.index(leaf)
    tv.outer_split(pos, mesh.size(name))
    tv.parallelize(pos, kind)
