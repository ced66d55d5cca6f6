"""Timing one callable: per-iteration device times, host time per call, and their statistics.

- :func:`timed_samples`: a barrier (every rank starts together, devices idle), then ``iters``
  calls, each between two CUDA events on the current stream (wall clock on the CPU). The calls
  are not synchronized one by one, so a call whose host work is slower than its kernels shows
  up as its host time (the GPU waits for it), and a GPU-bound call as its kernel time.
- :func:`host_us_per_call`: the CPU time of a call while the GPU is kept busy by a sleep
  kernel queued before it, so the host never waits for the GPU: the pure launch cost; and
  the GPU time of the same calls, which ran back to back after the sleep (no host gaps).
- :func:`interleaved`: several variants timed in alternating blocks of steps, in a new order
  each round, so that a drift of the GPU's state, or what one variant leaves to the next,
  weighs on all alike;
- :func:`summarize` and :func:`combine`: the median and the 10th/90th percentiles of one
  rank, then the slowest rank's (the max over ranks of the median), as the run is as slow as
  its slowest rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.context import Context

_SLEEP_CALIBRATION_CYCLES = 20_000_000
_MAX_SLEEP_MS = 2000.0
_cycles_per_ms: float | None = None


@dataclasses.dataclass(frozen=True)
class Stats:
    """Time per iteration over ranks: the slowest rank's median and its percentiles."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    iters: int
    rank_medians_ms: tuple[float, ...]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation, as ``numpy.percentile``."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float]) -> dict[str, float]:
    return {
        "median": percentile(samples_ms, 50),
        "p10": percentile(samples_ms, 10),
        "p90": percentile(samples_ms, 90),
        "n": len(samples_ms),
    }


def combine(per_rank: Sequence[dict[str, float]]) -> Stats:
    """The max over ranks of the median, with the percentiles of that rank."""
    slowest = max(per_rank, key=lambda s: s["median"])
    return Stats(slowest["median"], slowest["p10"], slowest["p90"], int(slowest["n"]),
                 tuple(s["median"] for s in per_rank))


def timed_samples(ctx: Context, fn: Callable[[], object], iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn``, after a barrier of all ranks."""
    ctx.barrier()
    if not ctx.cuda:
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(ctx.device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def profiled(run: Callable[[], object]) -> profile:
    """torch.profiler over ``run()``: the host, and the GPU where there is one, its work
    finished before and after (so the profile holds exactly ``run``'s kernels)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
                 ) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    return prof


def interleaved(steps: dict[str, Callable[[], object]], rounds: int, iters: int,
                device: torch.device, per_step: dict[str, list[list[float]]] | None = None
                ) -> dict[str, list[float]]:
    """Milliseconds per step of each variant in each round: blocks of ``iters`` steps of
    every variant in turn, in an order shuffled each round (seeded: the same in every run),
    so that a drift of the GPU's clocks or of its neighbours weighs on all alike, and so
    does what a block leaves to the next (a block starts from an idle GPU, after another
    variant's: its clocks, the host's caches). A rotating order kept each variant behind
    the same one in nearly every round (what the shuffle changed on an H100:
    ``benchmarks/results/2026-12-05-1640-h100-1gpu-summary.md``). Each block starts
    with autograd's device threads on, torch's default: a meshfuse call switches them off
    for its thread (:mod:`meshfuse.autodiff.engine_thread`), which would otherwise carry over
    to the torch variants timed after it.

    ``per_step``: a dict that gets, per variant, each round's milliseconds of each step of
    its block (a CUDA event between steps: the first step's time holds the host's latency
    from the idle GPU to its first kernel, the others the steady state), on CUDA only."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    order = random.Random(0)
    for _ in range(rounds):
        for name in order.sample(names, len(names)):
            with torch.autograd.set_multithreading_enabled(True):
                block_ms, step_ms = _block_ms(steps[name], iters, device, per_step is not None)
            times[name].append(block_ms)
            if step_ms is not None:
                per_step.setdefault(name, []).append(step_ms)
    return times


def _block_ms(step: Callable[[], object], iters: int, device: torch.device,
              per_step: bool = False) -> tuple[float, list[float] | None]:
    """Milliseconds per call of ``step`` over a block of ``iters`` calls, and those of each
    call where ``per_step`` (on CUDA: an event between calls)."""
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True)
                  for _ in range(iters + 1 if per_step else 2)]
        events[0].record()
        for i in range(iters):
            step()
            if per_step:
                events[i + 1].record()
        events[-1].record()
        events[-1].synchronize()
        step_ms = [a.elapsed_time(b) for a, b in itertools.pairwise(events)] if per_step \
            else None
        return events[0].elapsed_time(events[-1]) / iters, step_ms
    begin = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - begin) * 1e3 / iters, None


def interleaved_ratio(ctx: Context, base, step, rounds: int, iters: int) -> float:
    """The median over ``rounds`` of (median time of ``step``) / (median of ``base``), the
    two timed in alternating blocks of ``iters`` calls, so that a drift of the host's speed
    hits both alike; the largest over ranks."""
    ratios = []
    for _ in range(rounds):
        base_ms = percentile(timed_samples(ctx, base, iters), 50)
        ratios.append(percentile(timed_samples(ctx, step, iters), 50) / base_ms)
    return max(ctx.gather(statistics.median(ratios)))


def _sleep_cycles_per_ms(ctx: Context) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this GPU, measured once."""
    global _cycles_per_ms
    if _cycles_per_ms is None:
        ctx.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(_SLEEP_CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        _cycles_per_ms = _SLEEP_CALIBRATION_CYCLES / max(start.elapsed_time(end), 1e-3)
    return _cycles_per_ms


def host_us_per_call(ctx: Context, fn: Callable[[], object], calls: int,
                     rounds: int = 5) -> dict[str, object]:
    """Host microseconds per call of ``fn``: the median over ``rounds`` of ``calls`` calls.

    Each rank measures its own CPU (no barrier). On CUDA each round first queues a sleep
    kernel long enough that the GPU is still busy when the last call returns (checked, and
    retried with a longer sleep): then no call waited for the GPU. ``calls`` times the
    kernels of one call must stay well below the GPU's launch queue (about a thousand
    kernels), or the host blocks on a full queue. ``gpu_busy`` False means some call waited
    for the GPU anyway (it synchronizes), so its time includes GPU time. ``gpu_us`` is the
    GPU time per call, measured from the end of the sleep, when the calls ran back to back.
    """
    ctx.sync()
    if not ctx.cuda:
        host = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            host.append((time.perf_counter() - start) / calls * 1e6)
        return {"host_us": percentile(host, 50), "gpu_us": None, "gpu_busy": None}
    probe = time.perf_counter()
    fn()
    ctx.sync()
    sleep_ms = min(3 * (time.perf_counter() - probe) * 1e3 * calls + 20, _MAX_SLEEP_MS)
    host, gpu, all_busy = [], [], True
    for _ in range(rounds):
        host_us, gpu_us, busy, sleep_ms = _host_round(ctx, fn, calls, sleep_ms)
        host.append(host_us)
        gpu.append(gpu_us)
        all_busy = all_busy and busy
    return {"host_us": percentile(host, 50), "gpu_us": percentile(gpu, 50),
            "gpu_busy": all_busy}


def _host_round(ctx: Context, fn: Callable[[], object], calls: int, sleep_ms: float):
    """One round of :func:`host_us_per_call`; returns the sleep length that sufficed."""
    for _ in range(4):
        torch.cuda._sleep(int(sleep_ms * _sleep_cycles_per_ms(ctx)))
        sleeping, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleeping.record()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        done.record()
        busy = not sleeping.query()
        ctx.sync()
        if busy:
            break
        sleep_ms = min(sleep_ms * 4, _MAX_SLEEP_MS)
    # The calls were all queued behind the sleep, so sleeping -> done is their GPU time alone.
    gpu_us = sleeping.elapsed_time(done) / calls * 1e3
    return elapsed / calls * 1e6, gpu_us, busy, sleep_ms


def cuda_kernel_events(step: Callable[[], object]) -> list:
    """The CUDA events (kernels and copies) of one call of ``step``, profiled after a warm
    call, each side synchronized."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type.name == "CUDA"]
