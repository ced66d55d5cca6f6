"""Case 5: bus bandwidth of allgather, reduce-scatter and allreduce, 64 MiB to 512 MiB.

``size`` is the full buffer as nccl-tests counts it: allgather's output, reduce-scatter's
input, allreduce's buffer. ``algbw = size / time``; ``busbw`` is algbw times ``(n-1)/n``
(allgather, reduce-scatter) or ``2(n-1)/n`` (allreduce), comparable across world sizes.

Variants: ``torch`` (baseline: ``torch.distributed`` called directly) and ``meshfuse``
(``meshfuse.runtime.comm.collectives``, the functions a meshfuse program calls).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import meshfuse
from benchmarks.context import Context
from benchmarks.harness import Plan, Record, Variant, run_variants, skipped

SIZES_MIB = (64, 128, 256, 512)
QUICK_SIZES_MIB = (1, 4)
DTYPE = torch.float32

# collective -> busbw factor of n
COLLECTIVES = {
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allreduce": lambda n: 2 * (n - 1) / n,
}


def _buffers(ctx: Context, op: str, numel: int):
    """(input, output) of ``op`` for a full buffer of ``numel`` elements."""
    shard = numel // ctx.world
    full = torch.ones(numel, dtype=DTYPE, device=ctx.device)
    part = torch.ones(shard, dtype=DTYPE, device=ctx.device)
    if op == "allgather":
        return part, full
    if op == "reduce_scatter":
        return full, part
    return full, full


def _torch_step(op: str, inp: torch.Tensor, out: torch.Tensor):
    if op == "allgather":
        return lambda: dist.all_gather_into_tensor(out, inp)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(out, inp)
    return lambda: dist.all_reduce(inp)


def _meshfuse_step(ctx: Context, op: str, inp: torch.Tensor):
    """The call meshfuse's program makes for ``op`` (an allreduce reduces the partial result it
    is given in place, as the program does when the partial tensor has no other use)."""
    from meshfuse.runtime.comm import collectives
    from meshfuse.runtime.comm.communicator import Communicator

    mesh = meshfuse.DeviceMesh(range(ctx.world))
    group = collectives.Group(Communicator.instance().group(mesh, 0), mesh.device_ids,
                              ctx.rank, 0)
    if op == "allgather":
        return lambda: collectives.allgather(inp, 0, group)
    if op == "reduce_scatter":
        return lambda: collectives.reduce_scatter(inp, 0, group, "sum")
    return lambda: collectives.allreduce(inp, group, "sum", inplace=True)


def _variants(ctx: Context, op: str, numel: int) -> list[Variant]:
    def torch_setup():
        return _torch_step(op, *_buffers(ctx, op, numel))

    def meshfuse_setup():
        return _meshfuse_step(ctx, op, _buffers(ctx, op, numel)[0])

    return [Variant("torch", torch_setup), Variant("meshfuse", meshfuse_setup)]


def run(ctx: Context) -> list[Record]:
    if ctx.world < 2:
        return [skipped(ctx, "collectives", "-", "torch", "needs 2+ ranks (torchrun)")]
    sizes = QUICK_SIZES_MIB if ctx.quick else SIZES_MIB
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=5, iters=30)
    records = []
    element = torch.tensor([], dtype=DTYPE).element_size()
    with warnings.catch_warnings():  # reduce_scatter_tensor is deprecated in newer torch
        warnings.simplefilter("ignore", FutureWarning)
        for op, factor in COLLECTIVES.items():
            for mib in sizes:
                numel = mib * 2**20 // element
                params = {"op": op, "size_mib": mib, "dtype": "fp32", "ranks": ctx.world}
                found = run_variants(ctx, "collectives", f"{op} {mib}MiB",
                                     _variants(ctx, op, numel), plan, "torch",
                                     params)
                for r in found:
                    if r.status == "ok":
                        algbw = mib * 2**20 / (r.median_ms * 1e-3) / 1e9
                        r.metrics["algbw_gbps"] = algbw
                        r.metrics["busbw_gbps"] = algbw * factor(ctx.world)
                records += found
    return records
