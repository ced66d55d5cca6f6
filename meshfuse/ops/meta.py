"""What a shape rule sees of the arguments of an expression: metadata of IR values.

Used where an op is added to a fusion (global extents, possibly symbolic) and where execute
binds concrete extents and runs the shape rules again.
"""

from __future__ import annotations

from typing import Any

from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.tensor_view import Scalar, TensorView
from meshfuse.ops.registry import ScalarMeta, TensorMeta


def tensor_meta(tv: TensorView) -> TensorMeta:
    """A tensor's materialized axes (global extents, kinds), dtype and reduction axes."""
    ids = tv.materialized()
    return TensorMeta(tuple(i.extent for i in ids), tuple(i.iter_type for i in ids), tv.dtype,
                      tuple(i.extent for i in reduction_ids(tv)))


def reduction_ids(tv: TensorView) -> tuple[IterDomain, ...]:
    """The reduction IDs of ``tv``'s logical domain, in order (``TensorMeta.partial_axes``)."""
    return tuple(i for i in tv.logical if i.is_reduction)


def source_ids(tv: TensorView) -> tuple[IterDomain, ...]:
    """``tv``'s IDs as shape rules number their axes: the materialized ones, then the
    reduction ones."""
    return tv.materialized() + reduction_ids(tv)


def arg_meta(arg: Any) -> Any:
    """What a shape rule sees of one argument."""
    if isinstance(arg, TensorView):
        return tensor_meta(arg)
    if isinstance(arg, Scalar):
        return ScalarMeta(arg.dtype, arg.value)
    if isinstance(arg, list | tuple) and arg and all(isinstance(a, TensorView) for a in arg):
        return [tensor_meta(a) for a in arg]
    return arg
