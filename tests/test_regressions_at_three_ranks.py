"""The named fuzz regressions at 3 ranks, a world size that divides few extents (uneven
blocks, a rank with an empty shard): the suite's default world sizes (1, 2, 4) skip the
programs the fuzzers drew for 3 ranks, so their pytest runs here at ``--world-sizes 3``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FILES = ("tests/test_fuzz_regressions.py", "tests/test_fuzz_autodiff_regressions.py")


@pytest.mark.exclusive  # its pytest starts ranks of its own: not beside this run's batches
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 3,
                    reason="3 ranks need 3 GPUs under NCCL")
def test_fuzz_regressions_drawn_at_three_ranks():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--world-sizes", "3",
         *FILES], check=False, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]
