"""The op reference page, ``docs/ops.md``, generated from the op registry.

``python -m meshfuse.op_reference > docs/ops.md`` writes it: every registered op (grouped by
the module that declares it) with its signature, what it does (its declaration's ``doc``),
its sharding rule in one line (``sharding``, or one derived from the declaration's other
fields) and whether it has a VJP; then the composites (``fd.ops.rms_norm``...) with their
docstrings, and the helpers of ``fd.ops``. The text depends only on the declarations (ops
sorted by name), so a test compares the page with :func:`reference` and a new op without an
entry fails it until the command is run again.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

from meshfuse.ops import REGISTRY, OpDef
from meshfuse.ops.composites import COMPOSITES
from meshfuse.ops.namespace import Ops

COMMAND = "python -m meshfuse.op_reference > docs/ops.md"

_HEADER = f"""# Op reference

<!-- Generated from the op registry by `{COMMAND}`; edit the ops'
declarations (their `doc=` and `sharding=`) or the composites' docstrings, not this page. -->

Every op of `fd.ops`, as declared in `meshfuse/ops/` (see [design.md](design.md), "Where to
add"). For each: its signature (arguments after `x` with a default may be passed by name),
what it does, how its sharding follows from its domain map (which output axis comes from
which input axis; [sharding.md](sharding.md) explains propagation), and whether it has a
VJP, which `meshfuse.vjp` and `fd.as_autograd_function()` use ([autodiff.md](autodiff.md)).
"Recomputed" ops are cheap enough that a derived backward computes them again instead of
saving their results. Every op and composite also takes `name=`, which names its result in
prints, `explain`, errors and a derived backward ([explain.md](explain.md)).
"""

_FAMILIES = {
    "pointwise": "Pointwise",
    "reductions": "Reductions",
    "linalg": "Matrix products",
    "shape": "Shape",
    "slicing": "Windows and concatenation",
    "attention": "Attention",
    "random": "Random numbers",
}


_HELPERS = ("meta", "namespace", "registry", "shape_rules")  # modules no op is declared in


def family(op: OpDef) -> str:
    """The module (or package) of ``meshfuse.ops`` that declares ``op`` (``pointwise``,
    ``attention``): where its shape rule is written, or its implementation when the rule is
    a shared helper's."""
    for fn in (op.infer, op.impl, op.make_impl):
        module = getattr(fn, "__module__", None) or ""
        if module.startswith("meshfuse.ops."):
            name = module.removeprefix("meshfuse.ops.").split(".")[0]
            if name not in _HELPERS:
                return name
    return "other"


def sharding_line(op: OpDef) -> str:
    """The op's sharding rule in one line: its declared ``sharding``, else one derived from
    its declaration."""
    if op.sharding:
        return op.sharding
    parts = ["each output axis is sharded as the input axes it maps from"]
    if op.whole_axes is not None:
        parts.append("the axes it needs whole are gathered first")
    if op.partial_reduce is None:
        parts.append("a sharded reduced axis is gathered first (no partial result)")
    if op.check_sharding is not None:
        parts.append("some shardings are refused (ShardingError)")
    if op.replays is not None:
        parts.append("it is computed as the forward it replays was sharded")
    return "; ".join(parts)


def vjp_cell(op: OpDef) -> str:
    """Whether the op has a VJP, and how a derived backward treats it."""
    if op.vjp is None:
        return "no"
    if op.vjp.differentiable == ():
        return "constant (no gradient flows)"
    notes = [n for n, on in (("recomputed", op.vjp.recompute),
                             ("transposed communication", op.vjp.communication)) if on]
    return "yes" + (f" ({', '.join(notes)})" if notes else "")


def _cell(text: str) -> str:
    """``text`` on one line, as markdown: reStructuredText's roles and double backquotes of
    docstrings made plain code spans, ``|`` escaped for the table."""
    text = _ROLE.sub(lambda m: f"`{m.group(1).split('.')[-1]}`", " ".join(text.split()))
    return text.replace("``", "`").replace("|", "\\|")


_ROLE = re.compile(r":\w+:`~?([\w.]+)`")


def _where(fam: str) -> str:
    """The repository path of family ``fam``: a module, or a package."""
    package = Path(__file__).parent / "ops" / fam
    return f"meshfuse/ops/{fam}/" if package.is_dir() else f"meshfuse/ops/{fam}.py"


def _ops_tables() -> list[str]:
    by_family: dict[str, list[OpDef]] = {}
    for name in sorted(REGISTRY):
        by_family.setdefault(family(REGISTRY[name]), []).append(REGISTRY[name])
    order = [f for f in _FAMILIES if f in by_family] + sorted(set(by_family) - set(_FAMILIES))
    lines = []
    for fam in order:
        where = "" if fam == "other" else f" (`{_where(fam)}`)"
        lines += ["", f"## {_FAMILIES.get(fam, fam.capitalize())}{where}", "",
                  "| op | signature | what it does | sharding | VJP |", "|---|---|---|---|---|"]
        for op in by_family[fam]:
            lines.append(f"| `{op.name}` | `{_cell(op.signature())}` | {_cell(op.doc) or '-'} "
                         f"| {_cell(sharding_line(op))} | {vjp_cell(op)} |")
    return lines


def _docstring(fn) -> str:
    """The first paragraph of ``fn``'s docstring, on one line."""
    doc = inspect.getdoc(fn) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _signature(name: str, fn, skip: int) -> str:
    params = [p.replace(annotation=inspect.Parameter.empty)
              for p in list(inspect.signature(fn).parameters.values())[skip:]]
    return f"{name}({', '.join(str(p) for p in params)})"


def _composites() -> list[str]:
    lines = ["", "## Composites (`meshfuse/ops/composites.py`)", "",
             ("Written with the ops above: their sharding follows from those ops' rules and "
              "their gradient from those ops' VJPs."), "",
             "| composite | signature | what it does |", "|---|---|---|"]
    for name in sorted(COMPOSITES):
        fn = COMPOSITES[name]
        lines.append(f"| `{name}` | `{_cell(_signature(name, fn, 1))}` "
                     f"| {_cell(_docstring(fn))} |")
    lines += ["", "## Helpers of `fd.ops`", "", "| helper | signature | what it does |",
              "|---|---|---|"]
    for name in ("shape", "size"):
        fn = getattr(Ops, name)
        lines.append(f"| `{name}` | `{_cell(_signature(name, fn, 1))}` "
                     f"| {_cell(_docstring(fn))} |")
    return lines


def reference() -> str:
    """The text of ``docs/ops.md``."""
    text = "\n".join([_HEADER.rstrip("\n"), *_ops_tables(), *_composites()]) + "\n"
    return re.sub(r" +\n", "\n", text)


def undocumented() -> list[str]:
    """The ops without a ``doc`` and the composites without a docstring."""
    return sorted([f"op {n}" for n, op in REGISTRY.items() if not op.doc.strip()] +
                  [f"composite {n}" for n, fn in COMPOSITES.items() if not _docstring(fn)])


if __name__ == "__main__":
    sys.stdout.write(reference())
