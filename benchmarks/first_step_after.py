"""The first step of a block of the small GPT layer (through autograd, and the hand-written
fusion) right after a block of each variant of ``benchmarks.training_step`` (and after
torch's eager layer with autograd's device threads off), as the interleaved benchmark
orders them: the step's host time (call to return) and its GPU time between CUDA events
from an idle GPU, medians over rounds. What the benchmark's first step of a block pays, and
whether one predecessor costs more than the others (issue 34: that first step took 1.29 ms
through autograd against 0.825 in the steady state, on an H100, 2026-12-06).

    python -m benchmarks.first_step_after --out DIR [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from benchmarks import training_step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    setups = training_step.cuda_variants("small", None, "it times a step from an idle GPU")
    names = list(setups)
    steps = {n: setups[n]()[0] for n in names}
    timed = ["meshfuse_autograd", "meshfuse_hand_written"]
    for n in names:
        for _ in range(5):
            steps[n]()
    torch.cuda.synchronize()

    def block(name, threads: bool):
        with torch.autograd.set_multithreading_enabled(threads):
            for _ in range(10):
                steps[name]()
        torch.cuda.synchronize()

    def first(name, threads: bool) -> tuple[float, float]:
        with torch.autograd.set_multithreading_enabled(threads):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter_ns()
            start.record()
            steps[name]()
            end.record()
            t1 = time.perf_counter_ns()
            torch.cuda.synchronize()
        return (t1 - t0) / 1e3, start.elapsed_time(end) * 1e3

    cases = {f"after {n}": (n, True, True) for n in names}
    cases["after torch_eager, threads off"] = ("torch_eager", False, False)
    records = {f"{v} {c}": [] for v in timed for c in cases}
    for _ in range(args.rounds):
        for v in timed:
            for c, (before, threads_before, threads_step) in cases.items():
                block(before, threads_before)
                records[f"{v} {c}"].append(first(v, threads_step))
    lines = [(f"# {torch.cuda.get_device_name()} ({torch.__version__}), small layer, "
             f"first step of a block after another block (us, medians of {args.rounds}): "
             "host call, GPU step (events)")]
    for k, rs in records.items():
        lines.append(f"{k}: host {statistics.median(r[0] for r in rs):.0f}, "
                     f"gpu {statistics.median(r[1] for r in rs):.0f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "first_step_after.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "first_step_after.json"), "w") as f:
        json.dump(records, f)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
