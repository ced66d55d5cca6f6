"""Where the MLP case's peak memory goes (a diagnostic of case 4, not a benchmark).

``torchrun --nproc-per-node 2 -m benchmarks.mlp_memory``. For each variant of the MLP case,
on each rank: the memory allocated before its setup, after it, after one step, and a second
later (when NCCL's watchdog has released what completed collectives held); the peak over 5
steps queued back to back as the benchmark times them, and over 5 steps with a synchronize
after each (a difference: buffers held back while the host runs ahead of the GPU). Rank 0 then
lists the CUDA tensors Python still reaches, besides the case's inputs, and what holds them.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks import context
from benchmarks.cases import mlp

STEPS = 5
MIB = 2**20


def _peak_of(ctx: context.Context, step, synchronize: bool) -> float:
    ctx.sync()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    for _ in range(STEPS):
        step()
        if synchronize:
            ctx.sync()
    ctx.sync()
    return torch.cuda.max_memory_allocated(ctx.device) / MIB


def _mib() -> float:
    return torch.cuda.memory_allocated() / MIB


def _python_tensors(known: set[int]) -> list[str]:
    """CUDA tensors reachable from Python, other than ``known`` ones: shape, MiB, holders."""
    gc.collect()
    found = []
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.is_cuda and id(o) not in known:
            holders = sorted({type(r).__name__ for r in gc.get_referrers(o)})
            size = o.untyped_storage().nbytes() / MIB
            found.append(f"{list(o.shape)} {o.dtype} {size:.0f} MiB held by {holders}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mlp_memory")
    parser.parse_args()
    ctx = context.setup(quick=False)
    if not ctx.cuda:
        raise SystemExit("needs CUDA")
    sizes = mlp.SIZES
    tensors = mlp.tensors(ctx, sizes, torch.bfloat16)
    known = {id(t) for t in tensors}
    variants = {v.name: v for v in mlp.variants(ctx, sizes, torch.bfloat16, tensors)}
    for name in ("meshfuse", "torch_manual", "meshfuse", "dtensor_tp"):
        gc.collect()
        torch.cuda.empty_cache()
        ctx.barrier()
        start = _mib()
        prepared = variants[name].setup()
        step = prepared[0] if isinstance(prepared, tuple) else prepared
        ctx.sync()
        after_setup = _mib()
        step()
        ctx.sync()
        after_step = _mib()
        time.sleep(1.0)
        gc.collect()
        later = _mib()
        queued = _peak_of(ctx, step, synchronize=False)
        synced = _peak_of(ctx, step, synchronize=True)
        print(f"rank {ctx.rank} {name}: MiB before {start:.0f}, after setup {after_setup:.0f}, "
              f"after a step {after_step:.0f}, 1 s later {later:.0f}; peak of {STEPS} queued "
              f"steps {queued:.0f}, synchronized {synced:.0f}", flush=True)
        if ctx.rank == 0:
            for line in _python_tensors(known):
                print(f"  live: {line}", flush=True)
        del prepared, step
    context.teardown()


if __name__ == "__main__":
    main()
