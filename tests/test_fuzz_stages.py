"""The differential fuzzer on pipelines (``fuzz_stages.py``): random layer counts, stage
counts, cuts, schedules and microbatches, two steps of losses and gradients compared with
the same model on one device, at each world size.

CI runs ``DEFAULT_PROGRAMS`` pipelines per world size; the long mode runs more:
``MESHFUSE_FUZZ_STAGES_PROGRAMS=300 python -m pytest tests/test_fuzz_stages.py``, from seed
``MESHFUSE_FUZZ_SEED`` (default 0) on. A failure's report names its seed and draw; it
becomes a named test in ``test_pipeline_parallel.py``.
"""

from __future__ import annotations

import collections

import pytest
from fuzz_runner import Outcome, classify, run_many, seeds
from fuzz_stages import check, draw

pytestmark = pytest.mark.mpi

DEFAULT_PROGRAMS = 8
PROGRAMS_ENV = "MESHFUSE_FUZZ_STAGES_PROGRAMS"


def test_fuzz_pipelines_match_one_device(multidevice_test):
    size, rank = multidevice_test.size, multidevice_test.rank
    run = seeds(size, PROGRAMS_ENV, DEFAULT_PROGRAMS)

    def one(x, rank, device) -> Outcome:
        try:
            problems = check(x, rank, size)
        except Exception as e:  # noqa: BLE001 (every error is an outcome to report)
            kind, detail = classify(e)
            return Outcome(kind, f"{x.describe()}: {detail}")
        if problems:
            return Outcome("mismatch", f"{x.describe()}: {'; '.join(problems[:4])}")
        return Outcome("match")

    outcomes = run_many(run, rank, multidevice_test.device, lambda seed: draw(seed, size),
                        one)
    counts = collections.Counter(o.kind for o in outcomes)
    failures = [f"seed {seed}: {o.kind}: {o.detail}" for seed, o in zip(run, outcomes)
                if o.failed]
    assert not failures, (f"{len(failures)} of {len(run)} pipelines failed at world size "
                          f"{size}: {dict(counts)}\n" + "\n".join(failures[:4]))
    assert counts["match"] == len(run)
