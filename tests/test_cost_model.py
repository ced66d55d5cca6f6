"""The cost model (``meshfuse/cost/``): the committed calibrations read back, collectives'
times from bus bandwidth (reproducing the measured 2-H200 figures), compute from FLOPs and
bytes, overlap, and the strategies' estimates taking their figures from it."""

from __future__ import annotations

import json

import pytest

from benchmarks import calibrate
from meshfuse.cost import CostModel, load
from meshfuse.cost.calibration import DATA, from_dict
from meshfuse.errors import InputError
from meshfuse.parallel.context.cost import DEFAULTS as CONTEXT_DEFAULTS
from meshfuse.parallel.overlap.cost import DEFAULT_COSTS

MIB = 1 << 20
H200 = CostModel(load("h200"))
CPU = CostModel(load("cpu_gloo"))


@pytest.mark.parametrize("kind, busbw", [("allreduce", 314), ("allgather", 256),
                                         ("reduce_scatter", 254)])
def test_the_measured_two_gpu_bus_bandwidths_are_reproduced(kind, busbw):
    """The earlier runs' 2-GPU busbw at 512 MiB, within 10%: time back to busbw."""
    factor = 1.0 if kind == "allreduce" else 0.5
    seconds = H200.collective(kind, 512 * MIB, 2)
    assert 512 * MIB * factor / seconds / 1e9 == pytest.approx(busbw, rel=0.10)


def test_bandwidth_between_points_is_interpolated_and_latency_added_below_them():
    small, mid, large = (H200.bus_bandwidth("allreduce", n * MIB, 2) for n in (64, 96, 128))
    assert small < mid < large
    tiny = H200.collective("allreduce", 1024, 2)
    assert tiny >= H200.latency("allreduce", 2) > 0
    assert H200.collective("allreduce", 1024, 1) == 0.0


def test_groups_nobody_measured_use_the_links_and_crossing_nodes_is_slower():
    links = H200.calibration.links
    assert H200.bus_bandwidth("allgather", 64 * MIB, 8) == links.intra_node_gb_per_s
    assert H200.bus_bandwidth("allgather", 64 * MIB, 16) == links.inter_node_gb_per_s
    inside = H200.collective("allgather", 64 * MIB, 8)
    assert H200.collective("allgather", 64 * MIB, 8, crosses_nodes=True) > inside
    faster = CostModel(H200.calibration.with_links(inter_node_gb_per_s=400.0))
    assert faster.collective("allgather", 64 * MIB, 16) < H200.collective(
        "allgather", 64 * MIB, 16)


def test_gemms_by_shape_class_and_memory_bound_when_skinny():
    assert H200.gemm_tflops(8192, 8192, 8192) == 700.0
    assert H200.gemm_tflops(512, 8192, 8192) < H200.gemm_tflops(2048, 8192, 8192) < 700.0
    big = H200.gemm(8192, 8192, 8192)
    assert big == pytest.approx(2 * 8192 ** 3 / 700e12 + H200.launch)
    # a matrix-vector product moves its matrix: memory-bound
    skinny = H200.gemm(1, 8192, 8192)
    assert skinny == pytest.approx(H200.memory_bound((8192 + 8192 * 8192 + 8192) * 2))


def test_overlap_hides_the_shorter_by_the_contention():
    assert H200.overlapped(1.0, 0.5, contention=0.0) == 1.0
    assert H200.overlapped(1.0, 0.5, contention=1.0) == 1.5
    assert CPU.overlapped(1.0, 0.5) == 1.5  # gloo hides nothing


def test_the_existing_estimates_read_the_calibrations():
    cpu, cuda = DEFAULT_COSTS["cpu"], DEFAULT_COSTS["cuda"]
    assert cpu.gemm_tflops == CPU.calibration.gemm[-1].tflops
    assert cpu.link_gb_per_s == CPU.calibration.links.intra_node_gb_per_s
    assert cuda.link_gb_per_s == H200.bus_bandwidth("allgather", 50e6, 2)
    assert DEFAULT_COSTS["cuda_copy_engine"].link_gb_per_s == \
        H200.calibration.copy_engine_gb_per_s
    assert CONTEXT_DEFAULTS["cuda"].kernel_flops == H200.calibration.attention_tflops * 1e12
    assert CONTEXT_DEFAULTS["cpu"].link_bytes == CPU.calibration.links.intra_node_gb_per_s * 1e9


def test_every_committed_calibration_states_its_sources():
    for path in DATA.glob("*.json"):
        data = json.loads(path.read_text())
        from_dict(data, path.stem)
        for key in ("peak_tflops", "attention_tflops", "memory_gb_per_s", "launch_us"):
            assert data[key].get("source"), (path.name, key)


def test_bad_calibrations_and_kinds_are_refused():
    with pytest.raises(InputError, match="h200"):
        load("nonexistent")
    with pytest.raises(InputError, match="missing or malformed"):
        from_dict({"device": "x"})
    with pytest.raises(InputError, match="allreduce"):
        H200.collective("broadcastish", 1024, 2)


def test_the_calibration_script_writes_a_file_the_model_reads(tmp_path, monkeypatch):
    """``benchmarks/calibrate.py --quick`` on this CPU (one process: no collectives): the
    measured figures replace the base's, the rest is kept, and the file loads."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "here.json"
    calibrate.main(["--device", "cpu", "--quick", "--out", str(out),
                    "--base", str(DATA / "cpu_gloo.json")])
    measured = load(out)
    data = json.loads(out.read_text())
    assert "calibrate.py" in data["attention_tflops"]["source"]
    assert len(measured.gemm) == 3 and all(g.tflops > 0 for g in measured.gemm)
    assert measured.links == CPU.calibration.links  # kept from the base
    assert CostModel(measured).gemm(64, 64, 64) > 0
