"""The differential fuzzer: random programs run sharded at world sizes 1, 2 and 4 and compared
with plain torch on the global tensors (programs: ``fuzz_programs.py``, schedules:
``fuzz_schedules.py``, outcomes: ``fuzz_runner.py``).

CI runs ``DEFAULT_PROGRAMS`` programs per world size, all in one test per size. The long mode
runs more: ``MESHFUSE_FUZZ_PROGRAMS=5000 python -m pytest tests/test_fuzz.py`` (or
``--fuzz-programs 5000``), from seed ``MESHFUSE_FUZZ_SEED`` (default 0) on. A failure prints
the outcome counts and, for the first failures, a runnable reproduction.

Two more tests draw from the same generator: low-precision programs (BFloat16/Half,
``fuzz_precision.py``; ``MESHFUSE_FUZZ_LOW_PRECISION_PROGRAMS``) and programs run through
the compiled path (fused segments by Inductor, against torch and the interpreter, at one
world size in CI; ``MESHFUSE_FUZZ_COMPILED_PROGRAMS`` runs more, at every world size).
A fourth runs the fused segments compiled by ``aot_eager`` at every world size
(``MESHFUSE_FUZZ_SEGMENTED_PROGRAMS``), a fifth forces stream-parallel loops
(``fuzz_overlap.py``; ``MESHFUSE_FUZZ_OVERLAP_PROGRAMS``), a sixth grouped-query attention
and batched matmuls (``fuzz_heads.py``; ``MESHFUSE_FUZZ_FORWARD_HEAD_PROGRAMS``).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import fuzz_overlap
import pytest
from fuzz_programs import Features, generate
from fuzz_runner import (
    REPORT_ENV,
    run_many,
    run_program,
    seeds,
    summarize,
    watch_segment_reductions,
    write_report,
)

pytestmark = pytest.mark.mpi

DEFAULT_PROGRAMS = 200
PROGRAMS_ENV = "MESHFUSE_FUZZ_PROGRAMS"
# What the schedules may use beyond block shards of divisible extents (see Features): all
# of it; MESHFUSE_FUZZ_FEATURES="" (or a subset, "uneven") narrows a run.
FEATURES = Features(uneven=True, any_to_any=True, integers=True, extrema=True,
                    indexing=True, symbolic=True)
FEATURES_ENV = "MESHFUSE_FUZZ_FEATURES"
# Low-precision programs (Features.low_precision): their own count, the same long mode.
DEFAULT_LOW_PRECISION_PROGRAMS = 40
LOW_PRECISION_PROGRAMS_ENV = "MESHFUSE_FUZZ_LOW_PRECISION_PROGRAMS"
# The compiled path: a few programs at one world size in CI (Inductor's C++ compiler takes
# seconds for each new segment, on every rank); MESHFUSE_FUZZ_COMPILED_PROGRAMS=500 is its
# long mode, at every world size; MESHFUSE_FUZZ_COMPILE the torch.compile backend (default
# inductor).
DEFAULT_COMPILED_PROGRAMS = 3
COMPILED_WORLD_SIZE = 2  # CI's one world size of the compiled programs
COMPILED_PROGRAMS_ENV = "MESHFUSE_FUZZ_COMPILED_PROGRAMS"
COMPILE_ENV = "MESHFUSE_FUZZ_COMPILE"
# The fused segments compiled by aot_eager (no kernel generation), at every world size.
DEFAULT_SEGMENTED_PROGRAMS = 24
SEGMENTED_PROGRAMS_ENV = "MESHFUSE_FUZZ_SEGMENTED_PROGRAMS"
# Stream-parallel loops forced (Features.overlap): their own count, the same long mode.
DEFAULT_OVERLAP_PROGRAMS = 30
OVERLAP_PROGRAMS_ENV = "MESHFUSE_FUZZ_OVERLAP_PROGRAMS"
# Heads and batches (Features.heads, fuzz_heads.py) through a plain execute: their own count.
DEFAULT_HEAD_PROGRAMS = 40
HEAD_PROGRAMS_ENV = "MESHFUSE_FUZZ_FORWARD_HEAD_PROGRAMS"


def _features() -> Features:
    names = os.environ.get(FEATURES_ENV)
    if names is None:
        return FEATURES
    return Features(**{n: True for n in names.split(",") if n})


def test_fuzz_programs_match_torch(multidevice_test):
    _fuzz(multidevice_test, PROGRAMS_ENV, DEFAULT_PROGRAMS, _features())


def test_fuzz_low_precision_programs_match_torch(multidevice_test):
    """BFloat16 and Half programs (``fuzz_precision.py``), against their exact values with
    the tolerances of their dtype."""
    features = dataclasses.replace(_features(), low_precision=True)
    _fuzz(multidevice_test, LOW_PRECISION_PROGRAMS_ENV, DEFAULT_LOW_PRECISION_PROGRAMS,
          features)


def test_fuzz_head_programs_match_torch(multidevice_test):
    """Grouped-query attention, batched matmuls and weights with leading axes
    (``fuzz_heads.py``) through a plain execute, symbolic extents among them (the gradient
    fuzzer draws them too, through derived backwards, whose extents are made static
    first)."""
    features = dataclasses.replace(_features(), heads=True)
    _fuzz(multidevice_test, HEAD_PROGRAMS_ENV, DEFAULT_HEAD_PROGRAMS, features)


def test_fuzz_compiled_programs_match_torch_and_the_interpreter(multidevice_test):
    """The programs through the compiled path (fused segments; Inductor's C++ on CPU),
    float32 ones at even seeds, low-precision ones at odd seeds: compared with torch and with
    the interpreter, the cached call compiling nothing."""
    if COMPILED_PROGRAMS_ENV not in os.environ and multidevice_test.size != COMPILED_WORLD_SIZE:
        pytest.skip(f"CI compiles at {COMPILED_WORLD_SIZE} ranks only (Inductor's C++ build "
                    f"per rank); {COMPILED_PROGRAMS_ENV}=N runs every world size")
    backend = os.environ.get(COMPILE_ENV, "inductor")
    low = dataclasses.replace(_features(), low_precision=True)
    _fuzz(multidevice_test, COMPILED_PROGRAMS_ENV, DEFAULT_COMPILED_PROGRAMS, _features(),
          compile=backend, odd_seeds=low)


def test_fuzz_segmented_programs_match_torch_and_the_interpreter(multidevice_test,
                                                                 monkeypatch):
    """The programs through the fused segments at every world size, compiled by
    ``aot_eager`` (the graphs Inductor would get, run without generating kernels: cheap
    enough for many programs): the segmenting, the clustering and the recomputation across
    segments (``meshfuse.runtime.interpreter.recompute``, which derived backwards meet more
    often: ``test_fuzz_autodiff.py``) against torch and the interpreter. Each segment's
    reductions are also classified (along or across rows, on fake tensors: what decides
    Inductor's settings on a GPU), without error."""
    reductions = watch_segment_reductions(monkeypatch)
    low = dataclasses.replace(_features(), low_precision=True)
    _fuzz(multidevice_test, SEGMENTED_PROGRAMS_ENV, DEFAULT_SEGMENTED_PROGRAMS, _features(),
          compile="aot_eager", odd_seeds=low)
    if multidevice_test.size > 1:  # (a few programs at world size 1, a smoke run)
        assert reductions["along rows"] and reductions["across rows"], reductions


def test_fuzz_overlap_programs_match_torch(multidevice_test):
    """Programs with stream-parallel loops forced (``set_overlap(True)`` next to their
    GEMMs, ``MESHFUSE_OVERLAP_CHUNKS`` drawn): against torch, and, sharded, some program of
    the run must have formed a loop (``fd.explain``'s stream loops), else the mode tests
    nothing."""
    features = dataclasses.replace(_features(), overlap=True, stream_axes=True)
    looped = []

    def run(program, rank, device):
        outcome = run_program(program, rank, device, explain=True)
        if outcome.kind == "match":
            looped.append(fuzz_overlap.loops(outcome.explained) > 0)
        return outcome

    _fuzz(multidevice_test, OVERLAP_PROGRAMS_ENV, DEFAULT_OVERLAP_PROGRAMS, features, run=run)
    report = os.environ.get(REPORT_ENV)
    if report:  # the share of programs that looped, for a long run's record
        name = f"overlap-loops-ws{multidevice_test.size}-rank{multidevice_test.rank}.txt"
        with open(os.path.join(report, name), "w") as f:
            f.write(f"{sum(looped)} of {len(looped)} matching programs formed a stream loop\n")
    if multidevice_test.size > 1:
        assert any(looped), "no program formed a stream loop"


def _fuzz(multidevice_test, programs_env: str, default: int, features: Features,
          compile: str | None = None, odd_seeds: Features | None = None,
          run=None) -> None:
    """Runs the seeds of ``programs_env`` (``seeds``) at this world size, drawn with
    ``features`` (``odd_seeds`` at odd seeds, when given), compiled by ``compile``; fails
    with the counts and the first reproductions if a program failed."""
    size = multidevice_test.size
    seeds_run = seeds(size, programs_env, default)
    count = len(seeds_run)

    def make(seed: int):
        drawn_with = odd_seeds if odd_seeds is not None and seed % 2 else features
        return generate(seed, size, drawn_with)

    outcomes = run_many(seeds_run, multidevice_test.rank, multidevice_test.device, make,
                        run or functools.partial(run_program, compile=compile))
    summary = summarize(outcomes)
    write_report(programs_env, seeds_run, size, multidevice_test.rank, outcomes)
    failures = [o for o in outcomes if o.failed]
    assert len(outcomes) == count
    assert not failures, (
        f"{len(failures)} of {count} programs failed at world size {multidevice_test.size}: "
        f"{summary}\n\n" + "\n\n".join(o.report() for o in failures[:3])
    )
