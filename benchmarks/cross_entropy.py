"""Cross entropy on class indices, forward and backward, at one rank (issue 31).

``python -m benchmarks.cross_entropy [--out DIR] [--quick]`` from the repository root.

Logits ``[tokens, vocab]`` in bfloat16 that require grad, int64 targets (a few ignored),
``mean`` reduction; one step is the loss and the logits' gradient. Variants:

- ``floor``: a copy of the logits (read them, write a tensor of their size: what any fused
  forward+backward must at least do);
- ``eager``: ``F.cross_entropy(logits.float(), target)`` and ``backward()``;
- ``compile``: the same function through ``torch.compile``;
- ``meshfuse``: ``fd.ops.cross_entropy`` in a fusion run through
  ``fd.as_autograd_function()`` (the derived backward), and ``meshfuse_compiled`` the same
  with ``compile=True`` (fused segments by Inductor). Both run the fused op
  ``cross_entropy_fwd`` (one Triton kernel writes the loss and the gradient; the backward's
  ``cross_entropy_bwd`` sees a cotangent of 1.0 and returns the gradient as it is);
- ``meshfuse_captured`` (CUDA): ``meshfuse``'s step under ``meshfuse.capture_step``, one
  CUDA graph per step, reading the logits in place (as a captured training step reads its
  head's): the fusion's cost without the host's;
- ``kernel`` (CUDA): the same two Triton kernels called directly
  (``meshfuse.ops.cross_entropy.kernels``), without the fusion around them: what the
  framework adds is ``meshfuse`` less this; ``kernel_two_pass`` forces the two reads of a
  row that does not fit on chip (at 32k classes: what holding the row in registers saves).

Each round times every variant in turn (interleaved, so that clocks and neighbours weigh
on all alike), ``--iters`` steps between two CUDA events; reported: the median over rounds
of the time per step, its ratio to the floor, and the peak memory above the inputs
(``torch.cuda.max_memory_allocated`` after a reset, less what was allocated before) beside
the gradient's own size, and what a variant's timed steps left allocated (``kept``: memory a
variant holds across steps, such as CUDA graphs captured on the way, or leaks), and the host's
microseconds per step with the GPU kept busy (``benchmarks.timing.host_us_per_call``: a step
whose host time exceeds its GPU time is bound by the host; "waits": a step waited for the
GPU, it synchronizes) beside the GPU's time per step run back to back. Every
variant's loss and gradient are checked against eager's first.
Results: ``<out>/<date>-<gpu>-cross_entropy.{json,md}`` (``--out`` defaults to ``$OUT`` when
set, else ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.context import Context
from benchmarks.timing import host_us_per_call
from meshfuse import DataType, FusionDefinition
from meshfuse.ops.cross_entropy import kernels

IGNORE = -100
MIB = 2**20


def _inputs(tokens: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, vocab, generator=gen, device=device).mul_(3).bfloat16()
    t = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    t[::97] = IGNORE
    return x.requires_grad_(), t


def _torch_step(fn: Callable) -> Callable:
    def step(x, t):
        x.grad = None
        loss = fn(x, t)
        loss.backward()
        return loss, x.grad
    return step


def _eager(x, t):
    return F.cross_entropy(x.float(), t, ignore_index=IGNORE)


def _meshfuse_step(tokens: int, vocab: int, compile: bool) -> Callable:
    with FusionDefinition() as fd:
        logits = fd.define_tensor([tokens, vocab], dtype=DataType.BFloat16)
        target = fd.define_tensor([tokens], dtype=DataType.Int)
        fd.add_output(fd.ops.cross_entropy(logits, target, ignore_index=IGNORE))
    function = fd.as_autograd_function(compile=compile or None)

    def step(x, t):
        x.grad = None
        (loss,) = function([x, t])
        loss.backward()
        return loss, x.grad
    step.function = function  # what its calls did: function.call_lines()
    return step


def _meshfuse_captured_step(tokens: int, vocab: int) -> Callable:
    """``meshfuse``'s step under ``meshfuse.capture_step``: forward and backward replayed as
    one CUDA graph (no Python, no autograd engine per step), reading the logits where they
    lie, as a captured training step reads the logits its head made in the same graph (the
    logits are not one of its arguments, which it would copy in); its results are the
    graph's, valid until the next step. Bound to the first call's tensors."""
    import meshfuse

    inner = _meshfuse_step(tokens, vocab, compile=False)
    bound: dict = {}

    def step(x, t):
        if not bound:
            bound["inputs"] = (x, t)
            bound["step"] = meshfuse.capture_step(lambda: inner(x, t), copy_outputs=False)
        if bound["inputs"][0] is not x or bound["inputs"][1] is not t:
            raise ValueError("meshfuse_captured reads the logits of its first call")
        return bound["step"]()
    step.function = inner.function
    return step


def _kernel_step(one_block_max: int) -> Callable:
    def step(x, t):
        count = (t != IGNORE).sum().float()
        loss, grad, applied = kernels.forward(x.detach(), t, count, IGNORE, 0.0,
                                              one_block_max=one_block_max)
        kernels.scale_in_place(grad, applied, torch.ones((), device=x.device))
        return loss, grad
    return step


def _floor(x, t):
    return None, x.detach().clone()


def variants(tokens: int, vocab: int, device) -> dict[str, Callable]:
    steps = {
        "floor": _floor,
        "eager": _torch_step(_eager),
        "compile": _torch_step(torch.compile(_eager)),
        "meshfuse": _meshfuse_step(tokens, vocab, compile=False),
        "meshfuse_compiled": _meshfuse_step(tokens, vocab, compile=True),
    }
    if device.type == "cuda":
        steps["meshfuse_captured"] = _meshfuse_captured_step(tokens, vocab)
        steps["kernel"] = _kernel_step(kernels.ONE_BLOCK_MAX)
        steps["kernel_two_pass"] = _kernel_step(0)
    return steps


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(step, x, t, iters: int, device) -> float:
    """Milliseconds per step over ``iters`` steps (CUDA events; wall clock on the CPU)."""
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step(x, t)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    begin = datetime.datetime.now()
    for _ in range(iters):
        step(x, t)
    return (datetime.datetime.now() - begin).total_seconds() * 1e3 / iters


def _allocated(device) -> int:
    """Bytes allocated on ``device`` (0 on the CPU)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _peak_extra(step, x, t, device) -> float | None:
    """MiB allocated at the peak of one step above what was allocated before it."""
    if device.type != "cuda":
        return None
    x.grad = None
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(x, t)
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / MIB


def _check(name: str, step, x, t, reference) -> str:
    loss, grad = step(x, t)
    ref_loss, ref_grad = reference
    problems = []
    if loss is not None and not torch.allclose(loss.float(), ref_loss.float(), rtol=2e-2,
                                               atol=2e-2):
        problems.append(f"loss {loss.item():.5f} vs eager {ref_loss.item():.5f}")
    if name != "floor" and not torch.allclose(grad.float(), ref_grad.float(), rtol=2e-2,
                                              atol=1e-4):
        err = (grad.float() - ref_grad.float()).abs().max().item()
        problems.append(f"gradient off by {err:.3g}")
    return "; ".join(problems) or "ok"


def run_size(tokens: int, vocab: int, rounds: int, iters: int, device) -> list[dict]:
    x, t = _inputs(tokens, vocab, device)
    steps = variants(tokens, vocab, device)
    reference = tuple(v.detach().clone() for v in steps["eager"](x, t))
    records = {}
    for name, step in steps.items():
        try:
            for _ in range(2):  # warm-up: compilation, caches
                step(x, t)
            records[name] = {"check": _check(name, step, x, t, reference),
                             "peak_extra_mib": _peak_extra(step, x, t, device), "times": []}
        except Exception as e:  # noqa: BLE001 (a variant that fails is reported, not fatal)
            records[name] = {"check": f"error: {type(e).__name__}: {e}"[:300], "times": []}
    for _ in range(rounds):
        for name, step in steps.items():
            if not records[name]["check"].startswith("error"):
                before = _allocated(device)
                records[name]["times"].append(_time(step, x, t, iters, device))
                records[name]["grew"] = records[name].get("grew", 0) + _allocated(device) - before
    ctx = Context(0, 1, 0, device, "nccl" if device.type == "cuda" else "gloo", False)
    for name, step in steps.items():
        if not records[name]["check"].startswith("error"):
            records[name]["host"] = host_us_per_call(ctx, lambda step=step: step(x, t),
                                                     calls=iters,
                                                     rounds=3)
    floor = statistics.median(records["floor"]["times"])
    grad_mib = x.numel() * x.element_size() / MIB
    out = []
    for name, r in records.items():
        median = statistics.median(r["times"]) if r["times"] else None
        out.append({"tokens": tokens, "vocab": vocab, "variant": name, "median_ms": median,
                    "x_floor": None if median is None else median / floor,
                    "peak_extra_mib": r.get("peak_extra_mib"), "grad_mib": grad_mib,
                    "check": r["check"], "kept_mib": r.get("grew", 0) / MIB,
                    **r.get("host", {})})
    return out


def _table(records: list[dict]) -> str:
    head = ("| tokens | vocab | variant | ms/step | x floor | host us/step | GPU us/step | "
            "peak extra MiB | gradient MiB | kept MiB | check |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        ms = "-" if r["median_ms"] is None else f"{r['median_ms']:.3f}"
        ratio = "-" if r["x_floor"] is None else f"{r['x_floor']:.2f}"
        peak = "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}"
        host = "-" if r.get("host_us") is None else f"{r['host_us']:.0f}" + (
            "" if r.get("gpu_busy") in (True, None) else " (waits)")
        gpu = "-" if r.get("gpu_us") is None else f"{r['gpu_us']:.0f}"
        lines.append(f"| {r['tokens']} | {r['vocab']} | {r['variant']} | {ms} | {ratio} | "
                     f"{host} | {gpu} | {peak} | {r['grad_mib']:.0f} | {r['kept_mib']:.0f} | "
                     f"{r['check']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", default="32768,131072")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens, vocabs = args.tokens, [int(v) for v in args.vocab.split(",")]
    if args.quick:
        tokens, vocabs, args.rounds, args.iters = 64, [96], 2, 2
    records = []
    for vocab in vocabs:
        records += run_size(tokens, vocab, args.rounds, args.iters, device)
    gpu = torch.cuda.get_device_name(device).replace(" ", "-").lower() \
        if device.type == "cuda" else "cpu"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d-%H%M")
    stem = os.path.join(args.out, f"{stamp}-{gpu}-cross_entropy" + ("-quick" if args.quick
                                                                     else ""))
    os.makedirs(args.out, exist_ok=True)
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": gpu,
           "commit": os.environ.get("MESHFUSE_COMMIT", "unknown"), "args": vars(args)}
    with open(stem + ".json", "w") as f:
        json.dump({"environment": env, "records": records}, f, indent=1)
    table = _table(records)
    with open(stem + ".md", "w") as f:
        f.write(f"# Cross entropy on indices, fwd+bwd, bf16 logits\n\n{json.dumps(env)}\n\n"
                f"{table}\n")
    print(table)
    print(f"written: {stem}.json, {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
