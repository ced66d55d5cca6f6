"""The benchmark command still runs: ``python -m benchmarks.run --quick`` (tiny sizes, one CPU
process), every case, no error record. It measures nothing; it keeps the harness, the cases
and the reports from rotting between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_quick_benchmark_run_has_no_errors(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    written = {p.suffix for p in tmp_path.iterdir()}
    assert {".json", ".md"} <= written, written
    report = json.loads(next(tmp_path.glob("*.json")).read_text())
    records = report["records"]
    assert {r["case"] for r in records} == set(report["meta"]["cases"])
    errors = [f"{r['case']} {r['config']} {r['variant']}: {r['message']}" for r in records
              if r["status"] == "error"]
    assert not errors, errors
    measured = [r for r in records if r["variant"] in ("meshfuse", "direct")
                and r["status"] == "ok"]
    assert measured and all(r["median_ms"] > 0 for r in measured)


def test_training_step_benchmark_runs_on_the_cpu(tmp_path):
    """``benchmarks/training_step.py --quick`` end to end on tiny shapes (torch.compile's
    variants left out here: tracing the layer takes tens of seconds on a CPU)."""
    from benchmarks import training_step

    variants = "torch_eager,meshfuse_autograd,meshfuse_hand_written"
    assert training_step.main(["--quick", "--out", str(tmp_path), "--variants", variants,
                               "--rounds", "2", "--iters", "1"]) == 0
    report = json.loads((tmp_path / "training_step.json").read_text())
    (size,) = report["sizes"]
    results = {r["variant"]: r for r in size["results"]}
    assert set(results) == set(variants.split(","))
    assert all(r["status"] == "ok" and r["ms"] > 0 and not r["recompiled"]
               for r in results.values())
    assert results["meshfuse_autograd"]["ratios"]["meshfuse_hand_written"] > 0
    assert any("host time per cached call" in line
               for line in results["meshfuse_autograd"]["info"]["backward_explain"])
    assert "| meshfuse_autograd |" in (tmp_path / "training_step.md").read_text()


def test_training_step_variants_under_other_inductor_settings_are_opt_in(monkeypatch):
    """The variants compiled with another Inductor setting run only when named; named, the
    setting reaches the segments' compilation (here Inductor's C++ backend, tiny shapes)
    and no other variant's."""
    from benchmarks import training_step
    from meshfuse.runtime.interpreter import fused

    cpu = torch.device("cpu")
    assert not set(training_step.OPT_IN) & set(
        training_step.variants(training_step.TINY, cpu, torch.float32, "inductor"))
    seen = []
    original = fused.inductor_patches

    def recorded(backend, tensors, graph=None):
        patches = original(backend, tensors, graph)
        seen.append(patches.get("realize_opcount_threshold"))
        return patches
    monkeypatch.setattr(fused, "inductor_patches", recorded)
    monkeypatch.setenv("MESHFUSE_COMPILE", "1")
    chosen = ["meshfuse_hand_written", "meshfuse_hand_written_opcount30"]
    for name, setup in training_step.variants(training_step.TINY, cpu, torch.float32,
                                              "inductor", chosen).items():
        before = len(seen)
        step = setup()[0]
        step()
        step()
        assert set(seen[before:]) == ({30} if name.endswith("opcount30") else {None}), name


def test_mlp_case_reads_its_bar_from_records_of_the_same_run():
    """Issue 13's MLP bar (0.97x DTensor, 1.96x over one GPU) as two metrics of the sharded
    records, both against the run's own torch_1gpu and dtensor_tp records; one rank has no
    speedup to speak of."""
    from benchmarks.cases.mlp import speedups
    from benchmarks.harness import Record
    from benchmarks.report import headline

    def run(world, **ms):
        return speedups([Record("mlp", "T8", name, world, median_ms=t) for name, t in ms.items()])

    one, manual, dtensor, mesh = run(2, torch_1gpu=40.0, torch_manual=20.0, dtensor_tp=20.5,
                                     meshfuse=20.0)
    assert one.metrics == {}
    assert (manual.metrics["speedup_over_1gpu"], dtensor.metrics["speedup_over_1gpu"]) == (2.0, 1.951)
    assert mesh.metrics["speedup_over_1gpu"] == 2.0
    assert mesh.metrics["vs_dtensor_tp"] == 1.025
    assert "vs_dtensor_tp" not in dtensor.metrics
    assert headline([one, manual, dtensor, mesh]) == [(
        "mlp T8: execute 20.00 ms vs torch_manual 20.00 ms = 1.00x; 2.00x over one GPU, "
        "1.02x dtensor_tp's speed")]
    assert all(not r.metrics for r in run(1, torch_1gpu=4.0, dtensor_tp=4.1, meshfuse=4.0))


def test_dropout_cost_compares_each_kernel_with_itself():
    """Issue 16's bar read from one run's records: meshfuse's p0.1/p0, the cuDNN kernel's
    own ratio (the floor), and each fused kernel's p0.1 over its own p0."""
    from benchmarks.cases.attention_dropout import cost_summary, dropout_cost
    from benchmarks.harness import Record

    def record(variant, ms, gpu_us=None):
        return Record("attention_dropout", "BHSE", variant, 2, median_ms=ms,
                      metrics={} if gpu_us is None else {"gpu_us": gpu_us})

    records = [record("meshfuse_p0", 0.08, 53.0), record("meshfuse_p0.1", 0.124, 81.0),
               record("aten_cudnn_p0", 0.1, 53.0), record("aten_cudnn_p0.1", 0.15, 81.0),
               record("direct_cudnn_p0", 0.1, 53.0), record("direct_cudnn_p0.1", 0.15, 81.0),
               record("direct_flash_p0", 0.12, 88.0), record("direct_flash_p0.1", 0.13, 97.0),
               record("meshfuse_flash_p0", 0.1), record("meshfuse_flash_p0.1", 0.11)]
    cost = dropout_cost(records)
    assert cost["fastest_dropout_kernel"] == "cudnn"
    assert cost["same_kernel_gpu"] == {"cudnn": 1.528, "flash": 1.102}
    assert cost["same_kernel_meshfuse"] == {"flash": 1.1}
    assert cost["target_1.3x"].startswith("not reachable: the cuDNN kernel alone costs 1.53x")
    assert "each kernel against itself: GPU cudnn 1.53x, flash 1.10x, meshfuse flash 1.10x" in (
        cost_summary(cost))


def test_checkpoint_io_benchmark_runs_on_the_cpu(tmp_path):
    """``benchmarks/checkpoint_io.py --quick`` end to end, into a ``--dir`` that does not
    exist yet (a fresh GPU machine's): every time and GB/s recorded, nothing left behind."""
    from benchmarks import checkpoint_io

    where = tmp_path / "not" / "there"
    assert checkpoint_io.main(["--quick", "--out", str(tmp_path), "--dir", str(where)]) == 0
    report = json.loads((tmp_path / "checkpoint_io.json").read_text())
    assert set(report["median_seconds"]) == {"meshfuse_save", "torch_save", "meshfuse_load",
                                            "torch_load"}
    assert all(s > 0 for s in report["median_seconds"].values())
    assert report["async"]["first_call_seconds"] > 0 and report["tensor_bytes"] > 0
    assert "| meshfuse load |" in (tmp_path / "checkpoint_io.md").read_text()
    assert list(where.iterdir()) == []  # the checkpoints are removed


def test_host_profile_runs_on_the_cpu(tmp_path):
    """``benchmarks/host_profile.py --quick``: every variant of both cases profiled (no
    failure written), with the host's speed and the GPT step's parts."""
    from benchmarks import host_profile

    assert host_profile.main(["--quick", "--out", str(tmp_path)]) == 0
    # the kernels alone are a CUDA variant
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"host_profile-{name}.txt" for name in ("ce-eager", "ce-meshfuse",
                                                "gpt-meshfuse_autograd",
                                                "gpt-meshfuse_hand_written", "gpt-torch_eager")]
    texts = [p.read_text() for p in tmp_path.iterdir()]
    assert not [t for t in texts if " failed: " in t.splitlines()[0]]
    gpt = (tmp_path / "host_profile-gpt-meshfuse_autograd.txt").read_text()
    assert "host speed (us per call)" in gpt and "backward: engine to node" in gpt
    assert "host time by tottime" in gpt


def test_host_profile_by_step_names_every_step(tmp_path, monkeypatch):
    """``--by-step``: each program's steps in order, times summing to the program's."""
    from benchmarks import host_profile

    # main turns replay off for the process: the setting is undone after the test
    monkeypatch.setenv("MESHFUSE_CUDA_GRAPH", "0")
    assert host_profile.main(["--quick", "--case", "gpt", "--by-step", "--gpt-variants",
                              "meshfuse_autograd,meshfuse_hand_written",
                              "--out", str(tmp_path)]) == 0
    text = (tmp_path / "host_profile-gpt-meshfuse_autograd-by-step.txt").read_text()
    programs = [line for line in text.splitlines() if line.startswith("program of ")]
    assert len(programs) == 2  # the forward and the derived backward
    for header in programs:
        count = int(header.split()[2])
        block = text.split(header + "\n", 1)[1].split("\nprogram of ", 1)[0].splitlines()
        assert [int(line.split()[0]) for line in block] == list(range(count))
        total = float(header.split(": ")[1].split()[0])
        assert sum(float(line.split()[1]) for line in block) == pytest.approx(total, abs=1)
    hand = (tmp_path / "host_profile-gpt-meshfuse_hand_written-by-step.txt").read_text()
    assert hand.count("program of ") == 1


def test_live_by_origin_groups_a_snapshots_blocks():
    """What a memory snapshot holds, by pool and by the code that allocated it."""
    from benchmarks.memory_peak import live_by_origin

    frame = {"filename": "meshfuse/runtime/replay/graphs.py", "line": 108,
             "name": "warm_up_run"}
    block = {"state": "active_allocated", "size": 32 * 2**20, "frames": [frame]}
    snapshot = {"segments": [
        {"segment_pool_id": (0, 0), "blocks": [block, block, {"state": "inactive",
                                                              "size": 2**20}]},
        {"segment_pool_id": (1, 7), "blocks": [{"state": "active_allocated",
                                                "size": 2**20, "frames": []}]}]}
    lines = live_by_origin(snapshot)
    assert lines[1].split() == ["64.0", "MiB", "2", "blocks", "default",
                                "graphs.py:108:warm_up_run"]
    assert lines[2].split()[:5] == ["1.0", "MiB", "1", "blocks", "graphs"]
    assert len(lines) == 3


def test_interleaved_blocks_start_with_torchs_autograd_threads():
    """A step that switches autograd's device threads off for its thread (as a meshfuse
    call does) does not carry that over to the variant timed after it."""
    import torch

    from benchmarks.timing import interleaved

    seen = []
    steps = {"switches off": lambda: torch.autograd.set_multithreading_enabled(False),
             "reads": lambda: seen.append(torch.autograd.is_multithreading_enabled())}
    before = torch.autograd.is_multithreading_enabled()
    times = interleaved(steps, rounds=3, iters=2, device=torch.device("cpu"))
    assert seen == [True] * 6 and all(len(t) == 3 for t in times.values())
    assert torch.autograd.is_multithreading_enabled() == before


def test_interleaved_blocks_follow_a_different_variant_from_round_to_round():
    """Every variant timed once per round, in an order that changes between rounds, so no
    variant is always timed after the same one (what a block leaves to the next, a GPU's
    clocks or the host's caches, would otherwise weigh on one variant only); the same
    orders in every run."""
    import torch

    from benchmarks.timing import interleaved

    def orders():
        ran = []
        steps = {name: (lambda n=name: ran.append(n)) for name in "abcde"}
        interleaved(steps, rounds=8, iters=1, device=torch.device("cpu"))
        return [ran[i:i + 5] for i in range(0, len(ran), 5)]

    rounds = orders()
    assert all(sorted(r) == list("abcde") for r in rounds)
    for name in "abcde":
        before = {r[r.index(name) - 1] for r in rounds if r.index(name) > 0}
        assert len(before) > 1, (name, rounds)
    assert orders() == rounds


def test_step_timeline_lists_each_step(tmp_path):
    """``benchmarks.step_timeline``: each profiled step of each variant in the analysis, and
    a summary line per variant (CUDA-only variants skipped on the CPU)."""
    from benchmarks import step_timeline

    assert step_timeline.main(["--quick", "--steps", "3", "--warmup", "1", "--out",
                               str(tmp_path), "--variants",
                               "meshfuse_autograd,meshfuse_captured"]) == 0
    analysis = json.loads((tmp_path / "step_timeline-meshfuse_autograd.json").read_text())
    assert [c["name"] for c in analysis["calls"]] == ["call0", "call1", "call2"]
    assert all(c["host_ms"] > 0 for c in analysis["calls"])
    text = (tmp_path / "step_timeline.txt").read_text()
    assert "meshfuse_autograd: per step" in text
    assert ("meshfuse_captured: skipped" in text) != torch.cuda.is_available()
