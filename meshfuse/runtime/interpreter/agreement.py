"""Cross-rank agreement: ranks compare what they must share before they communicate.

Every rank runs the same program, so every rank must build the same fusion (ops, meshes,
schedules) and pass inputs of the same dtypes and global shapes; and an error one rank raises
must be raised on all of them, or the others wait in a collective that never completes. So, at
the two moments where a rank can diverge without any communication having happened yet:

- when a fusion is built (:func:`agreed_build`), and
- on the first call of each new input signature, once the inputs are checked and bound
  (:func:`agreed_inputs`),

each rank runs its local part (``attempt``), then the ranks exchange a digest of what they
hold (:class:`Fact` records) and whether the attempt failed: one small collective among the
ranks of the fusion's meshes (:func:`agreement_ranks`: the world when its meshes cover it; a
pipeline stage's ranks for a fusion on that stage's sub-mesh, so that ranks of other stages,
which never run it, take no part; none for a rank outside them, or alone in them). When the digests match and no rank failed, that is all. Otherwise (rare, and only on
the way to an error) they exchange the facts themselves and every rank raises the same error:
the failing rank's own error (the others raise its type, naming that rank), or an
:class:`~meshfuse.errors.InputError` naming the first fact they disagree on and the ranks.

On by default; ``execute(..., check_ranks=False)`` or ``MESHFUSE_CHECK_RANKS=0`` turns it off.
Cached calls never communicate for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from meshfuse.errors import InputError, MeshfuseError
from meshfuse.ir.fusion import Fusion
from meshfuse.ir.printer import format_expr, format_tensor
from meshfuse.ir.tensor_view import Scalar, TensorView
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.faults.board import Notice
from meshfuse.runtime.faults.failures import remote_error, shared

CHECK_RANKS_ENV = "MESHFUSE_CHECK_RANKS"
T = TypeVar("T")

_BUILD_ADVICE = ("every rank must define the same fusion, with the same meshes and schedules: "
                 "build it from the same code and values on every rank")
_INPUT_ADVICE = "pass every rank its shard of the same global tensors"


@dataclasses.dataclass(frozen=True)
class Fact:
    """One thing every rank that has it must hold alike.

    Attributes:
        subject: what it is about, e.g. ``"the mesh of T0"`` or ``"input T1"``.
        value: what is compared (picklable, with a deterministic ``repr``).
        shown: how a message shows this rank's value.
        shape: for an input, its global shape, so that a message can name the axis.
    """

    subject: str
    value: Any
    shown: str
    shape: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Claim:
    """What one rank brings: its facts, or the error its attempt raised (type name, text)."""

    facts: tuple[Fact, ...]
    error: tuple[str, str] | None = None

    def digest(self) -> list[int]:
        """Two 63-bit words of a hash of the facts, and 1 if the attempt failed (else 0)."""
        text = repr([(f.subject, f.value) for f in self.facts]).encode()
        words = hashlib.blake2b(text, digest_size=16).digest()
        return [int.from_bytes(words[:8], "little") >> 1,
                int.from_bytes(words[8:], "little") >> 1, int(self.error is not None)]


def enabled(option: bool | None) -> bool:
    """``check_ranks`` when given, else ``$MESHFUSE_CHECK_RANKS`` (on unless ``0``)."""
    if option is not None:
        return bool(option)
    return os.environ.get(CHECK_RANKS_ENV, "1").strip() not in ("0", "false", "False")


def agreement_ranks(fusion: Fusion, size: int) -> tuple[int, ...]:
    """The ranks that agree on ``fusion`` (sorted): those of its tensors' meshes, or the
    whole world of ``size`` ranks when some input has no mesh (it is on every rank) or a
    mesh names a device past the world (every rank then hears the check's refusal)."""
    world = tuple(range(size))
    if any(isinstance(v, TensorView) and v.mesh is None for v in fusion.inputs()):
        return world
    ranks = {d for tv in fusion.tensors() if tv.mesh is not None for d in tv.mesh.device_ids}
    return tuple(sorted(ranks)) if ranks and max(ranks) < size else world


def _alone(communicator: Communicator, ranks: tuple[int, ...]) -> bool:
    """Whether this rank has no one to agree with among ``ranks``."""
    return communicator.rank not in ranks or len(ranks) == 1


def _own(attempt: Callable[[], T]) -> T:
    """``attempt()`` of a rank no other rank agrees with on this fusion: its error is its
    own (marked shared, so that ranks of other meshes are not told of it)."""
    try:
        return attempt()
    except MeshfuseError as e:
        raise shared(e) from e.__cause__


def agreed(communicator: Communicator, attempt: Callable[[], T],
           facts: Callable[[T], Sequence[Fact]], advice: str, in_call: bool = False,
           ranks: tuple[int, ...] | None = None) -> T:
    """``attempt()``'s result, once every rank of ``ranks`` (sorted; default the world) has
    run its own attempt and all agree; see the module doc. ``in_call``: it checks the inputs
    of an ``execute`` call (a rank running a cached program meanwhile is told this rank's
    claim, see :mod:`meshfuse.runtime.faults.lone_failures`).

    Raises:
        MeshfuseError: the error some rank's attempt raised, on every rank (this rank's own
            error if it failed, else the first failing rank's type and text).
        InputError: on every rank, if the ranks' facts differ.
    """
    try:
        result = attempt()
        claim, own = Claim(tuple(facts(result))), None
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, then it is raised
        result, own = None, e
        claim = Claim((), (type(e).__name__, str(e)))
    digest = torch.tensor(claim.digest(), dtype=torch.int64)
    ranks = tuple(range(communicator.size)) if ranks is None else ranks
    late = communicator.lone.agreeing(claim, ranks) if in_call else None
    digests = [d.tolist() for d in communicator.agreement_allgather(digest, late, ranks)]
    if all(d == digests[0] for d in digests) and not digests[0][2]:
        return result
    claims = list(zip(ranks, communicator.allgather_object(claim, ranks)))
    try:
        _raise_failure(claims, own, communicator.rank)
        _raise_difference(claims, advice)
    except MeshfuseError as e:
        raise shared(e) from e.__cause__
    return result  # digests differed but the facts agree: a hash collision; nothing to say


def agreed_build(communicator: Communicator | None, fusion: Fusion, build: Callable[[], T],
                 check_ranks: bool | None = None) -> T:
    """``build()``, run on every rank, once all agree on the fusion's ops, meshes and
    schedules (and none failed to build it). Without a communicator, on one process, or
    when checks are off, just ``build()``."""
    if communicator is None or communicator.size == 1 or not enabled(check_ranks):
        return build()
    ranks = agreement_ranks(fusion, communicator.size)
    if _alone(communicator, ranks):
        return _own(build)
    described = fusion_facts(fusion)  # before building: a build may fill in schedules
    return agreed(communicator, build, lambda _: described, _BUILD_ADVICE, ranks=ranks)


def agreed_inputs(communicator: Communicator | None, fusion: Fusion, inputs: Sequence[Any],
                  prepare: Callable[[], T], extents_of: Callable[[T, TensorView], tuple],
                  held: Callable[[TensorView], bool], check_ranks: bool | None = None,
                  in_call: bool = False,
                  more_facts: Callable[[T], Sequence[Fact]] = lambda _: ()) -> T:
    """``prepare()`` (this rank's checks and binding of ``inputs``), once every rank agrees
    on the inputs' kinds, dtypes and global shapes (``extents_of(result, tv)``) and on
    ``more_facts(result)``; inputs a rank does not hold (``held``) are left out of its facts.
    ``in_call``: see :func:`agreed`."""
    if communicator is None or communicator.size == 1 or not enabled(check_ranks):
        return prepare()
    ranks = agreement_ranks(fusion, communicator.size)
    if _alone(communicator, ranks):
        return _own(prepare)

    def facts(prepared: T) -> list[Fact]:
        return [*input_facts(fusion, inputs, lambda tv: extents_of(prepared, tv), held),
                *more_facts(prepared)]

    return agreed(communicator, prepare, facts, _INPUT_ADVICE, in_call, ranks)


def exchanged(communicator: Communicator, values: Sequence[int], in_call: bool = False,
              ranks: tuple[int, ...] | None = None) -> list[list[int]]:
    """Every rank's ``values`` (as many on each), by rank of ``ranks`` (sorted; default the
    world): what ranks must learn of each other's inputs before they can bind theirs (the
    extents of their shards of an uneven split of a symbolic axis). One small collective
    among those ranks, on the first call of a signature, before the agreement proper;
    ``in_call``: see :func:`agreed` (a rank running a cached program meanwhile is told that
    this one checks a new signature). Only the ranks of ``ranks`` take part (none when
    this rank is outside them or alone); a rank of the world outside them has ``-1`` for
    each value."""
    by_rank = [[-1] * len(values) for _ in range(communicator.size)]
    by_rank[communicator.rank] = list(values)
    ranks = tuple(range(communicator.size)) if ranks is None else ranks
    if _alone(communicator, ranks):
        return by_rank
    late = communicator.lone.agreeing(Claim(()), ranks) if in_call else None
    tensor = torch.tensor(list(values), dtype=torch.int64)
    for r, t in zip(ranks, communicator.agreement_allgather(tensor, late, ranks)):
        by_rank[r] = t.tolist()
    return by_rank


def out_of_step(notice: Notice, rank: int, facts: Sequence[Fact]) -> MeshfuseError:
    """The error of a rank that runs a cached program (its inputs' ``facts``) while the rank
    of ``notice`` checks a new signature in the same call: the InputError naming the first
    input they differ on, or that rank's own error if its check failed."""
    theirs: Claim = notice.claim
    if theirs.error is not None:
        return remote_error(notice.rank, *theirs.error)
    try:
        _raise_difference(sorted([(notice.rank, theirs), (rank, Claim(tuple(facts)))],
                                 key=lambda c: c[0]), _INPUT_ADVICE)
    except InputError as e:
        return e
    return InputError(
        f"ranks are out of step: rank {notice.rank} passed inputs of a new signature (dtypes, "
        f"shapes, strides or device) while rank {rank} passed ones it ran before, of the same "
        f"dtypes and global shapes; {_INPUT_ADVICE}, laid out alike"
    )


def fusion_facts(fusion: Fusion) -> list[Fact]:
    """What every rank must hold alike in a fusion: its inputs, ops, outputs, and every
    tensor's mesh and schedule."""
    declared = ", ".join(
        f"{v.name}: {v.dtype.name} scalar" if isinstance(v, Scalar) else f"{v.name}: tensor"
        for v in fusion.inputs()
    )
    facts = [Fact("the fusion's inputs", declared, declared),
             Fact("the number of ops", len(fusion.exprs), str(len(fusion.exprs)))]
    for index, expr in enumerate(fusion.exprs):
        text = format_expr(expr)
        facts.append(Fact(f"op {index}", text, text))
    outputs = ", ".join(o.name for o in fusion.outputs())
    facts.append(Fact("the fusion's outputs", outputs, outputs or "none"))
    for tv in fusion.tensors():
        mesh = repr(tv.mesh) if tv.mesh is not None else "no mesh"
        facts.append(Fact(f"the mesh of {tv.name}", mesh, mesh))
        try:
            schedule = "\n".join(format_tensor(tv).splitlines()[1:])
        except MeshfuseError as e:  # an invalid schedule: the build says so, on every rank
            schedule = f"an invalid schedule ({e})"
        facts.append(Fact(f"the schedule of {tv.name}", schedule, "\n" + schedule))
    return facts


def input_facts(fusion: Fusion, inputs: Sequence[Any],
                extents: Callable[[TensorView], tuple], held: Callable[[TensorView], bool]
                ) -> list[Fact]:
    """Each held tensor input's dtype and global shape (its local shape shown), and each
    scalar input's kind."""
    facts = []
    for v, x in zip(fusion.inputs(), inputs):
        if isinstance(v, TensorView):
            if not held(v) or not isinstance(x, torch.Tensor):
                continue
            shape = tuple(extents(v))
            shown = (f"{x.dtype} of local shape {list(x.shape)} (global shape "
                     f"{list(shape)})")
            facts.append(Fact(f"input {v.name}", (str(x.dtype), shape), shown, shape))
        else:
            kind = type(x).__name__
            facts.append(Fact(f"input {v.name}", kind, f"a {kind}"))
    return facts


def _raise_failure(claims: list[tuple[int, Claim]], own: Exception | None, me: int) -> None:
    """Raises, on every rank, the error of a rank that failed, naming it and the others that
    failed: a rank that failed raises its own (chained to it), the others the first one's
    (``claims``: each rank's, in rank order)."""
    failed = [(r, c.error) for r, c in claims if c.error is not None]
    if not failed:
        return
    if own is not None:  # its own message fits its own inputs (the extent of its shard)
        failed.sort(key=lambda f: f[0] != me)
    rank, (name, text) = failed[0]
    raise remote_error(rank, name, text, [r for r, _ in failed[1:]]) from own


def _raise_difference(claims: list[tuple[int, Claim]], advice: str) -> None:
    """Raises InputError naming the first subject the ranks' facts differ on (``claims``:
    each rank's, in rank order)."""
    by_rank = [(r, {f.subject: f for f in c.facts}) for r, c in claims]
    subjects = list(dict.fromkeys(f.subject for _, c in claims for f in c.facts))
    for subject in subjects:
        holders = [(r, facts[subject]) for r, facts in by_rank if subject in facts]
        first_rank, first = holders[0]
        other = next(((r, f) for r, f in holders if f.value != first.value), None)
        if other is None:
            continue
        rank, fact = other
        axis = _differing_axis(first.shape, fact.shape)
        where = f" (on axis {axis})" if axis is not None else ""
        raise InputError(
            f"ranks disagree on {subject}{where}: rank {rank} has {fact.shown}, rank "
            f"{first_rank} has {first.shown}; {advice}"
        )


def _differing_axis(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> int | None:
    if a is None or b is None or len(a) != len(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
