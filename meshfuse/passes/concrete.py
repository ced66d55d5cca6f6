"""A copy of a fusion with its symbolic extents made static.

A symbolic extent (``-1`` in ``define_tensor``) leaves the build passes without the facts
they decide by: which axes of an op have one extent, whether a split is even, which input
axis an op's result lines up with. Once ``execute`` has bound the extents of one input
signature, :func:`with_extents` gives a copy of the fusion in which every IterDomain of
unknown extent is replaced by a new one of its bound extent (same kind), through every
place a fusion holds IDs: each tensor's logical, loop and allocation domains, its
transforms, parallel types and swizzles, and each expression's domain map. The build
passes then run on that copy as on a program written with those extents
(:func:`meshfuse.passes.pipeline.concretize`).
"""

from __future__ import annotations

from collections.abc import Mapping

from meshfuse.ir.fusion import Fusion
from meshfuse.ir.iter_domain import IterDomain, Merge, Split, Transform
from meshfuse.ir.tensor_view import Allocation, TensorView, Val


class _Substitution:
    """Each ID of unknown extent -> its new static ID (made once, so shared IDs stay
    shared); static IDs are kept."""

    def __init__(self, extents: Mapping[IterDomain, int]):
        self.extents = extents
        self.made: dict[IterDomain, IterDomain] = {}

    def __call__(self, id_: IterDomain) -> IterDomain:
        if id_.extent is not None:
            return id_
        new = self.made.get(id_)
        if new is None:
            new = self.made[id_] = IterDomain(self.extents[id_], id_.iter_type)
        return new

    def transform(self, t: Transform) -> Transform:
        if isinstance(t, Split):
            return Split(self(t.in_id), self(t.outer), self(t.inner), t.factor, t.inner_split,
                         t.zigzag)
        assert isinstance(t, Merge)
        return Merge(self(t.outer), self(t.inner), self(t.out))

    def tensor(self, tv: TensorView) -> None:
        """Rewrites the IDs of ``tv`` (a tensor of the copy) in place."""
        tv.logical = tuple(self(i) for i in tv.logical)
        tv.loop = [self(i) for i in tv.loop]
        tv.transforms = [self.transform(t) for t in tv.transforms]
        tv.parallel = {self(i): pt for i, pt in tv.parallel.items()}
        tv.swizzles = {self(i): pt for i, pt in tv.swizzles.items()}
        if tv.allocation is not None:
            tv.allocation = Allocation(tuple(self(i) for i in tv.allocation.ids),
                                       tv.allocation.contiguity)


def has_symbolic_ids(fusion: Fusion) -> bool:
    """Whether some tensor of ``fusion`` has an axis (logical or scheduled) of unknown
    extent."""
    return any(i.extent is None for tv in fusion.tensors()
               for i in (*tv.logical, *tv.loop))


def with_extents(fusion: Fusion, extents: Mapping[IterDomain, int],
                 schedules: Mapping[TensorView, TensorView] | None = None
                 ) -> tuple[Fusion, dict[Val, Val]]:
    """A copy of ``fusion`` (:meth:`Fusion.copy`) in which every ID of unknown extent is a
    static one of ``extents[id]`` (which must hold every such ID of every tensor, as a
    binding does); and each value's counterpart in it. ``fusion`` is not changed.

    ``schedules``: tensors of ``fusion`` -> their counterparts in a build of it (over the
    same logical IDs); each of them the user left unscheduled takes its build's schedule
    (so that the copy's inputs and outputs lie as ``shard_tensor`` says they do)."""
    copy, counterparts = fusion.copy()
    for tv, like in (schedules or {}).items():
        if not tv.is_scheduled:
            _take_schedule(counterparts[tv], like)
    substitute = _Substitution(extents)
    for tv in copy.tensors():
        substitute.tensor(tv)
    for expr in copy.exprs:
        expr.id_map = {substitute(o): tuple(substitute(i) for i in ins)
                       for o, ins in expr.id_map.items()}
    copy.propagated = fusion.propagated
    copy.user_scheduled = {counterparts[tv] for tv in fusion.user_scheduled
                           if tv in counterparts}
    return copy, counterparts


def _take_schedule(tv: TensorView, like: TensorView) -> None:
    """``tv`` scheduled as ``like`` (a tensor over the same logical IDs)."""
    tv.mesh = like.mesh
    tv.loop = list(like.loop)
    tv.transforms = list(like.transforms)
    tv.parallel = dict(like.parallel)
    tv.swizzles = dict(like.swizzles)
    tv.allocation = like.allocation
