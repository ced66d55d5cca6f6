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


def test_copy_engine_pulls_and_barriers_apart():
    """A GEMM 0-100, a barrier 100-110, a peer copy 105-155 (45 us beside the second GEMM
    at 110-200), a local copy 200-220: the pulls and barriers count as communication and are
    also given apart, with the pulls' time beside compute kernels."""
    trace = {"traceEvents": [
        _kernel("nvjet_gemm", 0, 100),
        _kernel("c10d::symmetric_memory::barrier_kernel(unsigned int**)", 100, 10),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "ts": 105,
         "dur": 50},
        _kernel("nvjet_gemm", 110, 90),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 200,
         "dur": 20},
    ]}
    whole, = summarize(trace)
    assert (whole["peer_copy_ms"], whole["peer_copy_beside_kernels_ms"]) == (0.05, 0.045)
    assert whole["barrier_ms"] == 0.01
    assert whole["nccl_ms"] == 0.055  # barrier and pull, merged where they overlap
    assert (whole["memcpy_ms"], whole["memcpy_beside_kernels_ms"]) == (0.02, 0.0)


def test_gemm_kernels_split_by_whether_a_transfer_ran_beside_them():
    """Two GEMMs of one name, one alone (0-100) and one (200-300) beside NCCL (250-400);
    a pointwise kernel beside NCCL is no GEMM."""
    trace = {"traceEvents": [
        _kernel("nvjet_sm90_tst_256x128_NNT", 0, 100), _kernel("nvjet_sm90_tst_256x128_NNT",
                                                               200, 100),
        _kernel("triton_poi_fused_add_0", 260, 10),
        _kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 250, 150),
    ]}
    gemms = summarize(trace)[0]["gemms"]
    assert (gemms["ms"], gemms["count"], gemms["beside_ms"], gemms["beside_count"]) == \
        (0.2, 2, 0.1, 1)
    assert gemms["by_name"] == {"nvjet_sm90_tst_256x128_NNT": {"alone": [1, 0.1],
                                                               "beside": [1, 0.1]}}
