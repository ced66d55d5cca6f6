"""``fd.ops``: every registered op as a method that adds it to the fusion."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshfuse.dtypes import DataType, dtype_of_number
from meshfuse.errors import DefinitionError
from meshfuse.ir.fusion import Expr, checked_name
from meshfuse.ir.iter_domain import IterDomain
from meshfuse.ir.tensor_view import Scalar, TensorView, Val
from meshfuse.ops import registry
from meshfuse.ops.composites import COMPOSITES
from meshfuse.ops.meta import arg_meta, source_ids
from meshfuse.ops.registry import Kind, OpDef, SymbolicSize
from meshfuse.ops.shape import memory_order
from meshfuse.ops.shape_rules import normalize_axis
from meshfuse.ops.user_tensor import UserTensorView

if TYPE_CHECKING:
    from meshfuse.ir.fusion import Fusion

_NUMBER = (bool, int, float, complex)


def flat_tensors(args) -> list[TensorView]:
    """The tensor arguments in signature order, lists flattened (the order of ``sources``)."""
    flat: list[TensorView] = []
    for a in args:
        if isinstance(a, TensorView):
            flat.append(a)
        elif isinstance(a, list | tuple):
            flat.extend(x for x in a if isinstance(x, TensorView))
    return flat


class Ops:
    """The namespace ``fd.ops``: ``fd.ops.add(a, b)``, ``fd.ops.sdpfa_fwd(q, k, v, ...)``.

    Every op and composite also takes ``name=``: ``fd.ops.linear(x, wq, name="q")`` names
    its result ``q`` (a list names the outputs of an op of several; see ``_named``)."""

    def __init__(self, fusion: Fusion):
        self._fusion = fusion

    def __getattr__(self, name: str):
        if name in COMPOSITES:  # written with the ops below (meshfuse.ops.composites)
            composite = COMPOSITES[name]
            return lambda *args, name=None, **kwargs: self._named(
                composite(self, *args, **kwargs), name, composite.__name__)
        op = registry.lookup(name)

        def call(*args, name=None, **kwargs):
            return self._named(add_op(self._fusion, op, args, kwargs), name, op.name)

        call.__name__ = name
        call.__doc__ = f"{op.signature()}: {op.doc}"
        return call

    def _named(self, result, names, op: str):
        """``result`` (an op's output, or tuple of outputs) named as ``name=`` asked: a
        string names a single output; a list gives one name (or None) per output. Names
        are what prints, ``explain``, errors and a derived backward (``grad_h``) call it."""
        if names is None:
            return result
        outputs = result if isinstance(result, tuple) else (result,)
        names = [names] if isinstance(names, str) else list(names)
        if len(names) != len(outputs):
            raise DefinitionError(
                f"{op}: name={names!r} gives {len(names)} names to {len(outputs)} outputs; "
                "give a string for one output, a list of one name (or None) per output"
            )
        for out, given in zip(outputs, names):
            if given is not None:
                self._fusion.set_name(out, checked_name(given, op))
        return result

    def __dir__(self):
        return sorted([*registry.REGISTRY, *COMPOSITES, "shape", "size"])

    def size(self, tv: TensorView, dim: int) -> int | SymbolicSize:
        """The global extent of axis ``dim`` of ``tv``: an int when static, else a
        :class:`~meshfuse.ops.registry.SymbolicSize` that shape arguments take
        (``broadcast_in_dim(w, shape=[fd.ops.size(x, 0), 8], ...)``, a ``slice`` end)."""
        if not isinstance(tv, TensorView):
            raise DefinitionError(f"size: expected a tensor of the fusion, got {tv!r}")
        ids = tv.materialized()
        id_ = ids[normalize_axis("size", dim, len(ids), "dim")]
        return id_.extent if id_.extent is not None else SymbolicSize(id_)

    def shape(self, tv: TensorView) -> list[int | SymbolicSize]:
        """``[fd.ops.size(tv, i) for each axis i]``."""
        if not isinstance(tv, TensorView):
            raise DefinitionError(f"shape: expected a tensor of the fusion, got {tv!r}")
        return [self.size(tv, i) for i in range(tv.ndim)]

    def stride_order(self, x: TensorView, stride_order) -> TensorView:
        """``x``'s values laid out with ``stride_order`` (rank of each axis, 0 = innermost):
        the output's allocation domain is that order."""
        out = add_op(self._fusion, registry.lookup("stride_order"), (x, stride_order), {})
        order = memory_order(stride_order)
        ids = out.materialized()
        out.set_allocation_domain([ids[a] for a in order], True)
        return out


def add_op(fusion: Fusion, op: OpDef, args, kwargs) -> Any:
    """Checks the arguments, runs the shape rule, and records the op in ``fusion``."""
    bound = op.bind(args, kwargs)
    for param, value in zip(op.params, bound):
        _check_kind(fusion, op, param, value)
    specs = op.infer(*[arg_meta(a) for a in bound])
    inputs = flat_tensors(bound)
    outputs: list[Val] = []
    id_map: dict[IterDomain, tuple[IterDomain, ...]] = {}
    for spec in specs:
        if spec.axes is None:
            outputs.append(Scalar(spec.dtype))
            continue
        ids = []
        for axis in spec.axes:
            new = IterDomain(axis.extent, axis.iter_type)
            id_map[new] = tuple(source_ids(inputs[t])[a] for t, a in axis.sources)
            ids.append(new)
        outputs.append(UserTensorView(fusion, ids, spec.dtype))
    attrs = {p.name: v for p, v in zip(op.params, bound) if p.kind is Kind.ATTR}
    fusion.add_expr(Expr(op, tuple(bound), tuple(outputs), attrs, id_map))
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _check_kind(fusion: Fusion, op: OpDef, param: registry.Param, value: Any) -> None:
    def fail(expected: str):
        raise DefinitionError(
            f"{op.name}: argument {param.name!r} must be {expected}, got {value!r}; "
            f"signature: {op.signature()}"
        )

    vals = [value] if isinstance(value, Val) else []
    match param.kind:
        case Kind.TENSOR:
            if not isinstance(value, TensorView) and not (value is None and param.default is None):
                fail("a tensor of the fusion")
        case Kind.TENSORS:
            if not isinstance(value, list | tuple) or not all(
                isinstance(v, TensorView) for v in value
            ):
                fail("a list of tensors of the fusion")
            vals = list(value)
        case Kind.OPERAND:
            if not isinstance(value, (TensorView, Scalar, *_NUMBER)):
                fail("a tensor, a scalar or a number")
        case Kind.SCALAR:
            if isinstance(value, TensorView):
                fail("a scalar (define_scalar) or a Python value")
        case Kind.ATTR:
            if isinstance(value, Val):
                fail("a static Python value, not a fusion value")
    for v in vals:
        if getattr(v, "fusion", fusion) is not fusion or v.name.endswith("?"):
            raise DefinitionError(
                f"{op.name}: argument {param.name!r} ({v!r}) belongs to another fusion"
            )


def scalar_dtype(value: Any) -> DataType:
    """The DataType of a Python constant given to define_scalar without a dtype."""
    dtype = dtype_of_number(value)
    if dtype is None:
        raise DefinitionError(
            f"define_scalar: cannot infer a dtype for {value!r}; pass dtype=DataType...."
        )
    return dtype
