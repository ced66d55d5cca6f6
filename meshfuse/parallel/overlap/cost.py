"""Whether decomposing a communication next to a GEMM into a stream loop pays.

For a candidate (:mod:`meshfuse.parallel.overlap.candidates`) of ``d`` chunks, a GEMM of
``t_g`` and a communication of ``t_c`` on this device (from the GEMM's FLOPs, the bytes
moved, and the device's GEMM throughput and link bandwidth):

- without the loop: ``t_g + t_c``;
- with it: ``max(t_g, t_c + t_g / d)`` (the first or last chunk's GEMM cannot hide) plus
  ``contention * min(t_g, t_c)`` (what the GEMMs lose to the transfers running beside them)
  plus ``d`` times the loop's host cost per chunk.

The loop is used when it is estimated at least 5% faster. Every rank decides alike: the
estimate reads global extents and shardings only.

The figures come from the device's committed calibration (:mod:`meshfuse.cost`).

The contention is what decides on GPUs. NCCL moves data with kernels that need SMs, and
cuBLAS's Hopper GEMMs are persistent kernels that hold every SM until they end: a transfer
launched beside a GEMM waits for the GEMM's blocks to retire, so it hides nothing (and the
GEMM cut in chunks runs less efficiently). Measured on 2 H200s with NCCL, no decomposition
was faster than the whole communication: the column-parallel linear of nvFuser's overlap
test (t = h = 8192) 3.19 ms as a loop and as a whole, the sequence-parallel row linear
3.22 ms looped against 3.11 ms whole, the GPT-3 layer's forward and backward (e = 12288)
18.53 ms against 18.10 ms. So the CUDA figures have a contention of 1.0 (the transfer's time
comes back in full), with which a loop is never estimated faster; so have the CPU's (a loop
runs its chunks in order there). A transport that copies without SMs (copy engines), or
GEMMs that leave SMs free, make a lower contention true: ``MESHFUSE_OVERLAP_COST=
"GB/s,TFLOP/s,us,contention"`` gives one's own figures (``"160,700,20,0.1"``: the loop pays
for large GEMMs), ``MESHFUSE_OVERLAP=off`` turns the automatic choice off, and
``set_overlap(True)`` forces a loop whatever the estimate.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from meshfuse.cost import CostModel
from meshfuse.errors import InputError
from meshfuse.ir.domain import domain
from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.tensor_view import TensorView
from meshfuse.parallel.overlap import allreduce_loop_cost
from meshfuse.parallel.overlap.allreduce_pattern import AllreduceCandidate
from meshfuse.parallel.overlap.candidates import OverlapCandidate

MARGIN = 0.02  # a loop is chosen when estimated this much faster (the estimate's error)


@dataclasses.dataclass(frozen=True)
class OverlapCost:
    """A device's GEMM throughput, link bandwidth, host cost of one loop chunk, and the
    fraction of an overlapped transfer's time that the GEMM beside it loses (module doc)."""

    link_gb_per_s: float
    gemm_tflops: float
    chunk_overhead_us: float
    contention: float = 1.0

    def estimate_ms(self, flops: float, comm_bytes: float, chunks: int) -> tuple[float, float]:
        """(milliseconds without the loop, with it); see the module doc."""
        t_g = flops / (self.gemm_tflops * 1e12) * 1e3
        t_c = comm_bytes / (self.link_gb_per_s * 1e9) * 1e3
        looped = max(t_g, t_c + t_g / chunks) + self.contention * min(t_g, t_c) + \
            chunks * self.chunk_overhead_us * 1e-3
        return t_g + t_c, looped


def _from_calibration(device_type: str, transport: str) -> OverlapCost:
    """The figures of ``device_type``'s committed calibration (:mod:`meshfuse.cost`): the
    process group's link is an allgather's bus bandwidth between 2 ranks at the size of the
    GPT-3 layer's gathers (25 MB per rank: 156 GB/s on 2 H200s with NCCL), the copy engines'
    their measured pull rate (365 GB/s); GEMMs at the GEMM model's rate of full waves
    (~780 TFLOP/s on an H200); each transport's measured host cost per chunk and contention
    beside GEMMs. On CPU ranks: gloo's link, 0.1 TFLOP/s, 300 us per chunk, no overlap."""
    model = CostModel.for_device(device_type)
    cal = model.calibration
    gemm = cal.gemm.tflops
    if transport == "copy_engine":
        return OverlapCost(cal.copy_engine_gb_per_s, gemm, cal.host["copy_engine_chunk_us"],
                           cal.overlap["copy_engine_beside_gemm"])
    return OverlapCost(model.bus_bandwidth("allgather", 50e6, 2), gemm,
                       cal.host["loop_chunk_us"], cal.overlap["process_group_beside_gemm"])


DEFAULT_COSTS = {
    "cuda": _from_calibration("cuda", "process_group"),
    "cuda_copy_engine": _from_calibration("cuda", "copy_engine"),
    "cpu": _from_calibration("cpu", "process_group"),
}


def cost_for(device_type: str, transport: str = "process_group") -> OverlapCost:
    """The cost figures of a device type and a loop transport (``"process_group"``,
    ``"copy_engine"``), or those of ``MESHFUSE_OVERLAP_COST``."""
    spec = os.environ.get("MESHFUSE_OVERLAP_COST", "")
    if not spec:
        key = f"{device_type}_{transport}"
        return DEFAULT_COSTS.get(key) or DEFAULT_COSTS.get(device_type, DEFAULT_COSTS["cpu"])
    try:
        figures = [float(v) for v in spec.split(",")]
        if len(figures) not in (3, 4) or min(figures) < 0 or 0 in figures[:2]:
            raise ValueError(spec)
    except ValueError:
        raise InputError(f"MESHFUSE_OVERLAP_COST={spec!r}: give 'GB/s,TFLOP/s,us' or "
                         "'GB/s,TFLOP/s,us,contention' (positive bandwidth and throughput, a "
                         "contention from 0: transfers beside GEMMs cost them nothing, to 1: "
                         "they cost their whole time), for example '160,700,20,0.1'") from None
    return OverlapCost(*figures)


def automatic() -> bool:
    """False when ``MESHFUSE_OVERLAP=off`` (only forced loops are used)."""
    return os.environ.get("MESHFUSE_OVERLAP", "auto").lower() not in ("off", "0", "false")


def decide(candidate: OverlapCandidate, extents: Mapping[IterDomain, int],
           device_type: str, transport: str = "process_group") -> tuple[bool, str]:
    """Whether to run ``candidate`` as a loop whose blocks move by ``transport``, and why
    (a line for explain)."""
    if candidate.forced is not None:
        return candidate.forced, f"set_overlap({candidate.forced})"
    if not automatic():
        return False, "MESHFUSE_OVERLAP=off"
    gemm_out = candidate.gemm.tensor_outputs[0]
    x = candidate.gemm.tensor_inputs[0]
    contracted = _largest_shard(x, extents)[-1] if x.ndim else 1
    flops = 2.0 * math.prod(_largest_shard(gemm_out, extents)) * contracted
    moved = candidate.reshard.outputs[0] if candidate.kind.startswith("allgather") else \
        candidate.reshard.args[0]
    d = candidate.devices
    comm = math.prod(_largest_shard(moved, extents)) * moved.dtype.torch_dtype.itemsize * \
        (d - 1) / d
    plain, looped = cost_for(device_type, transport).estimate_ms(flops, comm, d)
    verdict = looped < (1 - MARGIN) * plain
    by = " by copy engines" if transport == "copy_engine" else ""
    return verdict, (f"{candidate.kind}: est. {looped:.3f} ms in {d} chunks{by} vs "
                     f"{plain:.3f} ms without")


def _largest_shard(tv: TensorView, extents: Mapping[IterDomain, int]) -> list[int]:
    """The largest local extent of each materialized axis of ``tv`` over the ranks."""
    devices = domain(tv).device_ids
    shape = []
    for logical in tv.materialized():
        n = extents.get(logical, 1)
        for _, pt in devices.get(logical, []):
            n = -(-n // tv.mesh.axis_size(pt))
        shape.append(n)
    return shape


def choose_loops(candidates: list[OverlapCandidate], extents: Mapping[IterDomain, int],
                 device_type: str, transport: str = "process_group") -> tuple[list, list[str]]:
    """The loops to add for ``candidates`` (their plans) and explain's lines on each
    decision; ``transport``: how the loops would move their blocks."""
    plans, lines = [], []
    for candidate in candidates:
        if isinstance(candidate, AllreduceCandidate):
            plan, why = _allreduce_loop(candidate, extents, device_type, transport)
        else:
            use, why = decide(candidate, extents, device_type, transport)
            plan = candidate.plan(why) if use else None
        if plan is not None:
            plans.append(plan)
        verdict = plan.describe() if plan is not None else f"as a whole ({why})"
        lines.append(f"  {candidate.reshard.outputs[0].name} = reshard("
                     f"{candidate.reshard.args[0].name}) next to "
                     f"{candidate.gemm.op.name} -> {candidate.gemm.outputs[0].name}: {verdict}")
    return plans, lines


def _allreduce_loop(candidate: AllreduceCandidate, extents: Mapping[IterDomain, int],
                    device_type: str, transport: str):
    """(the loop or None, why) for a GEMM -> allreduce candidate
    (:func:`meshfuse.parallel.overlap.allreduce_loop_cost.choose`)."""
    return allreduce_loop_cost.choose(candidate, extents, _largest_shard,
                                      cost_for(device_type), cost_for(device_type, transport),
                                      transport, automatic())


def candidate_lines(candidates: list[OverlapCandidate]) -> list[str]:
    """explain's lines on the candidates before extents are known."""
    return [f"  {c.kind}: {c.reshard.outputs[0].name} = reshard({c.reshard.args[0].name}) "
            f"next to {c.gemm.op.name} -> {c.gemm.outputs[0].name}: "
            + (f"set_overlap({c.forced})" if c.forced is not None else
               "decided per input signature by a cost estimate") for c in candidates]
