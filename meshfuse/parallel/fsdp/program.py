"""A fully sharded program's order and buckets: each layer's parameters gathered by one
collective, issued one layer ahead; each layer's gradients reduced by one.

**Order** (:func:`prefetch_order`). The program builder launches every communication as
early as its inputs allow (:func:`~meshfuse.runtime.interpreter.program.communication_first`);
a parameter's gather needs only the parameter, so all layers would be gathered at the start
and all gathered parameters held at once. Here the gathers of layer ``i + 1`` are placed
right after the first step that reads layer ``i``'s gathered parameters (which waits for
layer ``i``'s gather): the gather runs under the rest of layer ``i``'s compute (FSDP's
prefetch) and, as each gathered parameter is freed after its last use, about two layers'
gathered parameters are alive at most. Local copies of gathered parameters move to their
first reader. Layers are taken in the
order the program first reads them: in a backward, last layer first.

A layer's gradient reductions, and what becomes of their results (HSDP's allreduces across
replicas, copies and casts on the way to the gradients), move together to where the last of
them was (:func:`gather_reductions`). Before that, the local ops whose results reach only
the reductions (the weight gradients' products), and the reductions, move to where their
inputs are ready (:func:`hoist_gradients`): the derived backward may compute a layer's
weight gradients, or pin them to their parameters' sharding, after the layer below's
backward, and its reduce-scatter would wait that long; so each layer's gradients are
reduced as they are ready, under the next layer's backward.

**Buckets** (:func:`bucket_layers`). A layer's gathers then run as one allgather, its
gradients' reductions as one reduce-scatter (and one allreduce across replicas, HSDP, which
the allreduces that follow the reduce-scatters leave to it), each placed where the last of
its members was (:mod:`meshfuse.parallel.fsdp.buckets`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence

import torch

from meshfuse.ir.fusion import Expr, Fusion, Reshard
from meshfuse.parallel.fsdp.buckets import (
    AheadOfStep,
    GroupOf,
    Member,
    allreduce_call,
    allreduce_member,
    gather_call,
    gather_member,
    reduce_call,
    reduce_member,
)
from meshfuse.parallel.fsdp.layers import (
    LayerCommunications,
    communications_by_layer,
    layers_of,
    reduce_dtype_of,
)
from meshfuse.parallel.fsdp.memory import GATHERED
from meshfuse.runtime.interpreter.executor import RESHARD, Step
from meshfuse.runtime.interpreter.program import communication_first

_LOCAL = ("set", "cast")
_LINEAR = ("set", "cast", "sum")  # local ops that commute with a sum over ranks


def prefetch_order(exprs: Sequence[Expr], gathers: Mapping[Expr, int]) -> list[Expr]:
    """``exprs`` in the program builder's order, with each layer's gathers (and the local
    casts that feed only them) moved after the first read of the layer before it, and the
    local copies of gathered parameters to their first reader; see the module doc."""
    order = communication_first(exprs)
    chains = _chains(order, gathers)
    moved = {e for chain in chains.values() for e in chain}
    deferred, reads, first_reads = _reads([e for e in order if e not in moved], gathers)
    following = dict(itertools.pairwise(first_reads))
    producer = {o: e for e in order for o in e.outputs}
    result: list[Expr] = []
    placed: set[int] = set()
    emitted: set[Expr] = set()

    def place(layer: int | None) -> None:
        if layer is not None and layer not in placed:
            placed.add(layer)
            result.extend(chains.get(layer, ()))

    def emit(e: Expr) -> None:
        for v in e.inputs:
            p = producer.get(v)
            if p in deferred and p not in emitted:
                emit(p)
        emitted.add(e)
        result.append(e)

    read: set[int] = set()
    for e in order:
        if e in moved or e in deferred:
            continue
        first = sorted(reads[e] - read)
        read.update(first)
        for k in first:
            place(k)
        emit(e)
        for k in first:  # the next layer's gather, under the rest of this layer
            place(following.get(k))
    for k in chains:
        place(k)  # gathers nothing reads (results of the fusion only)
    for e in order:
        if e in deferred and e not in emitted:
            emit(e)
    return result


def _reads(order: Sequence[Expr], gathers: Mapping[Expr, int]
           ) -> tuple[set[Expr], dict[Expr, set[int]], list[int]]:
    """The local copies and casts of gathered parameters (deferred to their first reader),
    the layers each other expression reads, and the layers in the order first read."""
    layer_of_value = {e.outputs[0]: k for e, k in gathers.items()}
    deferred: set[Expr] = set()
    first_reads: list[int] = []
    reads: dict[Expr, set[int]] = {}
    for e in order:
        layers = {layer_of_value[v] for v in e.inputs if v in layer_of_value}
        if layers and not isinstance(e, Reshard) and e.op.name in _LOCAL:
            layer_of_value.update(dict.fromkeys(e.outputs, min(layers)))
            deferred.add(e)
            continue
        reads[e] = layers
        first_reads += [k for k in sorted(layers) if k not in first_reads]
    return deferred, reads, first_reads


def gather_reductions(order: Sequence[Expr], reductions: Mapping[Expr, int]) -> list[Expr]:
    """``order`` with each layer's gradient reductions, and what becomes of their results
    (allreduces across replicas, local copies and casts on the way to the gradients), moved
    together to where the last of them was: a layer's reductions are then adjacent, one
    bucket, and its allreduces across replicas follow it."""
    readers: dict = {}
    for e in order:
        for v in e.inputs:
            readers.setdefault(v, []).append(e)
    tails: dict[int, list[Expr]] = {}
    last: dict[int, int] = {}
    taken: set[Expr] = set()
    for i, e in enumerate(order):
        if e not in reductions or e in taken:
            continue
        chain, tv = [e], e.outputs[0]
        while len(readers.get(tv, [])) == 1 and (isinstance(readers[tv][0], Reshard) or
                                                  readers[tv][0].op.name in _LOCAL):
            chain.append(readers[tv][0])
            tv = chain[-1].outputs[0]
        taken.update(chain)
        tails.setdefault(reductions[e], []).append(chain)
        last[reductions[e]] = i
    result = []
    for i, e in enumerate(order):
        if e not in taken:
            result.append(e)
        for k in (k for k, at in last.items() if at == i):
            chains = tails[k]
            result += [c[0] for c in chains] + [x for c in chains for x in c[1:]]
    return result


def hoist_gradients(order: Sequence[Expr], reductions: Mapping[Expr, int],
                    outputs: frozenset = frozenset(),
                    gathers: Mapping[Expr, int] | None = None) -> list[Expr]:
    """``order`` with the local expressions whose results reach only the ``reductions``
    (the cone of each gradient: its products and sums), and the reductions themselves, each
    placed right after the last expression it reads from (for a layer's gathered parameter:
    after the layer's last gather, where its bucket runs); the others keep their order.

    The reductions move too: the derived backward may pin a gradient to its parameter's
    sharding only at its end (on a dp x tp mesh, the column-parallel weights' gradients),
    and a reduction left there would hold its layer's bucket until the backward ends."""
    producer = {o: e for e in order for o in e.outputs}
    members = _cones(order, reductions, producer, outputs) | set(reductions)
    if not members:
        return list(order)
    gathers = gathers or {}
    last_gather = {gathers[e]: e for e in order if e in gathers}
    # in program order, never a set's: its order is the process's hashing, and ranks that
    # place their collectives in different orders deadlock
    cone = [e for e in order if e in members]
    after: dict[Expr, list[Expr]] = {}
    waiting: dict[Expr, int] = {}
    for e in cone:
        needs = {producer[v] for v in e.inputs if v in producer}
        needs = {last_gather[gathers[p]] if p in gathers else p for p in needs}
        for p in needs:  # each p lists its waiters in program order
            after.setdefault(p, []).append(e)
        waiting[e] = len(needs)
    return _place_when_ready(order, members, cone, after, waiting)


def _place_when_ready(order: Sequence[Expr], members: set[Expr], cone: Sequence[Expr],
                      after: Mapping[Expr, list[Expr]], waiting: dict[Expr, int]
                      ) -> list[Expr]:
    """``order``'s non-members in their order, each member (``cone``, in program order)
    right after the last of the expressions it waits for (``waiting`` counts them,
    ``after`` lists each one's waiters)."""
    result: list[Expr] = []
    placed: set[Expr] = set()

    def place(first: Expr) -> None:
        todo = [first]
        while todo:
            e = todo.pop()
            result.append(e)
            placed.add(e)
            for c in reversed(after.get(e, ())):
                waiting[c] -= 1
                if waiting[c] == 0:
                    todo.append(c)

    for e in cone:
        if waiting[e] == 0 and e not in placed:
            place(e)
    for e in order:
        if e not in members:
            place(e)
    return result


def _cones(order: Sequence[Expr], reductions: Mapping[Expr, int], producer: Mapping,
           outputs: frozenset) -> set[Expr]:
    """The local expressions all of whose results are read only by the reductions or by
    other such expressions (and are no output of the fusion)."""
    readers: dict = {}
    for e in order:
        for v in e.inputs:
            readers.setdefault(v, []).append(e)
    cone: set[Expr] = set()
    stack = [producer[v] for r in reductions for v in r.inputs if v in producer]
    while stack:
        e = stack.pop()
        if e in cone or e in reductions or isinstance(e, Reshard):
            continue
        if all(o not in outputs and readers.get(o) and
               all(r in cone or r in reductions for r in readers[o]) for o in e.outputs):
            cone.add(e)
            stack.extend(producer[v] for v in e.inputs if v in producer)
    return cone


def _chains(order: Sequence[Expr], gathers: Mapping[Expr, int]) -> dict[int, list[Expr]]:
    """Per layer, its gathers in order, each after the local casts that feed it only."""
    producer = {o: e for e in order for o in e.outputs}
    readers: dict = {}
    for e in order:
        for v in e.inputs:
            readers.setdefault(v, []).append(e)
    chains: dict[int, list[Expr]] = {}
    for e in order:
        if e not in gathers:
            continue
        chain, source = [e], producer.get(e.args[0])
        while source is not None and not isinstance(source, Reshard) and \
                source.op.name in _LOCAL and len(readers[source.outputs[0]]) == 1:
            chain.insert(0, source)
            source = producer.get(source.args[0])
        chains.setdefault(gathers[e], []).extend(chain)
    return chains


def bucket_layers(found: LayerCommunications, exprs: Sequence[Expr], steps: list[Step],
                  calls: list[Callable], slot_of: Mapping, *, rank: int, layouts: Mapping,
                  group_of: GroupOf, account=None
                  ) -> tuple[list[Step], list[Callable]]:
    """``steps`` and their ``calls`` with each layer's gathers, and each layer's
    reductions, made one step (see the module doc)."""
    buckets, followers = _buckets(found, exprs, steps, slot_of, rank, layouts)
    buckets, summed = _merged(buckets)
    for f in followers:  # an allreduce across replicas that its reduce-scatter's bucket runs
        k = _step_at(steps, slot_of[f.outputs[0]])
        what = steps[k].label.partition(":")[0]
        steps[k] = dataclasses.replace(
            steps[k], plan=(), label=f"{what}: run by its layer's reduction bucket")
        calls[k] = _unchanged
    for key, members in buckets.items():
        places = [_step_at(steps, slot_of[e.outputs[0]]) for e, _ in members]
        plan = steps[places[0]].plan
        group = group_of(plan[0].mesh, plan[0].mesh_axis)
        mine = [m for _, m in members]
        if key[0] == "gather":
            call = gather_call(mine, group, account)
        elif plan[0].kind == "allreduce":
            call = allreduce_call(mine, group, key[4])
        else:
            replicas = None if key[5] is None else group_of(plan[0].mesh, key[5])
            call = reduce_call(mine, group, replicas, key[4], summed.get(key), key[6])
        step = _bucket_step(key, [steps[k] for k in places], [e for e, _ in members], group)
        last = max(places)  # where the last member was: every member's input is ready
        steps[last] = step
        calls[last] = call if len(mine) > 1 else _single(call)
        if key[0] == "gather":
            calls[last] = AheadOfStep(calls[last])
        for k in sorted((k for k in places if k != last), reverse=True):
            del steps[k], calls[k]
    return steps, calls


def _merged(buckets: dict) -> tuple[dict, dict]:
    """A layer's reduction buckets that differ only in whether their members are summed
    across replicas after the scatter (HSDP's, or tensor- and context-parallel ranks' partial
    sums of replicated parameters) made one: its members summed across first, so that the
    allreduce covers the front of the reduced buffer. Returns the buckets and, per merged
    key, how many leading members the allreduce covers."""
    groups: dict[tuple, list[tuple]] = {}
    for key in buckets:
        groups.setdefault((*key[:5], *key[6:]), []).append(key)
    result, summed = {}, {}
    for base, keys in groups.items():
        axes = {k[5] for k in keys} - {None}
        if base[0] != "reduce" or len(keys) == 1 or len(axes) != 1:
            result.update((k, buckets[k]) for k in keys)
            continue
        across = [m for k in keys if k[5] is not None for m in buckets[k]]
        key = (*base[:5], axes.pop(), *base[5:])
        result[key] = across + [m for k in keys if k[5] is None for m in buckets[k]]
        summed[key] = len(across)
    return result, summed


def _buckets(found: LayerCommunications, exprs: Sequence[Expr], steps: list[Step],
             slot_of: Mapping, rank: int, layouts: Mapping) -> tuple[dict, set]:
    """The members of each bucket, by key (kind, layer, first collective, dtype, reduce
    dtype, replicate mesh axis); and the allreduces across replicas that follow a bucketed
    reduce-scatter and run in its bucket (HSDP: one allreduce per layer)."""
    buckets: dict[tuple, list[tuple[Expr, Member]]] = {}
    read = {v for e in exprs for v in e.inputs}
    readers: dict = {}
    for e in exprs:
        for v in e.inputs:
            readers.setdefault(v, []).append(e)
    plan_of = {e: steps[k].plan for e in (*found.gathers, *found.reductions)
               if (k := _step_at(steps, slot_of[e.outputs[0]])) is not None}
    followers: set[Expr] = set()
    leaders = _leaders(exprs, readers, found, plan_of, lambda e: steps[k].plan if (
        k := _step_at(steps, slot_of[e.outputs[0]])) is not None else None)

    for table, kind in ((found.gathers, "gather"), (found.reductions, "reduce")):
        for expr in exprs:
            if expr not in table or expr not in plan_of or expr in followers or \
                    expr in leaders:
                continue
            plan = plan_of[expr]
            member = _member(kind, plan, rank, expr, layouts,
                             read_later=expr.outputs[0] in read)
            if member is None:
                continue
            replicas = plan[1].mesh_axis if len(plan) > 1 and kind == "reduce" else None
            lone_scatter = kind == "reduce" and plan[0].kind == "reduce_scatter" and \
                len(plan) == 1
            follower = _follower(expr, readers, found, plan_of) if lone_scatter else None
            leader = next((e for e, (f, _) in leaders.items() if f is expr), None)
            if follower is not None and leader is None:
                followers.add(follower)
                replicas = plan_of[follower][0].mesh_axis
            elif leader is not None and follower is None and lone_scatter:
                followers.add(leader)  # summed across replicas after the scatter instead
                replicas = leaders[leader][1]
            wide, back = _reduce_dtypes(found, expr, kind, member.dtype)
            key = (kind, table[expr], (plan[0].kind, plan[0].mesh_axis), member.dtype, wide,
                   replicas, back)
            buckets.setdefault(key, []).append((expr, member))
    return buckets, followers


def _reduce_dtypes(found: LayerCommunications, expr: Expr, kind: str, dtype: torch.dtype
                   ) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The dtype a reduction runs in (None: its own) and the dtype its result is cast back
    to (None: left in the wide one, which a cast on the way to the gradient then keeps):
    the mixed-precision policy's ``reduce_dtype`` for gradients of another dtype (bf16
    parameters' gradients summed in float32 and held in bf16)."""
    if kind != "reduce" or found.reduce_dtype is None or found.reduce_dtype == dtype:
        return None, None
    if expr in found.widened:
        return found.reduce_dtype, None
    return found.reduce_dtype, dtype


def _leaders(exprs: Sequence[Expr], readers: Mapping, found: LayerCommunications,
             plan_of: Mapping, plan_at: Callable) -> dict[Expr, tuple[Expr, int]]:
    """The allreduces (sums) whose result alone feeds, through local copies, casts and
    sums, a lone reduce-scatter of a layer's gradient over another mesh dimension, each ->
    that reduce-scatter and its own mesh axis. Such an allreduce sums a gradient over the ranks that split the
    tokens on another dimension (context parallelism: each rank's positions' part of a weight
    gradient, still per batch row). Sums commute: the layer's bucket runs the
    reduce-scatter, then the allreduce of the shards, as HSDP's across replicas, on the
    summed gradient."""
    leaders = {}
    for e in exprs:
        if not isinstance(e, Reshard) or e in found.reductions or e in found.gathers:
            continue
        plan = plan_at(e)
        if not plan or [s.kind for s in plan] != ["allreduce"] or plan[0].reduce_op != "sum":
            continue
        after = readers.get(e.outputs[0], [])
        while len(after) == 1 and not isinstance(after[0], Reshard) and \
                after[0].op.name in _LINEAR:
            after = readers.get(after[0].outputs[0], [])
        if len(after) == 1 and after[0] in plan_of and after[0] in found.reductions and \
                [s.kind for s in plan_of[after[0]]] == ["reduce_scatter"] and \
                plan_of[after[0]][0].mesh_axis != plan[0].mesh_axis:
            leaders[e] = (after[0], plan[0].mesh_axis)
    return leaders


def _follower(expr: Expr, readers: Mapping, found: LayerCommunications, plan_of: Mapping
              ) -> Expr | None:
    """The allreduce of the same layer that alone reads ``expr``'s result, if any."""
    after = readers.get(expr.outputs[0], [])
    if len(after) != 1 or after[0] not in plan_of:
        return None
    f = after[0]
    if found.reductions.get(f) != found.reductions[expr] or \
            [s.kind for s in plan_of[f]] != ["allreduce"] or plan_of[f][0].reduce_op != "sum":
        return None
    return f


def _unchanged(x):
    return x


def _member(kind: str, plan, rank: int, expr: Expr, layouts: Mapping, read_later: bool
            ) -> Member | None:
    """``expr``'s communication as a member of its layer's bucket, or None (it runs
    alone). An allreduce no step reads is left to the program builder's own allreduce
    buckets (:mod:`meshfuse.runtime.interpreter.bucketing`)."""
    src = expr.args[0]
    shape, dtype = layouts[src].shape, src.dtype.torch_dtype
    if kind == "gather":
        return gather_member(plan, rank, shape, dtype)
    if [s.kind for s in plan] == ["allreduce"]:
        return allreduce_member(plan, rank, shape, dtype) if read_later else None
    return reduce_member(plan, rank, shape, dtype)


def _single(call: Callable) -> Callable:
    """A bucket of one member: its one result (a step of one output is not a list)."""
    return lambda *args: call(*args)[0]


def _step_at(steps: Sequence[Step], slot: int) -> int | None:
    """The index of the communication step that defines ``slot``."""
    return next((k for k, s in enumerate(steps) if s.op == RESHARD and slot in s.outputs), None)


def _bucket_step(key: tuple, members: list[Step], exprs: list[Expr], group) -> Step:
    layer = key[1]
    collective = key[2][0] + (" + allreduce" if key[5] is not None else "")
    names = ", ".join(e.outputs[0].name for e in exprs)
    label = (f"{names} = reshard(...): layer {layer}'s {len(exprs)} parameters, one "
             f"{collective} (ranks {list(group.ranks)})")
    return Step(RESHARD, tuple(a for s in members for a in s.args), {},
                tuple(o for s in members for o in s.outputs),
                tuple(dict.fromkeys(f for s in members for f in s.free)), label,
                tuple(p for s in members for p in s.plan))


@dataclasses.dataclass(frozen=True)
class LayerSchedule:
    """What the program builder asks of a fully sharded fusion: its order
    (:func:`prefetch_order`) and the rewrite of its steps (:func:`bucket_layers`)."""

    found: LayerCommunications
    outputs: frozenset = frozenset()

    def order(self, exprs: Sequence[Expr]) -> list[Expr]:
        # the gradients' cones first: the gathers are then placed one layer ahead of the
        # compute as it will run
        ordered = hoist_gradients(communication_first(exprs), self.found.reductions,
                                  self.outputs, self.found.gathers)
        ordered = prefetch_order(ordered, self.found.gathers)
        return gather_reductions(ordered, self.found.reductions)

    def regroup(self, exprs, steps, calls, slot_of, keep, *, rank: int, layouts: Mapping,
                group_of: GroupOf) -> tuple[list[Step], list[Callable]]:
        return bucket_layers(self.found, exprs, list(steps), list(calls), slot_of,
                             rank=rank, layouts=layouts, group_of=group_of,
                             account=GATHERED)


def layer_schedule(compiled: Fusion, sources: Sequence[Fusion],
                   counterpart: Callable) -> LayerSchedule | None:
    """The schedule of ``compiled`` when one of ``sources`` (the fusions it was compiled
    from) has layers registered; None otherwise. ``counterpart`` maps a source's tensor to
    its compiled copy."""
    for source in sources:
        layer_of = layers_of(source) if source is not None else None
        if layer_of:
            mapped = {counterpart(tv): k for tv, k in layer_of.items()}
            found = communications_by_layer(compiled, mapped, reduce_dtype_of(source))
            return LayerSchedule(found, frozenset(compiled.outputs())) if found else None
    return None

