"""Where the MLP case's peak memory goes (a diagnostic of case 4, not a benchmark).

``torchrun --nproc-per-node 2 -m benchmarks.mlp_memory --out DIR``. For each variant of the
MLP case, on each rank: the memory held before its steps (inputs), the peak over 5 steps queued
back to back as the benchmark times them, and the peak over 5 steps with a synchronize after
each (a difference: buffers held back while the host runs ahead of the GPU). With ``--out``,
rank 0 also writes a ``torch.cuda.memory`` snapshot (allocation trace with Python stacks) of
meshfuse's queued steps, for ``torch.cuda.memory._snapshot`` tools.
"""

from __future__ import annotations

import argparse
import os
import pickle

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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mlp_memory")
    parser.add_argument("--out", default=None, help="folder for rank 0's memory snapshot")
    args = parser.parse_args()
    ctx = context.setup(quick=False)
    if not ctx.cuda:
        raise SystemExit("needs CUDA")
    sizes = mlp.SIZES
    tensors = mlp._weights(ctx, sizes, torch.bfloat16)
    for variant in mlp._variants(ctx, sizes, torch.bfloat16, tensors):
        if variant.name == "torch_1gpu":
            continue
        prepared = variant.setup()
        step = prepared[0] if isinstance(prepared, tuple) else prepared
        step()
        ctx.sync()
        held = torch.cuda.memory_allocated(ctx.device) / MIB
        queued = _peak_of(ctx, step, synchronize=False)
        synced = _peak_of(ctx, step, synchronize=True)
        line = (f"rank {ctx.rank} {variant.name}: held {held:.0f} MiB, peak queued "
                f"{queued:.0f} MiB, peak synchronized {synced:.0f} MiB")
        print(line, flush=True)
        if variant.name == "meshfuse" and args.out and ctx.rank == 0:
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
            _peak_of(ctx, step, synchronize=False)
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "mlp-meshfuse-memory.pickle"), "wb") as f:
                pickle.dump(snapshot, f)
        del prepared, step
        torch.cuda.empty_cache()
        ctx.barrier()
    context.teardown()


if __name__ == "__main__":
    main()
