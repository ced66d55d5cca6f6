"""``VjpContext``: what an op's derivative rule sees of one application of the op.

A rule (``OpDef.vjp.rule``, declared next to the op) reads the primal expression through this
object and adds the ops of its gradient to the backward fusion through ``d.ops``. Primal values
are fetched lazily with ``d.value`` / ``d.out``: the derivation decides whether each comes from
a saved residual or is recomputed in the backward (see :mod:`meshfuse.autodiff.derivation`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from meshfuse.errors import DefinitionError
from meshfuse.ir.fusion import Expr, Reshard
from meshfuse.ir.placement import shard_signature
from meshfuse.ir.tensor_view import TensorView, Val
from meshfuse.ops.registry import OpDef, lookup

if TYPE_CHECKING:
    from meshfuse.ops.namespace import Ops


def op_of(expr: Expr) -> OpDef:
    """The op whose rules differentiate ``expr``: a communication (a :class:`Reshard` of the
    compiled forward) differentiates as the copy it is, ``set``: its gradient is the
    transposed communication."""
    return lookup("set") if isinstance(expr, Reshard) else expr.op


class VjpContext:
    """One primal expression, seen from the backward fusion being built.

    Attributes:
        ops: the ``fd.ops`` namespace of the backward fusion.
        expr: the primal expression (its arguments, outputs and attributes, global shapes).
    """

    def __init__(self, expr: Expr, ops: Ops, fetch) -> None:
        self.expr = expr
        self.ops = ops
        self._fetch = fetch
        self._names = [p.name for p in op_of(expr).params]

    @property
    def attrs(self) -> dict[str, Any]:
        """The op's static arguments (dims, shapes, flags) by name."""
        return self.expr.attrs

    def arg(self, name: str) -> Any:
        """The primal argument ``name``: a TensorView or Scalar of the forward, or a constant."""
        return self.expr.args[self._names.index(name)]

    def value(self, name_or_val: str | Any) -> Any:
        """The backward fusion's value of primal argument ``name`` (or of a primal value):
        a residual input, a recomputation, or a constant passed through."""
        v = self.arg(name_or_val) if isinstance(name_or_val, str) else name_or_val
        return self._fetch(v) if isinstance(v, Val) else v

    def out(self, index: int = 0) -> TensorView:
        """The backward fusion's value of primal output ``index``."""
        return self._fetch(self.expr.outputs[index])

    def is_tensor(self, name: str) -> bool:
        return isinstance(self.arg(name), TensorView)

    def ndim(self, name_or_tv: str | TensorView) -> int:
        tv = self.arg(name_or_tv) if isinstance(name_or_tv, str) else name_or_tv
        return len(tv.materialized())

    def shape(self, name_or_tv: str | TensorView) -> list[int]:
        """The static global extents of a primal tensor (its materialized axes).

        Raises DefinitionError for a symbolic extent: the gradient of this op needs it.
        """
        tv = self.arg(name_or_tv) if isinstance(name_or_tv, str) else name_or_tv
        extents = [i.extent for i in tv.materialized()]
        if None in extents:
            raise DefinitionError(
                f"the gradient of {op_of(self.expr).name} needs the extents of {tv.name}, which are "
                f"symbolic ({['?' if e is None else e for e in extents]}); declare the fusion's "
                "inputs with static extents to differentiate it"
            )
        return extents

    def is_broadcast_of_one(self, name_or_tv: str | TensorView, axis: int) -> bool:
        """Whether ``axis`` of a primal tensor is a broadcast axis of extent 1 (or unknown):
        not an expanded one, whose elements each have their gradient (see :func:`sum_to`)."""
        tv = self.arg(name_or_tv) if isinstance(name_or_tv, str) else name_or_tv
        id_ = tv.materialized()[axis]
        return id_.is_broadcast and id_.extent in (1, None)

    def is_sharded(self, name_or_tv: str | TensorView, axis: int) -> bool:
        """Whether materialized ``axis`` of a primal tensor is split over devices (in the
        compiled forward, whose shardings the backward's residuals keep)."""
        tv = self.arg(name_or_tv) if isinstance(name_or_tv, str) else name_or_tv
        return tv.mesh is not None and bool(shard_signature(tv, tv.materialized()[axis]))

    def sum_to(self, grad: TensorView, like: TensorView) -> TensorView:
        """``grad`` summed down to ``like``'s shape (see :func:`sum_to`)."""
        return sum_to(self.ops, grad, like)

    def reduced_count(self) -> int:
        """The number of elements reduced into one element of the first output."""
        count = 1
        for id_ in self.expr.outputs[0].logical:
            if id_.is_reduction:
                if id_.extent is None:
                    self.shape(self.expr.tensor_inputs[0])  # raises, naming the input
                count *= id_.extent
        return count


def sum_to(ops: Ops, grad: TensorView, like: TensorView) -> TensorView:
    """``grad`` (the gradient of a result broadcast from ``like``) summed over the leading
    axes ``like`` lacks and over the axes where ``like`` is broadcast, cast to its dtype.

    Not over an expanded broadcast axis of ``like`` (extent above 1): as a tensor, ``like``
    has that many elements there (a stride-0 view in PyTorch), each with its own gradient;
    they are summed where the axis was made (``broadcast_in_dim``'s rule), once. Likewise
    an expanded broadcast axis of ``grad`` holds that many gradients (equal ones), summed
    like an iteration axis's."""
    axes, target = grad.materialized(), like.materialized()
    lead = len(axes) - len(target)
    if lead > 0:
        grad = ops.sum(grad, dims=list(range(lead)))
    dims = [a for a, (id_, g) in enumerate(zip(target, grad.materialized()))
            if id_.is_broadcast and id_.extent in (1, None) and g.extent != 1]
    if dims:
        grad = ops.sum(grad, dims=dims, keepdim=True)
    return cast_to(ops, grad, like.dtype)


def materialized_like(ops: Ops, grad: TensorView, like: TensorView) -> TensorView:
    """``grad`` with an iteration axis wherever ``like`` has one: a gradient that is an
    expanded broadcast along an axis of ``like`` (the gradient of a sum or a mean over it)
    becomes an iteration axis there (a stride-0 view still), so that it can be pinned to
    ``like``'s sharding (a broadcast axis cannot be sharded over several devices)."""
    axes, target = grad.materialized(), like.materialized()
    if not any(g.is_broadcast and not t.is_broadcast for g, t in zip(axes, target)):
        return grad
    shape = [t.extent if g.is_broadcast and not t.is_broadcast else -1
             for g, t in zip(axes, target)]
    return ops.broadcast_in_dim(grad, shape, list(range(len(shape))))


def cast_to(ops: Ops, grad: TensorView, dtype) -> TensorView:
    """``grad`` as ``dtype``, without a new cast where one is not needed: a gradient that is
    an exact widening of a ``dtype`` value (bf16 -> float32, as the gradient of a float32
    sum of bf16 values is) is that value, and a cast of ``grad`` to ``dtype`` already in the
    backward is reused (several consumers of one value in the forward)."""
    if grad.dtype is dtype:
        return grad
    source = _widened_from(grad)
    if source is not None and source.dtype is dtype:
        return source
    for use in grad.fusion.uses().get(grad, ()):
        if getattr(use.op, "name", None) == "cast" and use.outputs[0].dtype is dtype:
            return use.outputs[0]
    return ops.cast(grad, dtype)


def _widened_from(tv: TensorView) -> TensorView | None:
    """The argument of the cast defining ``tv`` when that cast is an exact floating-point
    widening (every value of the argument's dtype is one of ``tv``'s), else None."""
    expr = tv.definition
    if expr is None or getattr(expr.op, "name", None) != "cast":
        return None
    source = expr.args[0]
    if not isinstance(source, TensorView):
        return None
    narrow, wide = source.dtype.torch_dtype, tv.dtype.torch_dtype
    if not (narrow.is_floating_point and wide.is_floating_point) or narrow.is_complex:
        return None
    a, b = torch.finfo(narrow), torch.finfo(wide)
    exact = b.bits > a.bits and b.eps <= a.eps and b.max >= a.max and b.tiny <= a.tiny
    return source if exact else None
