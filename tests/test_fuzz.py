"""The differential fuzzer: random programs run sharded at world sizes 1, 2 and 4 and compared
with plain torch on the global tensors (programs: ``fuzz_programs.py``, schedules:
``fuzz_schedules.py``, outcomes: ``fuzz_runner.py``).

CI runs ``DEFAULT_PROGRAMS`` programs per world size, all in one test per size. The long mode
runs more: ``MESHFUSE_FUZZ_PROGRAMS=5000 python -m pytest tests/test_fuzz.py`` (or
``--fuzz-programs 5000``), from seed ``MESHFUSE_FUZZ_SEED`` (default 0) on. A failure prints
the outcome counts and, for the first failures, a runnable reproduction.
"""

from __future__ import annotations

import os

import pytest
from fuzz_programs import Features, generate
from fuzz_runner import run_many, seeds, summarize, write_report

pytestmark = pytest.mark.mpi

DEFAULT_PROGRAMS = 200
PROGRAMS_ENV = "MESHFUSE_FUZZ_PROGRAMS"
# What the schedules may use beyond block shards of divisible extents (see Features): all
# of it; MESHFUSE_FUZZ_FEATURES="" (or a subset, "uneven") narrows a run.
FEATURES = Features(uneven=True, any_to_any=True, integers=True, extrema=True)
FEATURES_ENV = "MESHFUSE_FUZZ_FEATURES"


def _features() -> Features:
    names = os.environ.get(FEATURES_ENV)
    if names is None:
        return FEATURES
    return Features(**{n: True for n in names.split(",") if n})


def test_fuzz_programs_match_torch(multidevice_test):
    size, features = multidevice_test.size, _features()
    run = seeds(size, PROGRAMS_ENV, DEFAULT_PROGRAMS)
    count = len(run)
    outcomes = run_many(run, multidevice_test.rank, multidevice_test.device,
                        lambda seed: generate(seed, size, features))
    summary = summarize(outcomes)
    write_report(run, size, multidevice_test.rank, outcomes)
    failures = [o for o in outcomes if o.failed]
    assert len(outcomes) == count
    assert not failures, (
        f"{len(failures)} of {count} programs failed at world size {multidevice_test.size}: "
        f"{summary}\n\n" + "\n\n".join(o.report() for o in failures[:3])
    )

