"""Binding: from this rank's input tensors to concrete global extents and local layouts.

Everything here depends only on the definition, the schedule and the inputs' dtypes and
shapes, so every rank that got consistent inputs reaches the same decisions (and raises the
same errors) before any communication.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from meshfuse.errors import DefinitionError, InputError
from meshfuse.ir.fusion import Fusion, Reshard
from meshfuse.ir.global_index import GlobalIndex, global_index
from meshfuse.ir.iter_domain import IterDomain, Split
from meshfuse.ir.layout import (
    LocalLayout,
    derived_extents,
    device_ids,
    local_extent,
    local_layout,
    shard_factor,
)
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.ir.printer import format_expr
from meshfuse.ir.tensor_view import Allocation, Scalar, TensorView
from meshfuse.ops.meta import arg_meta
from meshfuse.ops.registry import LocalContext, TensorMeta


@dataclasses.dataclass(frozen=True)
class Binding:
    """Concrete extents of every ID, and every tensor's local layout on this rank."""

    extents: dict[IterDomain, int]
    layouts: dict[TensorView, LocalLayout]


def device_coords(tv: TensorView, rank: int) -> dict[ParallelType, int]:
    """This rank's coordinate on the mesh axis of each device parallel type ``tv`` uses
    (coordinate 0 for a rank outside ``tv``'s mesh: what it would hold there is never
    read)."""
    if tv.mesh is None:
        return {}
    coord = tv.mesh.coordinate(rank) if rank in tv.mesh else (0,) * tv.mesh.ndim
    return {pt: coord[tv.mesh.axis_of(pt)] for pt in tv.parallel.values() if pt.is_device}


def held_here(tv: TensorView, rank: int) -> bool:
    """Whether ``rank`` holds a shard of ``tv`` (it is on no mesh, or on one with ``rank``)."""
    return tv.mesh is None or rank in tv.mesh


def required_device(backend: str, device: torch.device, world_size: int) -> torch.device | None:
    """The device every tensor input of a rank must be on: its GPU ``device`` under NCCL
    between several ranks (NCCL moves only that GPU's memory, and a tensor elsewhere would fail
    inside a collective with a raw error); None otherwise (any device, one for all inputs)."""
    return device if backend == "nccl" and world_size > 1 else None


def check_inputs(fusion: Fusion, inputs: Sequence, rank: int = 0,
                 device: torch.device | None = None) -> None:
    """Count, kind, dtype, dimensions and device of each input. A rank outside an input's mesh
    passes None (or any tensor, which is ignored) for it; for an input with symbolic extents,
    a tensor of its global shape and dtype (values not read: on the meta device), from which
    it learns them.

    The tensor inputs this rank holds are on one device, and on ``device`` when it is given
    (see :func:`required_device`; a meta tensor, a shape only, is exempt from that). Two kinds
    are on the CPU beside them: ``is_cpu`` scalars, which must be, and 0-d CPU tensors, which
    torch's ops take beside tensors of any device (sdpa's forward returns its RNG seed and
    offset so).

    Raises:
        InputError: naming the input and, for a device, this rank and the expected device.
    """
    declared = fusion.inputs()
    if len(inputs) != len(declared):
        names = ", ".join(v.name for v in declared)
        raise InputError(
            f"execute got {len(inputs)} inputs but the fusion takes {len(declared)} ({names})"
        )
    first = None  # (input, device) of the first tensor input that fixes the device
    for v, x in zip(declared, inputs):
        if isinstance(v, Scalar):
            _check_scalar(v, x)
        elif not held_here(v, rank):
            _check_not_held(v, x, rank)
        else:
            _check_tensor(v, x)
            if v.is_cpu or is_cpu_scalar(x):
                continue
            if device is not None:
                _check_on_gpu(v, x, rank, device)
            if first is None:
                first = v, x.device
            elif x.device != first[1]:
                raise InputError(
                    f"input {v.name} is on {x.device} but input {first[0].name} is on "
                    f"{first[1]} (rank {rank}): put all inputs on one device"
                )


def is_cpu_scalar(x) -> bool:
    """Whether ``x`` is a 0-d CPU tensor: torch's ops take one beside tensors of any device,
    so it fixes no input device."""
    return isinstance(x, torch.Tensor) and x.ndim == 0 and x.device.type == "cpu"


def _check_tensor(v: TensorView, x) -> None:
    """Input ``v``, which this rank holds, is given a tensor of its kind (an ``is_cpu`` one on
    the CPU)."""
    if not isinstance(x, torch.Tensor):
        raise InputError(f"input {v.name} must be a torch.Tensor, got {type(x).__name__}")
    _check_kind(v, x)
    if v.is_cpu and x.device.type != "cpu":
        raise InputError(
            f"input {v.name} is declared is_cpu=True but is on {x.device}; pass a CPU tensor"
        )


def _check_on_gpu(v: TensorView, x: torch.Tensor, rank: int, device: torch.device) -> None:
    """Input ``v`` is on this rank's NCCL GPU ``device`` (a meta tensor, which stands for a
    shape only, is anywhere)."""
    if x.device != device and x.device.type != "meta":
        raise InputError(
            f"input {v.name} is on {x.device}, but rank {rank} runs NCCL on {device}: put "
            "the inputs on this rank's GPU (x.to(Communicator.instance().device))"
        )


def _check_scalar(v: Scalar, x) -> None:
    """Scalar input ``v`` is given a number (or a 0-d tensor)."""
    if isinstance(x, torch.Tensor) and x.ndim > 0:
        raise InputError(f"input {v.name} is a scalar; got a tensor of shape {list(x.shape)}")
    if not isinstance(x, bool | int | float | complex | torch.Tensor):
        raise InputError(
            f"input {v.name} is a {v.dtype.name} scalar; got {type(x).__name__} "
            f"{x!r}: pass a number"
        )


def _check_not_held(v: TensorView, x, rank: int) -> None:
    """Input ``v``, which ``rank`` holds no shard of, is given None or a tensor (one that
    stands for its global shape, when ``v`` has symbolic extents)."""
    if x is not None and not isinstance(x, torch.Tensor):
        raise InputError(
            f"input {v.name} is not on this rank ({rank} is outside {v.mesh!r}): pass "
            f"None for it, got {type(x).__name__}"
        )
    if x is not None and has_symbolic_extents(v):
        _check_kind(v, x)  # its shape stands for the global one: see bind


def has_symbolic_extents(tv: TensorView) -> bool:
    """Whether some axis of ``tv`` has an extent that is symbolic until execute."""
    return any(i.extent is None for i in tv.materialized())


def _check_kind(v: TensorView, x: torch.Tensor) -> None:
    """``x`` has ``v``'s dtype and number of axes."""
    if x.dtype != v.dtype.torch_dtype:
        raise InputError(
            f"input {v.name} must be {v.dtype.name} ({v.dtype.torch_dtype}), got {x.dtype}; "
            f"cast it with .to({v.dtype.torch_dtype})"
        )
    if x.ndim != v.ndim:
        raise InputError(
            f"input {v.name} must have {v.ndim} axes (global shape "
            f"{[i.extent if i.extent is not None else -1 for i in v.materialized()]}), got "
            f"shape {list(x.shape)}"
        )


def _unheld_extents(v: TensorView, x, rank: int) -> dict[IterDomain, int]:
    """The global extents of input ``v`` on a rank outside its mesh: the static ones, and
    for symbolic ones the shape of the tensor that rank passed for it, which stands for the
    global tensor (its values are never read: ``torch.empty(shape, device="meta")``)."""
    static = {i: i.extent for i in v.logical if i.extent is not None}
    if not has_symbolic_extents(v):
        return static
    if not isinstance(x, torch.Tensor):
        raise InputError(
            f"input {v.name} lives on {v.mesh!r}, not on rank {rank}, and has symbolic "
            f"extents, which rank {rank} needs too: pass a tensor of its global shape there "
            f"(its values are not read: torch.empty(shape, dtype={v.dtype.torch_dtype}, "
            "device='meta')), or declare the extents static"
        )
    for axis, (id_, n) in enumerate(zip(v.materialized(), x.shape)):
        if id_.extent is not None and id_.extent != n:
            raise InputError(
                f"input {v.name} axis {axis} has global extent {id_.extent}; rank {rank} "
                f"(outside its mesh) passed a tensor of global shape {list(x.shape)} for it"
            )
    return {**static, **dict(zip(v.materialized(), x.shape))}


def bind(
    fusion: Fusion,
    allocations: Mapping[TensorView, Allocation],
    inputs: Sequence,
    rank: int = 0,
    known: Mapping[IterDomain, int] | None = None,
) -> Binding:
    """Global extents from local input sizes (static ones for inputs this rank does not
    hold; ``known``: global extents of symbolic input axes learnt from every rank's shard,
    see :func:`shard_extents`), checked against the definition; local layouts."""
    extents: dict[IterDomain, int] = {}
    for v, x in zip(fusion.inputs(), inputs):
        if isinstance(v, TensorView):
            if held_here(v, rank):
                extents.update(zip(v.materialized(), global_shape(v, x, known)))
                _check_local_extents(v, x, extents, rank)
            else:
                extents.update(_unheld_extents(v, x, rank))
    for expr in fusion.exprs:
        if isinstance(expr, Reshard):
            # Communications keep every logical ID, reduction IDs of partials included.
            for d, s in zip(expr.outputs[0].logical, expr.args[0].logical):
                extents[d] = extents[s]
            continue
        metas = [_concrete_meta(a, extents) for a in expr.args]
        try:
            specs = expr.op.infer(*metas)
        except DefinitionError as e:
            raise InputError(f"{format_expr(expr)} with the given input sizes: {e}") from None
        for out, spec in zip(expr.outputs, specs):
            if isinstance(out, TensorView):
                for id_, axis in zip(out.logical, spec.axes):
                    extents[id_] = axis.extent
    layouts = {}
    for tv in fusion.tensors():
        extents.update(derived_extents(tv, extents))
        layouts[tv] = local_layout(tv, allocations[tv], extents, device_coords(tv, rank))
    return Binding(extents, layouts)


def _concrete_meta(arg, extents):
    meta = arg_meta(arg)
    if isinstance(meta, TensorMeta):
        return _concrete(arg, meta, extents)
    if isinstance(meta, list) and meta and isinstance(meta[0], TensorMeta):
        return [_concrete(a, m, extents) for a, m in zip(arg, meta)]
    return meta


def _concrete(tv: TensorView, meta: TensorMeta, extents) -> TensorMeta:
    shape = tuple(extents[i] for i in tv.materialized())
    partial = tuple(extents.get(i, i.extent) for i in tv.logical if i.is_reduction)
    return dataclasses.replace(meta, shape=shape, partial_axes=partial)


def global_shape(tv: TensorView, x: torch.Tensor,
                 known: Mapping[IterDomain, int] | None = None) -> tuple[int, ...]:
    """The global shape of input ``tv`` given this rank's local shard ``x``: each axis's
    static extent, else its extent in ``known`` (learnt from every rank's shard: an uneven
    split), else its local extent times the number of shards (even shards)."""
    known = known or {}
    shape = []
    for axis, id_ in enumerate(tv.materialized()):
        if id_ in tv.parallel and tv.parallel[id_].is_device and x.shape[axis] != 1:
            raise InputError(
                f"input {tv.name} axis {axis} is a device axis (parallelized on "
                f"{tv.parallel[id_].value}); its local extent must be 1, got {x.shape[axis]}"
            )
        if id_.is_broadcast and x.shape[axis] not in (1, id_.extent):
            # (an expanded broadcast axis, a residual of a backward, has its extent)
            raise InputError(
                f"input {tv.name} axis {axis} is a broadcast axis (declared extent 1) but has "
                f"extent {x.shape[axis]}; declare it -1 or pass extent 1"
            )
        if id_.extent is not None:
            shape.append(id_.extent)
        else:
            shape.append(known.get(id_, x.shape[axis] * shard_factor(tv, id_)))
    return tuple(shape)


def sharded_symbolic_axes(fusion: Fusion) -> list[tuple[int, int]]:
    """(input position, axis) of each symbolic input axis split over devices: a rank learns
    its global extent from every rank's shard (:func:`shard_extents`), the shards of an
    uneven split being of different extents."""
    return [(pos, axis) for pos, v in enumerate(fusion.inputs()) if isinstance(v, TensorView)
            for axis, id_ in enumerate(v.materialized())
            if id_.extent is None and device_ids(v).get(id_)]


def local_extents(fusion: Fusion, inputs: Sequence, rank: int,
                  axes: Sequence[tuple[int, int]]) -> list[int]:
    """This rank's extent of each of ``axes`` (see :func:`sharded_symbolic_axes`), -1 where
    it holds no shard of that input (or passed no tensor of its axes)."""
    declared = fusion.inputs()
    extents = []
    for pos, axis in axes:
        v, x = declared[pos], inputs[pos] if pos < len(inputs) else None
        ok = held_here(v, rank) and isinstance(x, torch.Tensor) and x.ndim == v.ndim
        extents.append(int(x.shape[axis]) if ok else -1)
    return extents


def shard_extents(fusion: Fusion, axes: Sequence[tuple[int, int]],
                  by_rank: Sequence[Sequence[int]]) -> dict[IterDomain, int]:
    """The global extent of each of ``axes`` from every rank's local extent (``by_rank``,
    :func:`local_extents` of each rank): the sum of the shards of one holder per position on
    the mesh axes that split it (each global index lies in one such shard)."""
    declared = fusion.inputs()
    known = {}
    for k, (pos, axis) in enumerate(axes):
        v = declared[pos]
        id_ = v.materialized()[axis]
        types = [pt for _, pt in device_ids(v)[id_]]
        holders = [r for r in v.mesh.device_ids if r < len(by_rank)]
        if any(by_rank[r][k] < 0 for r in holders):
            continue  # a holder passed no tensor: its own check says so
        shards = {tuple(device_coords(v, r)[pt] for pt in types): by_rank[r][k]
                  for r in holders}
        n = sum(shards.values())
        if all(by_rank[r][k] == _shard_extent(v, id_, n, r) for r in holders):
            known[id_] = n
        # (else no extent gives every rank its shard: each binds its own guess, and the
        # ranks' agreement names the one whose shard differs)
    return known


def _shard_extent(tv: TensorView, id_: IterDomain, n: int, rank: int) -> int:
    """The extent of ``rank``'s shard of logical axis ``id_`` of ``tv`` for global extent
    ``n``."""
    extents = {id_: n}
    for t in tv.transforms:
        if isinstance(t, Split) and t.in_id in extents:
            rest = -(-extents[t.in_id] // t.factor)
            extents[t.outer], extents[t.inner] = \
                (rest, t.factor) if t.inner_split else (t.factor, rest)
    return local_extent(tv, id_, extents, device_coords(tv, rank))


def _check_local_extents(tv: TensorView, x: torch.Tensor, extents: Mapping[IterDomain, int],
                         rank: int) -> None:
    """Each axis of ``x`` has the extent of this rank's shard of the global extent."""
    derived = derived_extents(tv, extents)
    coords = device_coords(tv, rank)
    for axis, id_ in enumerate(tv.materialized()):
        want = local_extent(tv, id_, derived, coords)
        if x.shape[axis] == want:
            continue
        factor = shard_factor(tv, id_)
        split = f" split into {factor} shards" if factor > 1 else ""
        raise InputError(
            f"input {tv.name} axis {axis} has local extent {x.shape[axis]}, but the definition "
            f"says {extents[id_]} (the global extent){split}, which gives rank {rank} a shard "
            f"of extent {want}; pass this rank's shard (shard_tensor) or fix the definition"
        )


def check_strides(tv: TensorView, x: torch.Tensor, layout: LocalLayout) -> None:
    """``x`` has ``layout``'s shape and follows its memory order (dense where contiguous)."""
    if tuple(x.shape) != layout.shape:
        raise InputError(
            f"input {tv.name} has local shape {list(x.shape)} but its schedule gives "
            f"{list(layout.shape)} on this rank; pass this rank's shard (shard_tensor)"
        )
    if x.numel() == 0:
        return  # an empty shard: any strides will do
    running = 1
    for axis in reversed(layout.order):
        n, stride = x.shape[axis], x.stride(axis)
        if n == 1:
            continue
        contiguous = layout.contiguity[axis]
        if (contiguous and stride != running) or stride < running:
            raise InputError(
                f"input {tv.name} has strides {list(x.stride())} (shape {list(x.shape)}), which "
                f"do not follow its declared memory order (axes outermost first: "
                f"{list(layout.order)}"
                f"{', dense' if contiguous else ''}); expected strides like "
                f"{list(layout.strides)}: lay the tensor out accordingly (e.g. .contiguous() "
                "for row-major) or declare its stride_order/contiguity"
            )
        running = stride * n


def local_context(binding: Binding, rank: int, device) -> LocalContext:
    """What ``localize`` rules see of this rank: global positions of its shards."""
    def index(tv: TensorView) -> GlobalIndex:
        return global_index(tv, binding.extents, device_coords(tv, rank))

    return LocalContext(rank, torch.device("cpu") if device is None else device, index,
                        binding.extents)
