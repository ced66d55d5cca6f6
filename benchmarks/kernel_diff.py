"""The GPU kernels of a replayed training step of the small GPT layer, variant against
variant: per kernel name, its microseconds per step in each variant (replayed from CUDA
graphs, as the timing loop runs them), sorted by the difference; what makes one variant's
step longer on the GPU than another's when their programs compute the same thing (issue
34: the derived forward and backward, replayed, took 13 us more per step than the
hand-written fusion on an H100).

    python -m benchmarks.kernel_diff --out DIR [--variants A,B,...] [--steps 20]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

from benchmarks import training_step
from benchmarks.timing import profiled

DEFAULT = "meshfuse_autograd,meshfuse_captured,meshfuse_hand_written"


def kernel_us(step, steps: int) -> dict[str, float]:
    """Microseconds per step of each kernel name over ``steps`` steps of ``step``."""
    def run():
        for _ in range(steps):
            step()
    totals: dict[str, float] = collections.defaultdict(float)
    for row in profiled(run).key_averages():
        # a kernel, copy or memset: device time and no host time of its own (an operator's
        # row counts the kernels it launched, a graph's included, in its own device time)
        if row.cpu_time_total == 0 and row.self_device_time_total > 0:
            totals[row.key] += row.self_device_time_total / steps
    return dict(totals)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--variants", default=DEFAULT)
    parser.add_argument("--size", default="small")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    setups = training_step.cuda_variants(args.size, names,
                                         "it times the GPU's kernels of replayed steps")
    per_variant = {}
    for name in names:
        step = setups[name]()[0]
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        per_variant[name] = kernel_us(step, args.steps)
    kernels = sorted({k for v in per_variant.values() for k in v})
    base = names[-1]
    rows = sorted(kernels, key=lambda k: -abs(per_variant[names[0]].get(k, 0.0)
                                                - per_variant[base].get(k, 0.0)))
    lines = [(f"# {torch.cuda.get_device_name()} ({torch.__version__}), {args.size} "
             f"layer, GPU us per step over {args.steps} replayed steps"),
             "total: " + ", ".join(f"{n} {sum(per_variant[n].values()):.1f}" for n in names),
             " | ".join(names) + " | kernel"]
    for k in rows:
        lines.append(" | ".join(f"{per_variant[n].get(k, 0.0):8.1f}" for n in names)
                     + f" | {k[:110]}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernel_diff.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
