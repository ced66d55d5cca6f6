"""Splits of a merged axis that miss the boundaries of the heads a reshape makes of it.

A projection's output ``[..., H*D]`` split over ranks and reshaped into ``[..., H, D]``
keeps its sharding only where each rank's block of rows is whole heads (the ranks divide
``H``): 8 heads of 4 over 3 ranks split the 32 rows 11, 11, 10, so rank 0 would hold two
heads and three rows of a third. Resharding then gathers the rows before the reshape, and
everything after it runs on every head on every rank: correct, but the head parallelism is
lost (3 extra allgathers in a Llama block). Nothing can be chosen for the user here: the
split is theirs (a pinned weight's rows), and a head-aligned split of the same tensor is
another sharding of their inputs. So the build reports it, once per build, as a warning
and in ``explain``, naming the tensor and the aligned alternatives (a weight ``[H, D, E]``
with its first axis sharded, given to ``linear``, whose rows then split by whole heads; or
a number of ranks that divides ``H``).
"""

from __future__ import annotations

from meshfuse.ir.fusion import Fusion, Reshard
from meshfuse.ir.layout import shard_factor
from meshfuse.ir.placement import Replicate, Shard, placements


class HeadSplitWarning(UserWarning):
    """A split of a merged ``[H*D]`` axis that does not fall on the heads a reshape makes
    of it (the rows are gathered before the reshape)."""


def unaligned_head_splits(fusion: Fusion) -> list[str]:
    """One line for each communication of the compiled ``fusion`` that gathers a split axis
    because the split misses the head boundaries of the reshape reading it."""
    uses = fusion.uses()
    notes = []
    for e in fusion.exprs:
        if not isinstance(e, Reshard):
            continue
        src, dst = e.args[0], e.outputs[0]
        for before, after in zip(placements(src), placements(dst)):
            if not isinstance(before, Shard) or not isinstance(after, Replicate):
                continue
            for reshape in uses.get(dst, []):
                note = _note(src, dst, before.axis, reshape)
                if note is not None and note not in notes:
                    notes.append(note)
    return notes


def _note(src, dst, axis: int, reshape) -> str | None:
    """The line for ``src``'s axis ``axis``, gathered into ``dst`` before ``reshape``, or
    None when ``reshape`` does not split it into heads or the split is aligned with them."""
    if reshape.op is None or reshape.op.name != "reshape":
        return None
    merged = dst.materialized()[axis]
    (out,) = reshape.tensor_outputs
    # a reshape maps the outer piece of a split axis from it (the heads), not the inner
    outer = [i for i in out.logical if merged in reshape.id_map.get(i, ())]
    extent = src.materialized()[axis].extent
    if len(outer) != 1 or extent is None or outer[0].extent in (None, extent) or \
            extent % outer[0].extent:
        return None
    heads, head_size = outer[0].extent, extent // outer[0].extent
    ranks = shard_factor(src, src.materialized()[axis])
    block = -(-extent // ranks)
    if block % head_size == 0:
        return None
    rows = [max(0, min(block, extent - r * block)) for r in range(ranks)]
    return (f"{src.name} axis {axis} ({extent} = {heads} x {head_size}) is split over {ranks} "
            f"ranks as {', '.join(map(str, rows))} rows, not on the boundaries of the "
            f"{heads} heads of {head_size} that {out.name} = reshape({dst.name}) makes of "
            f"it: it is gathered whole before the reshape, and what follows runs on every "
            f"head. Split by heads instead: a weight [{heads}, {head_size}, ...] sharded on "
            f"its first axis (linear takes it, its output's heads first), or a number of "
            f"ranks that divides {heads}")
