"""Copying a tensor's schedule onto another tensor of the same shape (in another fusion).

The derivation pins the tensors of the fusions it builds to schedules it reads elsewhere: the
clone of a user's fusion gets the user's pins, a gradient gets its primal's sharding, a
cotangent its output's, a residual the sharding it had in the forward. A schedule is replayed,
not shared: the splits and merges of the source's materialized logical IDs are applied to the
target's, the device IDs parallelized alike, and the allocation domain mapped.
"""

from __future__ import annotations

from meshfuse.ir.iter_domain import IterDomain, Split
from meshfuse.ir.tensor_view import Allocation, TensorView


def copy_schedule(src: TensorView, dst: TensorView, allocation: Allocation | None = None) -> None:
    """Gives ``dst`` ``src``'s mesh, splits, merges, device parallelization and loop order,
    and the allocation ``allocation`` (default ``src.allocation``) over ``dst``'s IDs.

    ``dst`` must be unscheduled and have as many materialized axes as ``src``, of equal
    extents. Where ``dst`` has ``src``'s reduction IDs too (the clone of a reduction), their
    transforms are replayed as well: a result pinned partial (its reduction axis
    parallelized) stays partial; else they are not (``dst`` has none).
    """
    assert len(src.materialized()) == len(dst.materialized()), (src, dst)
    if [i.is_reduction for i in src.logical] == [i.is_reduction for i in dst.logical]:
        ids: dict[IterDomain, IterDomain] = dict(zip(src.logical, dst.logical))
    else:
        ids = dict(zip(src.materialized(), dst.materialized()))
    if src.mesh is not None:
        dst.set_device_mesh(src.mesh)
    for t in src.transforms:
        if isinstance(t, Split):
            if t.in_id not in ids:
                continue
            dst.split(dst.loop.index(ids[t.in_id]), t.factor, t.inner_split, t.zigzag)
            record = dst.transforms[-1]
            ids[t.outer], ids[t.inner] = record.outer, record.inner
        elif t.outer in ids and t.inner in ids:
            outer = dst.loop.index(ids[t.outer])
            dst.reorder({dst.loop.index(ids[t.inner]): outer + 1})
            dst.merge(dst.loop.index(ids[t.outer]))
            ids[t.out] = dst.transforms[-1].out
    order = [ids[i] for i in src.loop if i in ids and ids[i] in dst.loop]
    if len(order) == len(dst.loop):
        dst.loop = order
    for id_, pt in src.parallel.items():
        if pt.is_device and id_ in ids and ids[id_] in dst.loop:
            dst.parallelize(dst.loop.index(ids[id_]), pt)
    allocation = allocation if allocation is not None else src.allocation
    if allocation is not None and all(i in ids for i in allocation.ids):
        dst.allocation = Allocation(tuple(ids[i] for i in allocation.ids), allocation.contiguity)

