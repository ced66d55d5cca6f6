"""The differential fuzzer on context-parallel attention: random programs whose attention
has its sequence sharded over the ranks (``fuzz_context_parallel.py``), run at world sizes 1,
2 and 4 and compared, forward and backward, with PyTorch's unsharded attention (outcomes
as for every fuzz program: ``fuzz_runner.py``).

CI runs ``DEFAULT_PROGRAMS`` programs per world size in one test. The long mode runs more:
``MESHFUSE_FUZZ_CP_PROGRAMS=2000 python -m pytest tests/test_fuzz_context_parallel.py``,
from seed ``MESHFUSE_FUZZ_SEED`` (default 0) on. A failure prints the first failures with a
runnable reproduction.
"""

from __future__ import annotations

import collections

import pytest
from fuzz_context_parallel import generate
from fuzz_runner import run_many, seeds

pytestmark = pytest.mark.mpi

DEFAULT_PROGRAMS = 16
PROGRAMS_ENV = "MESHFUSE_FUZZ_CP_PROGRAMS"


def test_fuzz_context_parallel_programs_match_torch(multidevice_test):
    size = multidevice_test.size
    run = seeds(size, PROGRAMS_ENV, DEFAULT_PROGRAMS)
    count = len(run)
    outcomes = run_many(run, multidevice_test.rank, multidevice_test.device,
                        lambda seed: generate(seed, size))
    counts = collections.Counter(o.kind for o in outcomes)
    modes = collections.Counter(o.program.mode.split(",")[1].strip() for o in outcomes
                                if o.program is not None)
    failures = [o for o in outcomes if o.failed]
    assert len(outcomes) == count
    assert not failures, (
        f"{len(failures)} of {count} context-parallel programs failed at world size "
        f"{multidevice_test.size}: {dict(counts)}\n\n"
        + "\n\n".join(o.report() for o in failures[:3]))
    assert counts["match"] == count
    if size > 1:  # (world size 1 is a smoke run of a few programs: nothing is split)
        assert len(modes) == 2, modes  # block and zig-zag splits both ran
