"""Sharding propagation: every tensor the user did not schedule gets a mesh, DID splits and
an allocation domain from its neighbours (docs/design.md, section 6, step 2).

- Tensors the user scheduled (a mesh, a split or a parallelized axis) are never changed.
- **Forward** (inputs to outputs, in definition order): an unscheduled op output copies the
  sharding of the input that shards the most of its mapped axes (ties: the op's preferred
  input, e.g. ``linear``'s weight; then the input mapping the most axes; then argument
  order), through the op's domain map: the split chain of each sharded logical ID is
  replayed on the mapped output ID and its device IDs are parallelized alike. Shardings of
  other inputs on mesh axes still free are added (data-parallel tokens next to
  tensor-parallel weights). Across a reshape's split or merge (axes of other extents) only a
  block shard whose factor divides both is carried (a block split over two mesh axes, one
  inside the other, counts as one block of the product). A sharded input axis that maps to a
  reduction ID makes the output partial, unless the op cannot make partial results. The
  output's allocation domain follows the reference input's, IDs mapped one to one, so BSHE in
  gives BSHE out with the device ID where the user put it (matrix products are row-major; a
  fusion input keeps the memory order it was declared with).
- **Backward** (outputs to inputs, in reverse order) fills what forward left without a mesh,
  for example inputs when only outputs are scheduled.
- What is left (say, an unscheduled input in a fusion whose pins are all upstream of nothing)
  is replicated on the mesh.
- **Consumers** (nvFuser's backward propagation), last: a filled tensor (not a fusion
  input) replicated on a mesh axis on which every consumer shards an axis mapped to one of
  its own takes that sharding, so it is computed sharded rather than whole and sliced; a
  partial sum so sharded is reduce-scattered (unless a consumer carries its partial sums,
  as an ``add`` of partial sums does: the sum is reduced once).
Disagreements with pins are kept: the sharding check names the op that would need a
communication. The result depends only on the fusion, not on the order of scheduling calls.
"""

from __future__ import annotations

import weakref

from meshfuse.ir.domain import domain
from meshfuse.ir.fusion import Expr, Fusion, partial_reduce_op
from meshfuse.ir.iter_domain import IterDomain, Split
from meshfuse.ir.layout import block_factor, logical_root
from meshfuse.ir.tensor_view import TensorView
from meshfuse.passes.layout import follow_allocation


def propagate_shardings(fusion: Fusion) -> set[TensorView]:
    """Fills the schedules of unscheduled tensors in place; returns the tensors it filled.

    Runs once per fusion: later calls return the empty set. The tensors the user scheduled
    are kept in ``fusion.user_scheduled``.
    """
    if fusion.propagated:
        return set()
    fusion.propagated = True
    tensors = fusion.tensors()
    pinned = {tv for tv in tensors if tv.is_scheduled}
    fusion.user_scheduled = set(pinned)
    meshes = [tv.mesh for tv in tensors if tv.mesh is not None]
    if not meshes:
        return set()
    filled: set[TensorView] = set()
    _propagate_forward(fusion, pinned, filled)
    _propagate_backward(fusion, pinned, filled)
    for tv in tensors:
        if tv not in pinned and tv not in filled:
            tv.set_device_mesh(meshes[0])
            filled.add(tv)
    inputs = set(fusion.inputs())
    uses = fusion.uses()
    for tv in reversed(tensors):
        if tv in filled and tv not in inputs:
            _take_consumers_sharding(tv, uses.get(tv, []))
    return filled


def _propagate_forward(fusion: Fusion, pinned: set[TensorView],
                       filled: set[TensorView]) -> None:
    """From inputs to outputs: each output no one scheduled takes the sharding of its best
    known input (and the device splits of the others on its mesh); a partial result the op
    cannot make is left replicated. Adds the tensors it fills to ``filled``."""
    for expr in fusion.exprs:
        sources = [t for t in expr.tensor_inputs if t in pinned or t in filled]
        for out in expr.tensor_outputs:
            if out in pinned or out in filled or not sources:
                continue
            ref = _best_reference(expr, sources, out, forward=True)
            _copy_sharding(ref, out, _forward_pairs(expr, ref, out),
                           layout=expr.op.follows_inputs(expr.tensor_outputs.index(out)))
            for other in sources:
                if other is not ref and other.mesh == ref.mesh:
                    _add_sharding(other, out, _forward_pairs(expr, other, out))
            whole = _whole(expr)
            for id_ in [i for i, pt in out.parallel.items() if pt.is_device and
                        i.is_reduction]:
                # A partial result the op cannot make (it cannot at all, or it needs the
                # reduced axes whole, or not all its arguments are partial alike): its
                # inputs get gathered or reduced instead.
                if expr.op.partial_reduce is None or \
                        all(s in whole for s in expr.id_map[logical_root(out, id_)]) or \
                        not partial_carried(expr, out, id_, sources):
                    del out.parallel[id_]
            filled.add(out)


def _propagate_backward(fusion: Fusion, pinned: set[TensorView],
                        filled: set[TensorView]) -> None:
    """From outputs to inputs: each input still unknown takes the sharding of its best known
    consumer output. Adds the tensors it fills to ``filled``."""
    for expr in reversed(fusion.exprs):
        sources = [t for t in expr.tensor_outputs if t in pinned or t in filled]
        for inp in expr.tensor_inputs:
            if inp in pinned or inp in filled or not sources:
                continue
            ref = _best_reference(expr, sources, inp, forward=False)
            definition = inp.definition
            follows = definition is None or definition.op.follows_inputs(
                definition.tensor_outputs.index(inp))
            _copy_sharding(ref, inp, _backward_pairs(expr, ref, inp), layout=follows)
            filled.add(inp)


def _take_consumers_sharding(tv: TensorView, consumers: list[Expr]) -> None:
    """nvFuser's backward propagation: a filled tensor replicated on a mesh axis that every
    consumer shards (on an iteration axis mapped to one axis of ``tv``) is sharded there too,
    so that it is computed sharded instead of whole and sliced (a partial sum is then
    reduce-scattered: the row-parallel projection whose result joins a sequence-sharded
    residual). A partial tensor whose consumer carries its partial sums (an ``add`` of
    partial sums) is left partial: the sum is reduced once, after the last addend."""
    if not consumers or tv.mesh is None:
        return
    partial = any(pt.is_device and i.is_reduction for i, pt in tv.parallel.items())
    used = {pt for i, pt in tv.parallel.items() if pt.is_device and not i.is_reduction}
    wanted = None  # parallel type -> (consumer output, its ID, tv's logical ID)
    for expr in consumers:
        outs = [o for o in expr.tensor_outputs if o.mesh == tv.mesh]
        if not outs or (partial and _carries_partials(expr, outs, tv)):
            return
        found = _consumer_shards(expr, outs, tv, used)
        wanted = found if wanted is None else {
            pt: ref for pt, ref in wanted.items() if pt in found and found[pt][2] is ref[2]}
        if not wanted:
            return
    for out, out_id, tv_id in wanted.values():
        if tv_id in tv.loop:
            _replay_shard(out, out_id, tv, tv_id, {})


def _carries_partials(expr: Expr, outs: list[TensorView], tv: TensorView) -> bool:
    """Whether ``expr`` maps a reduction axis of ``tv`` to a reduction axis of an output (an
    ``add`` of partial sums, whose result is reduced once for all its addends)."""
    return any(src in tv.logical for o in outs for i in o.logical if i.is_reduction
               for src in expr.id_map.get(i, ()))


def _consumer_shards(expr: Expr, outs: list[TensorView], tv: TensorView, used: set) -> dict:
    """The mesh axes (not in ``used``) on which ``expr``'s outputs ``outs`` shard an
    iteration axis mapped to an unsplit axis of ``tv`` that the op does not need whole:
    parallel type -> (output, its logical ID, ``tv``'s logical ID)."""
    whole = _whole(expr)
    found: dict = {}
    for out in outs:
        for out_id, tv_id in _mapped(expr, out, tv):
            if out_id.is_reduction or tv_id not in tv.loop or tv_id in whole:
                continue
            for leaf in _device_leaves(out, out_id):
                found.setdefault(out.parallel_type(leaf), (out, out_id, tv_id))
    return {pt: ref for pt, ref in found.items() if pt not in used}


def partial_carried(expr: Expr, out: TensorView, id_: IterDomain,
                    inputs: list[TensorView]) -> bool:
    """Whether ``out``'s device ID ``id_``, parallelizing a reduction ID, may stay: ``False``
    for a reduction ID that carries its arguments' partial sums (its sources are reduction
    IDs: ``add`` of two matmul results, see ``TensorMeta.partial_axes``) unless every
    argument (among ``inputs``, which may be scratch schedules) holds partial sums over it
    on the same mesh axis. Adding a partial sum and a complete value, or partial sums over
    two mesh axes, needs the partial sums reduced first. Only partial *sums* carry: the sum
    of partial maxima (or products) is not the maximum of the sums."""
    sources = expr.id_map.get(logical_root(out, id_), ())
    if not sources or not all(s.is_reduction for s in sources):
        return True  # a reduction of the op's own (a matmul's contraction)
    pt = out.parallel[id_]
    made_by = {i: t for t in expr.tensor_inputs for i in t.logical}
    if any(partial_reduce_op(made_by[s]) != "sum" for s in sources if s in made_by):
        return False
    for src in sources:
        tv = next((t for t in inputs if src in t.logical), None)
        if tv is None or not any(p == pt and logical_root(tv, d) is src
                                 for d, p in tv.parallel.items()):
            return False
    return True


def _forward_pairs(expr: Expr, ref: TensorView, out: TensorView) -> dict[IterDomain, IterDomain]:
    """ref (an input) logical ID -> out logical ID, through the op's domain map."""
    return {i: o for o, i in _mapped(expr, out, ref)}


def _backward_pairs(expr: Expr, ref: TensorView, inp: TensorView) -> dict[IterDomain, IterDomain]:
    """ref (an output) logical ID -> inp logical ID, through the op's domain map."""
    return dict(_mapped(expr, ref, inp))


def _mapped(expr: Expr, out: TensorView, inp: TensorView) -> list[tuple[IterDomain, IterDomain]]:
    """(out ID, inp ID) pairs of the domain map, broadcast inputs left out unless the output
    axis is a broadcast too (an axis of extent 1 that nvFuser may parallelize over a mesh
    axis of one device); each ID of either side in one pair only (the first one)."""
    pairs, seen_in, seen_out = [], set(), set()
    for out_id in out.logical:
        for src in expr.id_map.get(out_id, ()):
            if src in inp.logical and (not src.is_broadcast or out_id.is_broadcast) \
                    and src not in seen_in and out_id not in seen_out:
                pairs.append((out_id, src))
                seen_in.add(src)
                seen_out.add(out_id)
    return pairs


def _best_reference(expr: Expr, candidates: list[TensorView], target: TensorView,
                    forward: bool) -> TensorView:
    """The neighbour that shards the most axes mapped to ``target``; ties go to the op's
    preferred arguments (weights), then to the one that maps the most axes (so ``k_grad``
    follows ``k``), then to argument order. A candidate may be a scratch tensor over an
    argument's logical IDs (the resharding pass weighs schedules that way)."""
    order = [t.logical for t in (expr.tensor_inputs if forward else expr.tensor_outputs)]
    preferred = [order[i] for i in expr.op.prefer_inputs if i < len(order)] if forward else []

    def score(tv: TensorView):
        pairs = _forward_pairs(expr, tv, target) if forward else _backward_pairs(expr, tv, target)
        sharded = sum(1 for ref_id in pairs if _device_leaves(tv, ref_id))
        rank = preferred.index(tv.logical) if tv.logical in preferred else len(preferred)
        return (-sharded, rank, -len(pairs), order.index(tv.logical))

    return min(candidates, key=score)


def _is_block_shard(ref: TensorView, ref_id: IterDomain, target_id: IterDomain) -> bool:
    """True if ``ref_id`` is block-sharded (:func:`block_factor`) in blocks that divide both
    it and ``target_id`` (an axis of another extent that a reshape maps to it)."""
    factor = block_factor(ref, ref_id)
    return factor is not None and target_id.extent is not None and \
        target_id.extent % factor == 0 and (ref_id.extent is None or ref_id.extent % factor == 0)


def _device_leaves(tv: TensorView, logical_id: IterDomain) -> list[IterDomain]:
    return domain(tv).device_leaves(logical_id)


def _copy_sharding(ref: TensorView, target: TensorView,
                   pairs: dict[IterDomain, IterDomain], layout: bool = True) -> None:
    """Gives ``target`` ``ref``'s mesh and, for each paired logical ID, ``ref``'s split chain
    and device parallelization; then, with ``layout``, an allocation domain that follows ``ref``'s."""
    target.set_device_mesh(ref.mesh)
    replay: dict[IterDomain, IterDomain] = dict(pairs)
    for ref_id, target_id in pairs.items():
        _replay_shard(ref, ref_id, target, target_id, replay)
    if layout and ref.allocation is not None and target.allocation is None:
        allocation = follow_allocation(ref, target, replay)
        if allocation is not None:
            target.allocation = allocation


def _add_sharding(ref: TensorView, target: TensorView,
                  pairs: dict[IterDomain, IterDomain]) -> None:
    """Adds ``ref``'s shardings on mesh axes ``target`` does not use yet, to axes of
    ``target`` not split yet (data parallel tokens next to tensor parallel weights)."""
    for ref_id, target_id in pairs.items():
        used = {pt for pt in target.parallel.values() if pt.is_device}
        if not any(ref.parallel_type(i) in used for i in _device_leaves(ref, ref_id)):
            _replay_shard(ref, ref_id, target, target_id, {})


def _replay_shard(ref: TensorView, ref_id: IterDomain, target: TensorView,
                  target_id: IterDomain, replay: dict[IterDomain, IterDomain]) -> None:
    """Replays the split chain of ``ref``'s sharded logical ``ref_id`` on ``target_id`` (an
    unsplit loop ID of ``target``) and parallelizes the device IDs alike. Nothing happens for
    an unsharded or broadcast axis, or across a reshape (other extents) unless the shard is a
    block that divides both or both IDs are reductions (partial sums): the rest is
    resharded. A broadcast axis takes the shard of a
    broadcast axis only."""
    leaves = _device_leaves(ref, ref_id)
    if not leaves or target_id not in target.loop \
            or target_id.is_broadcast != ref_id.is_broadcast:
        return
    # Partial sums need only be partial over the same mesh axes, whatever the lengths of
    # the axes they were reduced over (an ``add`` of two products' partial sums).
    both_reduced = ref_id.is_reduction and target_id.is_reduction
    if _extent(ref, ref_id) != _extent(target, target_id) and not both_reduced and \
            not _is_block_shard(ref, ref_id, target_id):
        return
    chain = {ref_id: target_id}
    for t in ref.transforms:
        if isinstance(t, Split) and t.in_id in chain:
            target.split(target.loop.index(chain[t.in_id]), t.factor, t.inner_split, t.zigzag)
            record = target.transforms[-1]
            chain[t.outer], chain[t.inner] = record.outer, record.inner
    for leaf in leaves:
        # A mesh axis ``target`` already shards another axis of this kind with (say, a
        # reduce-scatter's output mapped onto one input) is left to resharding.
        pt, id_ = ref.parallel_type(leaf), chain[leaf]
        if not any(p is pt and i.is_reduction == id_.is_reduction
                   for i, p in target.parallel.items()):
            target.parallelize(target.loop.index(id_), pt)
    replay.update(chain)


def _whole(expr: Expr) -> set[IterDomain]:
    """The input axes ``expr``'s op computes on whole (its own sharding rule)."""
    return expr.op.whole_axes(expr) if expr.op.whole_axes is not None else set()


def _drop_shards(tv: TensorView, ids: set[IterDomain]) -> None:
    """Makes ``tv`` (a scratch tensor) whole along the logical IDs ``ids``."""
    for id_ in [i for i, pt in tv.parallel.items() if pt.is_device and
                logical_root(tv, i) in ids]:
        del tv.parallel[id_]


def _as_computed(expr: Expr, inputs: list[TensorView]) -> list[TensorView]:
    """``inputs`` as the op computes on them: gathered along the axes it needs whole."""
    whole = _whole(expr)
    result = []
    for tv in inputs:
        if any(logical_root(tv, i) in whole for i, pt in tv.parallel.items() if pt.is_device):
            gathered = TensorView(tv.fusion, tv.logical, tv.dtype)
            _copy_sharding(tv, gathered, {i: i for i in tv.logical}, layout=False)
            if tv.allocation is not None and set(tv.allocation.ids) <= set(tv.logical):
                gathered.allocation = tv.allocation
            _drop_shards(gathered, whole)
            tv = gathered
        result.append(tv)
    return result


def _extent(tv: TensorView, id_: IterDomain) -> int | None:
    """``id_``'s extent, or for a symbolic one the static extent of an axis an op maps it to
    one to one (a pointwise op's operands, a reshape's ``-1`` onto a static axis: equal by
    the op's shape rule), else None."""
    if id_.extent is not None:
        return id_.extent
    return _equal_extents(tv.fusion).get(id_)


# A fusion -> (its number of expressions when read, symbolic ID -> the static extent it
# equals); read again when expressions were added.
_equalities: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _equal_extents(fusion: Fusion) -> dict[IterDomain, int]:
    cached = _equalities.get(fusion)
    if cached is not None and cached[0] == len(fusion.exprs):
        return cached[1]
    root: dict[IterDomain, IterDomain] = {}

    def find(i: IterDomain) -> IterDomain:
        while root.get(i, i) is not i:
            i = root[i]
        return i

    for expr in fusion.exprs:
        for out_id, src in _one_to_one(expr):
            a, b = find(out_id), find(src)
            if a is not b:
                root[a] = b
    static = {find(i): i.extent for i in root if i.extent is not None}
    static.update({find(i): i.extent for i in root.values() if i.extent is not None})
    table = {i: static[find(i)] for i in (*root, *root.values())
             if i.extent is None and find(i) in static}
    _equalities[fusion] = (len(fusion.exprs), table)
    return table


def _one_to_one(expr: Expr):
    """(output ID, input ID) pairs of ``expr``'s domain map that map one axis of an input
    to one axis of an output and back, broadcast axes left out."""
    uses: dict[IterDomain, int] = {}
    for sources in expr.id_map.values():
        for s in sources:
            uses[s] = uses.get(s, 0) + 1
    owner = {i: t for t in expr.tensor_inputs for i in t.logical}
    for out_id, sources in expr.id_map.items():
        for s in sources:
            same_input = [x for x in sources if owner.get(x) is owner.get(s)]
            if uses[s] == 1 and len(same_input) == 1 and not s.is_broadcast and \
                    not out_id.is_broadcast:
                yield out_id, s
