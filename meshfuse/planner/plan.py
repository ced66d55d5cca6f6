"""What :func:`meshfuse.plan` returns: the chosen layout with its predictions, the runner-up,
and the forms the rest of meshfuse takes it in.

- :meth:`Plan.parallelize_plan`: the DTensor styles ``meshfuse.parallelize`` takes (Megatron's
  TP+SP on the ``tp`` axis, by the Llama-family module names or given ones);
- :meth:`Plan.fsdp_options`: the mesh dimension names and the ``shard``/``replicate``
  options of :class:`~meshfuse.autodiff.fsdp_module.FullyShardedModule`;
- :attr:`Plan.context_parallel`: the strategy to give ``context_parallel=`` (None without);
- :attr:`Plan.loop_transport`: the stream loops' transport (copy-engine overlap or not);
- :meth:`Plan.explain`: the predictions and why the plan beat the runner-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from meshfuse.planner.estimate import LayoutCost
from meshfuse.planner.layouts import Layout
from meshfuse.planner.spec import TransformerSpec

# Module names of Megatron's layout in Hugging Face's Llama (and meshfuse's twin,
# meshfuse.examples.llama_torch): column-parallel, row-parallel, norms, head.
LLAMA_NAMES = {
    "columns": ["model.layers.*.self_attn.[qkv]_proj", "model.layers.*.mlp.gate_proj",
                "model.layers.*.mlp.up_proj"],
    "rows": ["model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj"],
    "norms": ["model.layers.*.*_layernorm", "model.norm"],
    "head": "lm_head",
}
GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A layout with its recomputed blocks and predictions."""

    cost: LayoutCost
    recomputed: int

    @property
    def layout(self) -> Layout:
        return self.cost.layout

    @property
    def step_s(self) -> float:
        return self.cost.step_s + self.recomputed * self.cost.recompute_s

    @property
    def memory_bytes(self) -> float:
        return self.cost.memory_bytes - self.recomputed * self.cost.recompute_saves

    def describe(self) -> str:
        recompute = f", {self.recomputed} of {self.cost.blocks} blocks recomputed" \
            if self.recomputed else ""
        if len(self.cost.stages) > 1:
            recompute += f", blocks per stage {list(self.cost.stages)}"
        return (f"{self.layout.describe()}{recompute}: {self.step_s * 1e3:.2f} ms/step, "
                f"{self.memory_bytes / GIB:.2f} GiB/rank")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's choice (see the module doc). ``variables``: the integer program's size;
    ``considered``: the layouts costed; ``search_s``: the search's seconds."""

    spec: TransformerSpec
    chosen: Candidate
    runner_up: Candidate | None
    budget: float | None
    calibration: str
    variables: int
    considered: int
    search_s: float
    peak_tflops: float

    @property
    def layout(self) -> Layout:
        return self.chosen.layout

    @property
    def step_s(self) -> float:
        return self.chosen.step_s

    @property
    def memory_bytes(self) -> float:
        return self.chosen.memory_bytes

    @property
    def recomputed_blocks(self) -> int:
        return self.chosen.recomputed

    @property
    def context_parallel(self) -> str | None:
        return self.layout.cp_strategy

    @property
    def loop_transport(self) -> str:
        """How the TP collectives' stream loops move their blocks: ``"copy_engine"`` (the
        runner's ``loop_transport``; ``CommunicatorBackend.cuda`` in
        ``MultiDeviceExecutor``) when the plan overlaps them, else ``"process_group"``."""
        return "copy_engine" if self.layout.overlap else "process_group"

    @property
    def ranks(self) -> int:
        return self.layout.size("tp") * self.layout.size("cp") * self.layout.size("pp") * \
            self.layout.size("dp") * self.layout.size("ddp")

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the ranks' peak."""
        return self.spec.model_flops_per_step() / self.step_s / \
            (self.ranks * self.peak_tflops * 1e12)

    def communication(self) -> dict[str, float]:
        """Bytes each mesh axis's collectives move per rank and step, by ``role`` + axis."""
        out = {}
        for role, nbytes in self.chosen.cost.comm_bytes.items():
            axes = self.layout.axes(role) or self.layout.axes("cp")
            out[f"{role} (axis {','.join(map(str, axes))})"] = nbytes
        return out

    def mesh_names(self) -> tuple[str, ...]:
        """A name per mesh axis: its role (``dp``, ``ddp``, ``tp``, ``cp``, ``pp``), numbered
        where a role has several axes."""
        seen: dict[str, int] = {}
        names = []
        for role in self.layout.roles:
            seen[role] = seen.get(role, 0) + 1
            names.append(role if self.layout.roles.count(role) == 1 else f"{role}{seen[role]}")
        return tuple(names)

    def fsdp_options(self) -> dict:
        """``names``, ``shard`` and ``replicate`` for ``FullyShardedModule`` (empty without
        a ``dp`` axis)."""
        names = self.mesh_names()
        shard = [n for n, r in zip(names, self.layout.roles) if r == "dp"]
        replicate = [n for n, r in zip(names, self.layout.roles) if r == "ddp"]
        if not shard:
            return {}
        return {"names": names, "shard": shard[0] if len(shard) == 1 else tuple(shard),
                "replicate": replicate[0] if len(replicate) == 1 else
                (tuple(replicate) or None)}

    def parallelize_plan(self, names: Mapping[str, Sequence[str] | str] = LLAMA_NAMES
                         ) -> dict:
        """The styles for ``meshfuse.parallelize(module, mesh, plan)``: Megatron's TP+SP over
        the module names ``names`` (columns, rows, norms, head) when the plan has a ``tp``
        axis; empty (every parameter replicated) otherwise."""
        if "tp" not in self.layout.roles:
            return {}
        seq = Shard(1)
        plan = {**dict.fromkeys(names["columns"], ColwiseParallel(input_layouts=seq)),
                **dict.fromkeys(names["rows"], RowwiseParallel(output_layouts=seq)),
                **dict.fromkeys(names["norms"], SequenceParallel())}
        if names.get("head"):
            plan[names["head"]] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        return plan

    def explain(self) -> str:
        """The plan, its predictions, and why it beat the runner-up."""
        c = self.chosen
        budget = f"{self.budget / GIB:.2f} GiB/rank" if self.budget else "no memory budget"
        lines = [(f"plan for {self.spec.name} on {self.ranks} ranks ({budget}, calibration "
                 f"{self.calibration!r}): {c.describe()}, MFU {self.mfu:.1%}"),
                 "  time by kind (s/step): " + _parts(c.cost.parts),
                 "  memory by kind (GiB/rank, before recomputation): " + ", ".join(
                     f"{k} {v / GIB:.2f}" for k, v in c.cost.memory_parts.items() if v),
                 "  communication per rank and step: " + ", ".join(
                     f"{k} {v / GIB:.3f} GiB" for k, v in self.communication().items()),
                 (f"  search: {self.considered} layouts, {self.variables} solver variables, "
                 f"{self.search_s * 1e3:.0f} ms")]
        lines.append(_versus(c, self.runner_up, self.budget))
        return "\n".join(lines)


def _parts(parts: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in parts.items() if v > 0)


def _versus(chosen: Candidate, other: Candidate | None, budget: float | None) -> str:
    """Why ``chosen`` beat ``other``: the kinds of time that differ most."""
    if other is None:
        return "  runner-up: none (no other layout fits)"
    diffs = {k: other.cost.parts.get(k, 0.0) - v for k, v in chosen.cost.parts.items()}
    diffs["recompute"] = (other.recomputed * other.cost.recompute_s -
                          chosen.recomputed * chosen.cost.recompute_s)
    biggest = sorted(diffs.items(), key=lambda kv: -abs(kv[1]))[:3]
    reasons = ", ".join(f"{k} {'+' if d > 0 else ''}{d * 1e3:.2f} ms" for k, d in biggest
                        if abs(d) > 0)
    return (f"  runner-up: {other.describe()}; {(other.step_s / chosen.step_s - 1):.1%} "
            f"slower (its time minus the plan's, by kind: {reasons})")
