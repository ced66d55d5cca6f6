"""Where a step's host time goes on a GPU (issues 31 and 34: steps bound by the host).

``python -m benchmarks.host_profile --out DIR [--case ce|gpt|all] [--quick]``

Cases: ``ce``, the cross entropy on indices of :mod:`benchmarks.cross_entropy` (8192 x
32768 bf16 logits; variants ``meshfuse``, ``eager``, ``kernel``); ``gpt``, the small GPT
layer of :mod:`benchmarks.training_step` (variants ``meshfuse_autograd``,
``meshfuse_hand_written``, ``torch_eager``). For each variant, after a warm-up: the host
microseconds per step with the GPU kept busy (:func:`benchmarks.timing.host_us_per_call`),
the same split into the step's calls where the step has parts (``forward``: the call that
returns the output; the rest: the backward), then ``torch.profiler`` over a few steps (every
thread's operators and CUDA runtime calls, by their own host time: the autograd engine
runs a CUDA backward on a thread of its own) and ``cProfile`` (Python functions; on Python
3.12 every thread's). Written to ``DIR/host_profile-<case>-<variant>.txt``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

from benchmarks import cross_entropy, training_step
from benchmarks.context import Context
from benchmarks.memory_peak import host_profile
from benchmarks.timing import host_us_per_call


def _ce_variants(tokens: int, vocab: int, device) -> dict[str, Callable[[], object]]:
    x, t = cross_entropy._inputs(tokens, vocab, device)
    steps = cross_entropy.variants(tokens, vocab, device)
    chosen = ("meshfuse", "eager", "kernel")
    chosen = {name: steps[name] for name in chosen if name in steps}
    return {name: _with_function(lambda step=step: step(x, t), getattr(step, "function", None))
            for name, step in chosen.items()}


def _with_function(step: Callable[[], object], function) -> Callable[[], object]:
    """``step`` carrying meshfuse's function or fusion (its ``call_lines``), if any."""
    step.function = function
    return step


def _gpt_variants(size, device) -> dict[str, Callable[[], object]]:
    chosen = ("meshfuse_autograd", "meshfuse_hand_written", "torch_eager")
    setups = training_step.variants(size, device, torch.bfloat16 if device.type == "cuda"
                                    else torch.float32, "inductor", chosen)
    made = {name: setup()[:2] for name, setup in setups.items()}
    return {name: _with_function(step, owner) for name, (step, owner) in made.items()}


def _torch_profile(step: Callable[[], object], steps: int, rows: int = 40) -> list[str]:
    """``torch.profiler``'s table of ``steps`` steps by self CPU time (every thread)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return [f"torch.profiler over {steps} steps, by self CPU time:", *table.splitlines()]


def profile(name: str, step: Callable[[], object], ctx: Context, calls: int) -> list[str]:
    for _ in range(30):
        step()
    host = host_us_per_call(ctx, step, calls=calls)
    gpu = host["gpu_us"] if host["gpu_us"] is None else round(host["gpu_us"])
    summary = (f"host us/step (GPU kept busy): {host['host_us']:.0f}, GPU us/step back to "
               f"back: {gpu}, never waited for the GPU: {host['gpu_busy']}")
    lines = [f"# {name}", summary]
    function = getattr(step, "function", None)
    if hasattr(function, "call_lines"):
        lines += ["meshfuse's own account:", *function.call_lines()]
    lines += _torch_profile(step, 20)
    lines += host_profile(lambda: _steps(step, 50), rows=40)
    return lines


def _steps(step: Callable[[], object], n: int) -> None:
    """``n`` steps, none of whose results is kept (a kept result holds a replayed graph's
    outputs: the next call would not replay)."""
    for _ in range(n):
        step()


def host_speed(device: torch.device) -> list[str]:
    """How fast this host runs Python, torch's dispatcher and a launch: the scale of every
    host time here (hosts of the same GPU differ by several times)."""
    def per_call(fn, n: int) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6
    small = torch.ones(4, device=device)
    figures = {"a Python loop of 1000 additions": per_call(lambda: sum(range(1000)), 2000),
               "torch.empty(0) on the CPU": per_call(lambda: torch.empty(0), 20000),
               f"small.add(1) on {device.type}": per_call(lambda: small.add(1), 20000),
               "small.detach()": per_call(small.detach, 20000)}
    return ["host speed (us per call): " + ", ".join(f"{k} {v:.2f}"
                                                     for k, v in figures.items())]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--case", default="all", choices=("ce", "gpt", "all"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU dry run)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ctx = Context(0, 1, 0, device, "nccl" if device.type == "cuda" else "gloo", False)
    cases = {}
    if args.case in ("ce", "all"):
        cases["ce"] = lambda: _ce_variants(*((64, 128) if args.quick else (8192, 32768)),
                                           device)
    if args.case in ("gpt", "all"):
        cases["gpt"] = lambda: _gpt_variants(training_step.TINY if args.quick
                                             else training_step.SIZES["small"], device)
    os.makedirs(args.out, exist_ok=True)
    speed = host_speed(device)
    print(speed[0], flush=True)
    for case, make in cases.items():
        for name, step in make().items():
            began = time.perf_counter()
            try:
                lines = profile(f"{case} {name} ({torch.__version__})", step, ctx, calls=10)
                lines[1:1] = speed
            except Exception as error:  # noqa: BLE001 - one variant's failure is reported
                lines = [f"# {case} {name} failed: {type(error).__name__}: {error}"]
            path = os.path.join(args.out, f"host_profile-{case}-{name}.txt")
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
            summary = next((x for x in lines if x.startswith("host us")), lines[0])
            print(f"{case} {name}: {summary} "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
