"""Localization: what each op of a compiled fusion computes on one rank, for one signature.

An op is declared with global shapes; on a rank it runs on local shards. Most ops need
nothing more (their implementation reads the local shapes of its inputs). The rest get
*local attributes*, decided here once per input signature and rank, and passed to the
implementation as keyword arguments:

- ``out_shapes`` (ops declared ``needs_out_shape``, e.g. ``reshape``, ``expand``): the local
  shape of each output, whose global shape the op's arguments speak of; also for ops
  declared ``expands_broadcasts`` reading an expanded broadcast axis (see ``OpDef``);
- ``reduced_count`` (``needs_reduced_count``, ``mean``): the *global* number of elements
  reduced into one output element, so that a shard's mean is a partial mean;
- dropped addends (``partial_addends``, ``linear``'s bias): on a partial result, only
  coordinate 0 of the partial mesh axes adds them, so the reduction counts them once; the
  other ranks pass ``None`` for them and tell the implementation their positions
  (``dropped_addends=``), so that it may run the kernel it runs with them;
- whatever the op's own ``localize`` rule returns for the rank (random ops: the global
  positions of their local elements and their random stream, with a note for explain);
- whatever a parallelism strategy adds for the op (:func:`register_local_attrs`: context
  parallelism gives a sequence-sharded attention the record of its ring).

A rank takes part in an op when it holds one of its outputs, and in a communication when it
holds its source or its target (both meshes move the data).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from meshfuse.ir.fusion import Expr, Fusion, Reshard
from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.layout import LocalLayout
from meshfuse.ir.placement import Partial, placements
from meshfuse.ir.tensor_view import TensorView
from meshfuse.ops.registry import LocalContext


@dataclasses.dataclass(frozen=True)
class Local:
    """One expression as a rank runs it.

    Attributes:
        attrs: local attributes, the implementation's keyword arguments.
        dropped: positions of arguments this rank leaves out (passes ``None`` for).
        note: this rank's part, from the op's ``localize`` rule (for explain).
    """

    attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dropped: tuple[int, ...] = ()
    note: str = ""


# A strategy's local attributes for an expression on a rank: a dict to add, or None.
LocalAttrs = Callable[[Expr, LocalContext], Mapping[str, Any] | None]
_LOCAL_ATTRS: list[LocalAttrs] = []


def register_local_attrs(rule: LocalAttrs) -> LocalAttrs:
    """Registers ``rule`` (a strategy's, registered when its package is imported): run after
    each op's own ``localize`` rule; what it returns is added to the op's local attributes.
    Returns ``rule``, so that it serves as a decorator."""
    if rule not in _LOCAL_ATTRS:
        _LOCAL_ATTRS.append(rule)
    return rule


def localize(fusion: Fusion, extents: Mapping[IterDomain, int],
             layouts: Mapping[TensorView, LocalLayout], here: LocalContext) -> dict[Expr, Local]:
    """Each expression the rank ``here`` describes runs (absent: it does not take part),
    with its local attributes under the bound ``extents`` and local ``layouts``."""
    rank = here.rank
    result = {}
    for expr in fusion.exprs:
        if not takes_part(expr, rank):
            continue
        if isinstance(expr, Reshard):
            result[expr] = Local()
            continue
        attrs: dict[str, Any] = {}
        if expr.op.needs_out_shape or (expr.op.expands_broadcasts and reads_expanded(expr)):
            attrs["out_shapes"] = [layouts[o].shape for o in expr.tensor_outputs]
        if expr.op.needs_reduced_count:
            attrs["reduced_count"] = reduced_count(expr, extents)
        note = ""
        if expr.op.localize is not None:
            own, note = expr.op.localize(expr, here)
            attrs.update(own)
        for rule in _LOCAL_ATTRS:
            attrs.update(rule(expr, here) or {})
        dropped = dropped_addends(expr, rank)
        if dropped:
            attrs["dropped_addends"] = dropped
        result[expr] = Local(attrs, dropped, note)
    return result


def reads_expanded(expr: Expr) -> bool:
    """Whether an operand of ``expr`` has an expanded broadcast axis (an extent above 1)."""
    return any(i.is_broadcast and i.extent != 1 for t in expr.tensor_inputs
               for i in t.materialized())


def takes_part(expr: Expr, rank: int) -> bool:
    """Whether ``rank`` runs ``expr``: it holds one of its outputs, or, for a communication,
    its input or output."""
    tensors = list(expr.tensor_outputs)
    if isinstance(expr, Reshard):
        tensors += list(expr.tensor_inputs)
    meshes = [t.mesh for t in tensors]
    return not meshes or any(m is None or rank in m for m in meshes)


def reduced_count(expr: Expr, extents: Mapping[IterDomain, int]) -> int:
    """The global number of elements reduced into one element of the op's first output."""
    count = 1
    for id_ in expr.tensor_outputs[0].logical:
        if id_.is_reduction:
            count *= extents[id_]
    return count


def dropped_addends(expr: Expr, rank: int) -> tuple[int, ...]:
    """Arguments added to a result (a bias) that ``rank`` leaves out: a partial result
    includes them on coordinate 0 of its partial mesh axes only."""
    out = expr.tensor_outputs[0] if expr.tensor_outputs else None
    if not expr.op.partial_addends or out is None or out.mesh is None:
        return ()
    coord = out.mesh.coordinate(rank)
    if all(c == 0 for c, p in zip(coord, placements(out)) if isinstance(p, Partial)):
        return ()
    return tuple(p for p in expr.op.partial_addends if expr.args[p] is not None)
