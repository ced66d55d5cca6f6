"""The benchmark command still runs: ``python -m benchmarks.run --quick`` (tiny sizes, one CPU
process), every case, no error record. It measures nothing; it keeps the harness, the cases
and the reports from rotting between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
