"""A summary of one rank's GPU timeline from a torch.profiler Chrome trace: how busy the
compute kernels kept the device, where it sat idle, and how much of the communication
kernels' time no compute kernel hid.

Compute is every GPU kernel, memset and memcpy that is not communication; communication is
NCCL's kernels (whose time includes waiting for the peer to reach the same transfer) and
the copy-engine transport's work (its symmetric-memory barrier kernels and the peer-to-peer
copies), counted as ``nccl_ms`` alike. A window is
one ``gpu_user_annotation`` named ``window`` (one timed call wrapped in
``torch.profiler.record_function(window)``), or the whole trace when there is none; with a
window, the summary also gives the host time from the call to its first GPU work.

    python -m benchmarks.trace_summary TRACE.json [window]
"""

from __future__ import annotations

import json
import sys

Interval = tuple[float, float]  # microseconds [start, end)


def _union(intervals: list[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(intervals: list[Interval], cover: list[Interval]) -> list[Interval]:
    """The parts of (disjoint, sorted) ``intervals`` outside (disjoint, sorted) ``cover``."""
    result = []
    for a, b in intervals:
        for c, d in cover:
            if d <= a or c >= b:
                continue
            if c > a:
                result.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            result.append((a, b))
    return result


def _clip(events: list[dict], window: Interval) -> list[dict]:
    return [e for e in events if e["ts"] < window[1] and e["ts"] + e["dur"] > window[0]]


def summarize_window(events: list[dict], window: Interval, gaps: int = 6) -> dict:
    """Busy, idle and exposed-communication milliseconds of ``events`` (GPU events) in
    ``window``, with the longest idle gaps between compute kernels."""
    events = _clip(events, window)
    comm = [e for e in events if _is_transfer(e)]
    compute = [e for e in events if not _is_transfer(e)]
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in compute])
    sent = _union([(e["ts"], e["ts"] + e["dur"]) for e in comm])
    start = min((a for a, _ in busy + sent), default=window[0])
    end = max((b for _, b in busy + sent), default=window[0])
    idle = _minus([(start, end)], busy)
    # copies (a copy engine's, or a local one) and how much of them ran beside a kernel
    copies = _union([(e["ts"], e["ts"] + e["dur"]) for e in compute
                     if e.get("cat") == "gpu_memcpy"])
    kernels = _union([(e["ts"], e["ts"] + e["dur"]) for e in compute
                      if e.get("cat", "kernel") == "kernel"])
    # the copy-engine transport's pulls (peer copies) and barriers, apart
    pulls = _union([(e["ts"], e["ts"] + e["dur"]) for e in comm if "ptop" in e["name"].lower()])
    barriers = _union([(e["ts"], e["ts"] + e["dur"]) for e in comm
                       if "barrier_kernel" in e["name"].lower()])
    ordered = sorted(compute, key=lambda e: e["ts"])
    longest = sorted(idle, key=lambda g: g[0] - g[1])[:gaps]
    return {
        "span_ms": round((end - start) / 1e3, 3),
        "compute_busy_ms": round(_length(busy) / 1e3, 3),
        "idle_ms": round(_length(idle) / 1e3, 3),
        "nccl_ms": round(_length(sent) / 1e3, 3),
        "nccl_exposed_ms": round(_length(_minus(sent, busy)) / 1e3, 3),
        "memcpy_ms": round(_length(copies) / 1e3, 3),
        "memcpy_beside_kernels_ms": round(
            (_length(copies) - _length(_minus(copies, kernels))) / 1e3, 3),
        "peer_copy_ms": round(_length(pulls) / 1e3, 3),
        "peer_copy_beside_kernels_ms": round(
            (_length(pulls) - _length(_minus(pulls, kernels))) / 1e3, 3),
        "barrier_ms": round(_length(barriers) / 1e3, 3),
        "longest_idle_gaps": [{"at_ms": round((a - start) / 1e3, 3),
                               "ms": round((b - a) / 1e3, 3),
                               "after": _name_before(ordered, a),
                               "nccl_running": any(c < b and d > a for c, d in sent)}
                              for a, b in longest],
        "top_kernels_ms": _top(compute + comm),
        "gemms": gemm_split(compute, sent),
    }


GEMM_KERNEL_MARKS = ("nvjet", "gemm", "xmma", "cutlass")


def gemm_split(compute: list[dict], transfers: list[Interval]) -> dict:
    """The matrix-product kernels (cuBLAS's ``nvjet``/``gemm``/``xmma``, CUTLASS) split by
    whether a transfer ran at any point beside them: their milliseconds and counts, in all
    and per kernel name (a GEMM that shares the device with NCCL's kernels loses SMs to
    them, so its instances beside a transfer are the ones to compare)."""
    split: dict = {"ms": 0.0, "beside_ms": 0.0, "count": 0, "beside_count": 0, "by_name": {}}
    for e in compute:
        if e.get("cat", "kernel") != "kernel" or \
                not any(m in e["name"].lower() for m in GEMM_KERNEL_MARKS):
            continue
        a, b, ms = e["ts"], e["ts"] + e["dur"], e["dur"] / 1e3
        beside = any(c < b and d > a for c, d in transfers)
        split["ms"] += ms
        split["count"] += 1
        if beside:
            split["beside_ms"] += ms
            split["beside_count"] += 1
        by_name = split["by_name"].setdefault(e["name"][:80], {"alone": [0, 0.0],
                                                               "beside": [0, 0.0]})
        entry = by_name["beside" if beside else "alone"]
        entry[0] += 1
        entry[1] = round(entry[1] + ms, 3)
    split["ms"], split["beside_ms"] = round(split["ms"], 3), round(split["beside_ms"], 3)
    return split


def _is_transfer(event: dict) -> bool:
    """An NCCL kernel, a symmetric-memory barrier kernel, or a copy between two GPUs."""
    name = event["name"].lower()
    return "nccl" in name or "barrier_kernel" in name or "ptop" in name


def _name_before(ordered: list[dict], at: float) -> str | None:
    before = [e for e in ordered if e["ts"] + e["dur"] <= at]
    return before[-1]["name"][:80] if before else None


def _top(events: list[dict], count: int = 10) -> dict[str, float]:
    totals: dict[str, float] = {}
    for e in events:
        totals[e["name"][:80]] = totals.get(e["name"][:80], 0.0) + e["dur"] / 1e3
    return {k: round(v, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:count]}


def summarize(trace: dict, window: str | None = None) -> list[dict]:
    """One summary (:func:`summarize_window`) per annotated ``window`` of the trace."""
    events = trace.get("traceEvents", [])
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in
           ("kernel", "gpu_memcpy", "gpu_memset")]
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "gpu_user_annotation" and e.get("name") == window)
    if not windows:
        windows = [(min((e["ts"] for e in gpu), default=0.0),
                    max((e["ts"] + e["dur"] for e in gpu), default=0.0))]
    calls = sorted(e["ts"] for e in events
                   if e.get("cat") == "user_annotation" and e.get("name") == window)
    summaries = [summarize_window(gpu, w) for w in windows]
    for summary, w, called in zip(summaries, windows, calls):
        # The host's time from the call to its first GPU work (exposed when the device
        # was idle, as after a synchronization).
        first = min((e["ts"] for e in _clip(gpu, w)), default=called)
        summary["host_to_first_kernel_ms"] = round((first - called) / 1e3, 3)
    return summaries


def main(argv: list[str]) -> None:
    with open(argv[0]) as f:
        trace = json.load(f)
    print(json.dumps(summarize(trace, argv[1] if len(argv) > 1 else None), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
