"""Pointwise ops: unary math, casts, binary arithmetic and comparisons, ``where``.

Each family is a sorted table of ``name -> torch function``; one helper turns a table row
into an :class:`OpDef` (its torch function wrapped by :mod:`meshfuse.ops.pointwise_calls`
for nvFuser's expanded broadcast axes, low-precision arithmetic and Python numbers). Binary ops broadcast like PyTorch (tensors aligned on the right) and
accept meshfuse Scalars and Python numbers in either position. Unary ops accept them too (a
0-d result). A dtype that PyTorch has no kernel for (``neg`` of a bool tensor, ``silu`` of an
integer one) is a DefinitionError when the op is defined.

Result dtypes are nvFuser's: PyTorch's promotion of the operands, except that arithmetic on
Half or BFloat16 (binary arithmetic, the floating-point unary functions and ``neg``) computes
and returns Float, as nvFuser does; comparisons return Bool; ``abs``, ``ceil``, ``floor``,
``relu``, ``round``, ``sign``, ``silu`` and ``where`` keep the operands' dtype.
"""

from __future__ import annotations

import math

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError
from meshfuse.ops.pointwise_calls import (
    in_float,
    keeps_repeats,
    number_as_tensor,
    numbers_accepted,
    pointwise_call,
)
from meshfuse.ops.registry import (
    AxisSpec,
    OpDef,
    OutSpec,
    ScalarMeta,
    TensorMeta,
    Vjp,
    attr,
    operand,
    register,
    tensor,
)
from meshfuse.ops.shape_rules import (
    broadcast_axes,
    carried_partials,
    promote,
    require_tensor,
    same_axes,
)

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

# The gradient of each differentiable unary op, written with fusion ops ``o`` from the
# cotangent ``g`` and thunks of the input ``x`` and the result ``y`` (a thunk is called only
# where read, so a value the gradient does not read is neither saved nor recomputed).
LN2 = 0.6931471805599453
TWO_OVER_SQRT_PI = 1.1283791670955126
UNARY_GRADIENTS = {
    "abs": lambda o, g, x, y: o.mul(g, o.sign(x())),
    "acos": lambda o, g, x, y: o.neg(o.mul(g, o.rsqrt(o.sub(1.0, o.mul(x(), x()))))),
    "asin": lambda o, g, x, y: o.mul(g, o.rsqrt(o.sub(1.0, o.mul(x(), x())))),
    "atan": lambda o, g, x, y: o.div(g, o.add(o.mul(x(), x()), 1.0)),
    "cos": lambda o, g, x, y: o.neg(o.mul(g, o.sin(x()))),
    "cosh": lambda o, g, x, y: o.mul(g, o.sinh(x())),
    "erf": lambda o, g, x, y: o.mul(g, o.mul(o.exp(o.neg(o.mul(x(), x()))), TWO_OVER_SQRT_PI)),
    "exp": lambda o, g, x, y: o.mul(g, y()),
    "expm1": lambda o, g, x, y: o.mul(g, o.add(y(), 1.0)),
    "log": lambda o, g, x, y: o.div(g, x()),
    "log1p": lambda o, g, x, y: o.div(g, o.add(x(), 1.0)),
    "log2": lambda o, g, x, y: o.div(g, o.mul(x(), LN2)),
    "neg": lambda o, g, x, y: o.neg(g),
    "reciprocal": lambda o, g, x, y: o.neg(o.mul(g, o.mul(y(), y()))),
    "relu": lambda o, g, x, y: o.where(o.gt(y(), 0.0), g, 0.0),
    "rsqrt": lambda o, g, x, y: o.mul(g, o.mul(o.mul(y(), o.mul(y(), y())), -0.5)),
    "sigmoid": lambda o, g, x, y: o.mul(g, o.mul(y(), o.sub(1.0, y()))),
    "silu": lambda o, g, x, y: o.mul(g, _silu_derivative(o, x())),
    "sin": lambda o, g, x, y: o.mul(g, o.cos(x())),
    "sinh": lambda o, g, x, y: o.mul(g, o.cosh(x())),
    "sqrt": lambda o, g, x, y: o.div(g, o.mul(y(), 2.0)),
    "tan": lambda o, g, x, y: o.mul(g, o.add(o.mul(y(), y()), 1.0)),
    "tanh": lambda o, g, x, y: o.mul(g, o.sub(1.0, o.mul(y(), y()))),
}
# Piecewise constant: their gradient is zero wherever it exists (PyTorch's too); the
# derivation leaves it out.
ZERO_GRADIENT = {"ceil", "floor", "round", "sign"}


def _silu_derivative(o, x):
    s = o.sigmoid(x)
    return o.mul(s, o.add(o.mul(x, o.sub(1.0, s)), 1.0))


def _unary_vjp(name: str) -> Vjp:
    gradient = UNARY_GRADIENTS.get(name)
    assert (gradient is None) == (name in ZERO_GRADIENT), name

    def rule(d, grads):
        if gradient is None:
            return {}
        return {"x": lambda: gradient(d.ops, grads[0], lambda: d.value("x"), d.out)}

    return Vjp(rule, recompute=True)


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

def _trunc(o, x):
    return o.mul(o.sign(x), o.floor(o.abs(x)))


def _minus_one(o, b):
    return b - 1 if isinstance(b, int | float) else o.sub(b, 1)


def _pow_grads(d, g):
    o = d.ops

    def grad_a():
        a, b = d.value("a"), d.value("b")
        if isinstance(b, int | float) and b == 0:
            return None
        grad = o.mul(g, o.mul(b, o.pow(a, _minus_one(o, b))))
        return grad if isinstance(b, int | float) else o.where(o.eq(b, 0), 0.0, grad)

    def grad_b():  # zero where a == 0 and b >= 0 (PyTorch's choice at the singularity)
        a = d.value("a")
        if isinstance(a, int | float):
            return None if a == 0 else o.mul(g, o.mul(d.out(), math.log(a)))
        zero = o.logical_and(o.eq(a, 0), o.ge(d.value("b"), 0))
        return o.where(zero, 0.0, o.mul(g, o.mul(d.out(), o.log(a))))

    return {"a": grad_a, "b": grad_b}


def _extremum_grads(o, g, a, b, wins):
    """The gradient of maximum/minimum (``wins``: ``o.gt``/``o.lt``): all of it to the
    winner, half to each of two equal operands (as PyTorch)."""
    half = o.mul(g, 0.5)
    return {"a": lambda: o.where(wins(a(), b()), g, o.where(o.eq(a(), b()), half, 0.0)),
            "b": lambda: o.where(wins(b(), a()), g, o.where(o.eq(a(), b()), half, 0.0))}


# The gradients of the binary ops, as ``(d, g) -> {operand: thunk}``: the thunk of an operand
# is called only if it needs a gradient. Each may have the broadcast shape (summed down later).
BINARY_GRADIENTS = {
    "add": lambda d, g: {"a": lambda: g, "b": lambda: g},
    "atan2": lambda d, g: {
        "a": lambda: d.ops.div(d.ops.mul(g, d.value("b")), _squares(d)),
        "b": lambda: d.ops.neg(d.ops.div(d.ops.mul(g, d.value("a")), _squares(d)))},
    "div": lambda d, g: {
        "a": lambda: d.ops.div(g, d.value("b")),
        "b": lambda: d.ops.neg(d.ops.div(d.ops.mul(g, d.out()), d.value("b")))},
    "fmod": lambda d, g: {
        "a": lambda: g,
        "b": lambda: d.ops.neg(d.ops.mul(g, _trunc(d.ops, d.ops.div(d.value("a"),
                                                                     d.value("b")))))},
    "maximum": lambda d, g: _extremum_grads(d.ops, g, lambda: d.value("a"),
                                            lambda: d.value("b"), d.ops.gt),
    "minimum": lambda d, g: _extremum_grads(d.ops, g, lambda: d.value("a"),
                                            lambda: d.value("b"), d.ops.lt),
    "mul": lambda d, g: {"a": lambda: d.ops.mul(g, d.value("b")),
                         "b": lambda: d.ops.mul(g, d.value("a"))},
    "pow": _pow_grads,
    "remainder": lambda d, g: {
        "a": lambda: g,
        "b": lambda: d.ops.neg(d.ops.mul(g, d.ops.floor(d.ops.div(d.value("a"),
                                                                  d.value("b")))))},
    "sub": lambda d, g: {"a": lambda: g, "b": lambda: d.ops.neg(g)},
}


def _squares(d):
    a, b = d.value("a"), d.value("b")
    return d.ops.add(d.ops.mul(a, a), d.ops.mul(b, b))


def _binary_vjp(name: str) -> Vjp:
    gradients = BINARY_GRADIENTS.get(name)
    return Vjp(lambda d, grads: gradients(d, grads[0]) if gradients else {}, recompute=True)



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


def linear_partials(name: str, args: list) -> tuple[AxisSpec, ...]:
    """The reduction axes ``add`` and ``sub`` carry from their arguments' partial sums (see
    :func:`~meshfuse.ops.shape_rules.carried_partials`): one reduction of the result instead
    of one per argument. Other linear ops (``neg``, a product with a number) do not carry
    them: that would save no reduction, only move the op before it, out of the fused chain
    that follows."""
    return carried_partials(args) if name in ("add", "sub") else ()


ELEMENTWISE = "elementwise: the output is sharded as its input"
BROADCASTING = ("elementwise with broadcasting: each output axis is sharded as the operand axes "
                "it maps from (a broadcast axis follows the other operands)")


def _unary(name: str, fn, float_result: bool) -> OpDef:
    def infer(x):
        if not isinstance(x, TensorMeta):  # a scalar: a 0-d tensor of its dtype
            x = TensorMeta((), (), promote(x))
        check_dtype(name, x.dtype)
        dtype = result_dtype(name, _float_of(x.dtype) if float_result else x.dtype)
        return [OutSpec(dtype, same_axes(0, x))]

    impl = number_as_tensor(keeps_repeats(in_float(fn) if name in LOW_PRECISION_TO_FLOAT else fn))
    kind = "floating-point" if float_result else "dtype-preserving"
    return OpDef(name, (operand("x"),), infer, impl, doc=f"{kind} unary {fn.__name__}",
                 sharding=ELEMENTWISE, vjp=_unary_vjp(name))


def _binary(name: str, fn, fixed_dtype: DataType | None) -> OpDef:
    def infer(a, b):
        axes = broadcast_axes(name, [a, b]) + linear_partials(name, [a, b])
        dtype = check_dtype(name, promote(a, b))
        if name in FLOAT_RESULT:
            dtype = _float_of(dtype)
        return [OutSpec(fixed_dtype or result_dtype(name, dtype), axes)]

    impl = numbers_accepted(fn, name in NUMBER_FIRST, name in NUMBER_SECOND)
    if name in LOW_PRECISION_TO_FLOAT:
        impl = in_float(impl)
    impl = keeps_repeats(impl)
    return OpDef(name, (operand("a"), operand("b")), infer, impl,
                 doc=f"binary {name} with broadcasting", vjp=_binary_vjp(name),
                 sharding=BROADCASTING + ("; partial sums of the operands stay partial, "
                                          "reduced once" if name in ("add", "sub") else ""),
                 expands_broadcasts=True)


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
    doc="GELU, exact or with the tanh approximation", sharding=ELEMENTWISE,
    vjp=Vjp(lambda d, grads: {"x": lambda: d.ops.gelu_backward(
        grads[0], d.value("x"), d.attrs["approximate"])}, recompute=True),
))


def _gelu_backward_infer(grad, x, approximate):
    _check_gelu("gelu_backward", x, approximate)
    check_dtype("gelu_backward", require_tensor("gelu_backward", "grad", grad).dtype)
    return [OutSpec(promote(grad, x), broadcast_axes("gelu_backward", [grad, x]))]


register(OpDef(
    "gelu_backward", (tensor("grad"), tensor("x"), attr("approximate", "none")),
    _gelu_backward_infer,
    keeps_repeats(lambda grad, x, approximate: torch.ops.aten.gelu_backward(
        grad, x, approximate=approximate)),
    doc="grad * gelu'(x), one kernel (the backward of gelu)", expands_broadcasts=True,
    sharding=BROADCASTING,
))


def _cast_infer(x, dtype):
    """The axes of ``x``; a cast to a narrower floating type also carries ``x``'s partial
    sums (as DTensor's ``to`` keeps a Partial placement), so that they are reduced in the
    narrower type, moving fewer bytes: the backward's sum of bf16 matmul results, added in
    float, is reduce-scattered in bf16 as torch's autograd would."""
    x = require_tensor("cast", "x", x)
    if not isinstance(dtype, DataType):
        raise DefinitionError(f"cast: dtype must be a DataType, got {dtype!r}")
    narrows = x.dtype.is_floating and dtype.is_floating and \
        dtype.torch_dtype.itemsize < x.dtype.torch_dtype.itemsize
    return [OutSpec(dtype, same_axes(0, x) + (carried_partials([x]) if narrows else ()))]


register(OpDef(
    "cast", (tensor("x"), attr("dtype")), _cast_infer,
    keeps_repeats(lambda x, dtype: x.to(dtype.torch_dtype)),
    doc="element type conversion",
    sharding=ELEMENTWISE + "; a narrowing float cast keeps a partial sum partial (reduced in "
    "the narrower type)",
    vjp=Vjp(lambda d, grads: {"x": lambda: grads[0]}, recompute=True),  # cast back later
))


def _set_infer(x):
    x = require_tensor("set", "x", x)
    return [OutSpec(x.dtype, same_axes(0, x))]


register(OpDef(
    "set", (tensor("x"),), _set_infer, lambda x: x.clone(),
    doc="a copy of x; with a different schedule on its output, a resharding point",
    sharding="the output may be scheduled otherwise than x: the engine inserts the "
    "communication between the two (allgather, reduce-scatter, allreduce, all-to-all, slice)",
    # The identity, resharded back into x's sharding: the transposed communication.
    vjp=Vjp(lambda d, grads: {"x": lambda: grads[0]}, recompute=True, communication=True),
))


register(OpDef(
    # A copy, as set's: an output aliasing its input could be donated to an in-place
    # collective while the input lives on.
    "stop_gradient", (tensor("x"),), _set_infer, lambda x: x.clone(),
    doc="x, a constant to differentiation (its gradient is not taken)",
    vjp=Vjp(lambda d, grads: {}, differentiable=(), recompute=True),
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


def _where(cond, a, b, out_shapes=None):
    if not isinstance(cond, torch.Tensor):
        cond = torch.tensor(cond)
    return pointwise_call(torch.where, cond, a, b, out_shapes=out_shapes)


def _where_grads(d, grads):
    o, g = d.ops, grads[0]
    return {"a": lambda: o.where(d.value("cond"), g, 0.0),
            "b": lambda: o.where(d.value("cond"), 0.0, g)}


register(OpDef(
    "where", (operand("cond"), operand("a"), operand("b")), _where_infer, _where,
    doc="a where cond else b, with broadcasting", vjp=Vjp(_where_grads, recompute=True),
    sharding=BROADCASTING,
    expands_broadcasts=True,
))
