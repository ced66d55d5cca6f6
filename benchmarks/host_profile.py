"""Where a step's host time goes on a GPU (issues 31 and 34: steps bound by the host).

``python -m benchmarks.host_profile --out DIR [--case ce|gpt|all] [--gpt-variants A,B]
[--quick] [--by-step]``

Cases: ``ce``, the cross entropy on indices of :mod:`benchmarks.cross_entropy` (8192 x
32768 bf16 logits; variants ``meshfuse``, ``eager``, ``kernel``); ``gpt``, the small GPT
layer of :mod:`benchmarks.training_step` (variants ``meshfuse_autograd``,
``meshfuse_hand_written``, ``torch_eager``). For each variant, after a warm-up: the host
microseconds per step with the GPU kept busy (:func:`benchmarks.timing.host_us_per_call`),
then ``torch.profiler`` over a few steps (every thread's operators and CUDA runtime calls,
by their own host time: the autograd engine runs a CUDA backward on a thread of its own;
then every kernel by GPU time) and ``cProfile`` (Python functions; on Python 3.12 every
thread's). Before them, the host's speed (:func:`host_speed`: Python, a launch, an empty
autograd node) and, for the GPT layer, its autograd step in parts (:func:`gpt_phases`).
Written to ``DIR/host_profile-<case>-<variant>.txt``.

``--by-step``: instead, each meshfuse variant's kernels by the program step that launched
them (``docs/explain.md``, "Profiling a program step by step"), with CUDA-graph replay off
so that kernels are launched step by step: per step, its GPU (on CPU: CPU) microseconds per
call, in program order, and each program's total; written to
``DIR/host_profile-<case>-<variant>-by-step.txt``. What two variants' GPU time differs by,
step for step.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.autograd import DeviceType

from benchmarks import cross_entropy, training_step
from benchmarks.context import Context
from benchmarks.memory_peak import host_profile
from benchmarks.timing import host_us_per_call, profiled
from meshfuse import DataType
from meshfuse.autodiff.engine_thread import BACKWARD_THREAD_ENV
from meshfuse.autodiff.function import _FusionAutograd
from meshfuse.engine.settings import CUDA_GRAPH_ENV
from meshfuse.examples.gpt import GptBlock
from meshfuse.runtime.interpreter.step_names import PREFIX as STEP_PREFIX


def _ce_variants(tokens: int, vocab: int, device) -> dict[str, Callable[[], object]]:
    x, t = cross_entropy._inputs(tokens, vocab, device)
    steps = cross_entropy.variants(tokens, vocab, device)
    chosen = {name: steps[name] for name in ("meshfuse", "eager", "kernel") if name in steps}
    return {name: _with_function(lambda step=step: step(x, t), getattr(step, "function", None))
            for name, step in chosen.items()}


def _with_function(step: Callable[[], object], function) -> Callable[[], object]:
    """``step`` carrying meshfuse's function or fusion (its ``call_lines``), if any."""
    step.function = function
    return step


GPT_VARIANTS = ("meshfuse_autograd", "meshfuse_hand_written", "torch_eager")


def _gpt_variants(size, device, chosen=GPT_VARIANTS) -> dict[str, Callable[[], object]]:
    setups = training_step.variants(size, device, _dtype(device), "inductor", chosen)
    made = {name: setup()[:2] for name, setup in setups.items()}
    return {name: _with_function(step, owner) for name, (step, owner) in made.items()}


def _dtype(device: torch.device) -> torch.dtype:
    """The GPT layer's element type: bf16 on a GPU, float32 on the CPU (as training_step)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def gpt_phases(size, device, ctx: Context) -> list[str]:
    """The small GPT layer's autograd step in parts, host us per call with the GPU kept
    busy: the whole step (its backward on the calling thread, meshfuse's default), its
    forward alone (the node dropped at once), the backward split at the node, the step
    with the backward handed to the engine's device thread (torch's default:
    ``MESHFUSE_BACKWARD_THREAD=device``), with every object out of the collector's sight,
    and each captured CUDA graph's launch alone (``CUDAGraph.replay``)."""
    b, s, heads, e = size
    dtype = _dtype(device)
    function = GptBlock(b, s, e, heads, DataType.from_torch(dtype)).define() \
        .as_autograd_function()
    x, dy, params = training_step.layer_inputs(size, device, dtype)
    leaves = [t.detach().requires_grad_() for t in [x, *params.values()]]

    def forward():
        return function(leaves)[0]

    def step():
        torch.autograd.grad(forward(), leaves, dy)
    for _ in range(30):
        step()
    figures = {"step": host_us_per_call(ctx, step, calls=10)["host_us"],
               "forward alone": host_us_per_call(ctx, forward, calls=10)["host_us"]}
    figures |= _backward_split(forward, leaves, dy)
    os.environ[BACKWARD_THREAD_ENV] = "device"  # torch's default: the device's thread
    try:
        with torch.autograd.set_multithreading_enabled(True):
            figures["step, backward on the engine's device thread"] = host_us_per_call(
                ctx, step, calls=10)["host_us"]
    finally:
        del os.environ[BACKWARD_THREAD_ENV]
    gc.collect()
    gc.freeze()  # every object so far out of the collector's sight: what collections cost
    figures["step, objects frozen"] = host_us_per_call(ctx, step, calls=10)["host_us"]
    gc.unfreeze()
    (compiled,) = function._derivations.values()
    for name, runner in (("forward", compiled.derivation.forward_runner),
                         ("backward", compiled._backward)):
        # The graph the warm-up captured first: its inputs still lie at its captured
        # addresses (the layer's leaves, the first forward graph's outputs). A graph
        # captured for another set (a forward the interpreter ran) would read freed memory:
        # the first version of this loop launched them all, and one met an illegal address.
        for replay in runner._replays.values():
            for graphs in itertools.islice(replay._graphs.values(), 1):
                figures[f"{name} graph launch"] = host_us_per_call(
                    ctx, graphs[0]._graph.replay, calls=10)["host_us"]
    return ["GPT layer autograd step in parts (host us/call, GPU busy): " + ", ".join(
        f"{k} {v:.0f}" for k, v in figures.items())]


def _backward_split(forward, leaves, dy, steps: int = 200) -> dict[str, float]:
    """The backward's host time split at the node: from ``autograd.grad``'s call to the
    node's backward (the engine reaching the node), the node, and from its return to
    ``grad``'s (median us over ``steps``, the GPU not kept busy: the replays launch only)."""
    node = _FusionAutograd
    original = node.backward
    marks = []

    def backward(ctx, *cotangents):
        marks.append(time.perf_counter())
        result = original(ctx, *cotangents)
        marks.append(time.perf_counter())
        return result
    node.backward = staticmethod(backward)
    parts = {"engine to node": [], "node": [], "node to grad's return": []}
    try:
        for _ in range(steps):
            out = forward()
            marks.clear()
            begin = time.perf_counter()
            torch.autograd.grad(out, leaves, dy)
            end = time.perf_counter()
            for name, (a, b) in zip(parts, ((begin, marks[0]), tuple(marks), (marks[1], end))):
                parts[name].append((b - a) * 1e6)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    finally:
        node.backward = original
    return {f"backward: {name}": statistics.median(v) for name, v in parts.items()}


def _torch_profile(step: Callable[[], object], steps: int, rows: int = 40) -> list[str]:
    """``torch.profiler``'s table of ``steps`` steps by self CPU time (every thread)."""
    averages = profiled(lambda: _steps(step, steps)).key_averages()
    lines = [f"torch.profiler over {steps} steps, by self CPU time:",
             *averages.table(sort_by="self_cpu_time_total", row_limit=rows).splitlines()]
    if torch.cuda.is_available():  # every kernel: what two variants' GPU work differs by
        lines += [f"the same {steps} steps' kernels, by GPU time:",
                  *averages.table(sort_by="self_cuda_time_total", row_limit=100).splitlines()]
    return lines


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


def by_step(name: str, step: Callable[[], object], calls: int = 20) -> list[str]:
    """``step``'s time per program step (see the module doc): ``calls`` calls profiled
    after a warm-up; replay must be off where its runners were made."""
    for _ in range(5):
        step()
    cuda = torch.cuda.is_available()
    prof = profiled(lambda: _steps(step, calls))
    rows = []
    for event in prof.key_averages():
        # the step's range on the host, whose device time is its kernels' (on CUDA, the
        # profiler also shows the range on the GPU's timeline, by the same name: from its
        # first kernel's start to its last's end, waits for the host included)
        if event.key.startswith(STEP_PREFIX) and event.device_type == DeviceType.CPU:
            index, rest = event.key.removeprefix(STEP_PREFIX).split(" of ", 1)
            count, label = rest.split(": ", 1)
            us = (event.device_time_total if cuda else event.cpu_time_total) / calls
            rows.append((int(count), int(index), us, event.count / calls, label))
    unit = "GPU" if cuda else "CPU"
    title = f"# {name}: {unit} us per call of each program step, over {calls} calls"
    lines = [f"{title} (MESHFUSE_CUDA_GRAPH=0)"]
    for count, group in itertools.groupby(sorted(rows), key=lambda r: r[0]):
        group = list(group)
        lines.append(f"program of {count} steps: {sum(r[2] for r in group):.1f} us")
        lines += [f"  {index:4d} {us:9.1f} us  x{runs:g}  {label}"
                  for _, index, us, runs, label in group]
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
    for where in dict.fromkeys([device, torch.device("cpu")]):
        figures |= _autograd_figures(where, per_call)
    return ["host speed (us per call): " + ", ".join(f"{k} {v:.2f}"
                                                     for k, v in figures.items())]


class _Identity(torch.autograd.Function):
    """An autograd node that launches nothing: its output is an alias of its first input,
    its gradients are the given tensors (autograd's own cost, without kernels)."""

    @staticmethod
    def forward(ctx, grads, *inputs):
        ctx.grads = grads
        return inputs[0].detach()

    @staticmethod
    def backward(ctx, cotangent):
        return (None, *ctx.grads)


def _autograd_figures(device: torch.device, per_call) -> dict[str, float]:
    """What torch's autograd costs on this host for a node of 13 leaves on ``device``: the
    forward and ``autograd.grad`` (on CUDA the engine runs the backward on a thread of its
    own), with no kernel, then with one small kernel each way."""
    leaves = [torch.ones(4, device=device, requires_grad=True) for _ in range(13)]
    grads = [torch.ones(4, device=device) for _ in range(13)]
    dy = torch.ones(4, device=device)

    def node():
        torch.autograd.grad(_Identity.apply(grads, *leaves), leaves, dy)

    def one_kernel():
        torch.autograd.grad(leaves[0].mul(2), leaves[0], dy)
    with torch.autograd.set_multithreading_enabled(True):  # torch's default
        figures = {f"a node of 13 leaves, forward and grad, on {device.type}":
                   per_call(node, 3000),
                   f"mul and its grad on {device.type}": per_call(one_kernel, 3000)}
    if device.type != "cpu":  # a CPU backward runs on the calling thread anyway
        with torch.autograd.set_multithreading_enabled(False):
            figures[f"the node on {device.type}, backward on the calling thread"] = \
                per_call(node, 3000)
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--case", default="all", choices=("ce", "gpt", "all"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU dry run)")
    parser.add_argument("--gpt-variants", default=",".join(GPT_VARIANTS),
                        help="the GPT layer's variants (names of benchmarks.training_step)")
    parser.add_argument("--by-step", action="store_true",
                        help="each meshfuse variant's time by program step, replay off")
    args = parser.parse_args(argv)
    if args.by_step:  # read when the variants' runners are made
        os.environ[CUDA_GRAPH_ENV] = "0"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ctx = Context(0, 1, 0, device, "nccl" if device.type == "cuda" else "gloo", False)
    cases = {}
    gpt_size = training_step.TINY if args.quick else training_step.SIZES["small"]
    if args.case in ("ce", "all"):
        cases["ce"] = lambda: _ce_variants(*((64, 128) if args.quick else (8192, 32768)),
                                           device)
    if args.case in ("gpt", "all"):
        cases["gpt"] = lambda: _gpt_variants(gpt_size, device,
                                             tuple(args.gpt_variants.split(",")))
    os.makedirs(args.out, exist_ok=True)
    speed = [] if args.by_step else host_speed(device)
    if speed:
        print(speed[0], flush=True)
    if speed and args.case in ("gpt", "all"):
        speed += gpt_phases(gpt_size, device, ctx)
        print(speed[-1], flush=True)
    for case, make in cases.items():
        for name, step in make().items():
            began = time.perf_counter()
            title = f"{case} {name} ({torch.__version__})"
            try:
                if args.by_step:
                    lines = by_step(title, step)
                else:
                    lines = profile(title, step, ctx, calls=10)
                    lines[1:1] = speed
            except Exception as error:  # noqa: BLE001 - one variant's failure is reported
                lines = [f"# {case} {name} failed: {type(error).__name__}: {error}"]
            path = os.path.join(args.out, f"host_profile-{case}-{name}"
                                f"{'-by-step' if args.by_step else ''}.txt")
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
            summary = next((x for x in lines if x.startswith("host us")), lines[0])
            print(f"{case} {name}: {summary} "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
