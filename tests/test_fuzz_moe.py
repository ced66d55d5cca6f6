"""The differential fuzzer on mixture-of-experts programs (``fuzz_moe.py``): random routers
and routed experts, expert parallel, data parallel, replicated or EP x TP, with uneven
experts and tokens, empty experts and ranks, capacities, forward and backward, compared
with plain PyTorch at each world size.

CI runs ``DEFAULT_PROGRAMS`` programs per world size; the long mode runs more:
``MESHFUSE_FUZZ_MOE_PROGRAMS=500 python -m pytest tests/test_fuzz_moe.py``, from seed
``MESHFUSE_FUZZ_SEED`` (default 0) on.
"""

from __future__ import annotations

import collections

import pytest
from fuzz_moe import generate
from fuzz_runner import run_many, seeds

pytestmark = pytest.mark.mpi

DEFAULT_PROGRAMS = 4
PROGRAMS_ENV = "MESHFUSE_FUZZ_MOE_PROGRAMS"


def test_fuzz_moe_programs_match_torch(multidevice_test):
    size = multidevice_test.size
    run = seeds(size, PROGRAMS_ENV, DEFAULT_PROGRAMS)
    outcomes = run_many(run, multidevice_test.rank, multidevice_test.device,
                        lambda seed: generate(seed, size))
    counts = collections.Counter(o.kind for o in outcomes)
    failures = [o for o in outcomes if o.failed]
    assert not failures, (
        f"{len(failures)} of {len(run)} MoE programs failed at world size {size}: "
        f"{dict(counts)}\n\n" + "\n\n".join(o.report() for o in failures[:3]))
    assert counts["match"] == len(run)
