"""Case 3: what a cached ``execute`` costs on the host, over the same torch calls made directly.

Two programs, each as ``meshfuse`` (plain ``execute``: on CUDA replayed from a CUDA graph
where safe), ``meshfuse_interpreter`` (``execute(cuda_graph=False)``: each kernel launched
from Python), ``meshfuse_graph`` (``execute`` with ``cuda_graph=True``, seed only) and
``direct`` (the torch calls):

- the seed's attention fusion (BHSE), against the SDPA kernels called directly;
- :class:`~benchmarks.fusions.Pointwise10` on ``[n, n]`` fp32 (rows split over the ranks),
  against :func:`~benchmarks.fusions.pointwise10_torch`, at a host-bound and a GPU-bound n.

Reported per variant: ``host_us``, the CPU time of one call while the GPU is kept busy (so
no call waits for it), ``gpu_us``, the GPU time of the same calls run back to back, and the
per-iteration time of the usual timed loop. The meshfuse records carry ``host_overhead_us``
(their host time minus direct's) and ``host_ratio``.
"""

from __future__ import annotations

import time

import torch

import meshfuse
from benchmarks.cases.attention import (
    QUICK_SEED_SIZES,
    SEED_SIZES,
    direct_variant,
    local_inputs,
    meshfuse_variant,
)
from benchmarks.context import Context
from benchmarks.fusions import Pointwise10, QkvFormat, pointwise10_torch
from benchmarks.harness import Plan, Record, Variant, check_close, run_variants

POINTWISE_SIZES = (1024, 4096)
MESHFUSE = ("meshfuse", "meshfuse_interpreter", "meshfuse_graph")
QUICK_POINTWISE_SIZES = (64,)


def _add_overhead(records: list[Record]) -> None:
    by_name = {r.variant: r for r in records}
    direct = by_name.get("direct")
    for mf in (by_name.get(name) for name in MESHFUSE):
        if mf and direct and mf.host_us is not None and direct.host_us is not None:
            mf.metrics["host_overhead_us"] = mf.host_us - direct.host_us
            mf.metrics["host_ratio"] = mf.host_us / direct.host_us if direct.host_us else None


def _seed(ctx: Context, plan: Plan) -> list[Record]:
    sizes = QUICK_SEED_SIZES if ctx.quick else SEED_SIZES
    inputs = local_inputs(ctx, sizes, QkvFormat.BHSE)

    variants = [*(meshfuse_variant(ctx, sizes, QkvFormat.BHSE, inputs, cuda_graph=mode)
                  for mode in (None, False, True)),
                direct_variant(inputs)]
    params = dict(sizes, causal=True, dtype="bf16", layout="BHSE")
    records = run_variants(ctx, "overhead", "seed attention", variants, plan, "direct", params)
    _add_overhead(records)
    return records


def _pointwise(ctx: Context, n: int, plan: Plan) -> list[Record]:
    if n % ctx.world:
        raise ValueError(f"n={n} rows do not split over {ctx.world} ranks")
    gen = torch.Generator(ctx.device).manual_seed(0)
    x, y = (torch.randn(n // ctx.world, n, generator=gen, device=ctx.device) for _ in range(2))

    def setup(cuda_graph):
        model = Pointwise10(n, meshfuse.DeviceMesh(range(ctx.world)))
        start = time.perf_counter()
        got = model.execute([x, y], cuda_graph=cuda_graph)  # builds the program
        seconds = time.perf_counter() - start
        for _ in range(2):  # the first call, then a cached one (captured, where it replays)
            check_close("meshfuse vs torch", got, [pointwise10_torch(x, y)], 1e-5)
            got = model.execute([x, y], cuda_graph=cuda_graph)
        del got
        return (lambda: model.execute([x, y], cuda_graph=cuda_graph)), {
            "first_call_s": round(seconds, 4)}

    variants = [Variant("meshfuse", lambda: setup(None)),
                Variant("meshfuse_interpreter", lambda: setup(False)),
                Variant("direct", lambda: (lambda: pointwise10_torch(x, y)))]
    params = {"n": n, "ops": 10, "dtype": "fp32", "rows_per_rank": n // ctx.world}
    records = run_variants(ctx, "overhead", f"pointwise10 {n}x{n}", variants, plan, "direct",
                           params)
    _add_overhead(records)
    return records


def run(ctx: Context) -> list[Record]:
    """Case 3 (and, with case 1's meshfuse/direct ratio, issue 2's comparison)."""
    if ctx.quick:
        plan, sizes = Plan(warmup=1, iters=3, host_calls=5), QUICK_POINTWISE_SIZES
    else:
        # 30 calls of at most ~20 kernels stay well inside the GPU's launch queue
        plan, sizes = Plan(warmup=20, iters=100, host_calls=30), POINTWISE_SIZES
    records = _seed(ctx, plan)
    for n in sizes:
        records += _pointwise(ctx, n, plan)
    return records
