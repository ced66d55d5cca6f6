"""Where the engine may cut a GEMM and the allreduce of its partial result into a loop of
row chunks.

A row-parallel GEMM (its contracted axis split over a mesh axis, a ``linear`` without bias
or a ``matmul`` by a 2-D matrix) makes a partial result that an allreduce (``P -> R``) then
sums. The allreduce needs the whole GEMM, so it runs after it, exposed unless later work
hides it. Cut along the rows (every axis of the GEMM's first operand but the contracted
one, flattened: the tokens of a layer), the pair becomes a loop: chunk ``i``'s GEMM writes
its block of the result, then chunk ``i``'s allreduce is launched in place on that block
and runs while chunk ``i + 1``'s GEMM does; only the last chunk's allreduce is left after
the GEMMs. Unlike the allgather and reduce-scatter loops (:mod:`meshfuse.passes.
overlap_candidates`) any chunk count works: every device holds every row.

:func:`gemm_allreduce` finds the pattern at one communication (``overlap_candidates`` lists
it beside the two sequence-parallel ones); the runtime decides per input signature whether
it pays and with how many chunks (:mod:`meshfuse.parallel.overlap.allreduce_loop`).
"""

from __future__ import annotations

import dataclasses

from meshfuse.ir.fusion import Expr, Reshard
from meshfuse.ir.placement import Partial, Replicate, placements
from meshfuse.ir.printer import format_expr
from meshfuse.ir.tensor_view import TensorView
from meshfuse.passes.localization import reads_expanded

GEMM_ALLREDUCE = "GEMM -> allreduce"


@dataclasses.dataclass(frozen=True, eq=False)
class AllreduceLoopPlan:
    """A GEMM and the allreduce of its partial result, run as a loop of ``chunks`` row
    chunks (see the module doc).

    Attributes:
        gemm, reshard: the GEMM and the allreduce (a ``Reshard`` ``P -> R``).
        chunks: the number of row chunks.
        reason: why the engine chose it (its estimate, or the user's ``set_overlap``).
    """

    gemm: Expr
    reshard: Reshard
    chunks: int
    reason: str = ""

    @property
    def exprs(self) -> tuple[Expr, ...]:
        return (self.gemm, self.reshard)

    def describe(self, ring: bool = False) -> str:
        """One line for explain (``ring`` is the other loops' option; rows have no order)."""
        why = f" [{self.reason}]" if self.reason else ""
        return (f"stream loop: {self.chunks} chunks of the rows of "
                f"{self.gemm.outputs[0].name}: {format_expr(self.gemm)}; "
                f"{format_expr(self.reshard)} (per chunk: an allreduce in place, launched "
                f"under the next chunk's GEMM){why}")


@dataclasses.dataclass(frozen=True, eq=False)
class AllreduceCandidate:
    """A GEMM whose partial result is only allreduced over one mesh axis of ``devices``
    devices; ``forced``: the user's ``set_overlap`` choice (None: the estimate decides)."""

    reshard: Reshard
    gemm: Expr
    mesh_axis: int
    devices: int
    forced: bool | None
    kind: str = GEMM_ALLREDUCE

    def plan(self, reason: str, chunks: int) -> AllreduceLoopPlan:
        return AllreduceLoopPlan(self.gemm, self.reshard, chunks, reason)


def gemm_allreduce(e: Reshard, uses) -> AllreduceCandidate | None:
    """The candidate whose allreduce is ``e``, or None. ``uses``: the fusion's ``uses()``."""
    src, dst = e.args[0], e.outputs[0]
    gemm = src.definition
    if src.mesh is None or src.mesh != dst.mesh or not _row_gemm(gemm) or \
            len(uses.get(src, [])) != 1:
        return None
    changed = [(m, a, b) for m, (a, b) in enumerate(zip(placements(src), placements(dst)))
               if a != b]
    if len(changed) != 1:
        return None
    m, before, after = changed[0]
    if not isinstance(before, Partial) or not isinstance(after, Replicate):
        return None
    return AllreduceCandidate(e, gemm, m, src.mesh.shape[m], overlap_choice(e, gemm))


def _row_gemm(gemm: Expr | None) -> bool:
    """A GEMM that computes its rows independently from a 2-D right operand: a ``linear``
    without bias or a ``matmul``, its first operand of two or more axes, none of them an
    expanded broadcast (whose implementation needs the whole output's local shape)."""
    if gemm is None or gemm.op is None or gemm.op.name not in ("linear", "matmul") or \
            reads_expanded(gemm):
        return False
    a, b = gemm.args[0], gemm.args[1]
    if not isinstance(a, TensorView) or not isinstance(b, TensorView):
        return False
    no_bias = gemm.op.name == "matmul" or len(gemm.args) < 3 or gemm.args[2] is None
    return no_bias and a.ndim >= 2 and b.ndim == 2


def overlap_choice(*exprs: Expr) -> bool | None:
    """The user's ``set_overlap`` choice on any tensor of ``exprs``: False wins over True,
    None when no tensor has one."""
    flags = {t.overlap for e in exprs for t in (*e.tensor_inputs, *e.tensor_outputs)} - {None}
    return False if False in flags else (True if flags else None)
