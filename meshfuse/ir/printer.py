"""The one deterministic text form of the IR, used in errors, debug output and golden tests.

IDs print as ``{kind}{parallel}{n}{{extent}}``: ``i3{1024}``, ``iDIDx4{2}``, ``r5{64}``,
``b6{1}``, ``i7{?}`` (symbolic). ``n`` numbers the IDs of one printout in order of appearance,
so the text does not depend on how many IDs the process created before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfuse.ir.iter_domain import IterDomain, Merge, Split, format_id
from meshfuse.ir.placement import placements
from meshfuse.ir.tensor_view import Allocation, Scalar, TensorView, Val

if TYPE_CHECKING:
    from meshfuse.ir.fusion import Expr, Fusion


class Numbering:
    """Assigns printout-local numbers to IDs in order of first appearance."""

    def __init__(self) -> None:
        self._numbers: dict[IterDomain, int] = {}

    def __call__(self, id_: IterDomain) -> int:
        return self._numbers.setdefault(id_, len(self._numbers))


def _ids(tv: TensorView, ids, numbering: Numbering) -> str:
    return "[" + ", ".join(format_id(i, tv.parallel_type(i), numbering(i)) for i in ids) + "]"


def _transform(tv: TensorView, t, numbering: Numbering) -> str:
    def f(i):
        return format_id(i, tv.parallel_type(i), numbering(i))

    if isinstance(t, Split):
        kind = "inner" if t.inner_split else "zigzag" if t.zigzag else "outer"
        return f"{kind}_split({f(t.in_id)}, {t.factor}) -> {f(t.outer)}, {f(t.inner)}"
    assert isinstance(t, Merge)
    return f"merge({f(t.outer)}, {f(t.inner)}) -> {f(t.out)}"


def format_placements(tv: TensorView) -> str:
    """One placement per mesh axis, outermost first, as in DTensor: ``S(a)`` sharded on
    logical axis ``a`` (``S(a)c`` cyclically, from an inner split; ``S(a)z`` in head-tail
    chunk pairs, from a zig-zag split), ``P`` partial (a reduction
    over a sharded axis), ``R`` replicated."""
    return "[" + ", ".join(str(p) for p in placements(tv)) + "]"


def format_tensor(
    tv: TensorView,
    numbering: Numbering | None = None,
    allocation: Allocation | None = None,
) -> str:
    """A tensor's dtype, mesh, and domains, one per line."""
    numbering = numbering or Numbering()
    allocation = allocation or tv.allocation
    mesh = "" if tv.mesh is None else f" mesh={tv.mesh!r}"
    lines = [f"{tv.name} {tv.dtype.name}{mesh}", f"  logical: {_ids(tv, tv.logical, numbering)}"]
    for t in tv.transforms:
        lines.append(f"  {_transform(tv, t, numbering)}")
    if tv.loop != list(tv.logical):
        lines.append(f"  loop: {_ids(tv, tv.loop, numbering)}")
    if tv.mesh is not None:
        lines.append(f"  sharding: {format_placements(tv)}")
    if allocation is not None:
        flags = "".join("t" if c else "n" if c is None else "f" for c in allocation.contiguity)
        lines.append(f"  allocation: {_ids(tv, allocation.ids, numbering)} contiguity: {flags}")
    return "\n".join(lines)


def format_arg(arg) -> str:
    if isinstance(arg, Scalar) and arg.is_constant:
        return repr(arg.value)
    if isinstance(arg, Val):
        return arg.name
    if isinstance(arg, list | tuple) and arg and all(isinstance(a, Val) for a in arg):
        return "[" + ", ".join(a.name for a in arg) + "]"
    return repr(arg)


def format_expr(expr: Expr) -> str:
    outs = ", ".join(o.name for o in expr.outputs)
    if expr.op is None:  # a Reshard (a communication): ``T5 = reshard(T4, [S(0)] -> [R])``
        src, dst = expr.source_mesh, expr.target_mesh
        before = "[" + ", ".join(map(str, expr.source)) + "]"
        after = "[" + ", ".join(map(str, expr.target)) + "]"
        if src != dst:
            before, after = f"{src!r} {before}", f"{dst!r} {after}"
        return f"{outs} = reshard({expr.args[0].name}, {before} -> {after})"
    return f"{outs} = {format_call(expr)}"


def format_call(expr: Expr, skip_defaults: bool = False) -> str:
    """``op(args)``; with ``skip_defaults``, arguments left at their default are left out
    (those after one left out are named)."""
    args, named = [], False
    for p, a in zip(expr.op.params, expr.args):
        if skip_defaults and _is_default(p, a):
            named = True
            continue
        positional = p.kind.value in ("tensor", "tensors", "operand", "scalar") and not named
        args.append(format_arg(a) if positional else f"{p.name}={format_arg(a)}")
    return f"{expr.op.name}({', '.join(args)})"


def _is_default(param, arg) -> bool:
    if param.required:
        return False
    value = arg.value if isinstance(arg, Scalar) and arg.is_constant else arg
    if isinstance(value, Val):
        return False
    return value is param.default or (type(value) is type(param.default) and
                                      value == param.default)


def format_fusion(fusion: Fusion, allocations: dict | None = None) -> str:
    """The whole fusion: inputs, ops in order, outputs, then every tensor's domains."""
    numbering = Numbering()
    lines = ["Fusion"]
    for v in fusion.inputs():
        kind = f"scalar {v.dtype.name}" if isinstance(v, Scalar) else "tensor"
        lines.append(f"  input {v.name}: {kind}")
    for e in fusion.exprs:
        lines.append(f"  {format_expr(e)}")
    lines.append("  outputs: " + ", ".join(o.name for o in fusion.outputs()))
    for tv in fusion.tensors():
        alloc = (allocations or {}).get(tv)
        lines.append(format_tensor(tv, numbering, alloc))
    return "\n".join(lines)
