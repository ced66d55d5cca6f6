"""Helpers shared by the shape rules of the op declarations."""

from __future__ import annotations

import torch

from meshfuse.dtypes import DataType, dtype_of_number
from meshfuse.errors import DefinitionError
from meshfuse.ir.iter_domain import IterType
from meshfuse.ops.registry import AxisSpec, ScalarMeta, SymbolicSize, TensorMeta


def normalize_axis(op: str, axis: int, ndim: int, what: str = "axis") -> int:
    """``axis`` in ``[-ndim, ndim)`` made non-negative, or a DefinitionError."""
    if not isinstance(axis, int) or isinstance(axis, bool) or not -ndim <= axis < ndim:
        raise DefinitionError(
            f"{op}: {what} {axis!r} is out of range for a tensor of {ndim} axes; use an int "
            f"in [{-ndim}, {ndim})"
        )
    return axis % ndim


def int_list(op: str, what: str, value, sizes: bool = False) -> list:
    """``value`` as a list of ints, or a DefinitionError naming the argument. With ``sizes``,
    entries may also be :class:`SymbolicSize` s (symbolic extents given as shape entries)."""
    items = list(value) if isinstance(value, list | tuple) else None
    allowed = (int, SymbolicSize) if sizes else int
    if items is None or not all(isinstance(v, allowed) and not isinstance(v, bool)
                                for v in items):
        raise DefinitionError(f"{op}: {what} must be a list of ints, got {value!r}")
    return items


def normalize_axes(op: str, axes, ndim: int) -> tuple[int, ...]:
    """A sorted tuple of distinct non-negative axes; ``None`` means all axes."""
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, int):
        axes = [axes]
    result = sorted({normalize_axis(op, a, ndim) for a in axes})
    if len(result) != len(list(axes)):
        raise DefinitionError(f"{op}: axes {list(axes)} name an axis twice")
    return tuple(result)


def require_tensor(op: str, name: str, meta) -> TensorMeta:
    if not isinstance(meta, TensorMeta):
        raise DefinitionError(f"{op}: argument {name!r} must be a tensor, got {meta!r}")
    return meta


def _sample(meta) -> torch.Tensor | bool | int | float:
    """A stand-in for type promotion: a 1-element tensor for a tensor, a Python value for a
    scalar (so that scalars promote as PyTorch's Python scalars do)."""
    if isinstance(meta, TensorMeta):
        return torch.empty((1,) * min(meta.ndim, 1), dtype=meta.dtype.torch_dtype,
                           device="meta")
    dtype = meta.dtype if isinstance(meta, ScalarMeta) else dtype_of_number(meta)
    if dtype is None:
        raise DefinitionError(f"unsupported operand {meta!r}: use a tensor, a Scalar or a number")
    if dtype is DataType.Bool:
        return True
    if dtype.is_floating:
        return 1.0
    if dtype.torch_dtype.is_complex:
        return 1j
    return 1


def promote(*operands) -> DataType:
    """The result dtype of a pointwise op over ``operands``, by PyTorch's promotion rules
    (Python numbers and meshfuse Scalars promote like Python scalars)."""
    samples = [_sample(m) for m in operands]
    tensors = [s for s in samples if isinstance(s, torch.Tensor)]
    if not tensors:
        return DataType.from_torch(torch.tensor(samples[0]).dtype if len(samples) == 1 else
                                   torch.result_type(torch.tensor(samples[0]), samples[1]))
    # PyTorch's (and nvFuser's) categories: tensors with axes decide over 0-d tensors,
    # which decide over Python scalars, unless a lower one is of a higher kind (float over
    # integer).
    dimensioned = _promoted([t.dtype for t in tensors if t.ndim])
    zero_dim = _promoted([t.dtype for t in tensors if not t.ndim])
    lower = None
    if zero_dim is not None:
        lower = torch.empty((), dtype=zero_dim, device="meta")
    for s in samples:
        if not isinstance(s, torch.Tensor):
            lower = torch.tensor(s).to("meta") if lower is None else \
                torch.empty((), dtype=torch.result_type(lower, s), device="meta")
    if dimensioned is None:
        return DataType.from_torch(lower.dtype)
    higher = torch.empty(1, dtype=dimensioned, device="meta")
    return DataType.from_torch(higher.dtype if lower is None else
                               torch.result_type(higher, lower))


def _promoted(dtypes: list[torch.dtype]) -> torch.dtype | None:
    result = None
    for d in dtypes:
        result = d if result is None else torch.promote_types(result, d)
    return result


def broadcast_axes(op: str, args: list) -> tuple[AxisSpec, ...]:
    """The output axes of a pointwise op: tensor arguments aligned on the right, extents
    checked equal where neither is a broadcast axis. A broadcast axis broadcasts against any
    extent, expanded ones (extent above 1) included; where all are broadcast axes the
    output's is one too, of their expanded extent.

    Sources are the non-broadcast input axes (all inputs' axes where every one is broadcast).
    """
    tensors = list(enumerate(m for m in args if isinstance(m, TensorMeta)))
    ndim = max((m.ndim for _, m in tensors), default=0)
    axes = []
    for out_axis in range(ndim):
        real, bcast = [], []
        for pos, m in tensors:
            axis = out_axis - (ndim - m.ndim)
            if axis < 0:
                continue
            (bcast if m.is_broadcast(axis) else real).append((pos, axis, m.shape[axis]))
        static = {e for _, _, e in real if e is not None}
        if len(static) > 1:
            detail = ", ".join(f"argument {p} axis {a} has extent {e}" for p, a, e in real)
            raise DefinitionError(
                f"{op}: operands do not broadcast on output axis {out_axis}: {detail}; make the "
                "extents equal or make one of them a broadcast axis (extent 1)"
            )
        if real:
            extent = next(iter(static)) if static else None
            axes.append(AxisSpec(extent, IterType.Iteration, tuple((p, a) for p, a, _ in real)))
        else:
            axes.append(AxisSpec(_expanded_extent(op, out_axis, bcast), IterType.Broadcast,
                                 tuple((p, a) for p, a, _ in bcast)))
    return tuple(axes)


def _expanded_extent(op: str, out_axis: int, bcast: list) -> int:
    """The extent of an output axis where every operand's is a broadcast axis: 1, or the
    expanded extent the expanded ones (``broadcast_in_dim``'s new axes) agree on."""
    expanded = {e for _, _, e in bcast if e not in (1, None)}
    if len(expanded) > 1:
        detail = ", ".join(f"argument {p} axis {a} is expanded to {e}" for p, a, e in bcast)
        raise DefinitionError(
            f"{op}: broadcast axes expanded to different extents meet on output axis "
            f"{out_axis}: {detail}; expand them alike"
        )
    return expanded.pop() if expanded else 1


def carried_partials(args: list) -> tuple[AxisSpec, ...]:
    """The reduction axes of the output of an op linear in its tensor arguments (``add``,
    ``sub``): reduction axis ``k`` of the output maps to
    reduction axis ``k`` of each tensor argument, when every one has as many (else none).

    So where every argument holds partial sums over one mesh axis, the output holds partial
    sums too (their sum is the sum of the reductions) and one reduction follows instead of
    one per argument; sharding propagation keeps the output partial only then.
    """
    tensors = [(pos, m) for pos, m in enumerate(a for a in args if isinstance(a, TensorMeta))]
    counts = {len(m.partial_axes) for _, m in tensors}
    if len(counts) != 1 or len(tensors) < len(args):
        return ()  # a number or scalar added to partial sums would be counted on every device
    return tuple(AxisSpec(tensors[0][1].partial_axes[k], IterType.Reduction,
                          tuple((pos, m.ndim + k) for pos, m in tensors))
                 for k in range(counts.pop()))


def same_axes(pos: int, meta: TensorMeta) -> tuple[AxisSpec, ...]:
    """Output axes identical to (and mapped from) tensor argument ``pos``."""
    return tuple(
        AxisSpec(e, t, ((pos, a),)) for a, (e, t) in enumerate(zip(meta.shape, meta.iter_types))
    )
