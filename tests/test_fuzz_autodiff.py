"""The differential fuzzer of derived backwards: random differentiable programs
(``fuzz_programs.generate`` with ``Features.differentiable``), sharded by the fuzzer's random
schedules (uneven extents, cyclic and repeated splits, partial intermediates, several meshes)
at world sizes 1, 2 and 4, run through ``fd.as_autograd_function()`` with random cotangents
and a drawn rematerialization policy (``Features.remat``);
their outputs and every input's gradient shard compared with ``torch.autograd`` on the
global tensors (``fuzz_gradients.py``).

A second test draws the heads and batches of ``fuzz_heads.py`` too (``HEAD_FEATURES``;
``MESHFUSE_FUZZ_HEAD_PROGRAMS`` for its long mode). CI runs ``DEFAULT_PROGRAMS`` programs per
world size, all in one test per size. The long mode runs more: ``MESHFUSE_FUZZ_GRAD_PROGRAMS=2000 python -m pytest tests/test_fuzz_autodiff.py``,
from seed ``MESHFUSE_FUZZ_SEED`` (default 0) on. A failure prints the outcome counts and,
for the first failures, a runnable reproduction (``MESHFUSE_FUZZ_REPORT=DIR`` writes each
rank's counts there).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from fuzz_gradients import run_gradients
from fuzz_programs import Features, generate
from fuzz_runner import run_many, seeds, summarize, watch_segment_reductions, write_report

pytestmark = pytest.mark.mpi

DEFAULT_PROGRAMS = 24
PROGRAMS_ENV = "MESHFUSE_FUZZ_GRAD_PROGRAMS"
FEATURES = Features(uneven=True, any_to_any=True, integers=True, extrema=True,
                    differentiable=True, indexing=True, symbolic=True, remat=True)
# Heads and batches (fuzz_heads.py): grouped-query attention, batched matmuls, weights with
# leading axes; a feature set of its own, so that FEATURES' seeds draw what they drew.
HEAD_FEATURES = dataclasses.replace(FEATURES, heads=True)
HEAD_PROGRAMS_ENV = "MESHFUSE_FUZZ_HEAD_PROGRAMS"
SEGMENTED_PROGRAMS_ENV = "MESHFUSE_FUZZ_SEGMENTED_GRAD_PROGRAMS"


def _fuzz_gradients(multidevice_test, programs_env: str, features: Features,
                    run=run_gradients, what: str = "gradients") -> None:
    """Runs the seeds of ``programs_env`` at this world size, drawn with ``features``,
    through ``run``; fails with the counts and the first reproductions if a program
    failed (``what``: the failures' name in that message)."""
    size = multidevice_test.size
    seeds_run = seeds(size, programs_env, DEFAULT_PROGRAMS)
    outcomes = run_many(seeds_run, multidevice_test.rank, multidevice_test.device,
                        lambda seed: generate(seed, size, features), run)
    summary = summarize(outcomes)
    write_report(programs_env, seeds_run, size, multidevice_test.rank, outcomes)
    failures = [o for o in outcomes if o.failed]
    assert len(outcomes) == len(seeds_run)
    assert not failures, (
        f"{len(failures)} of {len(seeds_run)} programs' {what} failed at world size {size}: "
        f"{summary}\n\n" + "\n\n".join(o.report() for o in failures[:3]))


def test_fuzz_gradients_match_torch_autograd(multidevice_test):
    _fuzz_gradients(multidevice_test, PROGRAMS_ENV, FEATURES)


def test_fuzz_segmented_gradients_match_torch_autograd(multidevice_test, monkeypatch):
    """As above through fused segments compiled by ``aot_eager`` (the graphs Inductor would
    get, without generating kernels; ``MESHFUSE_FUZZ_SEGMENTED_GRAD_PROGRAMS`` programs): a
    derived backward's segments, their clustering and the recomputation across segments
    (``meshfuse.runtime.interpreter.recompute``), whose rewrites this run must have met in
    some program, else it tests nothing of them; and each segment's reductions classified
    (``fuzz_runner.watch_segment_reductions``)."""
    from meshfuse.engine import runner

    recomputed = []
    original = runner.fuse_program

    def fuse_program(program, backend="inductor", stats=None):
        fused = original(program, backend, stats)
        recomputed.append(any("recomputed:" in s.label for s in fused.steps))
        return fused
    monkeypatch.setattr(runner, "fuse_program", fuse_program)
    reductions = watch_segment_reductions(monkeypatch)
    _fuzz_gradients(multidevice_test, SEGMENTED_PROGRAMS_ENV, FEATURES,
                    functools.partial(run_gradients, compile="aot_eager"),
                    "segmented gradients")
    if multidevice_test.size > 1:  # (a quarter of the programs at world size 1, a smoke run)
        assert any(recomputed), "no program recomputed a value across segments"
        assert reductions["along rows"] and reductions["across rows"], reductions


def test_fuzz_head_gradients_match_torch_autograd(multidevice_test):
    """As above with ``HEAD_FEATURES`` (``MESHFUSE_FUZZ_HEAD_PROGRAMS`` programs)."""
    _fuzz_gradients(multidevice_test, HEAD_PROGRAMS_ENV, HEAD_FEATURES)
