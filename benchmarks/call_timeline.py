"""Where the time of consecutive calls goes, from a torch.profiler Chrome trace of them: each
call's host time, its GPU span, the GPU's idle time inside it and between it and the next,
and, for every long idle gap, whether the host was late (the kernel after the gap was
launched after the gap began: the GPU waited for the host) or the GPU waited on a dependency
(launched in time, started late: a stream waiting for another stream or a peer). Host runtime
calls that block (a synchronization, a blocking copy, an allocation) are listed with the
host operation they ran in.

Each call is a ``user_annotation`` (``torch.profiler.record_function(name)``) whose name
starts with a prefix (``call0``, ``call1``, ...). A GPU event belongs to the call whose host
range launched it (the runtime call with the same correlation id).

    python -m benchmarks.call_timeline TRACE.json [prefix]
"""

from __future__ import annotations

import itertools
import json
import sys

from benchmarks.trace_summary import _union

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_API = ("cuda_runtime", "cuda_driver")
# Runtime calls that can make the host wait for the device (or for the driver). An
# asynchronous copy counts only where its copy on the GPU touches pageable host memory (the
# runtime then copies synchronously): a copy from device to device returns at once, however
# long its call took.
BLOCKING = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc",
            "cuMemAlloc", "cuMemFree", "cuMemCreate", "cuMemMap")


def _end(e: dict) -> float:
    return e["ts"] + e.get("dur", 0.0)


def _is_nccl(e: dict) -> bool:
    return "nccl" in e["name"].lower()


def _calls(events: list[dict], prefix: str) -> list[dict]:
    return sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"
                   and e.get("name", "").startswith(prefix)), key=lambda e: e["ts"])


def _launches(events: list[dict]) -> dict[int, dict]:
    """Host runtime/driver events by correlation id."""
    return {e["args"]["correlation"]: e for e in events
            if e.get("cat") in HOST_API and "correlation" in e.get("args", {})}


def _owner(calls: list[dict], ts: float) -> int | None:
    for i, c in enumerate(calls):
        if c["ts"] <= ts <= _end(c):
            return i
    return None


def _enclosing_op(ops: list[dict], at: dict) -> str | None:
    """The innermost host operation (``cpu_op`` or ``python_function``) of the same thread
    around the host event ``at``."""
    around = [o for o in ops if o.get("tid") == at.get("tid") and o["ts"] <= at["ts"]
              and _end(o) >= _end(at)]
    return min(around, key=lambda o: o.get("dur", 0.0))["name"][:100] if around else None


def analyze(trace: dict, prefix: str = "call", min_gap_us: float = 20.0,
            count: int = 12) -> dict:
    """The per-call table and the long gaps and blocking host calls of ``trace`` (see the
    module doc). Times in milliseconds; gaps and host calls shorter than ``min_gap_us`` are
    left out; ``count`` of each, longest first."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    calls = _calls(events, prefix)
    launches = _launches(events)
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    owned: list[list[dict]] = [[] for _ in calls]
    for e in gpu:
        launch = launches.get(e.get("args", {}).get("correlation"))
        i = _owner(calls, launch["ts"]) if launch is not None else None
        if i is not None:
            owned[i].append(e)
    rows = [_call_row(c, mine) for c, mine in zip(calls, owned)]
    for row, following in itertools.pairwise(rows):
        if row["gpu_end_us"] is not None and following["gpu_start_us"] is not None:
            row["gpu_gap_to_next_ms"] = round(
                (following["gpu_start_us"] - row["gpu_end_us"]) / 1e3, 3)
    ops = [e for e in events if e.get("cat") in ("cpu_op", "python_function")]
    return {"calls": [{k: v for k, v in r.items() if not k.endswith("_us")} for r in rows],
            "idle_gaps": _gaps(gpu, launches, calls, ops, min_gap_us)[:count],
            "blocking_host_calls": _blocking(events, calls, ops, min_gap_us)[:count]}


def _call_row(call: dict, mine: list[dict]) -> dict:
    compute = _union([(e["ts"], _end(e)) for e in mine if not _is_nccl(e)])
    busy = _union([(e["ts"], _end(e)) for e in mine])
    start = min((e["ts"] for e in mine), default=None)
    end = max((_end(e) for e in mine), default=None)
    span = (end - start) if mine else 0.0
    return {
        "name": call["name"],
        "host_ms": round(call.get("dur", 0.0) / 1e3, 3),
        "host_to_first_gpu_ms": round((start - call["ts"]) / 1e3, 3) if mine else None,
        "gpu_span_ms": round(span / 1e3, 3),
        "compute_busy_ms": round(sum(b - a for a, b in compute) / 1e3, 3),
        "idle_inside_ms": round((span - sum(b - a for a, b in busy)) / 1e3, 3),
        "no_compute_inside_ms": round((span - sum(b - a for a, b in compute)) / 1e3, 3),
        "gpu_ends_after_host_ms": round((end - _end(call)) / 1e3, 3) if mine else None,
        "gpu_start_us": start, "gpu_end_us": end,
    }


def _gaps(gpu: list[dict], launches: dict, calls: list[dict], ops: list[dict],
          min_gap_us: float) -> list[dict]:
    """Every stretch longer than ``min_gap_us`` in which no GPU work (of any stream) ran,
    between the first and the last GPU event of the calls, with what came after it."""
    if not calls:
        return []
    first = calls[0]["ts"]
    gpu = [e for e in gpu if _end(e) >= first]
    busy = _union([(e["ts"], _end(e)) for e in gpu])
    result = []
    for (_, a), (b, _) in itertools.pairwise(busy):
        if b - a < min_gap_us:
            continue
        after = next(e for e in gpu if e["ts"] >= b)
        launch = launches.get(after.get("args", {}).get("correlation"))
        late = None if launch is None else launch["ts"] - a
        result.append({
            "at_ms": round((a - first) / 1e3, 3), "ms": round((b - a) / 1e3, 3),
            "in_call": _owner(calls, a), "next_kernel": after["name"][:90],
            "next_launched_by": _enclosing_op(ops, launch) if launch else None,
            # > 0: the host launched the next kernel only after the GPU went idle.
            "launch_after_gap_start_ms": None if late is None else round(late / 1e3, 3),
            "cause": None if late is None else ("host late" if late > 0 else
                                                "waited on a dependency"),
        })
    return sorted(result, key=lambda g: -g["ms"])


def _blocking(events: list[dict], calls: list[dict], ops: list[dict],
              min_us: float) -> list[dict]:
    pageable = {e.get("args", {}).get("correlation") for e in events
                if e.get("cat") == "gpu_memcpy" and "Pageable" in e.get("name", "")}
    found = [e for e in events if e.get("cat") in HOST_API and e.get("dur", 0.0) >= min_us
             and any(word in e["name"] for word in BLOCKING)
             and ("Async" not in e["name"]
                  or e.get("args", {}).get("correlation") in pageable)]
    return [{"name": e["name"], "ms": round(e["dur"] / 1e3, 3), "in_call": _owner(calls, e["ts"]),
             "at_ms": round((e["ts"] - calls[0]["ts"]) / 1e3, 3) if calls else None,
             "in_op": _enclosing_op(ops, e)}
            for e in sorted(found, key=lambda e: -e["dur"])]


def main(argv: list[str]) -> None:
    with open(argv[0]) as f:
        trace = json.load(f)
    print(json.dumps(analyze(trace, argv[1] if len(argv) > 1 else "call"), indent=1))


def marked_calls(trace: dict, marker: str = "spin_kernel", gaps: int = 6) -> list[dict]:
    """Calls told apart by a marker kernel queued between them (for a trace of GPU activity
    only, whose host cost is nearly nil): per call, from the end of the marker before it to
    the start of the marker after it, the time, the compute kernels' busy time, the idle
    time (no GPU work at all) and its longest gaps with the kernels around them."""
    gpu = sorted((e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
                  and e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    markers = [e for e in gpu if marker in e["name"]]
    result = []
    for before, after in itertools.pairwise(markers):
        start, stop = _end(before), after["ts"]
        inside = [e for e in gpu if e["ts"] >= start and _end(e) <= stop
                  and marker not in e["name"]]
        busy = _union([(e["ts"], _end(e)) for e in inside])
        compute = _union([(e["ts"], _end(e)) for e in inside if not _is_nccl(e)])
        edges = [start, *(x for pair in busy for x in pair), stop]
        idle = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a]
        longest = sorted(idle, key=lambda g: g[0] - g[1])[:gaps]
        result.append({
            "ms": round((stop - start) / 1e3, 3),
            "compute_busy_ms": round(sum(b - a for a, b in compute) / 1e3, 3),
            "idle_ms": round(sum(b - a for a, b in idle) / 1e3, 3),
            "longest_idle": [{"at_ms": round((a - start) / 1e3, 3), "ms": round((b - a) / 1e3, 3),
                              "previous": _name_at(inside, a, ending=True),
                              "next": _name_at(inside, b, ending=False)}
                             for a, b in longest],
        })
    return result


def _name_at(events: list[dict], at: float, ending: bool) -> str | None:
    """The name of the GPU event that ends at ``at`` (``ending``) or starts there."""
    found = [e for e in events if (_end(e) if ending else e["ts"]) == at]
    return found[0]["name"][:90] if found else None


if __name__ == "__main__":
    main(sys.argv[1:])
