"""Checkpoints moved between world sizes, as a user moves them: the training scripts'
``--save``/``--resume`` run as jobs of fresh gloo process groups of 4, 2, 3, 1 and 8 ranks
one after another (tests/checkpoint_jobs.py), each resumed run's losses compared with a run
that was never interrupted.

- ``python -m meshfuse.examples.train_fsdp`` (a GPT stack, FSDP): saved at 4 ranks (dp2 x
  tp2) after 5 steps; resumed for 5 steps at 4 ranks on the same mesh (losses bitwise
  equal), at 2 (tp2), 3 (FSDP3, uneven shards), 1 and 8 (dp2 x cp2 x tp2: context parallel
  attention); the 8-rank run saves again and 4 ranks resume from it. Every resumed loss on
  another mesh is within 1e-6 relative of the uninterrupted run's (the script itself also
  checks 1e-5 against PyTorch, replaying the saved steps).
- tests/checkpoint_layouts.py (the MLP stack of test_checkpoint.py): saved at 4 ranks (dp2 x
  tp2) after 5 steps, resumed for 5 cyclic at 3 ranks (uneven cycles), which saves again; 4
  ranks resume from the cyclic checkpoint.

tests/test_checkpoint.py also resumes on the same mesh (bitwise) and under every other
layout in the ranks of one test run, cyclic ones at 2 and 4 ranks among them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FSDP = "meshfuse.examples.train_fsdp:main"
MLP = "checkpoint_layouts:main"
GPT = ["--layers", "1", "--embed", "16", "--heads", "4", "--seq", "8", "--batch", "6"]
RTOL = 1e-6


def _fsdp(ranks: int, mesh: str, steps: int, out: Path | None = None, **paths: Path):
    argv = ["--mesh", mesh, "--steps", str(steps), *GPT]
    argv += ["--out", str(out)] if out else []
    for option, path in paths.items():
        argv += [f"--{option}", str(path)]
    return {"ranks": ranks, "target": FSDP, "argv": argv}


def _mlp(ranks: int, layout: str, steps: int, out: Path | None = None, **paths: Path):
    argv = ["--layout", layout, "--steps", str(steps)]
    argv += ["--out", str(out)] if out else []
    for option, path in paths.items():
        argv += [f"--{option}", str(path)]
    return {"ranks": ranks, "target": MLP, "argv": argv}


def _run(tmp: Path, jobs: list[dict]) -> None:
    plan = tmp / "jobs.json"
    plan.write_text(json.dumps(jobs))
    root = str(HERE.parent)
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")])),
               CUDA_VISIBLE_DEVICES="", MESHFUSE_BACKEND="gloo")
    done = subprocess.run([sys.executable, str(HERE / "checkpoint_jobs.py"), str(plan)],
                          check=False, cwd=root, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def _fsdp_losses(out: Path) -> list[float]:
    record = json.loads((out / "train_fsdp.json").read_text())
    assert record["ok"], record  # within the script's 1e-5 of PyTorch
    return [loss for loss, _ in record["losses"]]


def _mlp_losses(out: Path) -> list[float]:
    return json.loads(out.read_text())["losses"]


def _close(resumed: list[float], expected: list[float], what: str) -> None:
    assert len(resumed) == len(expected), what
    for a, b in zip(resumed, expected):
        assert abs(a - b) <= RTOL * abs(b), (what, resumed, expected)


@pytest.mark.exclusive
def test_a_checkpoint_moves_between_world_sizes(tmp_path):
    t = tmp_path
    resumed = {"dp=1,tp=2": 2, "dp=3": 3, "dp=1": 1}
    jobs = [_fsdp(4, "dp=2,tp=2", 12, t / "whole"),
            _fsdp(4, "dp=2,tp=2", 5, save=t / "at5"),
            _fsdp(4, "dp=2,tp=2", 10, t / "same", resume=t / "at5"),
            *[_fsdp(n, mesh, 10, t / mesh, resume=t / "at5") for mesh, n in resumed.items()],
            _fsdp(8, "dp=2,cp=2,tp=2", 10, t / "cp", resume=t / "at5", save=t / "at10"),
            _fsdp(4, "dp=2,tp=2", 12, t / "from8", resume=t / "at10"),
            _mlp(4, "dp2tp2", 12, t / "mlp_whole.json"),
            _mlp(4, "dp2tp2", 5, save=t / "mlp5"),
            _mlp(3, "cyclic", 10, t / "cyclic3.json", resume=t / "mlp5", save=t / "mlp10"),
            _mlp(4, "dp2tp2", 12, t / "mlp_back.json", resume=t / "mlp10")]
    _run(t, jobs)
    whole = _fsdp_losses(t / "whole")
    assert _fsdp_losses(t / "same") == whole[5:10]  # the same mesh: bitwise
    for mesh in resumed:
        _close(_fsdp_losses(t / mesh), whole[5:10], mesh)
    _close(_fsdp_losses(t / "cp"), whole[5:10], "dp=2,cp=2,tp=2")
    _close(_fsdp_losses(t / "from8"), whole[10:12], "saved at 8 ranks, resumed at 4")
    mlp = _mlp_losses(t / "mlp_whole.json")
    _close(_mlp_losses(t / "cyclic3.json"), mlp[5:10], "cyclic at 3 ranks")
    _close(_mlp_losses(t / "mlp_back.json"), mlp[10:12], "saved cyclic at 3, resumed at 4")
