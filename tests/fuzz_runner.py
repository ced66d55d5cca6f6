"""Runs fuzz programs sharded and compares them with plain torch (see ``test_fuzz.py``).

Each program ends in one outcome: ``match``; ``mismatch`` (wrong values: a failure);
``untyped`` (an exception that is not a :class:`meshfuse.MeshfuseError`, or an
``ExecutionError`` wrapping a kernel's failure: a failure); or a typed ``refusal``, which is
allowed only when its message matches a class of :data:`REFUSALS`, each of which names the
fix in its message (an unknown refusal is a failure: the generator writes valid programs).
Two more failures: ``mutated`` (``execute`` changed the user's fusion: compiling must work on
a copy) and ``invalid program`` (the generator itself failed on a seed; the run goes on).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import traceback
from collections.abc import Callable, Iterable

import torch
from fusion_snapshot import snapshot
from fuzz_programs import Program, build, reference

from meshfuse import MeshfuseError, shard_tensor
from meshfuse.errors import ExecutionError
from meshfuse.passes.pipeline import compiled_for


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A class of typed refusals the fuzzer accepts.

    Attributes:
        name: a short name, used in the counts.
        error: the error type.
        pattern: a regex that the message matches.
        fix: a regex that the message must also match: the part that says what to do.
        why: why such a program is refused (invalid, or waiting for a named feature).
    """

    name: str
    error: type
    pattern: str
    fix: str
    why: str


# Typed refusals the fuzzer accepts. The generator writes valid programs only, and meshfuse
# runs every valid program it can write: none is accepted (a refusal is a failure). A class
# goes here only for a program the generator cannot tell is invalid, with the fix its
# message names.
REFUSALS: tuple[Refusal, ...] = ()


@dataclasses.dataclass(frozen=True)
class Outcome:
    # "match", "mismatch", "untyped", "refusal", "unknown refusal", "invalid program" (the
    # generator failed), "mutated" (execute changed the user's fusion)
    kind: str
    detail: str = ""  # the refusal class, or the error
    program: Program | None = None
    check: str | None = None  # the end of the reproduction (see Program.repro)

    @property
    def failed(self) -> bool:
        return self.kind in ("mismatch", "untyped", "unknown refusal", "invalid program",
                             "mutated")

    def report(self) -> str:
        """The failure with its reproduction (the seed and the program as code)."""
        if self.program is None:  # the generator failed: its seed is in the detail
            return f"{self.kind}: {self.detail}"
        return (f"{self.kind}: {self.detail}\n--- reproduction (seed {self.program.seed}, "
                f"world size {self.program.world_size}) ---\n{self.program.repro(self.check)}")


def classify(error: BaseException) -> tuple[str, str]:
    """(outcome kind, detail) of an exception raised by a program."""
    if not isinstance(error, MeshfuseError) or isinstance(error, ExecutionError):
        last = traceback.extract_tb(error.__traceback__)[-1]
        return "untyped", f"{type(error).__name__}: {error} (at {last.filename}:{last.lineno})"
    message = str(error)
    for refusal in REFUSALS:
        if isinstance(error, refusal.error) and re.search(refusal.pattern, message):
            assert re.search(refusal.fix, message), f"{refusal.name} without its fix: {message}"
            return "refusal", refusal.name
    return "unknown refusal", f"{type(error).__name__}: {message}"


def tolerance(program: Program, expected: torch.Tensor) -> dict:
    finite = expected[torch.isfinite(expected)] if expected.dtype.is_floating_point else None
    scale = float(finite.abs().max()) if finite is not None and finite.numel() else 1.0
    return {"rtol": 1e-4, "atol": 1e-4 * max(1.0, scale), "equal_nan": True}


def holder(fusion, rank: int) -> Callable[[object], bool]:
    """``held(tv)``: whether ``rank`` holds a shard of ``fusion``'s tensor ``tv`` (is in its
    mesh, as compiling gives it: every tensor has one there)."""
    compiled = compiled_for(fusion)
    return lambda tv: compiled[tv].mesh is None or rank in compiled[tv].mesh


def local_inputs(fusion, inputs: list[torch.Tensor], rank: int,
                 device: torch.device) -> list[torch.Tensor | None]:
    """This rank's shards of global ``inputs`` (None where it holds none), as ``execute``
    takes them."""
    held = holder(fusion, rank)
    return [shard_tensor(x.detach().to(device), tv, rank) if held(tv) else None
            for x, tv in zip(inputs, fusion.inputs())]


def run_program(program: Program, rank: int, device: torch.device) -> Outcome:
    """Runs ``program`` on this rank's shards and compares with torch on the global tensors."""
    try:
        fd, _ = build(program)
        inputs, expected = reference(program)
        held = holder(fd.fusion, rank)
        local = local_inputs(fd.fusion, inputs, rank, device)
        before = snapshot(fd.fusion)
        # Twice: the first call builds and checks, the second runs the cached program (bound
        # kernels, reused plans), which must give the same values.
        for call in ("first call", "cached call"):
            outputs = fd.execute(local)
            if snapshot(fd.fusion) != before:
                return Outcome("mutated", "execute changed the user's fusion", program)
            for out, ref, tv in zip(outputs, expected, fd.fusion.outputs()):
                if not held(tv):
                    continue
                want = shard_tensor(ref.to(device), tv, rank)
                try:
                    torch.testing.assert_close(out, want, **tolerance(program, ref))
                except AssertionError as e:
                    return Outcome("mismatch", f"{call}, {tv.name}: {e}", program)
    except Exception as e:  # noqa: BLE001 (every error is an outcome to count)
        kind, detail = classify(e)
        return Outcome(kind, detail, program)
    return Outcome("match", "", program)


SEED_ENV = "MESHFUSE_FUZZ_SEED"  # the first seed of a run (default 0)
REPORT_ENV = "MESHFUSE_FUZZ_REPORT"  # a directory: each rank writes its counts there


def seeds(world_size: int, programs_env: str, default: int) -> range:
    """The seeds of one fuzz test at ``world_size``: ``$programs_env`` programs (``default``;
    a quarter of it at world size 1, where nothing is sharded: a smoke run) from
    ``$MESHFUSE_FUZZ_SEED`` on."""
    count = int(os.environ.get(programs_env, default))
    if world_size == 1:
        count = min(count, default // 4)
    first = int(os.environ.get(SEED_ENV, "0"))
    return range(first, first + count)


def run_many(seeds: Iterable[int], rank: int, device: torch.device,
             make: Callable[[int], Program],
             run: Callable[[Program, int, torch.device], Outcome] = run_program,
             ) -> list[Outcome]:
    """The outcome of each seed's program ``make(seed)`` by ``run`` (default: its outputs
    against torch's); a seed whose program cannot be made is an ``invalid program``
    outcome, and the run goes on."""
    outcomes = []
    for seed in seeds:
        try:
            program = make(seed)
        except Exception as e:  # noqa: BLE001 (the generator's own bug: counted, run goes on)
            outcomes.append(Outcome("invalid program", f"seed {seed}: {type(e).__name__}: {e}"))
            continue
        outcomes.append(run(program, rank, device))
    return outcomes


def summarize(outcomes: Iterable[Outcome]) -> dict[str, int]:
    """How many programs ended in each outcome (refusals and errors by their first words)."""
    counts = collections.Counter(
        o.kind if o.kind in ("match", "mismatch", "untyped") else f"{o.kind}: {o.detail[:60]}"
        for o in outcomes
    )
    return dict(sorted(counts.items()))


def write_report(run: range, world_size: int, rank: int, outcomes: list[Outcome]) -> None:
    """With ``$MESHFUSE_FUZZ_REPORT`` set (a directory), writes this rank's counts and its
    first failures there as ``ws{world_size}-rank{rank}.json`` (a long run's record)."""
    report = os.environ.get(REPORT_ENV)
    if not report:
        return
    os.makedirs(report, exist_ok=True)
    with open(os.path.join(report, f"ws{world_size}-rank{rank}.json"), "w") as f:
        json.dump({"programs": len(run), "first_seed": run.start,
                   "outcomes": summarize(outcomes),
                   "failures": [o.report() for o in outcomes if o.failed][:20]}, f, indent=1)
