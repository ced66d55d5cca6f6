"""Pointwise ops: unary math, casts, binary arithmetic and comparisons, ``where``.

Each family is a sorted table of ``name -> torch function``; one helper turns a table row
into an :class:`OpDef`. Binary ops broadcast like PyTorch (tensors aligned on the right) and
accept meshfuse Scalars and Python numbers in either position. Unary ops accept them too (a
0-d result). A dtype that PyTorch has no kernel for (``neg`` of a bool tensor, ``silu`` of an
integer one) is a DefinitionError when the op is defined.

Result dtypes are nvFuser's: PyTorch's promotion of the operands, except that arithmetic on
Half or BFloat16 (binary arithmetic, the floating-point unary functions and ``neg``) computes
and returns Float, as nvFuser does; comparisons return Bool; ``abs``, ``ceil``, ``floor``,
``relu``, ``round``, ``sign``, ``silu`` and ``where`` keep the operands' dtype.
"""

from __future__ import annotations

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError
from meshfuse.ops.registry import (
    OpDef,
    OutSpec,
    ScalarMeta,
    TensorMeta,
    attr,
    operand,
    register,
    tensor,
)
from meshfuse.ops.shape_rules import broadcast_axes, promote, require_tensor, same_axes

# Unary ops whose result is floating point (integer inputs promote to the default float).
UNARY_FLOAT = {
    "acos": torch.acos,
    "asin": torch.asin,
    "atan": torch.atan,
    "cos": torch.cos,
    "cosh": torch.cosh,
    "erf": torch.erf,
    "exp": torch.exp,
    "expm1": torch.expm1,
    "log": torch.log,
    "log1p": torch.log1p,
    "log2": torch.log2,
    "reciprocal": torch.reciprocal,
    "rsqrt": torch.rsqrt,
    "sigmoid": torch.sigmoid,
    "sin": torch.sin,
    "sinh": torch.sinh,
    "sqrt": torch.sqrt,
    "tan": torch.tan,
    "tanh": torch.tanh,
}

# Unary ops that keep their input's dtype.
UNARY_SAME = {
    "abs": torch.abs,
    "ceil": torch.ceil,
    "floor": torch.floor,
    "neg": torch.neg,
    "relu": torch.relu,
    "round": torch.round,
    "sign": torch.sign,
    "silu": torch.nn.functional.silu,
}

# Ops that compute Half and BFloat16 operands in Float and return Float (nvFuser's rule).
LOW_PRECISION_TO_FLOAT = set(UNARY_FLOAT) | {"neg", "add", "atan2", "div", "fmod", "maximum",
                                            "minimum", "mul", "pow", "remainder", "sub"}

BINARY_ARITH = {
    "add": torch.add,
    "atan2": torch.atan2,
    "div": torch.div,
    "fmod": torch.fmod,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "mul": torch.mul,
    "pow": torch.pow,
    "remainder": torch.remainder,
    "sub": torch.sub,
}

BINARY_COMPARE = {
    "eq": torch.eq,
    "ge": torch.ge,
    "gt": torch.gt,
    "le": torch.le,
    "lt": torch.lt,
    "ne": torch.ne,
}

BINARY_LOGICAL = {
    "logical_and": torch.logical_and,
    "logical_or": torch.logical_or,
}

# Ops whose result is floating point even for integer or bool operands (true division).
FLOAT_RESULT = {"atan2", "div"}
# Ops PyTorch defines for floating-point tensors only.
FLOAT_ONLY = {"gelu", "gelu_backward", "silu"}
# Ops PyTorch does not define for bool tensors (checked on the promoted dtype).
NO_BOOL = {"abs", "ceil", "floor", "fmod", "neg", "pow", "relu", "remainder", "round", "sub"}
# Ops whose torch function takes a Python number as the second or the first operand; the
# others get a 0-d tensor of the promoted dtype instead (which PyTorch promotes alike).
NUMBER_SECOND = {"add", "div", "eq", "fmod", "ge", "gt", "le", "lt", "mul", "ne", "pow",
                 "remainder", "sub"}
NUMBER_FIRST = {"add", "div", "mul", "pow", "remainder", "sub"}


def _float_of(dtype: DataType) -> DataType:
    if dtype.is_floating or dtype.torch_dtype.is_complex:
        return dtype
    return DataType.from_torch(torch.get_default_dtype())


def result_dtype(op: str, dtype: DataType) -> DataType:
    """The dtype ``op`` returns for operands promoted to ``dtype`` (nvFuser's rule)."""
    if op in LOW_PRECISION_TO_FLOAT and dtype.is_low_precision:
        return DataType.Float
    return dtype


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _in_float(fn):
    """``fn`` with Half and BFloat16 tensor operands computed in float32 (the result is then
    float32, as the shape rule says)."""

    def call(*operands):
        return fn(*(x.float() if isinstance(x, torch.Tensor) and x.dtype in _LOW_PRECISION
                    else x for x in operands))

    call.__name__ = fn.__name__
    return call


def _as_tensor(fn):
    """``fn`` applied to a Python number as a 0-d tensor (a unary op of a scalar)."""

    def call(x):
        return fn(x if isinstance(x, torch.Tensor) else torch.tensor(x))

    call.__name__ = fn.__name__
    return call


def check_dtype(op: str, dtype: DataType) -> DataType:
    """``dtype`` if PyTorch implements ``op`` for it, else a DefinitionError."""
    floating = dtype.is_floating or dtype.torch_dtype.is_complex
    if (op in FLOAT_ONLY and not floating) or (op in NO_BOOL and dtype is DataType.Bool):
        need = "floating-point" if op in FLOAT_ONLY else "numeric (not Bool)"
        raise DefinitionError(
            f"{op}: PyTorch has no {op} for {dtype.name} operands; it takes {need} ones: "
            f"cast them first (fd.ops.cast)"
        )
    return dtype


def _unary(name: str, fn, float_result: bool) -> OpDef:
    def infer(x):
        if not isinstance(x, TensorMeta):  # a scalar: a 0-d tensor of its dtype
            x = TensorMeta((), (), promote(x))
        check_dtype(name, x.dtype)
        dtype = result_dtype(name, _float_of(x.dtype) if float_result else x.dtype)
        return [OutSpec(dtype, same_axes(0, x))]

    impl = _as_tensor(_in_float(fn) if name in LOW_PRECISION_TO_FLOAT else fn)
    kind = "floating-point" if float_result else "dtype-preserving"
    return OpDef(name, (operand("x"),), infer, impl, doc=f"{kind} unary {fn.__name__}")


def _binary(name: str, fn, fixed_dtype: DataType | None) -> OpDef:
    def infer(a, b):
        axes = broadcast_axes(name, [a, b])
        dtype = check_dtype(name, promote(a, b))
        if name in FLOAT_RESULT:
            dtype = _float_of(dtype)
        return [OutSpec(fixed_dtype or result_dtype(name, dtype), axes)]

    impl = _scalar_safe(fn, name in NUMBER_FIRST, name in NUMBER_SECOND)
    if name in LOW_PRECISION_TO_FLOAT:
        impl = _in_float(impl)
    return OpDef(name, (operand("a"), operand("b")), infer, impl,
                 doc=f"binary {name} with broadcasting")


def _scalar_safe(fn, number_first: bool, number_second: bool):
    """``fn`` made to accept a Python number in either position.

    A number where ``fn`` takes none becomes a 0-d tensor of the promoted dtype on the other
    operand's device; two numbers become a result tensor, as the shape rule says (a 0-d one).
    """

    def call(a, b):
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            a = torch.tensor(a)
        if not isinstance(a, torch.Tensor) and not number_first:
            a = torch.tensor(a, dtype=torch.result_type(a, b), device=b.device)
        if not isinstance(b, torch.Tensor) and not number_second:
            b = torch.tensor(b, dtype=torch.result_type(a, b), device=a.device)
        return fn(a, b)

    call.__name__ = fn.__name__
    return call


for _name, _fn in sorted(UNARY_FLOAT.items()):
    register(_unary(_name, _fn, float_result=True))
for _name, _fn in sorted(UNARY_SAME.items()):
    register(_unary(_name, _fn, float_result=False))
for _name, _fn in sorted(BINARY_ARITH.items()):
    register(_binary(_name, _fn, None))
for _name, _fn in sorted(BINARY_COMPARE.items() | BINARY_LOGICAL.items()):
    register(_binary(_name, _fn, DataType.Bool))


def _check_gelu(op: str, x, approximate) -> None:
    x = require_tensor(op, "x", x)
    check_dtype(op, x.dtype)
    if approximate not in ("none", "tanh"):
        raise DefinitionError(f"{op}: approximate must be 'none' or 'tanh', got {approximate!r}")


def _gelu_infer(x, approximate):
    _check_gelu("gelu", x, approximate)
    return [OutSpec(_float_of(x.dtype), same_axes(0, x))]


register(OpDef(
    "gelu", (tensor("x"), attr("approximate", "none")), _gelu_infer,
    lambda x, approximate: torch.nn.functional.gelu(x, approximate=approximate),
    doc="GELU, exact or with the tanh approximation",
))


def _gelu_backward_infer(grad, x, approximate):
    _check_gelu("gelu_backward", x, approximate)
    check_dtype("gelu_backward", require_tensor("gelu_backward", "grad", grad).dtype)
    return [OutSpec(promote(grad, x), broadcast_axes("gelu_backward", [grad, x]))]


register(OpDef(
    "gelu_backward", (tensor("grad"), tensor("x"), attr("approximate", "none")),
    _gelu_backward_infer,
    lambda grad, x, approximate: torch.ops.aten.gelu_backward(grad, x, approximate=approximate),
    doc="grad * gelu'(x), one kernel (the backward of gelu)",
))


def _cast_infer(x, dtype):
    x = require_tensor("cast", "x", x)
    if not isinstance(dtype, DataType):
        raise DefinitionError(f"cast: dtype must be a DataType, got {dtype!r}")
    return [OutSpec(dtype, same_axes(0, x))]


register(OpDef(
    "cast", (tensor("x"), attr("dtype")), _cast_infer,
    lambda x, dtype: x.to(dtype.torch_dtype),
    doc="element type conversion",
))


def _set_infer(x):
    x = require_tensor("set", "x", x)
    return [OutSpec(x.dtype, same_axes(0, x))]


register(OpDef(
    "set", (tensor("x"),), _set_infer, lambda x: x.clone(),
    doc="a copy of x; with a different schedule on its output, a resharding point",
))


def _where_infer(cond, a, b):
    axes = broadcast_axes("where", [cond, a, b])
    cond_dtype = cond.dtype if isinstance(cond, TensorMeta | ScalarMeta) else type(cond)
    if cond_dtype not in (DataType.Bool, bool):
        raise DefinitionError(
            f"where: cond must be Bool, got {getattr(cond_dtype, 'name', cond_dtype)}; make it "
            "with a comparison (fd.ops.gt, ...) or fd.ops.cast(cond, DataType.Bool)"
        )
    return [OutSpec(promote(a, b), axes)]


def _where(cond, a, b):
    if not isinstance(cond, torch.Tensor):
        cond = torch.tensor(cond)
    return torch.where(cond, a, b)


register(OpDef(
    "where", (operand("cond"), operand("a"), operand("b")), _where_infer, _where,
    doc="a where cond else b, with broadcasting",
))
