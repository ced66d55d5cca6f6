"""Does the MLP's allreduce overlap its matmuls? (a diagnostic of case 4, not a benchmark)

``torchrun --nproc-per-node 2 -m benchmarks.overlap_probe``: times the meshfuse MLP (median of
20 steps, CUDA events) with its collectives on the default group and on groups with a
high-priority NCCL stream and/or fewer NCCL CTAs (more SMs left to the matmuls), and with
cuBLASLt matmuls that leave some SMs to NCCL; and the hand-written calls (no overlap) for
reference. Also prints, from a profile of one step, how
much of the NCCL kernels' time ran while a matmul ran.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

import meshfuse
from benchmarks import context
from benchmarks.cases import mlp
from benchmarks.fusions import MegatronMlp, megatron_mlp_torch
from benchmarks.timing import cuda_kernel_events, timed_samples
from meshfuse.runtime.comm.communicator import Communicator

ITERS = 20


def _median_ms(ctx, step) -> float:
    for _ in range(3):
        step()
    return statistics.median(timed_samples(ctx, step, ITERS))


def _overlap(step) -> str:
    kernels = cuda_kernel_events(step)
    nccl = [e for e in kernels if "nccl" in e.name.lower()]
    other = [e for e in kernels if "nccl" not in e.name.lower()]
    total = sum(e.time_range.end - e.time_range.start for e in nccl)
    covered = 0.0
    for n in nccl:
        for o in other:
            lo = max(n.time_range.start, o.time_range.start)
            hi = min(n.time_range.end, o.time_range.end)
            covered += max(0.0, hi - lo)
    return f"nccl kernels {total / 1e3:.2f} ms, {covered / max(total, 1e-9):.0%} under compute"


def _group(ctx, high_priority: bool, max_ctas: int | None):
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = high_priority
    if max_ctas is not None:
        options.config.max_ctas = max_ctas
    return dist.new_group(list(range(ctx.world)), pg_options=options)


def main() -> None:
    ctx = context.setup(quick=False)
    sizes = mlp.SIZES
    x, dz, _, _, w1, w2 = mlp.tensors(ctx, sizes, torch.bfloat16)
    inputs = [x, w1, w2, dz]
    world = dist.group.WORLD
    results = {"manual": _median_ms(ctx, lambda: megatron_mlp_torch(x, w1, w2, dz, world))}
    comm = Communicator.instance()
    mesh = meshfuse.DeviceMesh(range(ctx.world))
    configs = {"world": None}
    for high in (False, True):
        for ctas in (None, 32, 16, 8):
            configs[f"high_priority={high} max_ctas={ctas}"] = (high, ctas)
    for name, config in configs.items():
        group = world if config is None else _group(ctx, *config)
        comm.process_groups.by_ranks[tuple(range(ctx.world))] = group
        model = MegatronMlp(**sizes, mesh=mesh, dtype=meshfuse.DataType.BFloat16)
        model.execute(inputs)
        step = lambda model=model: model.execute(inputs)
        results[name] = _median_ms(ctx, step)
        overlap = _overlap(step)  # every rank: the steps communicate
        if ctx.rank == 0:
            print(f"{name}: {results[name]:.3f} ms; {overlap}", flush=True)
    # matmuls through cuBLASLt told to leave SMs free (a process-wide, experimental setting)
    comm.process_groups.by_ranks[tuple(range(ctx.world))] = world
    model = MegatronMlp(**sizes, mesh=mesh, dtype=meshfuse.DataType.BFloat16)
    step = lambda: model.execute(inputs)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    results["cublaslt"] = _median_ms(ctx, step)
    for carveout in (8, 16, 24, 32):
        torch._C._set_sm_carveout_experimental(carveout)
        results[f"cublaslt, {carveout} SMs left out"] = _median_ms(ctx, step)
        overlap = _overlap(step)
        if ctx.rank == 0:
            print(f"carveout {carveout}: {overlap}", flush=True)
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library("cublas")
    if ctx.rank == 0:
        for name, ms in results.items():
            print(f"{name}: {ms:.3f} ms", flush=True)
    context.teardown()


if __name__ == "__main__":
    main()
