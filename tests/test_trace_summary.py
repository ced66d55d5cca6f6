"""The profile summary of the context-parallel benchmark, on a hand-made GPU timeline."""

from __future__ import annotations

from benchmarks.trace_summary import summarize


def _kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_busy_idle_and_exposed_transfer_per_window():
    """Compute 0-100 and 150-300, NCCL 50-120 (20 us of it after the compute ended) and
    280-400 (100 us exposed); the second window sees only its own kernels."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "gpu_user_annotation", "name": "step", "ts": 0, "dur": 400},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "step", "ts": 1000, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 999},
        {"ph": "X", "cat": "user_annotation", "name": "step", "ts": -30, "dur": 400},
        {"ph": "X", "cat": "user_annotation", "name": "step", "ts": 990, "dur": 100},
        _kernel("fprop", 0, 100), _kernel("ncclDevKernel_SendRecv", 50, 70),
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 150, "dur": 50},
        _kernel("bprop", 200, 100), _kernel("ncclDevKernel_SendRecv", 280, 120),
        _kernel("fprop", 1000, 100),
    ]}
    first, second = summarize(trace, "step")
    assert first["span_ms"] == 0.4
    assert first["compute_busy_ms"] == 0.25
    assert first["idle_ms"] == 0.15
    assert first["nccl_ms"] == 0.19
    assert first["nccl_exposed_ms"] == 0.12
    gaps = first["longest_idle_gaps"]
    assert [(g["at_ms"], g["ms"], g["after"], g["nccl_running"]) for g in gaps] == [
        (0.3, 0.1, "bprop", True), (0.1, 0.05, "fprop", True)]
    assert second["compute_busy_ms"] == 0.1 and second["nccl_ms"] == 0.0
    assert (first["host_to_first_kernel_ms"], second["host_to_first_kernel_ms"]) == (0.03, 0.01)
    whole, = summarize(trace)
    assert whole["span_ms"] == 1.1
