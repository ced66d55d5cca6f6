"""Where the host time of a block's first step goes: the small GPT layer's step through
autograd, timed on the host part by part, right after a block of torch's eager layer (the
host's caches as the interleaved benchmark leaves them) and right after a step of its own.

``benchmarks.training_step --per-step`` found on an H100 that the first step of a block of
the layer through autograd takes 0.65 ms more than the steady state, the hand-written
fusion's 0.15 ms more, and ``capture_step``'s 0.03 ms: the GPU waits for the host there.
This splits the autograd step's host time at that first step: the forward call (of which
the autograd node, of which its program's ``execute``), ``torch.autograd.grad`` (of which the
backward node, of which its program), and the GPU's time of the whole step (CUDA events).

    python -m benchmarks.first_step --out DIR   # DIR/first_step.json and .txt
    python -m benchmarks.first_step --quick     # tiny shapes, CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import meshfuse
from benchmarks.training_step import SIZES, TINY, layer_inputs
from meshfuse.examples.gpt import GptBlock, GptBlockWithBackward
from meshfuse.examples.gpt_torch import Gpt3Block


def _last_us(path) -> float:
    return path.last / 1e3


def _program_us(runner) -> float:
    """The last cached call's host time of ``runner`` (replayed or interpreted)."""
    logs = list(runner._host.values())
    paths = [p for log in logs for p in (log.replayed, log.interpreted) if p.calls]
    return max(paths, key=lambda p: p.calls).last / 1e3 if paths else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, s, heads, e = TINY if args.quick else SIZES["small"]
    x, dy, params = layer_inputs((b, s, heads, e), device, dtype)
    mf_dtype = meshfuse.DataType.from_torch(dtype)
    function = GptBlock(b, s, e, heads, mf_dtype).define().as_autograd_function()
    hand = GptBlockWithBackward(b, s, e, heads, mf_dtype).define()
    hand_inputs = [x, dy, *params.values()]
    leaves = [t.detach().requires_grad_() for t in (x, *params.values())]
    eager = Gpt3Block(params, heads)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def event():
        if device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def autograd_step() -> dict:
        start, t0 = event(), time.perf_counter_ns()
        out = function(leaves)[0]
        t1 = time.perf_counter_ns()
        torch.autograd.grad(out, leaves, dy)
        t2 = time.perf_counter_ns()
        end = event()
        sync()
        compiled = next(iter(function._derivations.values()))
        return {"forward_call": (t1 - t0) / 1e3, "forward_node": _last_us(compiled.node_forward),
                "forward_program": _program_us(compiled.derivation.forward_runner),
                "grad_call": (t2 - t1) / 1e3,
                "backward_node": _last_us(compiled.node_backward),
                "backward_program": _program_us(compiled._backward),
                "gpu_step": start.elapsed_time(end) * 1e3 if start is not None else None}

    def hand_step() -> dict:
        start, t0 = event(), time.perf_counter_ns()
        hand.execute(hand_inputs)
        t1 = time.perf_counter_ns()
        end = event()
        sync()
        return {"execute_call": (t1 - t0) / 1e3,
                "gpu_step": start.elapsed_time(end) * 1e3 if start is not None else None}

    def eager_block():
        for _ in range(10):
            torch.autograd.grad(eager(leaves[0]), leaves[:1] + list(eager.parameters()), dy)
        sync()

    for _ in range(5):  # compile, capture, warm up
        autograd_step()
        hand_step()
    eager_block()
    records = {"autograd_cold": [], "autograd_warm": [], "hand_cold": [], "hand_warm": []}
    for _ in range(args.rounds):
        eager_block()
        records["autograd_cold"].append(autograd_step())
        records["autograd_warm"].append(autograd_step())
        eager_block()
        records["hand_cold"].append(hand_step())
        records["hand_warm"].append(hand_step())
    summary = {case: {k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None
                      for k in rs[0]} for case, rs in records.items()}
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "size": [b, s, heads, e], "rounds": args.rounds,
              "median_us": summary, "records": records}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "first_step.json"), "w") as f:
        json.dump(report, f, indent=1)
    title = (f"# {report['device']} ({report['torch']}), size {report['size']}, medians of "
             f"{args.rounds} rounds (us; cold: right after a block of torch's eager layer)")
    lines = [title]
    for case, values in summary.items():
        lines.append(f"{case}: " + ", ".join(f"{k} {v:.0f}" for k, v in values.items()
                                             if v is not None))
    with open(os.path.join(args.out, "first_step.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
