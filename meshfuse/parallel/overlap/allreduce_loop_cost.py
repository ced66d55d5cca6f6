"""Whether a GEMM -> allreduce pair runs as a loop of row chunks, by which transport, and in
how many chunks (:mod:`meshfuse.parallel.overlap.allreduce_loop`).

For a GEMM of ``t_g`` whose result's allreduce moves in ``t_c`` (``2 (d - 1) / d`` of the
result per device over the process group, ``d - 1`` whole results pulled by the copy
engines), with ``f`` the time of the GEMMs that may run while it moves (after the pair in
the program, neither feeding it nor reading its result: a backward's GEMMs beside the
forward's allreduce, the weight gradients beside the input gradient's), each on its
transport's figures (:class:`~meshfuse.parallel.overlap.cost.OverlapCost`: throughput,
bandwidth, host cost ``h`` per chunk, ``contention`` c: the share of a transfer's time that
the kernels beside it lose):

- as a whole (the process group's allreduce, launched asynchronously):
  ``t_g + max(0, t_c - f) + c * min(t_c, f)``;
- as a loop of ``k`` chunks: its last allreduce ends ``tail = max(t_c / k, t_c - t_g (k -
  1) / k)`` after its GEMMs, of which ``e = max(0, tail - f)`` is exposed:
  ``t_g + e + c * (t_c - e) + k h``.

With the process group's measured contention of 1 (NCCL's kernels wait for a persistent
cuBLAS GEMM's SMs, see :mod:`meshfuse.parallel.overlap.cost`) no loop is ever estimated
faster. By the copy engines (a contention of 0.1) it is: in one chunk where enough work
follows to hide the whole transfer (the allreduce then takes no SM while it moves), in more
where little does (the Megatron MLP's forward alone). ``k`` is the estimate's best of 1
(copy engines only), 2, 4 and 8, at most the row count, or ``MESHFUSE_OVERLAP_CHUNKS``.
Every rank decides alike: the estimate reads global extents only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence

from meshfuse.errors import InputError
from meshfuse.ir.fusion import Expr
from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.tensor_view import TensorView
from meshfuse.parallel.overlap.allreduce_loop import COPY_ENGINE, PROCESS_GROUP
from meshfuse.parallel.overlap.allreduce_pattern import AllreduceCandidate, AllreduceLoopPlan
from meshfuse.runtime.interpreter.program import communication_first

CHUNKS_ENV = "MESHFUSE_OVERLAP_CHUNKS"
CHUNK_CHOICES = (1, 2, 4, 8)  # 1: the copy engines only (the whole allreduce without SMs)
MARGIN = 0.02  # a loop is chosen when estimated this much faster (the estimate's error)
GEMMS = ("linear", "matmul")

# shard_shape(tv, extents) -> the largest local extent of each materialized axis of tv
ShardShape = Callable[[TensorView, Mapping[IterDomain, int]], Sequence[int]]


def fixed_chunks() -> int | None:
    """The chunk count ``MESHFUSE_OVERLAP_CHUNKS`` asks for, or None (the estimate's)."""
    spec = os.environ.get(CHUNKS_ENV, "")
    if not spec:
        return None
    if not spec.isdigit() or int(spec) < 1:
        raise InputError(f"{CHUNKS_ENV}={spec!r}: give a positive number of row chunks for "
                         "GEMM -> allreduce loops (or leave it unset: the estimate's)")
    return int(spec)


def transfer_ms(cost, result_bytes: float, devices: int, transport: str) -> float:
    """How long the allreduce of ``result_bytes`` over ``devices`` moves on ``cost``'s link."""
    moved = (devices - 1) * result_bytes if transport == COPY_ENGINE else \
        2 * result_bytes * (devices - 1) / devices
    return moved / (cost.link_gb_per_s * 1e9) * 1e3


def estimate_ms(whole_cost, loop_cost, flops: float, result_bytes: float, devices: int,
                chunks: int, transport: str = PROCESS_GROUP,
                beside_flops: float = 0.0) -> tuple[float, float]:
    """(milliseconds as a whole, as a loop of ``chunks`` by ``transport``); ``whole_cost``
    and ``loop_cost``: the two transports' figures; ``beside_flops``: the GEMMs that may run
    while the allreduce moves (see the module doc)."""
    t_g = flops / (loop_cost.gemm_tflops * 1e12) * 1e3
    f = beside_flops / (loop_cost.gemm_tflops * 1e12) * 1e3
    t_w = transfer_ms(whole_cost, result_bytes, devices, PROCESS_GROUP)
    whole = t_g + max(0.0, t_w - f) + whole_cost.contention * min(t_w, f)
    t_c, k = transfer_ms(loop_cost, result_bytes, devices, transport), chunks
    exposed = max(0.0, max(t_c / k, t_c - t_g * (k - 1) / k) - f)
    looped = t_g + exposed + loop_cost.contention * (t_c - exposed) + \
        k * loop_cost.chunk_overhead_us * 1e-3
    return whole, looped


def choose(candidate: AllreduceCandidate, extents: Mapping[IterDomain, int],
           shard_shape: ShardShape, whole_cost, loop_cost, transport: str,
           automatic: bool) -> tuple[AllreduceLoopPlan | None, str]:
    """The loop for ``candidate`` (None: the pair runs as a whole) and why (a phrase for
    explain); ``whole_cost``, ``loop_cost``: the figures of the process group and of
    ``transport``; ``automatic``: whether the estimate may choose (``MESHFUSE_OVERLAP``)."""
    out = candidate.gemm.tensor_outputs[0]
    shape = shard_shape(out, extents)
    flops = _flops(candidate.gemm, extents, shard_shape)
    nbytes = math.prod(shape) * out.dtype.torch_dtype.itemsize
    rows, d = math.prod(shape[:-1]), candidate.devices
    if d < 2 or rows < 2:
        return None, f"{candidate.kind}: one device or one row"
    fixed = fixed_chunks()
    lowest = 1 if transport == COPY_ENGINE else 2
    choices = [min(fixed, rows)] if fixed else [k for k in CHUNK_CHOICES if lowest <= k <= rows]
    beside = sum(_flops(e, extents, shard_shape) for e in _beside(candidate))
    estimates = {k: estimate_ms(whole_cost, loop_cost, flops, nbytes, d, k, transport, beside)
                 for k in choices}
    best = min(choices, key=lambda k: estimates[k][1])
    whole, looped = estimates[best]
    by = " by copy engines" if transport == COPY_ENGINE else ""
    beside_ms = beside / (loop_cost.gemm_tflops * 1e12) * 1e3
    why = (f"{candidate.kind}: est. {looped:.3f} ms in {best} chunks{by} vs {whole:.3f} ms "
           f"without, {beside_ms:.3f} ms of GEMMs beside")
    if candidate.forced is not None:
        use, why = candidate.forced, f"set_overlap({candidate.forced}); {why}"
    elif not automatic:
        use, why = False, "MESHFUSE_OVERLAP=off"
    else:
        use = looped < (1 - MARGIN) * whole
    return (candidate.plan(why, best) if use else None), why


def _flops(gemm: Expr, extents: Mapping[IterDomain, int], shard_shape: ShardShape) -> float:
    """2 x the output's elements x the contracted extent, on the device with most."""
    out, a = gemm.tensor_outputs[0], gemm.tensor_inputs[0]
    contracted = shard_shape(a, extents)[-1] if a.ndim else 1
    return 2.0 * math.prod(shard_shape(out, extents)) * contracted


def _beside(candidate: AllreduceCandidate) -> list[Expr]:
    """The GEMMs after the pair in the program's order (communications first) that neither
    feed its GEMM nor read its allreduce's result: what may run while it moves."""
    fusion = candidate.gemm.outputs[0].fusion
    order, uses = communication_first(fusion.exprs), fusion.uses()
    feeding = _closure(candidate.gemm, lambda e: [v.definition for v in e.inputs])
    reading = _closure(candidate.reshard,
                       lambda e: [u for v in e.outputs for u in uses.get(v, [])])
    after = order[order.index(candidate.reshard) + 1:]
    return [e for e in after if e.op is not None and e.op.name in GEMMS and
            e not in feeding and e not in reading]


def _closure(start: Expr, step: Callable[[Expr], list]) -> set[Expr]:
    """``start`` and every expression ``step`` reaches from it (None ends a path)."""
    seen, todo = set(), [start]
    while todo:
        e = todo.pop()
        if e is None or e in seen:
            continue
        seen.add(e)
        todo.extend(step(e))
    return seen
