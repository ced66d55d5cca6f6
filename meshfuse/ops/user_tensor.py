"""The TensorViews the frontend hands out, with nvFuser's ``rfactor``.

``tv.rfactor(axes)`` (and ``fd.sched.rfactor(tv, dims)``) splits the reduction that defines
``tv`` in two, as nvFuser does: a new tensor ``local`` computes the reduction over the loop
axes in ``axes`` only, and ``tv`` becomes a copy of ``local`` that reduces the rest. In
meshfuse a reduction loop axis that ``local`` parallelizes on a mesh axis makes ``local``
a partial result, and ``tv`` (not parallelized there) the reduced one: the copy is the
allreduce (or reduce-scatter) that nvFuser's decomposition makes explicit::

    out.outer_split(-1, d)                 # out: [i{M}, i{N}, r{d}, r{K/d}]
    local = out.rfactor(axes=[-1])         # local: the same domain, defined by the matmul
    local.axis(-2).parallelize(ParallelType.mesh_x)   # local partial over d; out = set(local)

``out`` loses its reduction axes and its splits (they described the decomposition): its
loop domain is its logical one again, unscheduled (propagation gives it ``local``'s mesh;
schedule it after ``rfactor`` to reduce-scatter instead).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshfuse.errors import ScheduleError
from meshfuse.ir.fusion import Expr
from meshfuse.ir.iter_domain import IterDomain, Split, merge_ids, split_ids
from meshfuse.ir.tensor_view import TensorView
from meshfuse.ops.registry import lookup


class UserTensorView(TensorView):
    """A TensorView made by ``define_tensor`` or ``fd.ops``: the IR tensor, plus the
    schedule calls that add expressions to its fusion."""

    def rfactor(self, axes: Sequence[int] | int) -> TensorView:
        """Splits the reduction defining this tensor: returns the new tensor that reduces
        loop axes ``axes`` (see the module doc); this tensor becomes its copy.

        Raises:
            ScheduleError: if this tensor is not defined by an op or an axis is not a
                reduction loop axis.
        """
        return rfactor(self, [axes] if isinstance(axes, int) else list(axes))


def rfactor(tv: TensorView, axes: list[int]) -> TensorView:
    """See :meth:`UserTensorView.rfactor`."""
    expr = tv.definition
    if expr is None:
        raise ScheduleError(
            f"rfactor of {tv.name}: it is an input of the fusion; rfactor splits the op that "
            "defines a tensor"
        )
    for axis in axes:
        if not tv.axis(axis).is_reduction():
            raise ScheduleError(
                f"rfactor of {tv.name}: loop axis {axis} ({tv.axis(axis)!r}) is not a reduction "
                "axis; name reduction axes of its loop domain"
            )
    if any(pt.is_device for pt in tv.parallel.values()):
        raise ScheduleError(
            f"rfactor of {tv.name}: it has an axis parallelized on the mesh; rfactor first, "
            "then schedule the copy (its loop domain is its logical one again)"
        )
    ids = {i: i.like() for i in tv.logical}
    local = UserTensorView(tv.fusion, [ids[i] for i in tv.logical], tv.dtype)
    local.transforms = [_replay(t, ids) for t in tv.transforms]
    local.loop = [ids[i] for i in tv.loop]
    local.mesh = tv.mesh
    local.parallel = {ids[i]: pt for i, pt in tv.parallel.items()}
    tv.fusion.name(local)
    expr.outputs = tuple(local if o is tv else o for o in expr.outputs)
    expr.id_map = {ids.get(k, k): v for k, v in expr.id_map.items()}
    local.definition = expr
    # tv becomes the reduced copy: its reduction IDs are local's now, and its splits only
    # described the decomposition (nvFuser's out = [M, N, r{d}]); left unscheduled, it gets
    # its mesh from local, and the copy of a partial local is its reduction.
    tv.logical = tv.materialized()
    tv.transforms, tv.loop, tv.parallel = [], list(tv.logical), {}
    copy = Expr(lookup("set"), (local,), (tv,), {}, {i: (ids[i],) for i in tv.logical})
    tv.fusion.add_expr(copy, position=tv.fusion.exprs.index(expr) + 1)
    return local


def _replay(t, ids: dict[IterDomain, IterDomain]):
    """Transform ``t`` applied to the images of its inputs; records the new IDs in ``ids``."""
    if isinstance(t, Split):
        new = split_ids(ids[t.in_id], t.factor, t.inner_split, t.zigzag)
        ids[t.outer], ids[t.inner] = new.outer, new.inner
        return new
    new = merge_ids(ids[t.outer], ids[t.inner])
    ids[t.out] = new.out
    return new

