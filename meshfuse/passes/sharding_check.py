"""Finds compute ops whose inputs and outputs are still sharded differently.

Runs per input signature, after ``insert_resharding`` made every compute op local as far as
the schedules show, with the bound extents: what the pass could not turn into a ``set`` (an
op's own sharding limits, owners that differ only with concrete extents) is an error raised
before anything runs, naming the op, the tensors, the axis and both shardings. An axis's
sharding is compared as its *owner map*: for each device parallel type, the mesh coordinate
that holds each global index.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshfuse.errors import ShardingError
from meshfuse.ir.fusion import Expr, Fusion, Reshard
from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.layout import device_ids, split_indices
from meshfuse.ir.placement import reduction_complete, shard_signature
from meshfuse.ir.printer import format_expr
from meshfuse.ir.tensor_view import TensorView
from meshfuse.ops.attention.sequence import sequence_parallel

OwnerMap = dict[str, tuple[int, ...]]


def owner_map(tv: TensorView, logical_id: IterDomain, extents: Mapping[IterDomain, int]) -> OwnerMap:
    """For each device parallel type sharding ``logical_id``: the owner of each index."""
    shards = device_ids(tv).get(logical_id, [])
    if not shards:
        return {}
    index = split_indices(tv, logical_id, extents)
    return {pt.value: tuple(index[id_].tolist()) for id_, pt in shards}


def same_owners(a: OwnerMap, b: OwnerMap) -> bool:
    """Whether two axes, of equal extents or one a multiple of the other (a reshape's split
    or merge), are owned alike: index ``i`` of the shorter axis and the ``k`` indices of the
    longer one it stands for have one owner."""
    if a.keys() != b.keys():
        return False
    for pt in a:
        short, long_ = sorted((a[pt], b[pt]), key=len)
        if not short or len(long_) % len(short):
            return False
        k = len(long_) // len(short)
        if any(long_[i] != short[i // k] for i in range(len(long_))):
            return False
    return True


def _unrelated(a: OwnerMap, b: OwnerMap) -> bool:
    """Whether two sharded axes have extents neither of which is a multiple of the other."""
    lengths = {len(o) for o in (*a.values(), *b.values())}
    return len(lengths) == 2 and max(lengths) % min(lengths) != 0


def describe(owners: OwnerMap) -> str:
    if not owners:
        return "replicated"
    return ", ".join(f"{pt} (owners {list(o[:8])}{'...' if len(o) > 8 else ''})"
                     for pt, o in sorted(owners.items()))


def check_no_resharding(fusion: Fusion, extents: Mapping[IterDomain, int]) -> None:
    """Raises ShardingError for the first compute op (not a communication) that would need a
    communication, or whose implementation cannot handle its sharding."""
    for expr in fusion.exprs:
        if isinstance(expr, Reshard):
            continue
        _check_expr(expr, extents)
        if expr.op.whole_axes is not None:
            _check_whole(expr, expr.op.whole_axes(expr))
        if expr.op.check_sharding is not None:
            expr.op.check_sharding(expr)
        if expr.op.partial_reduce is None:
            for out in expr.tensor_outputs:
                _check_not_partial(expr, out)


def _check_whole(expr: Expr, whole: set[IterDomain]) -> None:
    """The axes the op computes on whole are whole (resharding gathers them)."""
    for tv in expr.tensor_inputs:
        for axis, id_ in enumerate(tv.logical):
            if id_ in whole and device_ids(tv).get(id_):
                raise ShardingError(
                    f"{format_expr(expr)}: axis {axis} of {tv.name} is sharded but "
                    f"{expr.op.name} needs it whole; gather it first (fd.ops.set to a tensor "
                    "without that split)"
                )


def _check_not_partial(expr: Expr, tv: TensorView) -> None:
    for id_, pt in tv.parallel.items():
        if pt.is_device and id_.is_reduction:
            raise ShardingError(
                f"{format_expr(expr)}: {tv.name} would be a partial result (it reduces over an "
                f"axis sharded on {pt.value}), which {expr.op.name} cannot produce; do not "
                f"parallelize the reduction axes of {tv.name}"
            )


def _check_expr(expr: Expr, extents) -> None:
    inputs = list(expr.tensor_inputs)
    outputs = list(expr.tensor_outputs)
    meshes = {t.mesh for t in inputs + outputs}
    if len(meshes) > 1:
        raise ShardingError(
            f"{format_expr(expr)}: its tensors live on different meshes "
            f"({', '.join(f'{t.name}: {t.mesh!r}' for t in inputs + outputs)}); moving tensors "
            "between meshes is not supported yet"
        )
    mapped_inputs: set[IterDomain] = set()
    for out in outputs:
        for axis, out_id in enumerate(out.logical):
            sources = expr.id_map.get(out_id, ())
            mapped_inputs.update(sources)
            # A broadcast output axis comes from broadcast input axes (nvFuser parallelizes
            # them over a mesh axis of one device); any other axis from real ones.
            real = [s for s in sources if not s.is_broadcast or out_id.is_broadcast]
            # (a partial sum of the op's own, OpDef.own_partials, comes from no input axis)
            own = out_id.is_reduction and expr.op.own_partials is not None
            if not real and not own and device_ids(out).get(out_id):
                raise ShardingError(
                    f"{format_expr(expr)}: axis {axis} of {out.name} is sharded "
                    f"({describe(owner_map(out, out_id, extents))}) but is not mapped from any "
                    "input axis; shard an input instead"
                )
            for src in real:
                _check_mapped(expr, _owner_of(src, inputs), src, out, out_id, axis, extents)
    for tv in inputs:
        for axis, id_ in enumerate(tv.logical):
            if id_ not in mapped_inputs and not reduction_complete(tv, id_) and \
                    device_ids(tv).get(id_):
                raise ShardingError(
                    f"{format_expr(expr)}: axis {axis} of {tv.name} is sharded but the op does "
                    "not map it to an output axis (a slice, concatenation or reshape of a "
                    "sharded axis); shard another axis"
                )


def _check_mapped(expr: Expr, tv: TensorView, src: IterDomain, out: TensorView,
                  out_id: IterDomain, axis: int, extents) -> None:
    """Input axis ``src`` of ``tv`` and the output axis ``out_id`` it maps to are owned
    alike (index by index: an owner map is as long as the axis, so two axes of one extent
    split alike are taken as owned alike without one)."""
    device_ids(out), device_ids(tv)  # a device axis from a merge is an error, as owner_map's
    alike = shard_signature(tv, src) == shard_signature(out, out_id)
    if alike and extents.get(src) == extents.get(out_id) and extents.get(src):
        return  # (same_owners finds two empty axes unlike)
    src_owners, out_owners = owner_map(tv, src, extents), owner_map(out, out_id, extents)
    # Partial sums over axes of any lengths add up when they are partial over the same mesh
    # axes (which indices each rank summed does not matter to the sum of all ranks).
    if src.is_reduction and out_id.is_reduction and src_owners.keys() == out_owners.keys():
        return
    # A context-parallel attention maps its key sequence onto its query sequence (the rows
    # of one position), of another length in cross attention: those must be split alike,
    # index by index they cannot be compared.
    if sequence_parallel(expr) is not None and _unrelated(src_owners, out_owners) and alike:
        return
    if not same_owners(src_owners, out_owners):
        what = "reduced" if out_id.is_reduction else f"axis {axis} of {out.name}"
        raise ShardingError(
            f"{format_expr(expr)}: {tv.name} axis {tv.logical.index(src)} is "
            f"{describe(src_owners)} but {what} is {describe(out_owners)}; this needs a "
            "communication, which is not supported yet: schedule both alike"
        )


def _owner_of(id_: IterDomain, tensors: list[TensorView]) -> TensorView:
    for tv in tensors:
        if id_ in tv.logical:
            return tv
    raise AssertionError("a source ID belongs to no input")
