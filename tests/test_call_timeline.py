"""The call timeline of the context-parallel probe, on a hand-made trace of two calls."""

from __future__ import annotations

from benchmarks.call_timeline import analyze, marked_calls


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "args": args}


def _trace():
    """call0 (host 0-100) launches k1 (runs 10-60) and k2 (launched at 50, runs 60-150);
    call1 (host 100-400) blocks in a synchronize (110-300, inside aten::item), then launches
    k3 at 310 (runs 320-400): the GPU idles 150-320 because the host was late. NCCL runs
    200-250 on its own stream for call1 (launched at 105), so the idle stretch splits in two:
    150-200 waits on nothing but the host, 250-320 likewise."""
    return {"traceEvents": [
        _x("user_annotation", "call0", 0, 100), _x("user_annotation", "call1", 100, 300),
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 50, 2, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 105, 2, correlation=3),
        _x("cpu_op", "aten::item", 108, 195),
        _x("cuda_runtime", "cudaStreamSynchronize", 110, 190),
        _x("cpu_op", "aten::add", 309, 5),
        _x("cuda_runtime", "cudaLaunchKernel", 310, 2, correlation=4),
        _x("kernel", "k1", 10, 50, correlation=1), _x("kernel", "k2", 60, 90, correlation=2),
        _x("kernel", "ncclDevKernel_SendRecv", 200, 50, correlation=3),
        _x("kernel", "k3", 320, 80, correlation=4),
    ]}


def test_calls_gaps_and_blocking_host_calls():
    result = analyze(_trace(), "call", min_gap_us=20)
    first, second = result["calls"]
    assert (first["host_ms"], first["gpu_span_ms"], first["compute_busy_ms"]) == (0.1, 0.14, 0.14)
    assert first["gpu_gap_to_next_ms"] == 0.05  # k2 ends at 150, call1's NCCL starts at 200
    assert (second["gpu_span_ms"], second["compute_busy_ms"]) == (0.2, 0.08)
    assert (second["idle_inside_ms"], second["no_compute_inside_ms"]) == (0.07, 0.12)
    assert second["host_to_first_gpu_ms"] == 0.1
    gaps = result["idle_gaps"]
    assert [(g["at_ms"], g["ms"], g["next_kernel"], g["cause"]) for g in gaps] == [
        (0.25, 0.07, "k3", "host late"), (0.15, 0.05, "ncclDevKernel_SendRecv",
                                          "waited on a dependency")]
    assert gaps[0]["next_launched_by"] == "aten::add"
    assert gaps[0]["in_call"] == 1
    blocking, = result["blocking_host_calls"]
    assert (blocking["name"], blocking["ms"], blocking["in_call"], blocking["in_op"]) == (
        "cudaStreamSynchronize", 0.19, 1, "aten::item")


def test_an_asynchronous_copy_blocks_only_to_or_from_pageable_memory():
    """A copy from device to device returns at once however long its call took; one to
    pageable host memory makes the host wait."""
    trace = {"traceEvents": [
        _x("user_annotation", "call0", 0, 100),
        _x("cuda_runtime", "cudaMemcpyAsync", 5, 30, correlation=1),
        _x("cuda_runtime", "cudaMemcpyAsync", 40, 50, correlation=2),
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 10, 5, correlation=1),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 45, 40, correlation=2),
    ]}
    blocking, = analyze(trace, "call", min_gap_us=20)["blocking_host_calls"]
    assert (blocking["name"], blocking["ms"], blocking["at_ms"]) == ("cudaMemcpyAsync", 0.05,
                                                                     0.04)


def test_a_gap_shorter_than_the_threshold_is_left_out():
    assert analyze(_trace(), "call", min_gap_us=100)["idle_gaps"] == []


def test_calls_told_apart_by_marker_kernels():
    """Markers at 0-10, 80-85, 100-101; the first call runs a (12-32), NCCL (20-50), b
    (60-70): idle 10-12, 50-60 and 70-80; the second runs c (85-95), idle 95-100."""
    def k(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [k("spin_kernel", 0, 10), k("a", 12, 20), k("ncclDevKernel", 20, 30),
                             k("b", 60, 10), k("spin_kernel", 80, 5), k("c", 85, 10),
                             k("spin_kernel", 100, 1)]}
    first, second = marked_calls(trace)
    assert (first["ms"], first["compute_busy_ms"], first["idle_ms"]) == (0.07, 0.03, 0.022)
    assert [(g["at_ms"], g["ms"], g["previous"], g["next"]) for g in first["longest_idle"]] == [
        (0.04, 0.01, "ncclDevKernel", "b"), (0.06, 0.01, "b", None), (0.0, 0.002, None, "a")]
    assert (second["ms"], second["idle_ms"]) == (0.015, 0.005)
