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

Then a program fed its own output (``x = f(x, w)``, 400 calls): its values, and its graphs,
which must stop growing. Exits with 1 where a pattern's values differ, a GPT runner holds
more than two graphs (but those dropped for a graph reading a steady cotangent in place),
or the loop's graphs grow.
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
from meshfuse import DataType, FusionDefinition
from meshfuse.examples.gpt import GptBlock
from meshfuse.runtime.replay import automatic


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
                # a runner's two buffers (a copying graph dropped for one reading a
                # steady input in place does not count)
                if replay.graphs - replay.replaced > 2:
                    failures.append(f"{phase}: {name} {replay.graphs} graphs, "
                                    f"{replay.replaced} of them dropped")
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


    failures += _self_fed_loop(device, dtype)
    if failures:
        print("FAILED: " + "; ".join(failures), flush=True)
    return 1 if failures else 0


def _self_fed_loop(device: torch.device, dtype: torch.dtype, calls: int = 400) -> list[str]:
    """``x = tanh(x * w)`` for ``calls`` calls through one fusion's ``execute`` (its output
    fed back, ``w`` the same): the values against torch's loop, and the graphs captured,
    which must stop growing (``automatic.MAX_CHAIN``) and replay most calls."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([256, 256], dtype=DataType.from_torch(dtype))
        w = fd.define_tensor([256, 256], dtype=DataType.from_torch(dtype))
        # bf16 products compute in float32: the output cast back to be fed in again
        fd.add_output(fd.ops.cast(fd.ops.tanh(fd.ops.mul(x, w)), x.dtype))
    gen = torch.Generator(device).manual_seed(3)
    w = torch.rand(256, 256, generator=gen, device=device).to(dtype) + 0.5
    x = torch.randn(256, 256, generator=gen, device=device).to(dtype)
    ref = x.float()
    graphs = []
    for _ in range(calls):
        (x,) = fd.execute([x, w])
        ref = torch.tanh(ref * w.float())
        graphs.append(sum(r.graphs for r in fd._get_runner()._replays.values()))
    error = ((x.float() - ref).norm() / ref.norm()).item()
    print(f"[a program fed its own output, {calls} calls] relative error {error:.1e}; "
          f"graphs after {calls // 2} calls {graphs[calls // 2 - 1]}, after {calls} "
          f"{graphs[-1]}", flush=True)
    failures = [] if error < 5e-2 else [f"self-fed loop: relative error {error:.1e}"]
    if graphs[-1] > 2 * automatic.MAX_CHAIN + 4 or graphs[-1] != graphs[calls // 2 - 1]:
        failures.append(f"self-fed loop: {graphs[-1]} graphs, still growing or past the chain")
    return failures


if __name__ == "__main__":
    sys.exit(main())
