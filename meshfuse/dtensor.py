"""DTensor interop: DTensors in, DTensors out, and conversions between DTensor placements and
meshfuse schedules.

PyTorch users meet meshfuse here. ``fd.execute([...DTensors...])`` (or
``execute_with_dtensors(fd, dtensors)``, nvFuser's name) takes each DTensor's local shard, gives
every unscheduled fusion input the schedule its placements say (:func:`schedule_from_placements`),
runs the fusion, and wraps each output as a DTensor with the mesh and placements its schedule
implies (:func:`to_placements`) and the inputs' mesh dimension names.

The correspondence, per mesh axis (outermost first, as DTensor lists placements):

- ``Shard(d)``: an outer split of tensor axis ``d`` by the mesh axis size, its outer part
  parallelized on that mesh axis (``mesh_x`` is the last mesh axis). Several mesh axes on one
  tensor axis nest in mesh order, as DTensor's ``[Shard(0), Shard(0)]`` does;
- ``Replicate()``: nothing parallelized on that mesh axis;
- ``Partial(op)``: an output holding partial results of a reduction sharded on that mesh
  axis. A partial *input* is reduced by DTensor (``redistribute`` to ``Replicate``) before the
  fusion runs, since a fusion input cannot be partial.

- ``_StridedShard(d, split_factor=f)``: FSDP2 + TP's layout, mesh axis ``i`` splitting
  axis ``d`` within the shard of the later mesh axes (sizes multiplying to ``f``) that split
  it first: the split on ``i`` nests inside theirs.

A schedule DTensor cannot express (a cyclic shard from an inner split, mesh axes nested
otherwise) is refused with a ShardingError naming the tensor.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import placement_types as dt

from meshfuse.errors import InputError, ShardingError
from meshfuse.ir import placement as mf
from meshfuse.ir.iter_domain import Split
from meshfuse.ir.layout import device_ids, local_indices, shard_factor
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import device_parallel_type
from meshfuse.ir.tensor_view import TensorView
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.interpreter.binding import device_coords

__all__ = [
    "bind_dtensor",
    "check_dtensor_input",
    "execute_with_dtensors",
    "has_dtensors",
    "mesh_from_torch",
    "mesh_to_torch",
    "run_on_dtensors",
    "schedule_from_placements",
    "schedule_like_dtensor",
    "to_placements",
]


# ----- meshes ------------------------------------------------------------------------------
def mesh_from_torch(mesh: TorchDeviceMesh) -> DeviceMesh:
    """meshfuse's DeviceMesh with the ranks and shape of torch's ``mesh``.

    Remembered per torch mesh object, whose ranks never change: every DTensor input of every
    call asks for it, and torch rebuilds its rank tensor at each ``mesh.mesh`` (tens of
    microseconds a time, a millisecond per layer of a Llama model)."""
    known = _FROM_TORCH.get(id(mesh))
    if known is not None and known[0]() is mesh:
        return known[1]
    key = id(mesh)
    converted = DeviceMesh(mesh.mesh)
    _FROM_TORCH[key] = (weakref.ref(mesh, lambda _: _FROM_TORCH.pop(key, None)), converted)
    return converted


# Torch meshes converted by mesh_from_torch: id -> (a weak reference to it, meshfuse's mesh).
_FROM_TORCH: dict[int, tuple[weakref.ref, DeviceMesh]] = {}


def mesh_to_torch(mesh: DeviceMesh, device_type: str | None = None,
                  mesh_dim_names: Sequence[str] | None = None) -> TorchDeviceMesh:
    """torch's DeviceMesh with the ranks and shape of ``mesh`` (one object per mesh, device
    type and names; creating it is collective: every rank must call it alike).

    Args:
        mesh: a meshfuse DeviceMesh.
        device_type: ``"cuda"`` or ``"cpu"``; default: CUDA when the default process group is
            NCCL, else CPU.
        mesh_dim_names: a name per mesh axis, as torch's ``init_device_mesh`` takes them.

    Without a default process group, meshfuse's communicator makes one first, as a fusion's
    first ``execute`` does (from torchrun's environment, or a group of one in a single
    process).
    """
    if not dist.is_initialized():
        Communicator.instance()
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    return _torch_mesh(mesh, device_type, names)


@functools.cache
def _torch_mesh(mesh: DeviceMesh, device_type: str, names: tuple[str, ...] | None):
    return TorchDeviceMesh(device_type, mesh.devices, mesh_dim_names=names)


# ----- placements <-> schedules --------------------------------------------------------------
def to_placements(tv: TensorView) -> tuple[dt.Placement, ...]:
    """The DTensor placements of ``tv``'s schedule, one per axis of its mesh.

    Raises:
        ShardingError: if ``tv`` has no mesh, or a sharding DTensor has no placement for.
    """
    if tv.mesh is None:
        raise ShardingError(
            f"{tv.name} has no device mesh, so it has no DTensor placements; give it one "
            "(set_device_mesh) or let sharding propagation do so (execute first)"
        )
    result: list[dt.Placement] = []
    for mesh_axis, p in enumerate(mf.placements(tv, _reduce_op(tv))):
        if isinstance(p, mf.Shard):
            if p.cyclic:
                raise ShardingError(
                    f"{tv.name} axis {p.axis} is sharded cyclically (an inner split) on mesh "
                    f"axis {mesh_axis}; DTensor has no placement for that: use an outer split"
                )
            if p.zigzag:
                raise ShardingError(
                    f"{tv.name} axis {p.axis} is sharded in head-tail pairs (a zig-zag split) "
                    f"on mesh axis {mesh_axis}; DTensor has no placement for that: use an "
                    "outer split")
            result.append(_shard(tv, mesh_axis, p))
        elif isinstance(p, mf.Partial):
            result.append(dt.Partial(p.reduce_op))
        else:
            result.append(dt.Replicate())
    return tuple(result)


def _shard(tv: TensorView, mesh_axis: int, p: mf.Shard) -> dt.Placement:
    """``Shard(axis)``, or ``_StridedShard`` where later mesh axes split the axis outside
    this one (data-parallel within a tensor-parallel shard): its split factor their sizes'
    product."""
    depth = {tv.materialized()[p.axis]: 0}
    for t in tv.transforms:
        if isinstance(t, Split) and t.in_id in depth:
            depth[t.outer] = depth[t.inner] = depth[t.in_id] + 1
    outer = [tv.mesh.axis_of(pt) for id_, pt in tv.parallel.items()
             if pt.is_device and id_ in depth and depth[id_] < depth.get(p.id, 0)]
    factor = math.prod(tv.mesh.shape[m] for m in outer if m > mesh_axis)
    return dt._StridedShard(p.axis, split_factor=factor) if factor > 1 else dt.Shard(p.axis)


def _reduce_op(tv: TensorView) -> str:
    """How ``tv``'s partial values combine: its op's reduction (a communication or an input
    has none: a sum)."""
    op = getattr(tv.definition, "op", None)
    return getattr(op, "partial_reduce", None) or "sum"


def schedule_from_placements(tv: TensorView, mesh: DeviceMesh | TorchDeviceMesh,
                             placements: Sequence[dt.Placement]) -> TensorView:
    """Schedules the unscheduled ``tv`` as a DTensor with ``placements`` on ``mesh`` lies.

    Each ``Shard(d)`` on mesh axis ``i`` outer-splits what is left of tensor axis ``d`` by
    ``mesh.shape[i]`` and parallelizes the outer part on mesh axis ``i``. Example, a 2-D mesh
    of shape (2, 2) and ``[Shard(0), Replicate()]`` on ``[i{8}, i{4}]`` gives
    ``[iDIDy{2}, i{4}, i{4}]``.

    Raises:
        ScheduleError: if ``tv`` is already scheduled, or a split does not divide.
        ShardingError: for a placement meshfuse cannot take (a partial input, a strided shard).
    """
    if isinstance(mesh, TorchDeviceMesh):
        mesh = mesh_from_torch(mesh)
    if len(placements) != mesh.ndim:
        raise ShardingError(
            f"{tv.name}: {len(placements)} placements for a {mesh.ndim}-D mesh {mesh!r}; give "
            "one per mesh axis"
        )
    tv.set_device_mesh(mesh)
    remainder = {a: a for a in range(tv.ndim)}  # tensor axis -> loop position left to split
    for mesh_axis, axis in _nesting(tv.name, placements, mesh.shape, tv.ndim):
        pos = remainder[axis]
        tv.outer_split(pos, mesh.shape[mesh_axis])
        tv.parallelize(pos, device_parallel_type(mesh_axis, mesh.ndim))
        remainder = {a: q + 1 if q > pos else q for a, q in remainder.items()}
        remainder[axis] = pos + 1
    return tv


def _nesting(name: str, placements: Sequence[dt.Placement], shape: Sequence[int],
             ndim: int) -> list[tuple[int, int]]:
    """``(mesh axis, tensor axis)`` of each shard, outermost split first: ``Shard`` in mesh
    order; a ``_StridedShard(d, split_factor=f)`` (FSDP2 + TP's right-to-left sharding:
    data-parallel within the tensor-parallel shard) after the ``Shard(d)`` of later mesh axes
    whose sizes multiply to ``f``."""
    order: list[tuple[int, int]] = []
    waiting: list[list[int]] = []  # [mesh axis, tensor axis, factor still to come]
    for mesh_axis, p in enumerate(placements):
        if p.is_replicate():
            continue
        if type(p) not in (dt.Shard, dt._StridedShard):
            raise ShardingError(
                f"{name}: placement {p} on mesh axis {mesh_axis} has no meshfuse schedule; "
                "an input can be Shard(d), _StridedShard(d) or Replicate() (reduce a Partial "
                "one first)")
        axis = p.dim % ndim
        if type(p) is dt._StridedShard and p.split_factor > 1:
            waiting.append([mesh_axis, axis, p.split_factor])
            continue
        order.append((mesh_axis, axis))
        for w in waiting:
            if w[1] == axis and w[2] > 1:
                w[2] //= shape[mesh_axis]
                if w[2] == 1:
                    order.append((w[0], w[1]))
    if any(w[2] != 1 for w in waiting):
        raise ShardingError(f"{name}: {list(placements)}: a _StridedShard's split_factor is "
                            "not the product of the later mesh axes that shard its dimension")
    return order


def _check_like_dtensor(tv: TensorView, local: torch.Tensor, rank: int) -> None:
    """Where several mesh axes shard one axis of ``tv``, its local shard on ``rank`` holds the
    indices a DTensor with its placements holds (DTensor nests mesh axes in mesh order)."""
    sharded = [id_ for id_, ids in device_ids(tv).items() if len(ids) > 1]
    if not sharded or rank not in tv.mesh:
        return
    coords = device_coords(tv, rank)
    coordinate = tv.mesh.coordinate(rank)
    wanted = to_placements(tv)
    for id_ in sharded:
        axis = tv.materialized().index(id_)
        n = local.shape[axis] * shard_factor(tv, id_)
        held = local_indices(tv, id_, _chain_extents(tv, id_, n), coords)
        expected = torch.arange(n)
        for mesh_axis, dim in _nesting(tv.name, wanted, tv.mesh.shape, tv.ndim):
            if dim == axis:
                expected = expected.chunk(tv.mesh.shape[mesh_axis])[coordinate[mesh_axis]]
        if not torch.equal(held, expected):
            raise ShardingError(
                f"{tv.name} axis {axis} is sharded over several mesh axes in an order DTensor "
                f"cannot express ({[str(p) for p in wanted]} nest in mesh order); split it by "
                "the outermost mesh axis first"
            )


def _chain_extents(tv: TensorView, id_, n: int) -> dict:
    """Extents of ``id_`` (global extent ``n``) and of the IDs split from it."""
    extents = {id_: n}
    for t in tv.transforms:
        if isinstance(t, Split) and t.in_id in extents:
            rest = extents[t.in_id] // t.factor
            extents[t.outer], extents[t.inner] = (
                (rest, t.factor) if t.inner_split else (t.factor, rest))
    return extents


# ----- execution ---------------------------------------------------------------------------
def has_dtensors(inputs: Sequence[Any]) -> bool:
    """Whether any of ``inputs`` is a DTensor."""
    return any(isinstance(x, DTensor) for x in inputs)


def execute_with_dtensors(fd, inputs: Sequence[Any], **options) -> list[DTensor | torch.Tensor]:
    """Runs ``fd`` on DTensors (and plain tensors or scalars); returns DTensors.

    Each unscheduled fusion input gets the schedule of its DTensor's placements (before the
    fusion is built, that is, on the first call); a scheduled one must lie as its DTensor
    does. Each output comes back as a DTensor on the torch mesh of the input with the same
    ranks (the same object), or on a new one with the inputs' mesh dimension names.

    Raises:
        InputError: if an input DTensor lies otherwise than its scheduled fusion input, or the
            inputs' meshes name their dimensions differently.
    """
    fd.define()

    def run(local: list) -> tuple[list, list[TensorView]]:
        outputs = fd.execute(local, **options)
        compiled = fd.compiled()
        return outputs, [compiled[tv] for tv in fd.fusion.outputs()]

    return run_on_dtensors(inputs, lambda i, x: bind_dtensor(fd, i, x), run)


def run_on_dtensors(inputs: Sequence[Any], bind: Callable[[int, DTensor], None],
                    run: Callable[[list], tuple[Sequence[torch.Tensor], Sequence[TensorView]]]
                    ) -> list[DTensor | torch.Tensor]:
    """``run`` on the local shards of ``inputs``, its outputs wrapped as DTensors.

    Each DTensor input (a ``Partial`` one reduced first, by DTensor) is passed to
    ``bind(position, dtensor)`` (which schedules or checks the fusion input), then replaced
    by its local shard, through DTensor's differentiable ``to_local``; ``run(local)`` returns
    this rank's outputs and the compiled output TensorViews whose schedules give the
    outputs' placements. Outputs are made DTensors with the differentiable ``from_local``,
    so gradients flow between DTensors and a fusion run under torch autograd.
    """
    names = _common_dim_names(inputs)
    meshes: dict[DeviceMesh, TorchDeviceMesh] = {}
    local = []
    for i, x in enumerate(inputs):
        if isinstance(x, DTensor):
            x = _reduce_partials(x)
            meshes.setdefault(mesh_from_torch(x.device_mesh), x.device_mesh)
            bind(i, x)
            # without a gradient to pass back: no autograd node (a model's rotary tables,
            # masks and token ids, at every layer's call)
            x = x.to_local() if x.requires_grad and torch.is_grad_enabled() else x._local_tensor
        local.append(x)
    outputs, tvs = run(local)
    device_type = next(iter(meshes.values())).device_type if meshes else None
    return [_wrap(tv, out.local if hasattr(out, "local") else out, meshes, device_type, names)
            for tv, out in zip(tvs, outputs)]


def bind_dtensor(fd, position: int, x: DTensor) -> None:
    """Schedules input ``position`` of ``fd`` as ``x`` lies (unscheduled and not yet built),
    or checks that it lies so."""
    tv = fd.fusion.inputs()[position]
    if isinstance(tv, TensorView):
        _bind_schedule(fd, tv, x)
        _check_learnable_extents(tv, x)


def schedule_like_dtensor(tv: TensorView, x: DTensor) -> None:
    """Schedules the unscheduled input ``tv`` as ``x`` lies (see
    :func:`schedule_from_placements`), refusing an uneven shard of a symbolic axis."""
    schedule_from_placements(tv, mesh_from_torch(x.device_mesh), x.placements)
    _check_learnable_extents(tv, x)


def check_dtensor_input(tv: TensorView, x: DTensor) -> None:
    """Raises an InputError unless ``tv`` (a compiled fusion input) lies as ``x`` does (a
    layout found right once is remembered: every layer of a model checks a dozen inputs
    at each call)."""
    layout = (x.device_mesh, x.placements)
    passed = _PASSED.get(tv)
    if passed is not None and layout in passed:
        return
    mesh = mesh_from_torch(x.device_mesh)
    if tv.mesh == mesh and to_placements(tv) == tuple(x.placements):
        _PASSED.setdefault(tv, set()).add(layout)
        return
    have = "no schedule" if tv.mesh is None else f"{list(to_placements(tv))} on {tv.mesh!r}"
    raise InputError(
        f"input {tv.name} is scheduled as {have}, but its DTensor is {list(x.placements)} on "
        f"{mesh!r}; pass DTensors laid out like the first ones, or define a new fusion for "
        "this layout"
    )


def _common_dim_names(inputs: Sequence[Any]) -> tuple[str, ...] | None:
    names = {x.device_mesh.mesh_dim_names for x in inputs if isinstance(x, DTensor)}
    if len(names) > 1:
        raise InputError(
            f"the input DTensors' meshes name their dimensions differently ({sorted(map(str, names))}); "
            "use one naming, as the outputs get one"
        )
    return next(iter(names), None)


def _reduce_partials(x: DTensor) -> DTensor:
    if not any(p.is_partial() for p in x.placements):
        return x
    replicated = [dt.Replicate() if p.is_partial() else p for p in x.placements]
    return x.redistribute(x.device_mesh, replicated)


def _bind_schedule(fd, tv: TensorView, x: DTensor) -> None:
    mesh = mesh_from_torch(x.device_mesh)
    if not tv.is_scheduled and not fd.built:
        schedule_from_placements(tv, mesh, x.placements)
        return
    if fd.built:
        tv = fd.compiled()[tv]  # as compiled: propagation may have scheduled it
    check_dtensor_input(tv, x)


def _check_learnable_extents(tv: TensorView, x: DTensor) -> None:
    """A symbolic axis is learnt from this rank's shard as if shards were even: an uneven
    Shard of one must be declared static (InputError on every rank, before any runs)."""
    for mesh_axis, p in enumerate(x.placements):
        if not isinstance(p, dt.Shard):
            continue
        id_ = tv.materialized()[p.dim]
        parts = x.device_mesh.size(mesh_axis)
        if id_.extent is None and x.shape[p.dim] % parts:
            raise InputError(
                f"input {tv.name} axis {p.dim} is declared symbolic (-1) but its DTensor "
                f"shards {x.shape[p.dim]} over {parts} ranks unevenly, which a shard alone "
                f"does not tell; declare that axis with its extent {x.shape[p.dim]} in "
                "define_tensor"
            )


# compiled fusion inputs -> the (torch mesh, placements) of DTensors found laid out as they are
_PASSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# compiled fusion outputs -> what makes a local output of theirs a DTensor (see _wrap)
_WRAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _wrap(tv: TensorView, local: torch.Tensor, meshes: dict[DeviceMesh, TorchDeviceMesh],
          device_type: str | None, names: tuple[str, ...] | None) -> DTensor | torch.Tensor:
    """The DTensor of output ``tv`` whose local shard is ``local``; its torch mesh, placements,
    global shape and strides are found once per output, local shape and input meshes."""
    if tv.mesh is None:
        return local
    given = meshes.get(tv.mesh)
    key = (tuple(local.shape), local.dtype, given, device_type, names)
    known = _WRAPS.get(tv)
    if known is None:
        known = _WRAPS[tv] = {}
    found = known.get(key)
    if found is None:
        found = known[key] = _wrapping(tv, local, given, device_type, names)
    torch_mesh, placements, shape, stride = found
    return DTensor.from_local(local, torch_mesh, placements, run_check=False, shape=shape,
                              stride=stride)


def _wrapping(tv: TensorView, local: torch.Tensor, torch_mesh: TorchDeviceMesh | None,
              device_type: str | None, names: tuple[str, ...] | None) -> tuple:
    """``(torch mesh, placements, global shape, global strides)`` of ``tv``'s DTensor
    whose local shard is laid out as ``local`` (``torch_mesh``: an input's on ``tv``'s mesh,
    else one made)."""
    placements = to_placements(tv)
    rank = dist.get_rank() if dist.is_initialized() else 0
    _check_like_dtensor(tv, local, rank)
    if torch_mesh is None:
        dim_names = names if names is not None and len(names) == tv.mesh.ndim else None
        torch_mesh = mesh_to_torch(tv.mesh, device_type, dim_names)
    # The global shape: a static extent as defined (uneven shards), else the even shards'.
    shape = tuple(id_.extent if id_.extent is not None else n * shard_factor(tv, id_)
                  for id_, n in zip(tv.materialized(), local.shape))
    stride = torch.empty(shape, device="meta").stride()
    return torch_mesh, placements, shape, stride
