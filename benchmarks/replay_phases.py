"""The small GPT layer's autograd step through the call patterns of
:func:`benchmarks.host_profile.gpt_phases`, checking after each pattern that the step's
gradients equal its first (interpreted) call's and counting the CUDA graphs captured.

A replayed step must stay at one graph per runner per set of input addresses: the
patterns are plain steps, forwards alone, steps that hold the previous output during the
next forward (a second forward graph, and a second backward graph for its residuals), the
backward on the calling thread, and objects frozen out of the collector's sight. At the
end, each captured graph's keyed input addresses that lie in no live allocation (a graph
captured for a forward the interpreter ran; on 2026-12-04 ten backward graphs came so
from 200 steps holding the previous output, see *Buffers* in
``meshfuse/runtime/replay/pools.py``).

    python -m benchmarks.replay_phases > LOG    # CUDA: the small layer; CPU: tiny, no graphs

Exits with 1 where a pattern's gradients differ or a runner holds more than two graphs.
"""

from __future__ import annotations

import gc
import sys

import torch

from benchmarks import training_step
from benchmarks.context import Context
from benchmarks.harness import check_close
from benchmarks.host_profile import _backward_split
from benchmarks.timing import host_us_per_call
from meshfuse import DataType
from meshfuse.examples.gpt import GptBlock


def _live_blocks(device: torch.device) -> list[tuple[int, int]]:
    """The device memory allocated now, as ``[start, end)`` ranges."""
    live = []
    for segment in torch.cuda.memory_snapshot() if device.type == "cuda" else []:
        at = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live.append((at, at + block["size"]))
            at += block["size"]
    return live


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ctx = Context(0, 1, 0, device, "nccl" if device.type == "cuda" else "gloo", False)
    cuda = device.type == "cuda"
    size = training_step.SIZES["small"] if cuda else training_step.TINY
    b, s, heads, e = size
    dtype = torch.bfloat16 if cuda else torch.float32
    function = GptBlock(b, s, e, heads, DataType.from_torch(dtype)).define() \
        .as_autograd_function()
    x, dy, params = training_step.layer_inputs(size, device, dtype)
    leaves = [t.detach().requires_grad_() for t in [x, *params.values()]]
    expected = [g.detach().clone() for g in torch.autograd.grad(function(leaves)[0], leaves, dy)]

    def forward():
        return function(leaves)[0]

    def step():
        torch.autograd.grad(forward(), leaves, dy)

    def runners():
        (compiled,) = function._derivations.values()
        return (("forward", compiled.derivation.forward_runner),
                ("backward", compiled._backward))

    failures = []

    def check(phase: str) -> None:
        ctx.sync()
        got = torch.autograd.grad(forward(), leaves, dy)
        ctx.sync()
        try:
            check_close(phase, got, expected, 5e-2)
            values = "values ok"
        except ValueError as err:
            values = f"VALUES WRONG: {err}"
            failures.append(values)
        counts = [f"{name}: {replay.graphs} graphs for {len(replay._graphs)} sets of addresses"
                  for name, runner in runners() for replay in runner._replays.values()]
        for name, runner in runners():
            for replay in runner._replays.values():
                if replay.graphs > 2:  # a runner's two buffers
                    failures.append(f"{phase}: {name} {replay.graphs} graphs")
        print(f"[{phase}] {values}; {'; '.join(counts)}", flush=True)

    for _ in range(30):
        step()
    check("warm-up")
    print(host_us_per_call(ctx, step, calls=10))
    check("step")
    print(host_us_per_call(ctx, forward, calls=10))
    check("forward alone")
    print(_backward_split(forward, leaves, dy))
    check("previous output held (backward split)")
    with torch.autograd.set_multithreading_enabled(False):
        print(host_us_per_call(ctx, step, calls=10))
    check("backward on the calling thread")
    gc.collect()
    gc.freeze()
    print(host_us_per_call(ctx, step, calls=10))
    gc.unfreeze()
    check("objects frozen")
    live = _live_blocks(device)
    for name, runner in runners():
        for replay in runner._replays.values():
            for key, graphs in replay._graphs.items():
                addresses = [k for k in key if isinstance(k, int) and k > 2**20]
                dead = [hex(a) for a in addresses if not any(lo <= a < hi for lo, hi in live)]
                print(f"{name}: {len(graphs)} graphs for {len(addresses)} keyed addresses, "
                      f"those in no live allocation: {dead}", flush=True)


    if failures:
        print("FAILED: " + "; ".join(failures), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
