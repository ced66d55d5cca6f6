"""The differential fuzzer on pipelines (``fuzz_stages.py``): random layer counts, stage
counts, cuts, schedules and microbatches, two steps of losses and gradients compared with
the same model on one device, at each world size.

CI runs ``DEFAULT_PROGRAMS`` pipelines per world size; the long mode runs more:
``MESHFUSE_FUZZ_STAGES_PROGRAMS=300 python -m pytest tests/test_fuzz_stages.py``, from seed
``MESHFUSE_FUZZ_SEED`` (default 0) on. A failure's report names its seed and draw; it
becomes a named case of :data:`REGRESSIONS`, run at its world size.
"""

from __future__ import annotations

import collections

import pytest
from fuzz_runner import Outcome, classify, run_many, seeds
from fuzz_stages import check, draw

pytestmark = pytest.mark.mpi

DEFAULT_PROGRAMS = 8
PROGRAMS_ENV = "MESHFUSE_FUZZ_STAGES_PROGRAMS"

# (name, seed, world size) of the pipelines that failed once
REGRESSIONS = [
    # every piece a parameterless tanh, ZeroBubble with one microbatch: the one-device
    # reference had no backward to run (the fuzzer's bug)
    ("parameterless_model_zero_bubble", 15, 3),
    # a ShardedStage of parameterless pieces (tanh only): no flat shard to make
    ("sharded_stage_without_parameters", 18, 2),
    ("sharded_stage_without_parameters_interleaved", 7, 4),
    # a head tied to the embedding in two stages of one pipeline rank, each a ShardedStage:
    # a configuration the pipeline refuses (two copies on the same devices), drawn anyway
    # (the fuzzer's bug)
    ("tied_head_not_drawn_where_the_pipeline_refuses_it", 780119, 2),
]


def _outcome(x, rank: int, size: int) -> Outcome:
    try:
        problems = check(x, rank, size)
    except Exception as e:  # noqa: BLE001 (every error is an outcome to report)
        kind, detail = classify(e)
        return Outcome(kind, f"{x.describe()}: {detail}")
    if problems:
        return Outcome("mismatch", f"{x.describe()}: {'; '.join(problems[:4])}")
    return Outcome("match")


def test_fuzz_pipelines_match_one_device(multidevice_test):
    size, rank = multidevice_test.size, multidevice_test.rank
    run = seeds(size, PROGRAMS_ENV, DEFAULT_PROGRAMS)

    outcomes = run_many(run, rank, multidevice_test.device, lambda seed: draw(seed, size),
                        lambda x, rank, device: _outcome(x, rank, size))
    counts = collections.Counter(o.kind for o in outcomes)
    failures = [f"seed {seed}: {o.kind}: {o.detail}" for seed, o in zip(run, outcomes)
                if o.failed]
    assert not failures, (f"{len(failures)} of {len(run)} pipelines failed at world size "
                          f"{size}: {dict(counts)}\n" + "\n".join(failures[:4]))
    assert counts["match"] == len(run)


@pytest.mark.parametrize("name, seed, world", REGRESSIONS, ids=[r[0] for r in REGRESSIONS])
def test_fuzz_stages_regression(multidevice_test, name, seed, world):
    size = multidevice_test.size
    if size != world:
        pytest.skip(f"{name} failed at world size {world}")
    outcome = _outcome(draw(seed, size), multidevice_test.rank, size)
    assert outcome.kind == "match", outcome.detail


# (name, seed, world size) of draws with a head tied to the embedding in another stage,
# each way of keeping the copies equal: ranks apart, flat shards, one rank (ZBV)
TIED = [("tied_head_across_ranks", 19, 3), ("tied_head_flat_shards", 8, 4),
        ("tied_head_flat_shards_interleaved", 22, 4), ("tied_head_on_one_rank_zbv", 13, 2)]


@pytest.mark.parametrize("name, seed, world", TIED, ids=[r[0] for r in TIED])
def test_fuzz_stages_tied_head(multidevice_test, name, seed, world):
    size = multidevice_test.size
    if size != world:
        pytest.skip(f"{name} is drawn at world size {world}")
    x = draw(seed, size)
    assert x.tied
    outcome = _outcome(x, multidevice_test.rank, size)
    assert outcome.kind == "match", outcome.detail
