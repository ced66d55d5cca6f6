"""``explain()`` of a parallelized module: the captured program as text."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from meshfuse.capture.partition import Segment
from meshfuse.capture.program import Program, break_lines
from meshfuse.capture.trace import module_path

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
    for step in program.partition.steps:
        lines.append("")
        if isinstance(step, Segment):
            modules = _modules(step)
            lines.append(f"fusion {step.index}: {len(step.nodes)} ops over "
                         f"{', '.join(modules) or 'the top module'}")
            lines.append(program.segments[step.index].fd.explain())
        else:
            lines.append(f"graph break: {break_lines([step])[0]}")
    return "\n".join(lines)


def _modules(segment: Segment) -> list[str]:
    """The module paths of the segment's nodes, in first-seen order, repeated layers folded
    (``model.layers.{0..31}``)."""
    seen: dict[str, None] = {}
    for node in segment.nodes:
        path = module_path(node)
        if path:
            seen.setdefault(_layer(path), None)
    return list(seen)


def _layer(path: str) -> str:
    """``model.layers.3.mlp.up_proj`` as ``model.layers.3``: the repeated block a node is in."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]
