"""``explain()`` of a parallelized module: the captured program as text."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from meshfuse.capture.partition import Segment
from meshfuse.capture.program import Program, break_lines

__all__ = ["explain_program"]


def explain_program(program: Program, parameters: Mapping[str, torch.Tensor]) -> str:
    """Parameters and their placements, then each step in order: a fusion (the modules it
    covers, its tensors and communications from ``fd.explain()``) or a graph break (the op,
    its module path and why)."""
    head = (f"captured program: {len(program.partition.segments)} fusion(s), "
            f"{len(program.partition.breaks)} graph break(s)")
    lines = [head, "", "parameters:"]
    for name, p in parameters.items():
        where = list(p.placements) if isinstance(p, DTensor) else "plain tensor"
        lines.append(f"  {name} {list(p.shape)} {where}")
    shown: dict[tuple, int] = {}
    for step in program.partition.steps:
        lines.append("")
        if not isinstance(step, Segment):
            lines.append(f"graph break: {break_lines([step])[0]}")
            continue
        lines.append(f"fusion {step.index}: {len(step.nodes)} ops over {step.block}")
        found = program.ran.get(step.index)
        if found is None:
            lines.append("  (not run yet)")
        elif found in shown:
            lines.append(f"  the program of fusion {shown[found]} (an identical block, built "
                         "once)")
        else:
            shown[found] = step.index
            built, function = program.built[found]
            lines += [built.fd.explain(), *function.call_lines()]
    return "\n".join(lines)
