"""Runs fuzz programs sharded and compares them with plain torch (see ``test_fuzz.py``).

Each program ends in one outcome: ``match``; ``mismatch`` (wrong values: a failure);
``untyped`` (an exception that is not a :class:`meshfuse.MeshfuseError`, or an
``ExecutionError`` wrapping a kernel's failure: a failure); or a typed ``refusal``, which is
allowed only when its message matches a class of :data:`REFUSALS`, each of which names the
fix in its message (an unknown refusal is a failure: the generator writes valid programs).
Three more failures: ``mutated`` (``execute`` changed the user's fusion: compiling must work
on a copy), ``recompiled`` (a cached call of the compiled path compiled again) and ``invalid
program`` (the generator itself failed on a seed; the run goes on).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import os
import re
import traceback
from collections.abc import Callable, Iterable

import fuzz_precision
import fuzz_symbolic
import torch
import torch.distributed as dist
from fusion_snapshot import snapshot
from fuzz_overlap import chunks_env
from fuzz_programs import FORWARD_CHECK, Program, build, reference
from torch._dynamo.utils import counters

from meshfuse import MeshfuseError, shard_tensor
from meshfuse.errors import ExecutionError
from meshfuse.passes.pipeline import compiled_for
from meshfuse.runtime.comm.communicator import Communicator


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
    # generator failed), "mutated" (execute changed the user's fusion), "recompiled" (a
    # cached compiled call compiled again)
    kind: str
    detail: str = ""  # the refusal class, or the error
    program: Program | None = None
    check: str | None = None  # the end of the reproduction (see Program.repro)
    explained: str | None = None  # fd.explain(inputs) of the run, when asked for

    @property
    def failed(self) -> bool:
        return self.kind in ("mismatch", "untyped", "unknown refusal", "invalid program",
                             "mutated", "recompiled")

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
    """A float32 program's tolerances: float32's, but where the program rounds a value to
    bfloat16 and back, bfloat16's (4 units of roundoff at the output's scale): a narrowing
    cast keeps a partial sum partial, as DTensor does, so each rank rounds its partial sum
    and the sum of the rounded ones is not the rounded sum torch computes."""
    finite = expected[torch.isfinite(expected)] if expected.dtype.is_floating_point else None
    scale = float(finite.abs().max()) if finite is not None and finite.numel() else 1.0
    if rounds_to_bfloat16(program):
        return {"rtol": 2.0 ** -6, "atol": 2.0 ** -5 * max(1.0, scale), "equal_nan": True}
    return {"rtol": 1e-4, "atol": 1e-4 * max(1.0, scale), "equal_nan": True}


def rounds_to_bfloat16(program: Program) -> bool:
    """Whether a float32 program casts a value to bfloat16 (and back: ``cast`` draws)."""
    return not program.low and any("DataType.BFloat16)" in line for line in program.fd_lines)


def holder(fusion, rank: int) -> Callable[[object], bool]:
    """``held(tv)``: whether ``rank`` holds a shard of ``fusion``'s tensor ``tv`` (is in its
    mesh, as compiling gives it: every tensor has one there)."""
    compiled = compiled_for(fusion)
    return lambda tv: compiled[tv].mesh is None or rank in compiled[tv].mesh


def local_inputs(fusion, inputs: list[torch.Tensor], rank: int,
                 device: torch.device) -> list[torch.Tensor | None]:
    """This rank's shards of global ``inputs`` (None where it holds none, or a meta tensor of
    its global shape for an input with symbolic extents), as ``execute`` takes them."""
    held = holder(fusion, rank)
    return [shard_tensor(x.detach().to(device), tv, rank) if held(tv)
            else fuzz_symbolic.stand_in(tv, x.shape, x.dtype)
            for x, tv in zip(inputs, fusion.inputs())]


def run_program(program: Program, rank: int, device: torch.device,
                compile: str | None = None, explain: bool = False) -> Outcome:
    """Runs ``program`` on this rank's shards and compares with torch on the global tensors.

    Without ``compile``, ``execute`` runs twice (as ``MESHFUSE_COMPILE`` says: the
    interpreter by default): the first call builds and checks, the second runs the cached
    program (bound kernels, reused plans), which must give the same values. With ``compile``
    (a torch.compile backend: ``"inductor"``...), the interpreter runs first, then the
    compiled program twice; each compiled call is compared with torch and with the
    interpreter, and the cached one must compile nothing (outcome ``recompiled``). A
    failure's reproduction runs the program as the failing call did (:func:`repro_check`).
    With ``explain``, the outcome carries ``fd.explain`` of this rank's inputs (made on
    every rank that built the program, whatever its outcome: explain agrees with the others).
    """
    fd = local = None
    try:
        with chunks_env(program):
            fd, _ = build(program)
            inputs, outputs = reference(program)
            held = holder(fd.fusion, rank)
            local = local_inputs(fd.fusion, inputs, rank, device)
            references = expected(program, inputs, outputs)
            wanted = [(shard_tensor(ref[0].to(device), tv, rank), *ref[1:])
                      if held(tv) and ref is not None else None
                      for ref, tv in zip(references, fd.fusion.outputs())]
            kind, detail = _calls_outcome(fd, local, wanted, compile)
    except Exception as e:  # noqa: BLE001 (every error is an outcome to count)
        kind, detail = classify(e)
    explained = _explained(program, fd, local) if explain else None
    return Outcome(kind, detail, program, repro_check(program, compile), explained)


def _explained(program: Program, fd, local: list | None) -> str | None:
    """``fd.explain(local)`` under the program's environment; None if it was not built or
    its inputs were not made, or explain failed (the program's own error, counted in its
    outcome)."""
    if fd is None or local is None:
        return None
    try:
        with chunks_env(program):
            return fd.explain(local)
    except Exception:  # noqa: BLE001
        return None


def _calls_outcome(fd, local: list, wanted: list, compile: str | None) -> tuple[str, str]:
    """(kind, detail) of the calls of :func:`run_program` on this rank's inputs ``local``,
    compared with ``wanted`` (``(value, dtype, tolerances)``, None where not held). Every
    call runs even after a failure: another rank, which holds other outputs, may have found
    none, and it makes these calls (their collectives) too."""
    before = snapshot(fd.fusion)
    interpreted, failure = None, None
    for call, option in _calls(compile):
        counts = _compile_counts(fd) if call == "compiled cached call" else None
        got = fd.execute(local) if option is None else fd.execute(local, compile=option)
        if snapshot(fd.fusion) != before:
            failure = failure or ("mutated", "execute changed the user's fusion")
        if counts is not None and _compile_counts(fd) != counts:
            failure = failure or ("recompiled", f"{call}: {counts} -> {_compile_counts(fd)}")
        against = [("torch", wanted)]
        if option and interpreted is not None:  # the interpreter, with torch's dtypes
            against.append(("the interpreter", [
                None if w is None else (x, w[1], w[2]) for x, w in zip(interpreted, wanted)]))
        for name, references in against:
            difference = _difference(got, references, fd.fusion.outputs())
            if difference and failure is None:
                failure = ("mismatch", f"{call}, {difference} (against {name})")
        if option is False:
            interpreted = got
    return failure or ("match", "")


def repro_check(program: Program, compile: str | None) -> str | None:
    """The end of ``program``'s reproduction (``Program.repro``): the forward check, with
    ``compile`` passed to ``execute``, and for a low-precision program the tolerances of its
    dtype (a bound for the script's reader, wider than the run's: ``fuzz_precision``)."""
    if compile is None and not program.low and not rounds_to_bfloat16(program):
        return None
    check = FORWARD_CHECK
    if compile is not None:
        check = check.replace("fd.execute(local)", f"fd.execute(local, compile={compile!r})")
    if program.low or rounds_to_bfloat16(program):
        check = check.replace("rtol=1e-4", "rtol=2e-2").replace("atol=1e-4", "atol=2e-2")
    return check


def expected(program: Program, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
             ) -> list[tuple[torch.Tensor, torch.dtype, dict] | None]:
    """For each of torch's ``outputs`` (global): the value an output is compared with, the
    dtype it must have, and the tolerances; a low-precision program's values are exact
    (float64) with tolerances of its dtype (``fuzz_precision.expectations``; None: not
    compared)."""
    if not program.low:
        return [(out, out.dtype, tolerance(program, out)) for out in outputs]
    return [None if e is None else (e[0], out.dtype, e[1]) for out, e in
            zip(outputs, fuzz_precision.expectations(program, inputs, outputs))]


def _difference(outputs, references, tvs) -> str:
    """The first output that differs from its ``(value, dtype, tolerances)`` reference
    (None: not held here), or ``""``."""
    for out, ref, tv in zip(outputs, references, tvs):
        if ref is None:
            continue
        want, dtype, tol = ref
        if out.dtype != dtype:
            return f"{tv.name}: dtype {out.dtype}, torch's {dtype}"
        try:
            torch.testing.assert_close(out.to(want.dtype), want, **tol)
        except AssertionError as e:
            return f"{tv.name}: {e}"
    return ""


def _calls(compile: str | None) -> list[tuple[str, str | bool | None]]:
    """The calls of one program: (name, ``execute``'s ``compile`` option; None: not given)."""
    if compile is None:
        return [("first call", None), ("cached call", None)]
    return [("interpreter", False), ("compiled first call", compile),
            ("compiled cached call", compile)]


def _compile_counts(fd) -> tuple:
    """The segment compilations of each fused program of ``fd`` (meshfuse's count) and
    torch's compile counters (AOTAutograd's, Inductor's): a call that compiles changes one
    of them."""
    fused = fd._get_runner()._fused  # the tests of fused segments read it too
    mine = tuple(sorted((str(key), stats.compiles) for key, (_, stats) in fused.items()))
    theirs = tuple(sorted((name, tuple(sorted(c.items()))) for name, c in counters.items()
                          if name in ("aot_autograd", "inductor")))
    return mine, theirs


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


def settle(outcome: Outcome) -> None:
    """After one program at several ranks: when it raised on some rank (the others may
    have finished, or failed only in their next collective), every rank starts meshfuse's
    process groups over (``Communicator.recover``), so that one failure does not fail every
    later program. The ranks say whether they raised through the rendezvous store (no
    process group, and no timeout shorter than a failing collective's)."""
    global _settled
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store, size = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    # A rank still in a collective that failed on another waits out meshfuse's timeout.
    store.set_timeout(datetime.timedelta(seconds=3 * Communicator.instance().timeout + 60))
    _settled += 1
    key = f"meshfuse-fuzz/settle/{_settled}"
    store.set(f"{key}/{dist.get_rank()}", "1" if outcome.kind not in ("match", "mismatch")
              else "0")
    if any(store.get(f"{key}/{r}") == b"1" for r in range(size)):
        # A rank first waits out its collectives still in flight (up to the timeout): the
        # others wait for it in recover() longer than that.
        comm = Communicator.instance()
        timeout = comm.timeout
        comm.set_timeout(3 * timeout + 60)
        try:
            comm.recover()
        finally:
            comm.set_timeout(timeout)


_settled = 0  # programs settled so far (the same count on every rank)


def run_many(seeds: Iterable[int], rank: int, device: torch.device,
             make: Callable[[int], Program],
             run: Callable[[Program, int, torch.device], Outcome] = run_program,
             ) -> list[Outcome]:
    """The outcome of each seed's program ``make(seed)`` by ``run`` (default: its outputs
    against torch's), with :func:`settle` after each; a seed whose program cannot be made
    (on every rank alike) is an ``invalid program`` outcome, and the run goes on."""
    outcomes = []
    for seed in seeds:
        try:
            program = make(seed)
        except Exception as e:  # noqa: BLE001 (the generator's own bug: counted, run goes on)
            outcomes.append(Outcome("invalid program", f"seed {seed}: {type(e).__name__}: {e}"))
            continue
        outcomes.append(run(program, rank, device))
        settle(outcomes[-1])
    return outcomes


def summarize(outcomes: Iterable[Outcome]) -> dict[str, int]:
    """How many programs ended in each outcome (refusals and errors by their first words)."""
    counts = collections.Counter(
        o.kind if o.kind in ("match", "mismatch", "untyped") else f"{o.kind}: {o.detail[:60]}"
        for o in outcomes
    )
    return dict(sorted(counts.items()))


def write_report(kind: str, run: range, world_size: int, rank: int,
                 outcomes: list[Outcome]) -> None:
    """With ``$MESHFUSE_FUZZ_REPORT`` set (a directory), writes this rank's counts and its
    first failures there as ``{kind}-ws{world_size}-rank{rank}.json`` (a long run's record;
    ``kind``: the run's variable of program counts, lower case, so that the fuzz tests of
    one session do not overwrite each other's)."""
    report = os.environ.get(REPORT_ENV)
    if not report:
        return
    os.makedirs(report, exist_ok=True)
    name = f"{kind.lower()}-ws{world_size}-rank{rank}.json"
    with open(os.path.join(report, name), "w") as f:
        json.dump({"programs": len(run), "first_seed": run.start,
                   "outcomes": summarize(outcomes),
                   "failures": [o.report() for o in outcomes if o.failed][:20]}, f, indent=1)


def watch_segment_reductions(monkeypatch) -> collections.Counter:
    """Counts, for every fused segment compiled from now on (any backend), which way its
    reductions run (``segment_reductions.reduces_along_rows``: ``"along rows"``,
    ``"across rows"``), run strictly: an error of the fake-tensor run fails the program,
    where on a GPU it would silently give a segment the default Inductor settings."""
    from meshfuse.runtime.interpreter import fused
    from meshfuse.runtime.interpreter.segment_reductions import reduces_along_rows

    seen: collections.Counter = collections.Counter()
    original = fused.inductor_patches

    def inductor_patches(backend, tensors, graph=None):
        if graph is not None:
            along = reduces_along_rows(graph, tensors)
            seen["along rows" if along else "across rows"] += 1
        return original(backend, tensors, graph)
    monkeypatch.setattr(fused, "inductor_patches", inductor_patches)
    return seen
