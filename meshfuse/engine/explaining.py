"""``fd.explain`` where no runner answers: a multi-rank plan previewed from one process
(``fd.explain(world_size=N)``), and what can be shown of a fusion whose build fails.

A preview compiles the fusion for ``world_size`` ranks (the same build every rank makes) and
explains it as ``rank`` would, from the definition's extents, without starting a rank or
creating a process group: the placements, local shapes and communications are what
``fd.explain()`` prints on that rank of a real run.

A failed build (propagation or a check refusing the schedule) is replayed pass by pass on a
private copy up to the pass that fails, and :func:`meshfuse.explain.explain_unbuilt` prints
the tensors as that pass left them, with the reason.
"""

from __future__ import annotations

from meshfuse.errors import DefinitionError, InputError, ScheduleError, ShardingError
from meshfuse.explain import explain, explain_unbuilt
from meshfuse.ir.fusion import Fusion
from meshfuse.ir.printer import format_fusion
from meshfuse.parallel.overlap import OverlapPlan
from meshfuse.passes.pipeline import BUILD_PASSES, compiled_for
from meshfuse.runtime.comm import Communicator

# What a fusion that cannot be built (or a program that cannot be built for its inputs)
# raises; explain shows them instead of raising.
BUILD_FAILURES = (DefinitionError, ScheduleError, ShardingError, InputError)


def preview(fusion: Fusion, world_size: int, rank: int = 0, verbose: bool = False) -> str:
    """``fd.explain()`` as ``rank`` of ``world_size`` ranks would print it, from this one
    process (extents from the definition); a build that fails is shown as
    :func:`unbuilt` shows it."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InputError(f"explain: world_size={world_size!r}; give the number of ranks "
                         "to preview, a positive int")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InputError(f"explain: rank={rank!r} is not a rank of {world_size}; give one in "
                         f"[0, {world_size - 1}]")
    try:
        compiled = compiled_for(fusion, world_size)
    except BUILD_FAILURES as error:
        return unbuilt(fusion, error, world_size, rank)
    text = explain(compiled.fusion, compiled.allocations, rank, world_size)
    lines = [text, *OverlapPlan.of(compiled.fusion).explain_lines(None, False, None)]
    if verbose:
        lines.append(format_fusion(compiled.fusion, compiled.allocations))
    return "\n".join(lines)


def unbuilt(fusion: Fusion, error: Exception, world_size: int | None = None,
            rank: int | None = None) -> str:
    """The tensors of ``fusion`` as its build left them when it raised ``error``, and the
    reason. ``world_size`` and ``rank``: the build's (default: this process's)."""
    if world_size is None:
        here = Communicator.instance() if any(tv.mesh is not None for tv in fusion.tensors()) \
            else None
        world_size, rank = (here.size, here.rank) if here is not None else (1, 0)
    copy, _ = fusion.copy()
    stage = "before its first pass"
    for run in BUILD_PASSES:
        try:
            run(copy, world_size)
        except BUILD_FAILURES:
            stage = f"stopped in its {run.__name__.strip('_')} pass"
            break
        stage = f"after its {run.__name__.strip('_')} pass"
    return explain_unbuilt(copy, rank or 0, world_size, stage, error)
