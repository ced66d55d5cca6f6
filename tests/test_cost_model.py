"""The cost model (``meshfuse/cost/``): the committed calibrations read back, collectives'
times from bus bandwidth (reproducing the measured 2-H200 figures), compute from FLOPs and
bytes, overlap, and the strategies' estimates taking their figures from it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks import calibrate
from benchmarks import calibrate_programs as programs
from meshfuse.cost import CostModel, load
from meshfuse.cost.calibration import DATA, KERNELS, AttentionFit, GemmFit, MemoryFit, from_dict
from meshfuse.cost.fit import (
    attention_flops,
    fit_attention,
    fit_attention_blocks,
    fit_gemm,
    kernel_factors,
)
from meshfuse.cost.kernels import (
    attention_makespan,
    attention_seconds,
    gemm_best_tile,
    gemm_seconds,
)
from meshfuse.errors import InputError
from meshfuse.parallel.context.cost import DEFAULTS as CONTEXT_DEFAULTS
from meshfuse.parallel.overlap.cost import DEFAULT_COSTS

MIB = 1 << 20
H200 = CostModel(load("h200"))
CPU = CostModel(load("cpu_gloo"))
CHECK = Path(__file__).parents[1] / "benchmarks/results" / \
    "2026-12-03-1300-h200-1gpu-calibrate-check-cdeb973.json"


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


def _h200(**changes) -> CostModel:
    """The H200 model with some GEMM parameters changed."""
    cal = H200.calibration
    return CostModel(dataclasses.replace(cal, gemm=dataclasses.replace(cal.gemm, **changes)))


def test_a_gemm_runs_in_waves_of_tiles_with_a_floor_and_a_memory_bound():
    model = _h200(tile=(256, 128), units=132, tile_us=2.0, alternatives=())
    g = model.calibration.gemm
    tm, tn = g.tile
    per_wave = 2 * tm * tn * 4096 / (g.tflops * 1e12 / g.units) + 2e-6
    one_wave = (tm * 12, tn * g.units // 12)  # exactly one wave of tiles
    assert model.gemm(*one_wave, 4096) == pytest.approx(per_wave)
    # one tile more: a second wave, of one tile, takes as long as the first
    assert model.gemm(one_wave[0] + 1, one_wave[1], 4096) == pytest.approx(2 * per_wave)
    # 3072^3 is 2.2 waves on an H200, run as 3: below the rate of whole waves
    assert model.gemm_tflops(3072, 3072, 3072) < 0.8 * g.tflops
    assert model.gemm_tflops(12288, 4096, 12288) > 0.9 * g.tflops
    # the tile's fixed cost weighs on a short k
    assert model.gemm_tflops(8192, 8192, 256) < 0.8 * model.gemm_tflops(8192, 8192, 4096)
    assert model.gemm(64, 64, 64) == pytest.approx(g.floor_us * 1e-6)
    # a matrix-vector product moves its matrix: memory-bound
    bandwidth = model.calibration.memory.gb_per_s * 1e9
    assert model.gemm(1, 8192, 8192) == pytest.approx((8192 + 8192 * 8192 + 8192) * 2 /
                                                      bandwidth)


def test_a_gemm_runs_at_its_fastest_tile_of_the_alternatives():
    single = _h200(tile=(128, 128), units=132, tile_us=2.0, alternatives=())
    both = _h200(tile=(128, 128), units=132, tile_us=2.0, alternatives=((192, 192),))
    g = both.calibration.gemm
    per_unit = 2 * 3072 / (g.tflops * 1e12 / g.units)
    # 3072^2: 576 tiles of 128 x 128 are 5 waves, 256 tiles of 192 x 192 are 2
    assert single.gemm(3072, 3072, 3072) == pytest.approx(5 * (128 * 128 * per_unit + 2e-6))
    assert both.gemm(3072, 3072, 3072) == pytest.approx(2 * (192 * 192 * per_unit + 2e-6))
    assert gemm_best_tile(g, 3072, 3072, 3072) == (192, 192)
    # 4096^2: 1024 tiles of 128 x 128 are 7.8 waves, better than 3.5 of 192 x 192 run as 4
    assert gemm_best_tile(g, 4096, 4096, 4096) == (128, 128)
    assert both.gemm(4096, 4096, 4096) == single.gemm(4096, 4096, 4096)


def test_attention_by_head_dimension_and_sequence():
    fit = AttentionFit({64: 400.0, 128: 600.0}, 512.0, 20.0)
    model = CostModel(dataclasses.replace(H200.calibration, attention=fit))
    flops = 1e12
    assert model.attention(flops, 4096, 128) == pytest.approx(flops / 600e12 * (1 + 1 / 8))
    assert model.attention(flops, 4096, 96) == pytest.approx(flops / 500e12 * (1 + 1 / 8))
    assert model.attention(flops, 4096, 256) == model.attention(flops, 4096, 128)
    assert model.attention(flops, 1024, 64) > model.attention(flops, 8192, 64)
    assert model.attention(1e3, 64, 64) == pytest.approx(20e-6)


def test_attention_scheduled_by_query_blocks_on_slots():
    """The scheduled model: a head's query blocks, the ``i``-th of ``i + 1`` key blocks and
    a fixed cost, handed to the first free of ``slots``; few heads leave slots idle."""
    # key blocks 1, 2, 3, 4 in launch order on 2 slots: 1 + 3 and 2 + 4
    assert attention_makespan(1, 4, 2, 0.0) == 6.0
    assert attention_makespan(1, 4, 2, 1.0) == 8.0  # 2 + 4 and 3 + 5
    assert attention_makespan(2, 4, 4, 0.0) == 7.0  # the 2nd head's 4 starts on the 3 slot
    fit = AttentionFit({64: 400.0, 128: 600.0}, 0.0, 20.0, block=128, slots=264,
                       block_cost=2.0)
    model = CostModel(dataclasses.replace(H200.calibration, attention=fit))
    many, few = (attention_flops(b, h, 4096, 64) for b, h in ((64, 32), (4, 8)))
    per_flop_many = model.attention(many, 4096, 64) / many
    assert model.attention(few, 4096, 64) / few > 1.05 * per_flop_many
    assert per_flop_many > 1 / 400e12  # the diagonal's blocks and the fixed costs
    # the same heads of 128: twice the work per block at 600 TFLOP/s instead of 400
    assert model.attention(attention_flops(64, 32, 4096, 128), 4096, 128) == pytest.approx(
        model.attention(many, 4096, 64) * 2 * 400 / 600)
    assert model.attention(1e3, 64, 64) == pytest.approx(20e-6)
    shapes = [(b, h, s, d) for b, h, s in ((16, 16, 1024), (2, 8, 6144), (1, 32, 12288))
              for d in (64, 128)]
    samples = [(*shape, attention_seconds(fit, attention_flops(*shape), *shape[2:]))
               for shape in shapes]
    got = fit_attention_blocks(samples, 20.0, (132, 264))
    assert (got.slots, got.block_cost) == (264, 2.0)
    assert got.tflops == pytest.approx({64: 400.0, 128: 600.0})


def test_memory_bound_kernels_by_kind_and_row_length():
    factors = {kind: {4096: 1.0} for kind in KERNELS}
    factors["softmax"] = {4096: 3.0, 16384: 5.0}
    fit = MemoryFit(4000.0, 10.0, factors)
    model = CostModel(dataclasses.replace(H200.calibration, memory=fit))
    nbytes = 1e9
    assert model.memory_bound(nbytes) == pytest.approx(nbytes / 4000e9)
    # a softmax's kernel changes with the row length: between two rows, the worse of them
    assert model.memory_bound(nbytes, "softmax", 8192) == pytest.approx(5 * nbytes / 4000e9)
    assert model.memory_bound(nbytes, "softmax", 65536) == pytest.approx(5 * nbytes / 4000e9)
    factors["layer_norm"] = {4096: 3.0, 16384: 5.0}  # a norm's changes smoothly: interpolated
    model = CostModel(dataclasses.replace(H200.calibration, memory=MemoryFit(
        4000.0, 10.0, factors)))
    assert model.memory_bound(nbytes, "layer_norm", 8192) == pytest.approx(4 * nbytes / 4000e9)
    assert model.memory_bound(100.0, "sum") == pytest.approx(10e-6)
    with pytest.raises(InputError, match="pointwise"):
        model.memory_bound(nbytes, "conv")


def test_the_fits_recover_the_parameters_of_synthetic_measurements():
    """Samples made by a known model are fitted back to it (the tile among candidates)."""
    truth = GemmFit(700.0, (128, 256), 132, 3.0, 25.0)
    memory = H200.calibration.memory
    shapes = [(m, n, k) for m in (704, 2880, 5952, 16384) for n in (1344, 3008, 8192)
              for k in (256, 2048, 8192)]
    samples = [(m, n, k, gemm_seconds(truth, memory, m, n, k, 2)) for m, n, k in shapes]
    fitted = fit_gemm(samples, [(256, 128), (128, 256), (128, 128)], 132, 25.0, memory, 2)
    assert fitted.tile == truth.tile
    assert (fitted.tflops, fitted.tile_us) == pytest.approx((700.0, 3.0), rel=1e-6)
    attention = AttentionFit({64: 350.0, 128: 620.0}, 448.0, 20.0)
    shapes = [(4, 16, s, d) for s in (1024, 4096, 16384) for d in (64, 128)]
    samples = [(*shape, attention_seconds(attention, attention_flops(*shape), *shape[2:]))
               for shape in shapes]
    got = fit_attention(samples, 20.0)
    assert got.seq_overhead == 448.0
    assert got.tflops == pytest.approx({64: 350.0, 128: 620.0})
    factors = kernel_factors([("softmax", 4096, 1e9, 1e9 * 2.5 / 4e12),
                              ("softmax", 4096, 2e9, 2e9 * 3.5 / 4e12)], 4000.0)
    assert factors == {"softmax": {4096: pytest.approx(3.0)}}


def test_the_check_is_a_hold_out():
    """No check program has a microbenchmark's shape, and every kernel kind is measured."""
    gemms = {(m, n, k) for _, family, (m, n, k) in
             [p for p in programs.check_programs(1) if p[1] == "gemm"]}
    assert len(gemms) == 8 and not gemms & set(programs.GEMM_SHAPES)
    attention = {shape for _, family, shape in programs.check_programs(1)
                 if family == "attention"}
    assert len(attention) == 4 and not attention & set(programs.ATTENTION_SHAPES)
    assert programs.CHECK_ROWS not in programs.KERNEL_ROWS
    assert set(programs.KERNELS) == set(KERNELS)
    assert len(programs.check_programs(1)) == 20


def test_the_recorded_h200_check_is_predicted_offline():
    """``calibrate.py --offline`` re-predicts the 20 variants of the committed H200 check
    (their names match the programs') from a calibration; the GEMMs' and attention's
    predictions follow the model."""
    result = calibrate.offline(str(CHECK), "h200")
    assert len(result["rows"]) == 20
    row = next(r for r in result["rows"] if r["variant"] == "gemm 3072x3072x3072")
    assert row["predicted_ms"] == pytest.approx(H200.gemm(3072, 3072, 3072) * 1e3)


def test_a_recorded_run_is_refitted_offline():
    """``--offline CHECK --refit SAMPLES``: the compute figures fitted anew to a recorded
    run's microbenchmarks (its floors from the base: that file has none), then its check
    re-predicted; the attention fit is the scheduled model's."""
    run = Path(calibrate.__file__).parent / "results" / "2026-12-03-1432-h200-1gpu-calibrate-"
    base = str(run.with_name(run.name.replace("calibrate-", "calibration-measured-plan38.json")))
    cal = calibrate.refit(f"{run}samples-plan38.json", base)
    fitted = from_dict(cal)
    assert fitted.attention.block == 128 and fitted.attention.slots in (132, 264)
    assert fitted.gemm.floor_us == json.loads(Path(base).read_text())["gemm"]["floor_us"]
    assert "refitted offline" in cal["gemm"]["source"]
    result = calibrate.offline(f"{run}check-plan38.json", cal)
    assert len(result["rows"]) == 20
    row = next(r for r in result["rows"] if r["variant"] == "attention 4x8x4096x64")
    assert row["predicted_ms"] == pytest.approx(CostModel(fitted).attention(
        attention_flops(4, 8, 4096, 64), 4096, 64) * 1e3)


RECHECK = Path(calibrate.__file__).parent / "results" / \
    "2026-12-03-1526-h200-1gpu-calibrate-recheck-"


def test_the_independent_h200_rerun_is_predicted_within_the_bar():
    """Issue 38's bar against the H200 run of 15:26 (measured apart from the committed
    calibration's): the committed calibration predicts its 20 variants within 15% (median
    within 5%), and so does a calibration refitted to that run's own microbenchmarks, whose
    call floors are at most its fastest samples (its tiny GEMMs' median, 19.4 us, lay above
    a 512^3 GEMM's 13.4 us: the small GEMMs were predicted 47-49% slow)."""
    for cal in ("h200", calibrate.refit(f"{RECHECK}samples-a982ca1.json", "h200")):
        rows = calibrate.offline(f"{RECHECK}check-a982ca1.json", cal)["rows"]
        errors = sorted(abs(r["error"]) for r in rows)
        assert len(rows) == 20 and errors[-1] < 0.15 and errors[9] < 0.05, rows
    refitted = from_dict(calibrate.refit(f"{RECHECK}samples-a982ca1.json", "h200"))
    samples = json.loads(Path(f"{RECHECK}samples-a982ca1.json").read_text())
    fastest = min(s for *_, s in samples["gemm [m, n, k, s]"]) * 1e6
    assert refitted.gemm.floor_us == pytest.approx(fastest, rel=0.01)  # written to 3 figures


def test_overlap_hides_the_shorter_by_the_contention():
    assert H200.overlapped(1.0, 0.5, contention=0.0) == 1.0
    assert H200.overlapped(1.0, 0.5, contention=1.0) == 1.5
    assert CPU.overlapped(1.0, 0.5) == 1.5  # gloo hides nothing


def test_the_existing_estimates_read_the_calibrations():
    cpu, cuda = DEFAULT_COSTS["cpu"], DEFAULT_COSTS["cuda"]
    assert cpu.gemm_tflops == CPU.calibration.gemm.tflops
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
        assert data["peak_tflops"].get("source"), path.name
        for family in ("gemm", "attention", "memory"):  # the family's source, or each's
            for key, entry in data[family].items():
                if key in ("tflops", "floor_us", "tile_us", "gb_per_s", "seq_overhead"):
                    assert "source" in json.dumps(entry) or "source" in data[family], (
                        path.name, family, key)


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
    assert "calibrate.py" in data["gemm"]["source"]
    assert measured.gemm.tflops > 0 and measured.gemm.tile == (1, 1)
    assert set(measured.attention.tflops) == {64, 128}
    assert set(measured.memory.kernels) == set(KERNELS)
    assert all(set(rows) == set(programs.KERNEL_ROWS)
               for rows in measured.memory.kernels.values())
    assert measured.links == CPU.calibration.links  # kept from the base
    assert CostModel(measured).gemm(64, 64, 64) > 0
    assert all("source" in data[family] for family in ("gemm", "attention", "memory"))
    samples = json.loads((tmp_path / "here-samples.json").read_text())
    assert len(samples["gemm [m, n, k, s]"]) == len(programs.GEMM_SHAPES)
