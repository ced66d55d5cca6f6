"""GPU probe of the context-parallel ring's time per call (issue 14): where the milliseconds
between a profiled call's GPU span and the timed median of back-to-back calls go.

    torchrun --nproc-per-node 2 -m benchmarks.cp_probe OUT [--seq 32768] [--calls 20]
        [--full] [--strategy ring] [--quick]

Runs the benchmark's attention (bf16 forward+backward, b=1, h=32, head dim 128, sequence
zig-zag split, causal unless ``--full``, the ring unless ``--strategy``) and writes under
``OUT``: ``probe.json`` (every rank's numbers), ``probe.md`` (a summary), and per rank
``trace_rank<r>.json`` (a torch.profiler trace of three back-to-back calls, ``call0`` to
``call2``) with its analysis ``timeline_rank<r>.json`` (:mod:`benchmarks.call_timeline`).

Phases, each after a barrier of every rank with idle devices:

1. ``back_to_back``: ``--calls`` calls, each between two CUDA events: each call's GPU time
   (start to end event), the gap to the next call's start event, its host time, and whether
   the previous call's GPU work had already finished when the call began (``drained``: the
   GPU waited for the host). Host start times (the monotonic clock, shared by the processes
   of a host) give the ranks' skew.
2. ``synced``: the same, the device synchronized before each call.
3. ``host_ahead``: :func:`benchmarks.timing.host_us_per_call`, calls queued behind a sleep
   kernel: the pure host time of a call, and ``gpu_busy`` False if a call waited for the GPU
   anyway (something in it synchronizes).
4. ``sync_debug``: one call under ``torch.cuda.set_sync_debug_mode("warn")``: every
   synchronizing torch operation, with its Python stack.
5. ``allocator``: the caching allocator's counters across the back-to-back calls (device
   allocations and retries made per call).
6. ``profile``: three back-to-back calls under torch.profiler (CPU and CUDA; no Python
   stacks, whose host cost would change the timeline being measured).
7. ``gpu_only``: five back-to-back calls under torch.profiler recording GPU activity only
   (nearly no host cost), a marker kernel queued between calls
   (:func:`benchmarks.call_timeline.marked_calls`): each call's GPU time, busy and idle.
8. ``compute_only``: this rank's kernels of a ring call (both steps' blocks, forward and
   backward, merges and sums) on its local tensors with no communication and no program,
   back to back between CUDA events: the compute floor of a call, timed as phase 1 is.
9. ``one_gpu``: the whole problem on this GPU as bare ``torch.ops.aten`` calls of the
   benchmark's baseline kernel (cuDNN on Hopper; the ideal is its time over the ranks).

Phases 1, 8 and 9 also sample the GPU's SM clock and power draw (NVML) as they run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import threading
import time
import traceback
import warnings
from typing import Self

import torch

import meshfuse
from benchmarks import call_timeline, context
from benchmarks.cases.attention import raw_aten
from benchmarks.cases.context_parallel import (
    QUICK_SIZES,
    SIZES,
    CausalAttention,
    global_inputs,
    one_gpu_kernel,
)
from benchmarks.timing import host_us_per_call
from meshfuse.parallel.context.blocks import (
    Merged,
    add_key_gradients,
    backward_blocks,
    forward_blocks,
    sums_dtype,
)
from meshfuse.parallel.context.record import ContextParallel, runs_of

ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free",
                      "segment.all.allocated", "num_sync_all_streams")


def _setup(ctx, sizes, s: int, causal: bool, strategy: str):
    """The attention program and this rank's inputs; returns ``call()``."""
    mesh = meshfuse.DeviceMesh(range(ctx.world))
    fd = CausalAttention(sizes, s, causal, mesh, True, strategy)
    fd.define()
    full = global_inputs(ctx, sizes, s)
    local = [meshfuse.shard_tensor(t, tv) for t, tv in zip(full, fd.tensors[:4])]
    return lambda: fd.execute(local)


def _events_phase(ctx, call, calls: int, synced: bool) -> dict:
    """Phases 1 and 2: per call GPU ms, gap to the next call, host ms, drained, host start."""
    ctx.barrier()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    host, begun, drained = [], [], []
    for i in range(calls):
        if synced:
            ctx.sync()
        drained.append(bool(i and ends[i - 1].query()))
        begun.append(time.perf_counter())
        starts[i].record()
        call()
        ends[i].record()
        host.append((time.perf_counter() - begun[-1]) * 1e3)
    ctx.sync()
    gpu = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    gaps = [e.elapsed_time(s) for e, s in zip(ends, starts[1:])]
    return {"gpu_ms": _rounded(gpu), "gap_to_next_ms": _rounded(gaps),
            "host_ms": _rounded(host), "drained": drained, "host_start_s": begun,
            "median_gpu_ms": round(statistics.median(gpu), 3),
            "median_host_ms": round(statistics.median(host), 3),
            "median_gap_ms": round(statistics.median(gaps), 3) if gaps else None,
            "per_call_ms": round(starts[0].elapsed_time(ends[-1]) / calls, 3)}


def _rounded(values) -> list[float]:
    return [round(v, 3) for v in values]


class Clocks:
    """Samples this GPU's SM clock (MHz) and power draw (W) through NVML
    (``torch.cuda.clock_rate``, ``torch.cuda.power_draw``) every 10 ms while a phase runs:
    a kernel that slows down as the GPU stays busy shows here as a falling clock."""

    def __init__(self, device):
        self.device, self.samples, self.error = device, [], None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((torch.cuda.clock_rate(self.device),
                                     torch.cuda.power_draw(self.device) / 1e3))
            except Exception as e:  # noqa: BLE001 - NVML may be missing: say so, measure on
                self.error = f"{type(e).__name__}: {e}"[:200]
                return
            time.sleep(0.01)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {"error": self.error or "no samples"}
        clocks, power = zip(*self.samples)
        return {"samples": len(clocks), "clock_mhz": _spread(clocks), "power_w": _spread(power)}


def _spread(values) -> dict:
    return {"min": round(min(values), 1), "median": round(statistics.median(values), 1),
            "max": round(max(values), 1)}


def _clocked(ctx, phase):
    """``phase()``'s result with the GPU's clocks and power while it ran."""
    with Clocks(ctx.device) as clocks:
        result = phase()
    return dict(result, clocks=clocks.summary())


def _sync_debug(ctx, call) -> list[dict]:
    """Phase 4: the synchronizing operations of one call, each with its Python stack."""
    found: list[dict] = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "prototype feature" in str(message):  # set_sync_debug_mode's own notice
            return
        found.append({"message": str(message)[:300],
                      "stack": [s.strip() for s in traceback.format_stack(limit=14)[:-1]]})

    ctx.sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        saved, warnings.showwarning = warnings.showwarning, show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = saved
    ctx.sync()
    return found


def _allocator(ctx, call, calls: int) -> dict:
    """Phase 5: allocator counters before and after ``calls`` back-to-back calls."""
    ctx.barrier()
    before = torch.cuda.memory_stats(ctx.device)
    for _ in range(calls):
        call()
    ctx.sync()
    after = torch.cuda.memory_stats(ctx.device)
    return {k: after.get(k, 0) - before.get(k, 0) for k in ALLOCATOR_COUNTERS}


def _profile(ctx, call, out: str) -> dict:
    """Phase 6: a trace of three back-to-back calls and its analysis."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ctx.barrier()
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(3):
            with torch.profiler.record_function(f"call{i}"):
                call()
        ctx.sync()
    path = os.path.join(out, f"trace_rank{ctx.rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        timeline = call_timeline.analyze(json.load(f), "call")
    with open(os.path.join(out, f"timeline_rank{ctx.rank}.json"), "w") as f:
        json.dump(timeline, f, indent=1)
    return timeline


def _gpu_only(ctx, call, out: str, calls: int = 5) -> list[dict]:
    """Phase 7: GPU activity only, calls told apart by a marker kernel."""
    ctx.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(1000)
        for _ in range(calls):
            call()
            torch.cuda._sleep(1000)
        ctx.sync()
    path = os.path.join(out, f"gpu_only_rank{ctx.rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return call_timeline.marked_calls(json.load(f))


def _compute_call(ctx, sizes, s: int, causal: bool, n: int):
    """Phase 8's call: the per-block work of this rank of a ring of ``n`` (on one GPU:
    position 0's), without transfers (the block of another position is stood in for by
    this rank's own, of the same shape)."""
    rank = ctx.rank if ctx.world == n else 0
    chunks = torch.arange(s).chunk(2 * n)
    rows = tuple(runs_of(torch.cat([chunks[r], chunks[2 * n - 1 - r]])) for r in range(n))
    shape = (sizes["b"], sizes["h"], s // n, sizes["head_dim"])
    q, k, v, g = (torch.randn(shape, device=ctx.device, dtype=torch.bfloat16) for _ in range(4))
    forward = ContextParallel("ring", 0, tuple(range(n)), rank, rows, False)
    backward = dataclasses.replace(forward, backward=True)

    def call():
        merged = Merged(q, v, sums_dtype(forward, q))
        for step in range(n):
            forward_blocks(q, k, v, None, causal, forward, forward.holder(step), merged)
        attn, lse = merged.result(q.dtype)
        dq, sums = None, (None, None)
        for step in range(n):
            dq, parts = backward_blocks(g, q, k, v, attn, lse, None, causal, backward,
                                        backward.holder(step), dq, None)
            sums = add_key_gradients(parts, sums, (k, v), sums_dtype(backward, q))
        return dq, sums

    return call


def _compute_only(ctx, sizes, s: int, causal: bool, calls: int, n: int) -> dict:
    """Phase 8: :func:`_compute_call` timed as phase 1 times the program."""
    call = _compute_call(ctx, sizes, s, causal, n)
    for _ in range(3):
        call()
    result = _events_phase(ctx, call, calls, synced=False)
    result.pop("host_start_s")
    return dict(result, ranks=n)


def _one_gpu(ctx, sizes, s: int, causal: bool, calls: int) -> dict:
    """Phase 9: the whole problem on this GPU as bare ``torch.ops.aten`` calls of the
    benchmark's baseline kernel (the ideal time on ``n`` GPUs is this over ``n``)."""
    shape = (sizes["b"], sizes["h"], s, sizes["head_dim"])
    q, k, v, g = (torch.randn(shape, device=ctx.device, dtype=torch.bfloat16) for _ in range(4))
    kernel = one_gpu_kernel(q.device)

    def call():
        return raw_aten(kernel, q, k, v, g, causal)

    for _ in range(3):
        call()
    result = _events_phase(ctx, call, calls, synced=False)
    result.pop("host_start_s")
    return dict(result, backend=kernel)


def probe(ctx, args) -> dict:
    """Every phase on this rank (see the module doc); a phase that fails records its error
    (under ``errors``) and the others still run."""
    sizes = QUICK_SIZES if args.quick else SIZES
    causal = not args.full
    call = _setup(ctx, sizes, args.seq, causal, args.strategy)
    for _ in range(3):  # build, first kernels, cuDNN plans
        call()
    ctx.sync()
    phases = {"profile": lambda: _profile(ctx, call, args.out)}
    if ctx.cuda:
        n = max(ctx.world, args.ranks)
        phases = {
            "back_to_back": lambda: _clocked(
                ctx, lambda: _events_phase(ctx, call, args.calls, synced=False)),
            "synced": lambda: _events_phase(ctx, call, args.calls, synced=True),
            "host_ahead": lambda: host_us_per_call(ctx, call, calls=3, rounds=3),
            "sync_debug": lambda: _sync_debug(ctx, call),
            "allocator": lambda: _allocator(ctx, call, args.calls),
            "gpu_only": lambda: _gpu_only(ctx, call, args.out),
            **phases,
            "compute_only": lambda: _clocked(
                ctx, lambda: _compute_only(ctx, sizes, args.seq, causal, args.calls, n)),
            "one_gpu": lambda: _clocked(
                ctx, lambda: _one_gpu(ctx, sizes, args.seq, causal, max(args.calls // 2, 3))),
        }
    result: dict = {"rank": ctx.rank, "errors": {}}
    for name, phase in phases.items():
        try:
            result[name] = phase()
        except Exception as e:  # noqa: BLE001 - one broken phase must not lose the others
            result["errors"][name] = f"{type(e).__name__}: {e}"[:500]
            ctx.log(f"phase {name} failed: {result['errors'][name]}")
    return result


def _skew(results: list[dict], phase: str) -> list[float]:
    """Per call, how much later the last rank began it than the first (ms)."""
    starts = [r[phase]["host_start_s"] for r in results if "host_start_s" in r.get(phase, {})]
    if len(starts) < 2:
        return []
    return [round((max(s) - min(s)) * 1e3, 3) for s in zip(*starts)]


def summary(results: list[dict], args) -> str:
    """probe.md: the numbers that say where a call's time goes, per rank."""
    lines = [(f"# context-parallel probe: s={args.seq}, {'full' if args.full else 'causal'}, "
             f"{args.strategy}, {len(results)} ranks"), ""]
    lines += [f"- rank {r['rank']}: phase {name} failed: {error}"
              for r in results for name, error in r["errors"].items()]
    for phase in ("one_gpu", "back_to_back", "synced", "compute_only"):
        if any(phase not in r for r in results):
            continue
        lines.append(f"## {phase}")
        for r in results:
            p = r[phase]
            lines.append(f"- rank {r['rank']}: GPU per call median {p['median_gpu_ms']} ms, "
                         f"gap to next median {p['median_gap_ms']} ms, host per call median "
                         f"{p['median_host_ms']} ms, calls that found the GPU drained "
                         f"{sum(p['drained'])}/{len(p['drained'])}; clocks {p.get('clocks')}")
        skew = _skew(results, phase)
        if skew:
            lines.append(f"- host start skew between ranks, median {statistics.median(skew)} "
                         f"ms, max {max(skew)} ms")
        lines.append("")
    for r in results:
        if all(p in r for p in ("host_ahead", "sync_debug", "allocator")):
            lines.append(f"- rank {r['rank']} host ahead: {r['host_ahead']}; synchronizing "
                         f"ops in one call: {len(r['sync_debug'])}; allocator per "
                         f"{args.calls} calls: {r['allocator']}")
    for r in results:
        for sync in r.get("sync_debug", [])[:6]:
            lines += [f"- rank {r['rank']} synchronizes: {sync['message'][:120]}",
                      *(f"    {frame}" for frame in sync["stack"][-4:])]
    lines.append("")
    for r in results:
        if "gpu_only" in r:
            lines += [f"## GPU-only profile, rank {r['rank']}", "", "```",
                      *(json.dumps(c) for c in r["gpu_only"]), "```", ""]
    for r in results:
        if "profile" not in r:
            continue
        t = r["profile"]
        lines += [f"## profile, rank {r['rank']}", "", "```", "calls:",
                  *(json.dumps(c) for c in t["calls"]), "idle gaps, longest first:",
                  *(json.dumps(g) for g in t["idle_gaps"][:8]), "blocking host calls:",
                  *(json.dumps(b) for b in t["blocking_host_calls"][:8]), "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory for probe.json, probe.md and the traces")
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--full", action="store_true", help="no causal mask")
    parser.add_argument("--strategy", default="ring", choices=("ring", "allgather", "alltoall"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--ranks", type=int, default=2,
                        help="on one GPU: the ring whose per-rank compute phase 8 times")
    args = parser.parse_args()
    ctx = context.setup(args.quick)
    os.makedirs(args.out, exist_ok=True)
    try:
        results = ctx.gather(probe(ctx, args))
        if ctx.rank == 0:
            with open(os.path.join(args.out, "probe.json"), "w") as f:
                json.dump(results, f, indent=1)
            text = summary(results, args)
            with open(os.path.join(args.out, "probe.md"), "w") as f:
                f.write(text)
            print(text)
    finally:
        context.teardown()


if __name__ == "__main__":
    main()
