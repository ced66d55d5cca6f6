"""Projection: the planner's best plan and its step time and MFU on a cluster this machine is
not, from the same cost model with the cluster's links as parameters.

A cluster of ``gpus`` in nodes of ``gpus_per_node`` is searched as meshes ``(a, b, g)``
(``a b g = gpus``, ``g`` dividing a node: the fast axis stays inside a node, the two others
cross nodes) and ``(gpus / g, g)``; every layout of each is costed, and the integer program
chooses per mesh (:func:`meshfuse.planner.search.plan`). Collectives inside a node run at
``intra_node_gb_per_s`` of bus bandwidth, those crossing nodes at ``inter_node_gb_per_s``.

``python -m meshfuse.planner.projection`` prints docs/planner.md's table.
"""

from __future__ import annotations

import dataclasses

from meshfuse.cost import CostModel, load
from meshfuse.errors import InputError
from meshfuse.planner.plan import Plan
from meshfuse.planner.search import plan
from meshfuse.planner.spec import GPT3_175B, LLAMA3_70B, LLAMA3_405B, TransformerSpec


@dataclasses.dataclass(frozen=True)
class Projection:
    """The best plan on ``gpus`` and what it predicts."""

    spec: TransformerSpec
    gpus: int
    plan: Plan

    @property
    def mfu(self) -> float:
        return self.plan.mfu

    @property
    def tokens_per_gpu_s(self) -> float:
        return self.spec.batch * self.spec.seq / self.plan.step_s / self.gpus

    def row(self) -> str:
        p = self.plan
        recompute = f", {p.recomputed_blocks}/{p.chosen.cost.blocks} recomputed" \
            if p.recomputed_blocks else ""
        return (f"| {self.spec.name} | {self.gpus} | {p.layout.describe()}{recompute} | "
                f"{p.step_s:.2f} | {self.tokens_per_gpu_s:.0f} | {self.mfu:.1%} | "
                f"{p.memory_bytes / 2**30:.0f} |")


def meshes(gpus: int, gpus_per_node: int) -> list[tuple[int, ...]]:
    """The mesh shapes searched for ``gpus`` (see the module doc)."""
    shapes = []
    for g in (n for n in (2, 4, 8, 16) if gpus_per_node % n == 0 and gpus % n == 0):
        rest = gpus // g
        shapes.append((rest, g))
        shapes += [(a, rest // a, g) for a in range(2, rest) if rest % a == 0]
    return shapes


def project(spec: TransformerSpec, gpus: int, *, intra_node_gb_per_s: float | None = None,
            inter_node_gb_per_s: float | None = None, gpus_per_node: int = 8,
            memory_budget: float = 72 * 2**30, calibration: str = "h200",
            context: bool = False, overlap: bool = False) -> Projection:
    """The best plan of ``spec`` on ``gpus`` GPUs (see the module doc); ``memory_budget``:
    bytes per GPU (default: 72 GiB of an 80 GB H100, for comparison with H100 figures);
    ``context``, ``overlap``: whether context parallelism and TP's copy-engine loops may be
    chosen (default not: the published runs used neither)."""
    cal = load(calibration).with_links(intra_node_gb_per_s, inter_node_gb_per_s,
                                       gpus_per_node)
    model = CostModel(cal)
    best = None
    for shape in meshes(gpus, gpus_per_node):
        try:
            candidate = plan(spec, shape, memory_budget, calibration=model, context=context,
                             overlap=overlap)
        except InputError:
            continue
        if best is None or candidate.step_s < best.step_s:
            best = candidate
    if best is None:
        raise InputError(f"projection: no plan of {spec.name} fits {memory_budget / 2**30:.0f} "
                         f"GiB per GPU on {gpus} GPUs")
    return Projection(spec, gpus, best)


# Global batches (sequences) of the published runs: GPT-3's 1536 of 2048 tokens (Megatron's
# weak-scaling table grows it with the GPUs; here fixed), Llama-3's 4M-token batches.
DEFAULT_RUNS = ((GPT3_175B, (64, 128, 256, 512, 1024)),
                (LLAMA3_70B, (64, 128, 256, 512, 1024)),
                (LLAMA3_405B, (128, 256, 512, 1024)))


def table(runs=DEFAULT_RUNS, **options) -> str:
    """The projection table of ``runs`` (spec, GPU counts) as markdown."""
    lines = ["| model | GPUs | plan | step s | tokens/s/GPU | MFU | GiB/GPU |",
             "|---|---|---|---|---|---|---|"]
    for spec, counts in runs:
        lines += [project(spec, n, **options).row() for n in counts]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
    print()
    print("With TP's collectives overlapped by the copy engines:")
    print(table(overlap=True))
