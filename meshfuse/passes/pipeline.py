"""``compile(fusion, world_size)``: the build passes, in order, on a private copy of a fusion.

The user's fusion is never changed: :func:`compile` copies it (:meth:`Fusion.copy`) and runs
:data:`BUILD_PASSES` on the copy, in this order:

0. ``unmerge_device_axes``: a device axis split from merged axes becomes the equivalent split
   of one logical axis (``passes/merged_axes.py``);
1. ``check_tensor_schedules``: each tensor's own schedule against the world size (errors name
   what the user wrote, before any pass fills in the rest);
1b. ``decompose_sharded_ops``: a fused op whose kernel cannot run on the shardings it would
   get (a cross entropy with its classes sharded) replaced by fusion ops
   (``passes/expansion.py``);
2. ``propagate_shardings``: a mesh, DID splits and a memory order for every unscheduled tensor;
2b. ``_plan_ops``: each op's own planning rule (``OpDef.plan``: grouped-query attention
   checks its key/value heads and, replicated, maps them apart from the query heads);
3. the *strategy passes* (:func:`register_strategy_pass`), in the order registered: a
   parallelism's planning on the propagated shardings, before any communication is inserted
   (context parallelism's ``plan_context_parallel``: the strategy of each sequence-sharded
   attention, a ring keeping k and v sharded; see ``docs/context_parallel.md``);
4. ``insert_resharding``: communications so that every op is local;
5. ``check_schedule``: meshes and device types across all tensors;
6. ``infer_allocations``: the memory order of every tensor (a side table).

The result, a :class:`CompiledFusion`, is the same on every rank. What depends on the input
signature and the rank (extents, local layouts, the per-rank program) is built from it by
:mod:`meshfuse.engine.runner`; see ``docs/pipeline.md`` for the whole pipeline.

A fusion with symbolic extents is built so too, then once more per set of bound extents
(:func:`concretize`): a copy with those extents made static (:mod:`meshfuse.passes.concrete`),
on which :data:`SIGNATURE_PASSES` decide again what the extents decide (the communications
each op needs, the schedules' checks), as for a program written with those extents.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Mapping

from meshfuse.ir.fusion import Fusion
from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.lint import lint as check_graph
from meshfuse.ir.printer import format_fusion
from meshfuse.ir.tensor_view import Allocation, TensorView, Val
from meshfuse.ir.verifier import check_schedule, check_tensor_schedules
from meshfuse.passes.concrete import with_extents
from meshfuse.passes.expansion import decompose_sharded_ops
from meshfuse.passes.head_alignment import HeadSplitWarning, unaligned_head_splits
from meshfuse.passes.layout import infer_allocations
from meshfuse.passes.merged_axes import unmerge_device_axes
from meshfuse.passes.propagation import propagate_shardings
from meshfuse.passes.resharding import insert_resharding


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledFusion:
    """A fusion after the build passes.

    Attributes:
        fusion: the compiled copy: every tensor scheduled, communications inserted.
        allocations: the memory order of every tensor of ``fusion``.
        world_size: the number of processes it was checked against (None: any that holds
            its meshes).
        counterparts: each value of the user's fusion -> its value in ``fusion`` (weak in
            the user's values, so that a build kept for a fusion does not keep it alive).
    """

    fusion: Fusion
    allocations: dict[TensorView, Allocation]
    world_size: int | None
    counterparts: weakref.WeakKeyDictionary[Val, Val]

    def __getitem__(self, user_val: Val) -> Val:
        """The compiled counterpart of a value of the user's fusion (or of the copy)."""
        if user_val in self.counterparts:
            return self.counterparts[user_val]
        if getattr(user_val, "fusion", None) is self.fusion:
            return user_val
        raise KeyError(f"{getattr(user_val, 'name', user_val)!r} is not a value of this fusion")

    def explain(self) -> str:
        """The compiled fusion with its shardings, memory orders and communications."""
        return format_fusion(self.fusion, self.allocations)


def _check_world(fusion: Fusion, world_size: int | None) -> None:
    check_tensor_schedules(fusion, _world_or_meshes(fusion, world_size))


def _check_all(fusion: Fusion, world_size: int | None) -> None:
    check_schedule(fusion, _world_or_meshes(fusion, world_size))


def _world_or_meshes(fusion: Fusion, world_size: int | None) -> int:
    if world_size is not None:
        return world_size
    return 1 + max((max(tv.mesh.device_ids) for tv in fusion.tensors() if tv.mesh is not None),
                   default=0)


def _unmerge(fusion: Fusion, world_size: int | None) -> None:
    unmerge_device_axes(fusion)


def _decompose(fusion: Fusion, world_size: int | None) -> None:
    decompose_sharded_ops(fusion)


def _propagate(fusion: Fusion, world_size: int | None) -> None:
    propagate_shardings(fusion)


def _plan_ops(fusion: Fusion, world_size: int | None) -> None:
    """Each op's own planning rule (``OpDef.plan``) on the propagated shardings."""
    for expr in fusion.exprs:
        if expr.op is not None and expr.op.plan is not None:
            expr.op.plan(expr)


def _reshard(fusion: Fusion, world_size: int | None) -> None:
    insert_resharding(fusion)


# A strategy's planning pass: edits the fusion copy (its shardings propagated, no
# communication inserted yet).
StrategyPass = Callable[[Fusion], None]
_STRATEGY_PASSES: list[StrategyPass] = []


def register_strategy_pass(run: StrategyPass) -> StrategyPass:
    """Registers a parallelism's planning pass (registered when the strategy's package is
    imported; ``import meshfuse`` imports them all): it runs on every build, after
    propagation and before resharding, in the order registered. Returns ``run``."""
    if run not in _STRATEGY_PASSES:
        _STRATEGY_PASSES.append(run)
    return run


def _strategies(fusion: Fusion, world_size: int | None) -> None:
    for run in _STRATEGY_PASSES:
        run(fusion)


# Each pass takes the fusion copy and the world size and edits the copy (never the user's).
BUILD_PASSES = (
    _unmerge,
    _check_world,
    _decompose,
    _propagate,
    _plan_ops,
    _strategies,
    _reshard,
    _check_all,
)


def compile(fusion: Fusion, world_size: int | None = None,
            lint: bool = False) -> CompiledFusion:
    """Runs the build passes on a copy of ``fusion``; ``fusion`` itself is left as it is.

    Args:
        fusion: the user's fusion (defined and scheduled).
        world_size: the number of processes it will run on; ``None`` checks only that the
            meshes are consistent (what ``shard_tensor`` needs).
        lint: check the graph's invariants (:func:`meshfuse.ir.lint.lint`) after each pass.

    Returns:
        A :class:`CompiledFusion`; compiling the same fusion again gives an equal one.
    """
    copy, counterparts = fusion.copy()
    if lint:
        check_graph(copy, "copy")
    for run in BUILD_PASSES:
        run(copy, world_size)
        if lint:
            check_graph(copy, run.__name__.strip("_"))
    compiled = CompiledFusion(copy, infer_allocations(copy), world_size,
                              weakref.WeakKeyDictionary(counterparts))
    _warn_once(fusion, unaligned_head_splits(copy))
    _compiled_copies[copy] = weakref.ref(compiled)
    return compiled


# The passes run again on a copy whose symbolic extents are bound (see concretize): the
# shardings stay as built (propagation and the strategies' plans are kept: the inputs are
# laid out by them), the communications and checks are decided with the extents. The ops'
# plan rules run again: what they could not decide without the extents (grouped-query
# attention's key/value heads, with symbolic head extents) they decide then; what they
# decided on the build they leave (a plan rule may run twice on one fusion).
SIGNATURE_PASSES = (
    _check_world,
    _plan_ops,
    _reshard,
    _check_all,
)


def concretize(compiled: CompiledFusion, extents: Mapping[IterDomain, int],
               lint: bool = False) -> CompiledFusion:
    """``compiled`` (a build of a fusion with symbolic extents) for one set of bound
    ``extents`` (every ID of every tensor of ``compiled.fusion``, as a binding gives them):
    a copy with those extents static, through :data:`SIGNATURE_PASSES` and the memory-order
    inference. Its counterparts map the user's values (and ``compiled``'s) to the copy's;
    ``compiled`` is not changed."""
    copy, counterparts = with_extents(compiled.fusion, extents)
    if lint:
        check_graph(copy, "with_extents")
    for run in SIGNATURE_PASSES:
        run(copy, compiled.world_size)
        if lint:
            check_graph(copy, run.__name__.strip("_"))
    mapped = weakref.WeakKeyDictionary(
        {user: counterparts[v] for user, v in compiled.counterparts.items()})
    mapped.update(counterparts)
    concrete = CompiledFusion(copy, infer_allocations(copy), compiled.world_size, mapped)
    _compiled_copies[copy] = weakref.ref(concrete)
    return concrete


# The warnings given for each user fusion (each one once, whatever the builds).
_warned: weakref.WeakKeyDictionary[Fusion, set[str]] = weakref.WeakKeyDictionary()


def _warn_once(fusion: Fusion, notes: list[str]) -> None:
    given = _warned.setdefault(fusion, set())
    for note in notes:
        if note not in given:
            given.add(note)
            warnings.warn(note, HeadSplitWarning, stacklevel=3)


# A compiled copy -> its CompiledFusion (a tensor of the copy is its own counterpart).
_compiled_copies: weakref.WeakKeyDictionary[Fusion, weakref.ref] = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class _Builds:
    """What :func:`compiled_for` built of one user fusion: the fingerprint of the definition
    and schedule it was built from, and the build for each world size asked for."""

    fingerprint: tuple
    by_world: dict[int | None, CompiledFusion]


# The builds of each user fusion, held weakly by the fusion so that they go when it does
# (nothing in a build refers back to the user's fusion: its counterparts are weak, its
# fingerprint names tensors), and kept here rather than on the fusion, which stays as the
# user wrote it.
_builds: weakref.WeakKeyDictionary[Fusion, _Builds] = weakref.WeakKeyDictionary()


def compiled_for(fusion: Fusion, world_size: int | None = None) -> CompiledFusion:
    """``compile(fusion, world_size)``, kept until the fusion's definition or schedule
    changes: what ``execute`` runs and what helpers that take one tensor (``shard_tensor``)
    read. A compiled copy is its own compiled fusion.

    One build serves every world size: the build passes do not read it, only the checks
    do, and those pass for any world that holds the devices of the build's meshes. For a
    smaller world, or without a build yet, this compiles (and raises the checks' error).
    """
    of_copy = _compiled_copies.get(fusion)
    if of_copy is not None and of_copy() is not None:
        return of_copy()
    key = _fingerprint(fusion)
    builds = _builds.get(fusion)
    if builds is None or builds.fingerprint != key:
        builds = _builds[fusion] = _Builds(key, {})
    if world_size not in builds.by_world:
        done = next(iter(builds.by_world.values()), None)
        if done is not None and (world_size is None or _devices(done.fusion) <= world_size):
            builds.by_world[world_size] = dataclasses.replace(done, world_size=world_size)
        else:
            builds.by_world[world_size] = compile(fusion, world_size)
    return builds.by_world[world_size]


def _devices(fusion: Fusion) -> int:
    """The number of processes the meshes of ``fusion`` need (devices 0..n-1)."""
    return _world_or_meshes(fusion, None)


def _fingerprint(fusion: Fusion) -> tuple:
    """What the build passes, and the runner's planning of a compiled fusion, read of the
    user's fusion: its values by name (unique in a fusion, and no reference that would keep
    the fusion alive), IterDomains by identity."""
    return (len(fusion.exprs), tuple(v.name for v in fusion.inputs()),
            tuple(tv.name for tv in fusion.outputs()), tuple(
        (tv.name, tv.mesh, tuple(tv.loop), len(tv.transforms), tuple(tv.parallel.items()),
         tv.allocation, tuple(tv.swizzles.items()), tv.memory_type, tv.overlap, tv.is_cpu)
        for tv in fusion.tensors()))
