"""Grouped-query attention under a sharding: every rank must hold, with its query heads, the
key/value heads that serve them.

In grouped-query attention (PyTorch's SDPA with ``enable_gqa=True``) q has ``H`` heads and k
and v ``Hkv``, a divisor of ``H``; query head ``h`` attends with key/value head ``h // G``,
``G = H / Hkv``. On each mesh axis that shards the query heads, the key/value heads are
either

- *sharded by groups*: the owner of query head ``h`` owns key/value head ``h // G`` (block
  splits of both into a number of blocks that divides ``Hkv``: 8 query and 4 key/value
  heads over 2 ranks, query heads 0-3 with key/value heads 0-1 on rank 0); or
- *replicated* (Megatron's and torchtitan's plans when the ranks outnumber the key/value
  heads: 8 query and 2 key/value heads over 4 ranks). Each rank then computes with the
  key/value heads its query heads need, taken from its whole copy: no communication. In the
  backward a key/value head's gradient is the sum over its query heads, of which each rank
  computed its own: ``k_grad`` and ``v_grad`` carry a reduction over the query heads (see
  ``sdpfa_bwd``'s shape rule) and are partial sums over those mesh axes, reduced by the
  resharding that follows (an allreduce, or a reduce-scatter).

Propagation gives unscheduled k and v the first where the block count divides ``Hkv``, the
second otherwise. Key/value heads pinned sharded any other way (over fewer mesh axes than
the query heads, or in blocks that miss the groups) are *gathered*: the attention needs
them whole (its ``whole_axes``), then takes them as replicated ones; that allgather moves
key/value heads a rank does not need, which replicating them (or sharding them by groups)
avoids.

:func:`plan_grouped_heads` (the op's ``plan`` rule, run after propagation) rewrites the
attention's domain map for key/value heads taken from a whole copy; :func:`kv_head_index`
tells each rank which of its key/value heads serve its query heads, and
:func:`with_kv_heads` makes a kernel take only those.
"""

from __future__ import annotations

import functools

import torch

from meshfuse.ir.domain import domain
from meshfuse.ir.iter_domain import Merge, Split
from meshfuse.ir.layout import block_factor, derived_extents, device_ids, split_indices
from meshfuse.ir.tensor_view import TensorView

_QUERY_SIDE = ("q", "grad_attn", "attn", "log_sumexp")
_KEY_SIDE = ("k", "v")


def head_owners(tv: TensorView) -> dict[str, torch.Tensor] | None:
    """For each device parallel type that shards ``tv``'s heads (axis -3 of its
    materialized axes), the coordinate owning each global head; None when the heads'
    extent is not known before execute (nor where they are merged with another axis). The
    other axes' extents do not matter (a symbolic sequence)."""
    heads = tv.materialized()[-3]
    if heads.extent is None:
        return None
    subtree = set(domain(tv).subtree(heads))
    if any(isinstance(t, Merge) and set(t.inputs) & subtree for t in tv.transforms):
        return None
    # (a stand-in extent for a symbolic axis: its splits do not reach the heads')
    extents = derived_extents(tv, {i: 1 if i.extent is None else i.extent
                                   for i in tv.logical})
    indices = split_indices(tv, heads, extents)
    return {pt.value: indices[leaf] for leaf, pt in device_ids(tv).get(heads, [])}


BY_GROUPS, REPLICATED, GATHERED = "by groups", "replicated", "gathered"


def kv_layout(q: TensorView, kv: dict[str, TensorView]) -> str | None:
    """How the key/value heads of ``kv`` (``{"k": k, "v": v}``) lie against ``q``'s heads:
    :data:`BY_GROUPS` (on each mesh axis sharding either, the owner of query head ``h``
    owns key/value head ``h // G``; also when neither is sharded), :data:`REPLICATED`
    (not sharded, the query heads are) or :data:`GATHERED` (sharded otherwise: they are
    gathered whole before the attention, then taken as replicated ones). None for as many
    key/value heads as query heads, or symbolic extents."""
    q_owners = head_owners(q)
    layouts = set()
    for tv in kv.values():
        kv_owners = head_owners(tv)
        if q_owners is None or kv_owners is None:
            return None
        heads, kv_heads = q.materialized()[-3].extent, tv.materialized()[-3].extent
        if heads == kv_heads:
            return None
        group = heads // kv_heads
        served = {pt: owners[torch.arange(heads) // group] for pt, owners in kv_owners.items()}
        if served.keys() == q_owners.keys() and \
                all(torch.equal(served[pt], q_owners[pt]) for pt in served):
            layouts.add(BY_GROUPS)
        else:
            layouts.add(GATHERED if served else REPLICATED)
    return GATHERED if GATHERED in layouts else REPLICATED if REPLICATED in layouts else \
        BY_GROUPS


def replicated_kv_axes(expr, q: TensorView, kv: dict[str, TensorView]) -> set[str]:
    """The mesh axes (parallel type names) sharding ``q``'s heads on which a rank computes
    with key/value heads taken from a whole copy (replicated or gathered ones)."""
    if kv_layout(q, kv) in (REPLICATED, GATHERED):
        return set(head_owners(q))
    return set()


def attention_kv_layout(expr) -> str | None:
    """:func:`kv_layout` of an attention's key/value heads against its q, unless a tensor
    of its query heads that the op may be computed like (an output pinned otherwise than q
    lies: resharding may make q lie as it does, as it does for a q from another mesh) is
    not cut into whole groups (:func:`_in_whole_groups`: a cyclic split, more blocks than
    key/value heads, uneven blocks): no split of the key/value heads then serves that
    computation, so they are taken from a whole copy (:data:`REPLICATED`, or
    :data:`GATHERED` where they are sharded). Two cases read the outputs too: q's heads
    whole and the output split by the groups of k and v as they lie give
    :data:`BY_GROUPS` (:func:`_by_the_outputs_groups`); a backward's key/value gradients
    split otherwise than by groups against q give a whole copy
    (:func:`_gradients_by_groups`)."""
    args = dict(zip((p.name for p in expr.op.params), expr.args))
    kv = {n: args[n] for n in _KEY_SIDE}
    layout = kv_layout(args["q"], kv)
    if layout == GATHERED and _by_the_outputs_groups(expr, args["q"], kv):
        layout = BY_GROUPS
    if layout != BY_GROUPS:
        return layout
    query_side = [args[n] for n in _QUERY_SIDE[:3] if n in args] + [expr.tensor_outputs[0]]
    kv_heads = args["k"].materialized()[-3].extent
    if all(_in_whole_groups(t, kv_heads) for t in query_side) and \
            _gradients_by_groups(expr, args["q"]):
        return BY_GROUPS
    return GATHERED if any(head_owners(t) for t in kv.values()) else REPLICATED


def _by_the_outputs_groups(expr, q: TensorView, kv: dict[str, TensorView]) -> bool:
    """Whether q's heads are whole and the attention's output lies split on its heads by
    the groups of k and v as they lie (propagated from them): the attention then runs as
    its output lies, q sliced to those heads and k and v read where they are, rather than
    gathering k and v for a q that every rank would slice anyway."""
    if head_owners(q) != {}:
        return False
    out = expr.tensor_outputs[0]
    return bool(head_owners(out)) and kv_layout(out, kv) == BY_GROUPS


def _gradients_by_groups(expr, q: TensorView) -> bool:
    """Whether a backward's key/value gradients (``sdpfa_bwd``'s second and third outputs)
    lie by groups against ``q``, or are not split on their heads. Propagation may give them
    the split of the key/value inputs they are copied into (k and v sharded, their whole
    copies gathered for the forward, the derived backward's residuals): computed as they
    lie, the attention would take k and v split against a q that is not (refused before:
    seed 601225 of the heads gradient fuzzer). Otherwise they are computed whole (from the
    whole k and v), then cut where they are copied."""
    if expr.op.name != "sdpfa_bwd":
        return True
    gradients = dict(zip(_KEY_SIDE, expr.tensor_outputs[1:3]))
    return kv_layout(q, gradients) in (BY_GROUPS, None)


def _in_whole_groups(tv: TensorView, kv_heads: int) -> bool:
    """Whether ``tv``'s query heads are cut so that a split of the ``kv_heads`` key/value
    heads serves them: not sharded, or in even blocks (:func:`block_factor`) whose count
    divides ``kv_heads`` (each block then holds whole groups, and that split carried onto
    the key/value heads holds their heads; resharding carries no other). True where the
    extents are not known yet."""
    owners = head_owners(tv)
    if not owners:
        return True
    factor = block_factor(tv, tv.materialized()[-3])
    return factor is not None and kv_heads % factor == 0


def gathered_kv_heads(expr) -> set:
    """The key/value head axes an attention needs whole (part of its ``whole_axes``): those
    of k and v when they are sharded otherwise than by groups."""
    if attention_kv_layout(expr) != GATHERED:
        return set()
    args = dict(zip((p.name for p in expr.op.params), expr.args))
    return {args[n].materialized()[-3] for n in _KEY_SIDE}


def plan_grouped_heads(expr) -> None:
    """An attention's ``plan`` rule (after propagation, on the compiler's copy). With
    key/value heads sharded by groups (or no heads sharded), the backward's reduction over
    the query heads is within a rank's heads: it maps from nothing. Otherwise a rank takes
    the key/value heads it needs from a whole copy: no output head axis maps between the
    key/value and the query heads, the key/value gradients' heads are computed whole and
    their reduction over the query heads is a partial sum over the mesh axes sharding them
    (reduced by the resharding that follows).

    With symbolic head extents it decides nothing (:func:`kv_layout` is None); it runs again
    once the extents are bound (``meshfuse.passes.pipeline.concretize``), where what it
    decided before stays: a domain map planned apart already is left as it is."""
    args = dict(zip((p.name for p in expr.op.params), expr.args))
    q = args["q"]
    layout = attention_kv_layout(expr)
    if layout is None:
        return
    axis = len(q.materialized()) - 3  # the heads (log_sumexp is [..., B, H, S])
    heads = {t: t.materialized()[axis] for name, t in args.items()
             if name in _QUERY_SIDE + _KEY_SIDE}
    query_ids = {heads[args[n]] for n in _QUERY_SIDE if n in args}
    key_ids = {heads[args[n]] for n in _KEY_SIDE}
    if layout != BY_GROUPS and not any(
            set(sources) & query_ids and set(sources) & key_ids
            for out_id, sources in expr.id_map.items() if not out_id.is_reduction):
        return  # planned apart on the build already
    pinned = getattr(q.fusion, "user_scheduled", set())
    if layout != BY_GROUPS and expr.op.name == "sdpfa_fwd":
        for name in _KEY_SIDE:
            _whole_key_sequence(q, args[name], pinned)
    id_map = {}
    for out_id, sources in expr.id_map.items():
        if out_id.is_reduction and set(sources) and set(sources) <= query_ids:
            out = next(o for o in expr.tensor_outputs if out_id in o.logical)
            if layout == BY_GROUPS:
                _drop_device_ids(out, out_id)
                sources = ()
            elif out not in pinned:  # the key/value gradients: partial over the query heads
                _drop_device_ids(out, out.materialized()[axis])
                _copy_split(q, heads[q], out, out_id)
        elif layout != BY_GROUPS and set(sources) & query_ids:
            sources = tuple(s for s in sources if s not in key_ids)
        id_map[out_id] = sources
    expr.id_map = id_map


def _whole_key_sequence(q: TensorView, kv: TensorView, pinned) -> None:
    """Replicated key/value heads with the query sequence whole (no context parallelism):
    the attention needs ``kv``'s sequence whole, so ``kv`` and the unscheduled tensors
    making it (a projection, reshapes, RoPE: each read only on the way to ``kv``) are left
    whole along it, not split as their inputs are; resharding then takes the projection's
    input gathered for the query projection instead of gathering k and v after theirs
    (Megatron's one allgather of a sequence-parallel region's input), or gathers where it
    moves fewer bytes."""
    seq = len(q.materialized()) - 2
    if device_ids(q).get(q.materialized()[seq]):
        return  # a context-parallel candidate: its planning decides the key sequence
    uses = q.fusion.uses()
    attention = {e for e in uses.get(kv, []) if e.op is not None and e.op.name == "sdpfa_fwd"}
    axis_of = {kv: kv.materialized()[seq]}  # a candidate -> its axis to make whole
    whole: set[TensorView] = set()
    pending, progress = {kv}, True
    while progress:  # a tensor read on two ways waits for both
        progress = False
        for tv in sorted(pending, key=lambda t: t.name):  # the same order on every rank
            if tv in pinned or tv.definition is None:
                pending.discard(tv)
            elif _read_on_the_way(tv, axis_of, whole, uses, attention):
                pending.discard(tv)
                _drop_device_ids(tv, axis_of[tv])
                whole.add(tv)
                progress = True
                producer = tv.definition
                for source in producer.id_map.get(axis_of[tv], ()):
                    for t in producer.tensor_inputs:
                        if source in t.logical and t not in axis_of and \
                                device_ids(t).get(source):
                            axis_of[t] = source
                            pending.add(t)


def _read_on_the_way(tv: TensorView, axis_of: dict, whole: set, uses,
                     attention: set) -> bool:
    """Whether every consumer of ``tv`` is the attention or makes only tensors of
    ``whole`` (along an axis mapped from ``tv``'s)."""
    for e in uses.get(tv, []):
        if e in attention:
            continue
        for o in e.tensor_outputs:
            if o not in whole or axis_of[tv] not in e.id_map.get(axis_of[o], ()):
                return False
    return True


def _drop_device_ids(out: TensorView, logical_id) -> None:
    for leaf, _ in device_ids(out).get(logical_id, []):
        del out.parallel[leaf]


def _copy_split(src: TensorView, src_id, out: TensorView, out_id) -> None:
    """Shards ``out``'s unsplit ``out_id`` as ``src`` shards ``src_id`` (of one extent):
    the same split chain, its device IDs parallelized alike."""
    if out_id not in out.loop or device_ids(out).get(out_id):
        return
    used = {pt for pt in out.parallel.values() if pt.is_device}
    leaves = device_ids(src).get(src_id, [])
    if not leaves or any(pt in used for _, pt in leaves):
        return
    chain = {src_id: out_id}
    for t in src.transforms:
        if isinstance(t, Split) and t.in_id in chain:
            out.split(out.loop.index(chain[t.in_id]), t.factor, t.inner_split, t.zigzag)
            record = out.transforms[-1]
            chain[t.outer], chain[t.inner] = record.outer, record.inner
    for leaf, pt in leaves:
        out.parallelize(out.loop.index(chain[leaf]), pt)


def kv_head_index(q_heads: torch.Tensor, kv_heads: torch.Tensor, heads: int,
                  kv_extent: int) -> tuple | None:
    """Which of this rank's key/value heads serve its query heads: None when all of them,
    in groups (the kernel takes them as they are); else ``("narrow", start, count)`` for
    consecutive heads serving equal groups, or ``("select", positions)``, one position per
    query head (query heads whose groups this rank holds in part: the kernel runs with one
    key/value head per query head).

    Args:
        q_heads, kv_heads: the global head indices held on this rank (ascending).
        heads, kv_extent: the global head counts of q and of k/v.
    """
    group = heads // kv_extent
    needed = q_heads // group
    if not len(needed):
        return ("narrow", 0, 0)  # no query heads here: no key/value heads either
    position = {int(h): i for i, h in enumerate(kv_heads.tolist())}
    wanted = [position[int(h)] for h in needed.tolist()]
    unique = sorted(set(wanted))
    if unique == list(range(len(kv_heads))) and _grouped(wanted, len(unique)):
        return None
    if unique == list(range(unique[0], unique[-1] + 1)) and _grouped(wanted, len(unique)):
        return ("narrow", unique[0], len(unique))
    return ("select", tuple(wanted))


def _grouped(wanted: list[int], count: int) -> bool:
    """Whether ``wanted`` is ``count`` runs of equal length of consecutive positions."""
    if not wanted or len(wanted) % count:
        return False
    run = len(wanted) // count
    return all(w - wanted[0] == i // run for i, w in enumerate(wanted))


def _take(t: torch.Tensor, index: tuple) -> torch.Tensor:
    axis = t.ndim - 3
    if index[0] == "narrow":
        return t.narrow(axis, index[1], index[2])
    return t.index_select(axis, torch.tensor(index[1], device=t.device))


def _put_back(grad: torch.Tensor, like: torch.Tensor, index: tuple) -> torch.Tensor:
    """The gradient of the heads taken by ``index``, as a gradient of all of ``like``'s
    (zero for heads no query head of this rank used)."""
    full = torch.zeros_like(like, dtype=grad.dtype)
    axis = like.ndim - 3
    if index[0] == "narrow":
        full.narrow(axis, index[1], index[2]).copy_(grad)
    else:
        full.index_add_(axis, torch.tensor(index[1], device=grad.device), grad)
    return full


def with_kv_heads(fn, backward: bool):
    """``fn``, an attention implementation (``sdpfa_fwd``'s signature, or ``sdpfa_bwd``'s
    with ``backward``), taking a ``kv_heads=`` keyword (:func:`kv_head_index`'s result):
    k and v cut to those heads; in the backward, their gradients put back in place."""
    first = 2 if backward else 1

    @functools.wraps(fn)
    def call(*args, kv_heads=None, **kwargs):
        if kv_heads is None:
            return fn(*args, **kwargs)
        k, v = args[first], args[first + 1]
        args = (*args[:first], _take(k, kv_heads), _take(v, kv_heads), *args[first + 2:])
        result = fn(*args, **kwargs)
        if not backward:
            return result
        dq, dk, dv = result
        return dq, _put_back(dk, k, kv_heads), _put_back(dv, v, kv_heads)
    return call
