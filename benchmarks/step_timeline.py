"""The GPT layer's training step (:mod:`benchmarks.training_step`) call by call on the GPU's
timeline: where a replayed step's GPU sits idle, and whether the host was late or something
blocked it (issue 34: a step whose kernels take 1.01-1.02x the hand-written fusion's, summed
kernel by kernel, timed 1.08x of it replayed).

For each variant, after a warm-up (its graphs captured), ``--steps`` consecutive steps are
profiled (torch.profiler, CPU and CUDA), each in ``record_function("call<i>")``, as the
timing loop runs them (no synchronization between steps), and the trace is read by
:func:`benchmarks.call_timeline.analyze`: per step its host time, GPU span, busy and idle
time and the gap to the next step's first kernel; the longest idle gaps (host late, or a
dependency); host runtime calls that block. Written to ``DIR/step_timeline-<variant>.json``
with a summary line per variant in ``DIR/step_timeline.txt`` (medians over the steps but
the first and last).

    python -m benchmarks.step_timeline --out DIR [--size small] [--variants A,B] [--steps 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys

import torch

from benchmarks import call_timeline, training_step
from benchmarks.timing import profiled

DEFAULT_VARIANTS = "meshfuse_autograd,meshfuse_captured,meshfuse_hand_written"


def profile_steps(step, steps: int, path: str) -> dict:
    """``steps`` calls of ``step`` profiled back to back; the trace's analysis."""
    def marked():
        for i in range(steps):
            with torch.profiler.record_function(f"call{i}"):
                step()
    profiled(marked).export_chrome_trace(path)
    with open(path) as f:
        return call_timeline.analyze(json.load(f), "call", min_gap_us=5.0)


def summary(name: str, analysis: dict) -> str:
    """One line: the medians over the inner steps (the first and last left out)."""
    rows = analysis["calls"][1:-1] or analysis["calls"]

    def median(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) * 1e3 if values else float("nan")

    return (f"{name}: per step (us, median of {len(rows)}): host {median('host_ms'):.0f}, "
            f"GPU span {median('gpu_span_ms'):.0f}, compute busy "
            f"{median('compute_busy_ms'):.0f}, idle inside {median('idle_inside_ms'):.0f}, "
            f"gap to the next step {median('gpu_gap_to_next_ms'):.0f}; "
            f"{len(analysis['idle_gaps'])} idle gaps of 5 us or more listed, "
            f"{len(analysis['blocking_host_calls'])} blocking host calls")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--size", default="small", choices=sorted(training_step.SIZES))
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU dry run)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    size = training_step.TINY if args.quick else training_step.SIZES[args.size]
    dtype = torch.bfloat16 if cuda else torch.float32
    setups = training_step.variants(size, device, dtype, "inductor",
                                    chosen=args.variants.split(","))
    where = torch.cuda.get_device_name() if cuda else "cpu"
    lines = [f"# {where} ({torch.__version__}), size {size}"]
    for name, setup in setups.items():
        try:
            step = setup()[0]
        except training_step.Skipped as skipped:
            lines.append(f"{name}: skipped ({skipped})")
            continue
        for _ in range(args.warmup):
            step()
        analysis = profile_steps(step, args.steps,
                                 os.path.join(args.out, f"trace-{name}.json"))
        with open(os.path.join(args.out, f"step_timeline-{name}.json"), "w") as f:
            json.dump(analysis, f, indent=1)
        lines.append(summary(name, analysis))
        del step
        gc.collect()
    text = "\n".join(lines)
    with open(os.path.join(args.out, "step_timeline.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
