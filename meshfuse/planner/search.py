"""``meshfuse.plan(model, mesh, memory_budget=..., example_inputs=...)``: the fastest layout
of a transformer on a mesh within a memory budget, by the calibrated cost model.

The search costs every layout of the mesh (:mod:`.layouts`: a role per axis, the context
strategy, the pipeline schedule) for one block (:mod:`.estimate`), then chooses the layout
and the number of recomputed blocks exactly (:mod:`.solver`); the runner-up is the best
other layout. See docs/planner.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from meshfuse.cost import CostModel, load
from meshfuse.errors import InputError
from meshfuse.planner.estimate import layout_cost
from meshfuse.planner.layouts import enumerate_layouts
from meshfuse.planner.plan import Candidate, Plan
from meshfuse.planner.solver import solve
from meshfuse.planner.spec import spec_of


def plan(model: Any, mesh: Any, memory_budget: float | None = None, *,
         example_inputs: Any = None, calibration: str | CostModel | None = None,
         pipeline: bool = True, context: bool = True, overlap: bool = True,
         dtype_bytes: int | None = None) -> Plan:
    """The fastest plan of ``model`` on ``mesh`` whose memory per rank fits.

    Args:
        model: a :class:`~meshfuse.planner.spec.TransformerSpec`, a model or fusion of the
            examples, a Hugging Face model or config (see :func:`.spec.spec_of`).
        mesh: a meshfuse or torch ``DeviceMesh``, or a shape (``(4, 8)``: 4 nodes of 8).
        memory_budget: bytes per rank (None: no limit).
        example_inputs: ``ids [batch, seq]`` (or a tuple starting with them), for the batch
            and sequence when ``model`` has none.
        calibration: a calibration name (``"h200"``, ``"cpu_gloo"``), path or cost model
            (default: the mesh's device type's, else the H200's).
        pipeline, context: whether pipeline stages and context parallelism may be chosen.
        overlap: whether TP's collectives may run as copy-engine stream loops.
        dtype_bytes: the element size (default: the model's).

    Returns:
        a :class:`~meshfuse.planner.plan.Plan`.

    Raises:
        InputError: when no layout fits the budget (the message gives the smallest need).

    Example:
        >>> p = meshfuse.plan(LlamaConfig(...), (4, 8), memory_budget=80 * 2**30,
        ...                   example_inputs=ids)
        >>> print(p.explain()); model = meshfuse.parallelize(model, mesh, p.parallelize_plan())
    """
    start = time.perf_counter()
    spec = spec_of(model, example_inputs, dtype_bytes)
    cost_model = _cost_model(calibration, mesh)
    costs = [layout_cost(spec, layout, cost_model)
             for layout in enumerate_layouts(mesh_shape(mesh), pipeline, context, overlap)]
    best = solve(costs, memory_budget)
    if best is None:
        raise InputError(_no_fit(spec, costs, memory_budget))
    second = solve(costs, memory_budget, exclude=[best.index])
    runner_up = Candidate(costs[second.index], second.recomputed) if second else None
    return Plan(spec, Candidate(costs[best.index], best.recomputed), runner_up, memory_budget,
                cost_model.calibration.name, best.variables, len(costs),
                time.perf_counter() - start, cost_model.calibration.peak_tflops)


def mesh_shape(mesh: Any) -> tuple[int, ...]:
    """The shape of a meshfuse or torch mesh, or of a shape given as such."""
    if isinstance(mesh, int):
        return (mesh,)
    if isinstance(mesh, Sequence) and all(isinstance(n, int) for n in mesh):
        return tuple(mesh)
    devices = getattr(mesh, "devices", None)
    if devices is None:
        devices = getattr(mesh, "mesh", None)
    if devices is None:
        raise InputError(f"plan: mesh {mesh!r} is neither a DeviceMesh nor a shape; give "
                         "meshfuse.DeviceMesh(...), a torch DeviceMesh or a tuple of sizes")
    return tuple(int(n) for n in devices.shape)


def _cost_model(calibration: Any, mesh: Any) -> CostModel:
    if isinstance(calibration, CostModel):
        return calibration
    if calibration is not None:
        return CostModel(load(calibration))
    device = getattr(mesh, "device_type", None)
    return CostModel.for_device(device or "cuda")


def _no_fit(spec, costs, budget: float) -> str:
    feasible = [c for c in costs if not c.infeasible]
    if not feasible:
        reasons = sorted({c.infeasible for c in costs})
        return f"plan: no layout of the mesh can run {spec.name}: {'; '.join(reasons[:3])}"
    least = min(c.memory_bytes - c.blocks * c.recompute_saves for c in feasible)
    return (f"plan: no layout fits {_size(budget)} per rank for {spec.name}; the least any "
            f"needs (every block recomputed) is {_size(least)}: raise the budget, add ranks "
            "or shorten the batch")


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} bytes"
