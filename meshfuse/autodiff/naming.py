"""Names of a derived backward's tensors, after the forward values they stand for.

A backward built by :mod:`meshfuse.autodiff.derivation` names its tensors so that a user
reading ``print(meshfuse.vjp(fd))``, ``bwd.explain()`` or an error can tell what each is:

- a forward value the backward reads (a residual input, or a cheap op recomputed) keeps its
  forward name: ``x``, ``wq``, ``T3``;
- the gradient of a forward value ``v`` is ``grad_v`` (a cotangent input ``grad_T5``, an
  input's gradient ``grad_wq``, an intermediate's complete gradient ``grad_T4``);
- a transpose of a named tensor (the last two axes swapped) is ``name.T``: ``x.T``,
  ``grad_T5.T``;
- any other tensor that a derivative rule makes on its way to ``grad_v`` is a step of it,
  numbered in program order: ``grad_v.1``, ``grad_v.2``, ...

Names come from the forward's names, so a tensor named by ``define_tensor(name=...)`` (or
after a ``FusionModule`` parameter) gives its gradient's name: ``grad_wq``.
"""

from __future__ import annotations

from meshfuse.ir.fusion import Expr, Fusion
from meshfuse.ir.tensor_view import TensorView


def gradient_name(name: str) -> str:
    """The name of the gradient of a value named ``name``."""
    return f"grad_{name}"


class BackwardNames:
    """What the backward builder knows of each tensor it makes; :meth:`apply` names them.

    Priority, highest first: forward values and cotangents (:meth:`value`), the gradients
    the backward returns, the complete gradients of forward values (:meth:`gradient`), a
    transpose of a named tensor, a step of a gradient (:meth:`steps`).
    """

    def __init__(self, backward: Fusion) -> None:
        self.backward = backward
        self.fixed: dict[TensorView, str] = {}
        self.outputs: dict[TensorView, str] = {}
        self.complete: dict[TensorView, str] = {}
        self.step_of: dict[Expr, str] = {}

    def value(self, tv: TensorView, name: str) -> None:
        """``tv`` is the forward value ``name`` (or, named ``grad_...``, a cotangent)."""
        self.fixed.setdefault(tv, name)

    def gradient(self, tv: TensorView, primal: TensorView, output: bool = False) -> None:
        """``tv`` is the complete gradient of forward value ``primal`` (``output``: the one
        the backward returns)."""
        names = self.outputs if output else self.complete
        names.setdefault(tv, gradient_name(primal.name))

    def mark(self) -> int:
        """Where the next expression of the backward will be; see :meth:`steps`."""
        return len(self.backward.exprs)

    def steps(self, start: int, primal_name: str) -> None:
        """The expressions added since :meth:`mark` returned ``start`` compute the gradient
        of the forward value ``primal_name``."""
        for expr in self.backward.exprs[start:]:
            self.step_of.setdefault(expr, gradient_name(primal_name))

    def apply(self) -> None:
        """Names every tensor of the backward (see the module doc), each name once."""
        fusion = self.backward
        taken: set[str] = set()
        named: dict[TensorView, str] = {}
        for table in (self.fixed, self.outputs, self.complete):
            for tv, name in table.items():
                if tv not in named and name not in taken:
                    named[tv] = name
                    taken.add(name)
        counts: dict[str, int] = {}
        for expr in fusion.exprs:
            for tv in expr.tensor_outputs:
                if tv in named:
                    continue
                name = _transpose_name(expr, named)
                if (name is None or name in taken) and expr in self.step_of:
                    base = self.step_of[expr]
                    counts[base] = counts.get(base, 0) + 1
                    name = f"{base}.{counts[base]}"
                if name is not None and name not in taken:
                    named[tv] = name
                    taken.add(name)
        for tv, name in named.items():
            fusion.set_name(tv, name)
        given = fusion.given_names()
        for tv in fusion.tensors():  # an automatic name that a given one now shadows
            if tv not in named and tv.name in given:
                fusion.name(tv)


def _transpose_name(expr: Expr, named: dict[TensorView, str]) -> str | None:
    """``name.T`` for a permute that swaps the last two axes of a named tensor."""
    if getattr(expr.op, "name", None) != "permute":
        return None
    source = expr.args[0]
    dims = list(expr.attrs.get("dims", expr.args[1] if len(expr.args) > 1 else ()))
    n = len(dims)
    if source not in named or n < 2 or dims != [*range(n - 2), n - 1, n - 2]:
        return None
    return f"{named[source]}.T"
