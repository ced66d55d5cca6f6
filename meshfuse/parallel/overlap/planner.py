"""What the engine overlaps in one compiled fusion (docs/overlap.md): the stream-parallel loops
the user scheduled, and the communications next to GEMMs that the engine may run as loops,
chosen per input signature by their cost estimate (:mod:`meshfuse.parallel.overlap.cost`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from meshfuse.ir.fusion import Fusion
from meshfuse.ir.iter_domain import IterDomain
from meshfuse.parallel.overlap.candidates import OverlapCandidate, overlap_candidates
from meshfuse.parallel.overlap.cost import candidate_lines, choose_loops
from meshfuse.parallel.overlap.stream_loop import STREAM_LOOP
from meshfuse.parallel.overlap.stream_loop_lowering import choose_transport, stream_loop_lines
from meshfuse.parallel.overlap.stream_parallel import StreamLoopPlan, plan_stream_loops
from meshfuse.runtime.interpreter.executor import Program


@dataclasses.dataclass
class OverlapPlan:
    """The loops of one compiled fusion.

    Attributes:
        stream_loops: the user's stream-parallel loops (``ParallelType.Stream``).
        candidates: communications next to a GEMM, with the user's choice for each.
        decided: per input signature, explain's lines on the engine's choice.
    """

    stream_loops: list[StreamLoopPlan]
    candidates: list[OverlapCandidate]
    decided: dict[tuple, list[str]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, fusion: Fusion) -> OverlapPlan:
        loops = plan_stream_loops(fusion)
        return cls(loops, overlap_candidates(fusion, loops))

    def loops_for(self, signature: tuple, extents: Mapping[IterDomain, int],
                  device: torch.device, transport: str) -> list:
        """The loops a program of ``signature`` runs: the user's, then the candidates the
        estimate picks for these ``extents`` on ``device`` (``transport``: the runner's
        setting for decomposed communications)."""
        chosen_transport, _ = choose_transport(transport, device, [], symmetric=False)
        plans, lines = choose_loops(self.candidates, extents, device.type, chosen_transport)
        self.decided[signature] = lines
        return [*self.stream_loops, *plans]

    def explain_lines(self, signature: tuple | None, ring_order: bool,
                      program: Program | None) -> list[str]:
        """explain's lines on stream-parallel loops: the user's, then the engine's choice for
        each communication next to a GEMM (for ``signature``, when given), then the
        transports of ``program``'s loops."""
        lines = []
        if self.stream_loops:
            lines += ["stream-parallel loops:", *stream_loop_lines(self.stream_loops, ring_order)]
        if self.candidates:
            decided = self.decided.get(signature) if signature is not None else None
            lines += ["communications next to GEMMs (overlap):",
                      *(decided or candidate_lines(self.candidates))]
        transports = [step.plan[0].transport_line() for step in program.steps
                      if step.op == STREAM_LOOP] if program is not None else []
        if any(transports):
            lines += ["stream loop transports on this rank:",
                      *(f"  {line}" for line in transports if line)]
        return lines
