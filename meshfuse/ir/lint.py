"""``lint(fusion)``: the structural invariants of a fusion graph, checked between passes.

Like torch.fx's ``Graph.lint``: the compiler runs it after each build pass when asked to
(``compile(..., lint=True)``, as the tests do), so a pass that leaves the graph inconsistent
is caught where it did, not by a wrong value later. A violation is an internal error
(``AssertionError`` naming the pass, the expression and what is wrong), never a user error.
"""

from __future__ import annotations

from meshfuse.ir.fusion import Fusion, Reshard
from meshfuse.ir.printer import format_expr
from meshfuse.ir.tensor_view import Scalar, TensorView, Val


def lint(fusion: Fusion, after: str = "") -> None:
    """Checks that ``fusion`` is a well-formed graph:

    - expressions are in a topological order: each reads fusion inputs, constants or values
      defined by an earlier expression, and each value is defined once, by the expression
      its ``definition`` names;
    - each domain map goes from output logical IDs to logical IDs of the inputs;
    - a communication moves one scheduled tensor to another of the same logical rank;
    - the fusion's outputs are defined.
    """
    where = f" after {after}" if after else ""
    defined: set[Val] = set(fusion.inputs())
    for expr in fusion.exprs:
        text = format_expr(expr)
        for v in expr.inputs:
            _check(v in defined or (isinstance(v, Scalar) and v.is_constant),
                   f"{text}{where}: reads {v.name} before it is defined")
        for out in expr.outputs:
            _check(out not in defined, f"{text}{where}: {out.name} is defined twice")
            _check(out.definition is expr,
                   f"{text}{where}: {out.name}'s definition is another expression")
            defined.add(out)
        outputs = {i for o in expr.tensor_outputs for i in o.logical}
        inputs = {i for t in expr.tensor_inputs for i in t.logical}
        for out_id, sources in expr.id_map.items():
            _check(out_id in outputs, f"{text}{where}: its domain map names an ID of no output")
            _check(all(s in inputs for s in sources),
                   f"{text}{where}: its domain map names an ID of no input")
        if isinstance(expr, Reshard):
            src, dst = expr.args[0], expr.outputs[0]
            _check(isinstance(src, TensorView) and isinstance(dst, TensorView) and
                   len(src.logical) == len(dst.logical) and src.mesh is not None and
                   dst.mesh is not None,
                   f"{text}{where}: a communication moves one scheduled tensor to another")
    for out in fusion.outputs():
        _check(out in defined, f"output {out.name}{where} is not defined by the fusion")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"internal error (lint): {message}")
