"""What is alive at a CUDA memory peak, where the host waits for the device, and where the
host spends its time.

- :func:`live_at_peak` runs a function under ``torch.cuda.memory._record_memory_history``
  and replays the recorded allocations and frees: at the moment the most bytes were allocated
  (the trace's own peak, on top of what was allocated before recording began), it groups the
  live blocks by the innermost frame of the code that allocated them (meshfuse's, the
  benchmark's, ``transformers``'), largest first;
- :func:`sync_points` runs a function with ``torch.cuda.set_sync_debug_mode("warn")`` and
  returns each synchronizing call's place (the frames above it), counted;
- :func:`host_profile` runs a function under ``cProfile``: the functions with the most host
  time of their own, and the most time with what they call.

All three are diagnostics for the benchmarks' ``--diagnose`` options: a few seconds of a GPU.
"""

from __future__ import annotations

import collections
import os
import re
import traceback
import warnings
from collections.abc import Callable

import torch

MIB = 2**20
OURS = ("meshfuse/", "benchmarks/", "transformers/", "torchtitan/", "torch/optim/")


def _where(frames: list[dict], depth: int = 3) -> str:
    """The innermost ``depth`` frames of ours (see :data:`OURS`) among ``frames``."""
    picked = [f for f in frames if any(key in f["filename"] for key in OURS)][:depth]
    return " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}"
                      for f in picked) or "(no frame of ours)"


def live_at_peak(fn: Callable[[], object], rows: int = 25) -> list[str]:
    """Runs ``fn`` once, recording allocations; lines describing the live blocks at the
    peak, and the allocator's pools at the end."""
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    peak_index = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            total += e["size"]
        elif e["action"] == "free_completed":
            total -= e["size"]
        if total > peak:
            peak, peak_index = total, i
    for e in events[:peak_index + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    lines = [(f"allocated before recording {before / MIB:.0f} MiB; at the recorded peak "
             f"{peak / MIB:.0f} MiB more, in {len(live)} blocks ({len(events)} events):")]
    return lines + _segments(snapshot) + _grouped(live.values(), rows)


def _grouped(blocks, rows: int) -> list[str]:
    """Lines of ``blocks`` (``(size, label)`` pairs) summed by label, the largest first."""
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, label in blocks:
        groups[label][0] += size
        groups[label][1] += 1
    return [f"  {size / MIB:9.1f} MiB {count:5d} blocks  {label}"
            for label, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:rows]]


def live_by_origin(snapshot: dict, rows: int = 30) -> list[str]:
    """The blocks allocated at ``snapshot`` (``torch.cuda.memory._snapshot()`` taken while
    the history was recorded), by pool and by the code that allocated them (blocks of
    before the recording: "(no frame of ours)"), largest first."""
    blocks = []
    for segment in snapshot["segments"]:
        pool = "default" if tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0) \
            else "graphs"
        blocks += [(block["size"], f"{pool:7}  {_where(block.get('frames', []), depth=4)}")
                   for block in segment["blocks"] if block["state"] == "active_allocated"]
    return ["blocks allocated now, by pool (default or graph) and origin:",
            *_grouped(blocks, rows)]


def _segments(snapshot: dict) -> list[str]:
    """The allocator's segments at the end, by pool (0: the default pool; others: CUDA graph
    or ``MemPool`` pools): reserved bytes, bytes allocated, and of those the blocks allocated
    before recording began (largest sizes listed)."""
    pools: dict = collections.defaultdict(lambda: [0, 0, []])
    for seg in snapshot["segments"]:
        key = tuple(seg.get("segment_pool_id", (0, 0)))
        pools[key][0] += seg["total_size"]
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                pools[key][1] += block["size"]
                if not any(f for f in block.get("frames", [])):
                    pools[key][2].append(block["size"])
    lines = [("allocator segments at the end, by pool (reserved, allocated, allocated before "
             "recording: the largest blocks):")]
    for key, (reserved, allocated, old) in sorted(pools.items(), key=lambda kv: -kv[1][0]):
        largest = ", ".join(f"{b / MIB:.0f}" for b in sorted(old, reverse=True)[:8])
        lines.append(f"  pool {key}: {reserved / MIB:.0f} MiB reserved, {allocated / MIB:.0f} "
                     f"allocated, {sum(old) / MIB:.0f} MiB in {len(old)} older blocks "
                     f"[{largest}]")
    return lines


def sync_points(fn: Callable[[], object], rows: int = 15) -> list[str]:
    """Runs ``fn`` with synchronizing CUDA calls reported; lines naming where they were made
    (the frames of ours above each), most frequent first."""
    places: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" in str(message):  # not the mode's own notice
            stack = traceback.extract_stack()[:-2]
            frames = [{"filename": f.filename, "line": f.lineno, "name": f.name}
                      for f in reversed(stack)]
            places[f"{str(message)[:60]} at {_where(frames, 4)}"] += 1
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # restores warnings.showwarning on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    lines = [f"synchronizing calls in one step: {sum(places.values())}"]
    lines += [f"  {n:4d}x {where}" for where, n in places.most_common(rows)]
    return lines


def diagnose(fn: Callable[[], object], host: bool = False) -> list[str]:
    """:func:`sync_points` and :func:`live_at_peak` of ``fn`` (and, with ``host``,
    :func:`host_profile`), each run once; one that fails gives a line saying so (a
    diagnostic never stops its benchmark)."""
    lines = []
    probes = (sync_points, live_at_peak) + ((host_profile,) if host else ())
    for probe in probes:
        try:
            lines += probe(fn)
        except Exception as error:  # noqa: BLE001 - reported, the benchmark goes on
            lines.append(f"{probe.__name__} failed: {type(error).__name__}: {error}")
    return lines


def host_profile(fn: Callable[[], object], rows: int = 30) -> list[str]:
    """Runs ``fn`` under ``cProfile`` (the device synchronized before and after); lines of the
    functions with the most time of their own, then the most time with their callees."""
    import cProfile
    import io
    import pstats

    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    sync()
    lines = []
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(rows)
        lines += [f"host time by {order}:"] + [
            "  " + _short_paths(line) for line in text.getvalue().splitlines()
            if line.strip() and not line.startswith(("   Ordered", "   List"))][1:]
    return lines


def _short_paths(line: str) -> str:
    """``line`` with this tree's directory and site-packages' left out of file names."""
    line = line.replace(os.getcwd() + os.sep, "")
    return re.sub(r"\S*site-packages/", "site-packages/", line)
