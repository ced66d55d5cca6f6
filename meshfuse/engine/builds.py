"""The builds a runner runs: the fusion's own, or one per set of bound extents.

A fusion whose extents are all static is built once (:func:`~meshfuse.passes.pipeline.compiled_for`)
and every input signature runs that build. A fusion with symbolic extents is built once
too (what ``shard_tensor`` and ``fd.explain()`` without inputs read: the shardings the inputs
are laid out by), but what that build could not decide without the extents (the
communications each op needs, the checks of its schedules) is decided again for each set
of extents the inputs bind (:func:`~meshfuse.passes.pipeline.concretize`), kept per set: two
signatures of one set of global extents (other strides, another device) share it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.tensor_view import Allocation, TensorView
from meshfuse.parallel.overlap import OverlapPlan
from meshfuse.passes.concrete import has_symbolic_ids
from meshfuse.passes.pipeline import CompiledFusion, concretize


@dataclasses.dataclass(frozen=True, eq=False)
class Build:
    """One build a program is made from, and the stream loops planned on it."""

    compiled: CompiledFusion
    overlap: OverlapPlan

    @property
    def fusion(self):
        return self.compiled.fusion

    @property
    def allocations(self) -> dict[TensorView, Allocation]:
        return self.compiled.allocations

    @classmethod
    def of(cls, compiled: CompiledFusion) -> Build:
        return cls(compiled, OverlapPlan.of(compiled.fusion))


class Builds:
    """The fusion's build (``base``) and, for a fusion with symbolic extents, its builds
    for the extents bound so far (see the module doc)."""

    def __init__(self, compiled: CompiledFusion):
        self.base = Build.of(compiled)
        self.symbolic = has_symbolic_ids(compiled.fusion)
        # Every ID of unknown extent: the key of a set of bound extents.
        self._ids: tuple[IterDomain, ...] = tuple(dict.fromkeys(
            i for tv in compiled.fusion.tensors() for i in _ids_of(tv) if i.extent is None))
        self._by_extents: dict[tuple, Build] = {}

    def for_extents(self, extents: Mapping[IterDomain, int]) -> Build:
        """The build to run for bound ``extents`` (of every ID of the base build)."""
        if not self.symbolic:
            return self.base
        key = tuple(extents[i] for i in self._ids)
        build = self._by_extents.get(key)
        if build is None:
            build = self._by_extents[key] = Build.of(concretize(self.base.compiled, extents))
        return build


def _ids_of(tv: TensorView):
    yield from tv.logical
    for t in tv.transforms:
        yield from t.outputs
