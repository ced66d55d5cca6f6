"""The op table of ``test_ops.py``: for every registered op, samples and a torch reference.

Each :class:`OpInfo` lists :class:`Sample` s: the op's arguments, written as input specs
(:class:`T` a tensor input, :class:`S` a scalar) and static values, and a torch reference
(as Thunder's OpInfo). ``OP_TABLE`` holds one OpInfo per op of the registry.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from meshfuse import DataType
from meshfuse.ops.random import rng

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FLOATS = (torch.float32, torch.bfloat16)
INTS = (torch.int64,)
BOOL = (torch.bool,)

# (rtol, atol) of a result of each dtype against the float64 reference.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float64: (1e-7, 1e-7),
}


# ----------------------------------------------------------------------------------------------
# Specs of samples


@dataclasses.dataclass(frozen=True)
class T:
    """A tensor input of concrete ``shape``.

    Axes of extent 1 are declared broadcast; the others static or symbolic by the test's mode
    (always static with ``static=True``: ops that need static extents). ``dtype`` None is the
    dtype under test. Values are uniform in ``[low, high]`` (integers: the integers there).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    low: float = -2.0
    high: float = 2.0
    static: bool = False
    stride_order: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class S:
    """A scalar ``value``: given to the op as a Python number (``how="number"``), as a
    ``define_scalar(value)`` constant (``"const"``), or as a scalar input of the fusion bound
    at execute (``"input"``)."""

    value: Any
    how: str = "number"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One call of an op.

    Attributes:
        args: positional arguments: T/S specs (or lists of T) and static values.
        ref: the torch reference, called with ``args`` made concrete (same structure).
        kwargs: static keyword arguments for the op.
        name: a short id.
        define: builds the outputs from ``(fd.ops, *args, **kwargs)``; default: the op.
        check: which outputs of a multi-output op the reference covers (None: all).
        tol: (rtol, atol) per dtype, replacing TOLERANCES.
        scaled_atol: atol scales with the largest magnitude of the reference.
    """

    args: tuple
    ref: Callable[..., Any]
    kwargs: dict = dataclasses.field(default_factory=dict)
    name: str = ""
    define: Callable[..., Any] | None = None
    check: tuple[int, ...] | None = None
    tol: dict | None = None
    scaled_atol: bool = False

    @property
    def needs_static(self) -> bool:
        return any(isinstance(s, T) and s.static for s in _flat(self.args))


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """An op's samples, the dtypes they run with, and dtypes its shape rule must refuse."""

    name: str
    samples: tuple[Sample, ...]
    dtypes: tuple[torch.dtype, ...] = FLOATS
    rejects: tuple[torch.dtype, ...] = ()


def _flat(args) -> list:
    out = []
    for a in args:
        out.extend(_flat(a) if isinstance(a, list) else [a])
    return out


# ----------------------------------------------------------------------------------------------
# Samples by family

UNARY_DOMAINS = {  # (low, high) where the function is defined and well conditioned
    "acos": (-0.9, 0.9), "asin": (-0.9, 0.9), "log": (0.5, 3.0), "log1p": (0.0, 3.0),
    "log2": (0.5, 3.0), "reciprocal": (0.5, 3.0), "rsqrt": (0.5, 3.0), "sqrt": (0.0, 3.0),
    "tan": (-1.2, 1.2),
}
UNARY_FLOAT = [
    "acos", "asin", "atan", "cos", "cosh", "erf", "exp", "expm1", "log", "log1p", "log2",
    "reciprocal", "rsqrt", "sigmoid", "silu", "sin", "sinh", "sqrt", "tan", "tanh",
]
UNARY_SAME = ["abs", "ceil", "floor", "neg", "relu", "round", "sign"]
NO_INT = ("silu",)  # PyTorch defines these for floating-point tensors only
NO_BOOL = ("abs", "ceil", "floor", "neg", "relu", "round", "silu")


def _torch_fn(name: str):
    return getattr(torch, name, None) or getattr(F, name)


# nvFuser's promotion: these compute Half and BFloat16 operands in float32 and return float32.
FLOAT_COMPUTE = {*UNARY_FLOAT, "neg", "add", "atan2", "div", "fmod", "maximum", "minimum",
                 "mul", "pow", "remainder", "sub"} - {"silu"}


def in_float(name: str, fn):
    """``fn`` as nvFuser computes op ``name``: low-precision float tensors upcast first."""
    if name not in FLOAT_COMPUTE:
        return fn

    def ref(*args):
        return fn(*(a.float() if isinstance(a, torch.Tensor) and a.dtype in LOW_PRECISION
                    else a for a in args))

    return ref


LOW_PRECISION = (torch.float16, torch.bfloat16)


def unary_info(name: str) -> OpInfo:
    fn = in_float(name, _torch_fn(name))
    low, high = UNARY_DOMAINS.get(name, (-2.0, 2.0))
    samples = (
        Sample((T((5, 7), low=low, high=high),), fn, name="2d"),
        Sample((T((2, 1, 3), low=low, high=high),), fn, name="broadcast-axis"),
    )
    if name in NO_INT:
        dtypes, rejects = FLOATS, INTS + BOOL
    elif name in NO_BOOL:
        dtypes, rejects = FLOATS + INTS, BOOL
    else:
        dtypes, rejects = FLOATS + INTS + BOOL, ()
    return OpInfo(name, samples, dtypes, rejects)


BINARY_DOMAINS = {  # (a's range, b's range)
    "div": ((-2.0, 2.0), (0.5, 2.0)),
    "fmod": ((-4.0, 4.0), (1.0, 3.0)),
    "remainder": ((-4.0, 4.0), (1.0, 3.0)),
    "pow": ((0.5, 2.0), (0.0, 2.0)),
}
BINARY_ARITH = [
    "add", "atan2", "div", "fmod", "maximum", "minimum", "mul", "pow", "remainder", "sub",
]
COMPARE = ["eq", "ge", "gt", "le", "lt", "ne"]
LOGICAL = ["logical_and", "logical_or"]


def binary_ref(fn):
    """``fn`` with Python numbers as 0-d tensors of the promoted dtype (PyTorch's promotion
    of a number; several torch functions take no number, or none first)."""

    def ref(a, b):
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            a = torch.tensor(a)
        dtype = torch.result_type(a, b)
        a, b = (x if isinstance(x, torch.Tensor) else
                torch.tensor(x, dtype=dtype, device=(b if x is a else a).device) for x in (a, b))
        return fn(a, b)

    return ref


def binary_samples(name: str) -> tuple[Sample, ...]:
    fn = in_float(name, binary_ref(_torch_fn(name)))
    (alo, ahi), (blo, bhi) = BINARY_DOMAINS.get(name, ((-2.0, 2.0), (-2.0, 2.0)))

    def a(shape):
        return T(shape, low=alo, high=ahi)

    def b(shape):
        return T(shape, low=blo, high=bhi)

    scalar = 1.5 if name != "pow" else 2  # exactly representable in bf16
    return (
        Sample((a((4, 6)), b((4, 6))), fn, name="same-shape"),
        Sample((a((3, 4, 6)), b((4, 1))), fn, name="broadcast-rank"),
        Sample((a((1, 6)), b((4, 1))), fn, name="broadcast-both"),
        Sample((a((4, 6)), S(scalar)), fn, name="python-number"),
        Sample((S(scalar), b((4, 6))), fn, name="number-first"),
        Sample((a((4, 6)), S(scalar, "const")), fn, name="define-scalar"),
        Sample((a((4, 6)), S(scalar, "input")), fn, name="scalar-input"),
    )


def binary_info(name: str) -> OpInfo:
    if name in LOGICAL:
        return OpInfo(name, binary_samples(name), BOOL + FLOATS + INTS)
    if name in COMPARE:
        return OpInfo(name, binary_samples(name), FLOATS + INTS + BOOL)
    no_bool = name in ("fmod", "pow", "remainder", "sub")
    return OpInfo(name, binary_samples(name), FLOATS + INTS + (() if no_bool else BOOL),
                  BOOL if no_bool else ())


def _where(cond, a, b):
    return torch.where(cond, a, b)


COND = T((4, 6), dtype=torch.bool)
WHERE = OpInfo("where", (
    Sample((COND, T((4, 6)), T((4, 6))), _where, name="tensors"),
    Sample((T((4, 1), dtype=torch.bool), T((1, 6)), T((3, 4, 6))), _where, name="broadcast"),
    Sample((COND, T((4, 6)), S(0.5)), _where, name="number"),
    Sample((COND, S(-1.5, "const"), T((4, 6))), _where, name="define-scalar"),
    Sample((COND, T((4, 6)), S(2.5, "input")), _where, name="scalar-input"),
    Sample((COND, S(1.5), S(-0.5)), _where, name="two-numbers"),
), FLOATS + INTS + BOOL, rejects=())

GELU = OpInfo("gelu", (
    Sample((T((4, 6), low=-4, high=4),), F.gelu, name="exact"),
    Sample((T((4, 6), low=-4, high=4), "tanh"), lambda x, a: F.gelu(x, approximate=a),
           name="tanh"),
    Sample((T((2, 1, 6)),), lambda x: F.gelu(x, approximate="tanh"),
           kwargs={"approximate": "tanh"}, name="tanh-kwarg"),
), rejects=INTS + BOOL)
GELU_BACKWARD = OpInfo("gelu_backward", (
    Sample((T((4, 6)), T((4, 6), low=-4, high=4)),
           lambda g, x: torch.ops.aten.gelu_backward(g, x), name="exact"),
    Sample((T((4, 6)), T((4, 6), low=-4, high=4), "tanh"),
           lambda g, x, a: torch.ops.aten.gelu_backward(g, x, approximate=a), name="tanh"),
), rejects=INTS + BOOL)


def cast_sample(to: DataType) -> Sample:
    return Sample((T((4, 6), low=-3, high=3), to), lambda x, d: x.to(d.torch_dtype),
                  name=to.name)


CAST = OpInfo("cast", tuple(cast_sample(d) for d in (
    DataType.Float, DataType.BFloat16, DataType.Double, DataType.Int, DataType.Bool,
)), FLOATS + INTS + BOOL)

SET = OpInfo("set", (Sample((T((4, 6)),), torch.clone, name="copy"),), FLOATS + INTS + BOOL)


# Reductions: (input shape, dims, keepdim); dims as given to meshfuse and to torch.
REDUCTION_CASES = (
    ((4, 6), [1], False),
    ((4, 6), [0], True),
    ((3, 4, 5), [0, 2], False),
    ((3, 4, 5), [-1, -3], True),
    ((3, 4, 5), None, False),
    ((3, 1, 5), [2], True),
    ((3, 4, 5), 1, False),
)


def _reduce_ref(name: str, dims, keepdim: bool):
    """The reduction as torch's one-axis reductions, innermost axis first."""

    def ref(x):
        axes = range(x.ndim) if dims is None else [dims] if isinstance(dims, int) else dims
        out = x
        for d in sorted((d % x.ndim for d in axes), reverse=True):
            out = _reduce_one(name, out, d, keepdim)
        return out

    return ref


def _reduce_one(name: str, x, dim: int, keepdim: bool):
    if name in ("max", "min"):
        return getattr(torch, f"a{name}")(x, dim, keepdim=keepdim)
    if name == "mean":  # the mean over several axes is the mean of means (equal counts)
        return torch.mean(x, dim, keepdim=keepdim)
    return getattr(torch, name)(x, dim, keepdim=keepdim)


def reduction_info(name: str) -> OpInfo:
    samples = [
        Sample((T(shape),), _reduce_ref(name, dims, keepdim),
               kwargs={"dims": dims, "keepdim": keepdim},
               name=f"dims{dims}-keep{keepdim}".replace(" ", ""))
        for shape, dims, keepdim in REDUCTION_CASES
    ]
    if name in ("sum", "mean", "prod"):
        samples.append(Sample(
            (T((4, 6)),), lambda x: getattr(torch, name)(x, 1, dtype=torch.float64),
            kwargs={"dims": [1], "dtype": DataType.Double}, name="dtype",
        ))
    dtypes = FLOATS if name == "mean" else FLOATS + INTS
    rejects = INTS + BOOL if name == "mean" else ()
    return OpInfo(name, tuple(samples), dtypes, rejects)


def _var_mean_ref(dims, correction, keepdim):
    def ref(x):
        return torch.var_mean(x, dim=dims, correction=correction, keepdim=keepdim)

    return ref


VAR_MEAN = OpInfo("var_mean", tuple(
    Sample((T(shape),), _var_mean_ref(dims, correction, keepdim),
           kwargs={"dims": dims, "correction": correction, "keepdim": keepdim},
           name=f"dims{dims}-c{correction}-keep{keepdim}".replace(" ", ""))
    for shape, dims, correction, keepdim in (
        ((4, 6), [1], 1, False),
        ((4, 6), [-1], 0, True),
        ((3, 4, 5), [0, 2], 1, True),
        ((3, 4, 5), None, 2, False),
    )
), rejects=INTS + BOOL)


# Shape ops.
def _broadcast_in_dim_ref(shape, dims):
    def ref(x, *_):
        view = [1] * len(shape)
        for a, d in enumerate(dims):
            view[d] = x.shape[a]
        return x.reshape(view).expand(shape)

    return ref


def bid_sample(in_shape, shape, dims, name):
    return Sample((T(in_shape), list(shape), list(dims)), _broadcast_in_dim_ref(shape, dims),
                  name=name)


BROADCAST_IN_DIM = OpInfo("broadcast_in_dim", (
    bid_sample((6,), (4, 6), (1,), "new-outer"),
    bid_sample((4,), (4, 3, 2), (0,), "new-inner"),
    bid_sample((4, 1), (4, 6), (0, 1), "expand-broadcast"),
    bid_sample((3, 5), (2, 3, 1, 5), (1, 3), "middle"),
), FLOATS + INTS + BOOL)

BROADCAST = OpInfo("broadcast", (
    Sample((T((4, 6)), [True, False, False]), lambda x, f: x.unsqueeze(0), name="new-outer"),
    Sample((T((4, 6)), [False, True, False, True]), lambda x, f: x[:, None, :, None],
           name="new-middle-and-inner"),
), FLOATS + INTS + BOOL)

STRIDE_ORDER = OpInfo("stride_order", (
    Sample((T((2, 3, 4)), [0, 2, 1]), lambda x, o: x, name="permuted"),
    Sample((T((2, 3)), [1, 0]), lambda x, o: x, name="row-major"),
), FLOATS + INTS + BOOL)

EXPAND = OpInfo("expand", (
    Sample((T((1, 6)), [4, 6]), lambda x, s: x.expand(s), name="broadcast-axis"),
    Sample((T((4, 1)), [2, -1, 6]), lambda x, s: x.expand(s), name="new-axis-and-minus-one"),
), FLOATS + INTS + BOOL)

SQUEEZE = OpInfo("squeeze", (
    Sample((T((4, 1, 6)), [1]), lambda x, d: x.squeeze(d), name="one"),
    Sample((T((4, 1, 6, 1)), [-1, 1]), lambda x, d: x.squeeze(d), name="negative"),
    Sample((T((1, 4, 1)),), lambda x: x.squeeze(), name="all"),
), FLOATS + INTS + BOOL)

PERMUTE = OpInfo("permute", (
    Sample((T((2, 3, 4)), [2, 0, 1]), lambda x, d: x.permute(d), name="3d"),
    Sample((T((2, 3, 4)), [-1, 0, -2]), lambda x, d: x.permute(d), name="negative"),
    Sample((T((4, 1)), [1, 0]), lambda x, d: x.permute(d), name="broadcast-axis"),
), FLOATS + INTS + BOOL)


def reshape_sample(shape, new_shape, name):
    return Sample((T(shape, static=True), list(new_shape)), lambda x, s: x.reshape(s),
                  name=name)


RESHAPE = OpInfo("reshape", (
    reshape_sample((4, 6), (2, 12), "split-merge"),
    reshape_sample((4, 6), (-1,), "flatten"),
    reshape_sample((2, 3, 4), (6, -1), "minus-one"),
    reshape_sample((4, 1, 6), (24,), "through-broadcast"),
    reshape_sample((2, 12), (2, 3, 4), "keep-outer"),
), FLOATS + INTS + BOOL)


def _slice_ref(x, starts, ends, strides=None):
    steps = strides or [1] * x.ndim
    return x[tuple(slice(s, e, st) for s, e, st in zip(starts, ends, steps))]


SLICE = OpInfo("slice", (
    Sample((T((8, 6), static=True), [1, 0], [7, 6]), _slice_ref, name="unit-stride"),
    Sample((T((8, 6), static=True), [1, 0], [8, 5], [2, 3]), _slice_ref, name="strided"),
    Sample((T((3, 9, 4), static=True), [0, 2, 1], [3, 9, 3], [1, 4, 1]), _slice_ref,
           name="3d"),
), FLOATS + INTS + BOOL)

def _slice_backward_ref(grad, shape, starts, ends, strides=None):
    out = grad.new_zeros(shape)
    steps = strides or [1] * grad.ndim
    out[tuple(slice(s, e, st) for s, e, st in zip(starts, ends, steps))] = grad
    return out


SLICE_BACKWARD = OpInfo("slice_backward", (
    Sample((T((6, 6)), [8, 6], [1, 0], [7, 6]), _slice_backward_ref, name="unit-stride"),
    Sample((T((4, 2)), [8, 6], [1, 0], [8, 5], [2, 3]), _slice_backward_ref, name="strided"),
    Sample((T((3, 2, 2), static=True), [3, 9, 4], [0, 2, 1], [3, 9, 3], [1, 4, 1]),
           _slice_backward_ref, name="3d"),
), FLOATS + INTS + BOOL)

# Expr.inputs does not look into list arguments (ir/fusion.py), so the sharding check of any
# fusion with cat fails; strict, so that the fix turns these into failures to remove the mark.
CAT = OpInfo("cat", (
    Sample(([T((2, 6)), T((3, 6))], 0), lambda xs, d: torch.cat(xs, d), name="dim0"),
    Sample(([T((4, 2)), T((4, 1)), T((4, 3))], -1), lambda xs, d: torch.cat(xs, d),
           name="three-negative-dim"),
    Sample(([T((2, 6), dtype=torch.bfloat16), T((2, 6))], 1), lambda xs, d: torch.cat(xs, d),
           name="promotes"),
), FLOATS + INTS + BOOL)

SPLIT = OpInfo("split", (
    Sample((T((4, 10), static=True), 4, 1), lambda x, s, d: torch.split(x, s, d), name="size"),
    Sample((T((6, 3), static=True), [1, 0, 5]), lambda x, s: torch.split(x, s),
           name="sizes"),
), FLOATS + INTS + BOOL)


# Indexing: index tensors of integers in range (T's low/high), Int and Int32.
def _index(shape, high, dtype=torch.int64):
    return T(shape, dtype=dtype, low=0, high=high)


IOTA = OpInfo("iota", tuple(
    Sample((5, 2, 3, dtype), lambda n, a, b, dt: (torch.arange(n) * b + a).to(dt.torch_dtype),
           name=f"{dtype.name}") for dtype in (DataType.Int, DataType.Int32)
) + (Sample((4, 0.5, 0.25, DataType.Float),
            lambda n, a, b, dt: (torch.arange(n) * b + a).float(), name="Float"),),
    (torch.float32,))
STOP_GRADIENT = OpInfo("stop_gradient", (Sample((T((4, 6)),), torch.clone, name="copy"),),
                       FLOATS + INTS + BOOL)
TAKE_ALONG_AXIS = OpInfo("take_along_axis", (
    Sample((T((4, 10)), _index((4, 3), 9), 1), lambda x, i, d: torch.take_along_dim(x, i, d),
           name="dim1"),
    Sample((T((5, 3, 2)), _index((2, 3, 2), 4, torch.int32), 0),
           lambda x, i, d: torch.take_along_dim(x, i.long(), d), name="dim0-int32"),
), FLOATS + INTS)
GATHER = OpInfo("gather", (
    Sample((T((4, 10)), _index((3, 5), 3), 0), lambda x, i, d: torch.gather(x, d, i),
           name="smaller-index"),
    Sample((T((4, 10)), _index((4, 7), 9), -1), lambda x, i, d: torch.gather(x, d, i),
           name="last-axis"),
), FLOATS + INTS)
INDEX_SELECT = OpInfo("index_select", (
    Sample((T((4, 10)), _index((6,), 9, torch.int32), 1),
           lambda x, i, d: torch.index_select(x, d, i), name="dim1"),
    Sample((T((5, 3, 2)), _index((7,), 4), 0), lambda x, i, d: torch.index_select(x, d, i),
           name="dim0"),
), FLOATS + INTS)
EMBEDDING_FWD = OpInfo("embedding_fwd", (
    Sample((_index((2, 5), 10), T((11, 6))), lambda i, w: F.embedding(i, w), name="2d-ids"),
    Sample((_index((7,), 10, torch.int32), T((11, 6)), 3),
           lambda i, w, p: F.embedding(i.long(), w, p), name="padding-idx"),
))
TAKE_ALONG_AXIS_BACKWARD = OpInfo("take_along_axis_backward", (
    Sample((T((4, 3)), _index((4, 3), 9), T((4, 10)), 1),
           lambda g, i, like, d: torch.zeros_like(like).scatter_add(d, i, g), name="dim1"),
    Sample((T((3, 5)), _index((3, 5), 3), T((4, 10)), 0),
           lambda g, i, like, d: torch.zeros_like(like).scatter_add(d, i, g),
           name="smaller-index"),
))
INDEX_SELECT_BACKWARD = OpInfo("index_select_backward", (
    Sample((T((4, 6)), _index((6,), 9), T((4, 10)), 1),
           lambda g, i, like, d: torch.zeros_like(like).index_add(d, i, g), name="dim1"),
    Sample((T((2, 5, 6)), _index((2, 5), 10), T((11, 6)), 0),
           lambda g, i, like, d: torch.zeros_like(like).index_add(d, i.flatten(),
                                                                  g.flatten(0, 1)),
           name="embedding"),
))


# Matrix products.
MATMUL_SHAPES = {
    "1d-1d": ((16,), (16,)),
    "2d-1d": ((5, 16), (16,)),
    "1d-2d": ((16,), (16, 7)),
    "2d-2d": ((5, 16), (16, 7)),
    "batched": ((3, 5, 16), (3, 16, 7)),
    "batch-2d": ((3, 5, 16), (16, 7)),
    "2d-batch": ((5, 16), (3, 16, 7)),
    "1d-batch": ((16,), (2, 16, 7)),
    "broadcast-batch": ((2, 1, 5, 16), (3, 16, 7)),
}
MATMUL = OpInfo("matmul", tuple(
    Sample((T(a), T(b)), torch.matmul, name=name) for name, (a, b) in MATMUL_SHAPES.items()
))

LINEAR = OpInfo("linear", (
    Sample((T((5, 16)), T((7, 16))), F.linear, name="no-bias"),
    Sample((T((2, 5, 16)), T((7, 16)), T((7,))), F.linear, name="bias"),
    Sample((T((16,)), T((7, 16)), T((7,))), F.linear, name="1d"),
    Sample((T((5, 16)), T((7, 16))), lambda x, w: F.linear(x, w, None), kwargs={"bias": None},
           name="bias-none"),
    # nvFuser's weights with leading axes ([d, n, k], a head axis [h, dh, e]): one linear
    # per leading index, those axes first in the output
    Sample((T((2, 5, 16)), T((3, 7, 16)), T((3, 7))), lambda x, w, b: torch.stack(
        [F.linear(x, w[i], b[i]) for i in range(w.shape[0])]), name="3d-weight"),
    Sample((T((5, 16)), T((2, 3, 7, 16))), lambda x, w: torch.stack([torch.stack(
        [F.linear(x, w[i, j]) for j in range(w.shape[1])]) for i in range(w.shape[0])]),
        name="4d-weight"),
    Sample((T((16,)), T((3, 7, 16)), T((3, 7))), lambda x, w, b: torch.stack(
        [F.linear(x, w[i], b[i]) for i in range(w.shape[0])]), name="3d-weight-1d"),
))


def _grouped_mm_ref(mat1, mat2, offsets):
    starts = [0, *offsets.tolist()[:-1]]
    return torch.cat([mat1[s:e] @ mat2[g] for g, (s, e) in enumerate(zip(starts,
                                                                          offsets.tolist()))])


GROUPED_MM = OpInfo("grouped_mm", (
    Sample((T((5, 16)), T((1, 16, 7)), T((1,), dtype=torch.int32, low=5, high=5)),
           _grouped_mm_ref, name="one-group"),
    Sample((T((3, 16)), T((2, 16, 7)), T((2,), dtype=torch.int32, low=3, high=3)),
           _grouped_mm_ref, name="empty-group"),
))


# Attention: the reference is torch's SDPA (and its autograd) on the math backend.
def sdpa_ref(q, k, v, is_causal, scale):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


def _lse(q, k, is_causal, scale):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.double() @ k.double().transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    return torch.logsumexp(scores, dim=-1).float()


def sdpfa_fwd_ref(q, k, v, dropout_p, is_causal, scale=None):
    return sdpa_ref(q, k, v, is_causal, scale), _lse(q, k, is_causal, scale)


def sdpfa_bwd_ref(grad, q, k, v, is_causal, scale=None):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out = sdpa_ref(*leaves, is_causal, scale)
        return torch.autograd.grad(out, leaves, grad)


def _fwd_then_bwd(ops, grad, q, k, v, is_causal, scale=None):
    attn, lse, seed, offset = ops.sdpfa_fwd(q, k, v, 0.0, is_causal, scale)
    return ops.sdpfa_bwd(grad, q, k, v, attn, lse, 0.0, is_causal, seed, offset, scale)


# (B, H, S, Skv, E); S != Skv only without a causal mask (the masks' alignments differ).
ATTENTION_CASES = {
    "causal": ((2, 2, 16, 16, 8), True, None),
    "cross": ((1, 3, 8, 12, 16), False, None),
    "scale": ((2, 2, 16, 16, 8), False, 0.25),
}
ATTENTION_TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}


def qkv_specs(shape, lead=()):
    b, h, s, skv, e = shape
    return T((*lead, b, h, s, e)), T((*lead, b, h, skv, e)), T((*lead, b, h, skv, e))


SDPFA_FWD = OpInfo("sdpfa_fwd", tuple(
    Sample((*qkv_specs(shape), 0.0, causal, scale), sdpfa_fwd_ref, name=name, check=(0, 1),
           tol=ATTENTION_TOL, scaled_atol=True)
    for name, (shape, causal, scale) in ATTENTION_CASES.items()
) + (
    # nvFuser's [DIDx, b, h, s, e]: a leading axis batches like b.
    Sample((*qkv_specs((2, 2, 16, 16, 8), lead=(3,)), 0.0, True, None), sdpfa_fwd_ref,
           name="leading-axis", check=(0, 1), tol=ATTENTION_TOL, scaled_atol=True),
))
SDPFA_BWD = OpInfo("sdpfa_bwd", tuple(
    Sample((T(shape[:3] + shape[4:]), *qkv_specs(shape), causal, scale), sdpfa_bwd_ref,
           define=_fwd_then_bwd, name=name, tol=ATTENTION_TOL, scaled_atol=True)
    for name, (shape, causal, scale) in ATTENTION_CASES.items()
) + (
    Sample((T((3, 2, 2, 16, 8)), *qkv_specs((2, 2, 16, 16, 8), lead=(3,)), True, None),
           sdpfa_bwd_ref, define=_fwd_then_bwd, name="leading-axis", tol=ATTENTION_TOL,
           scaled_atol=True),
))


# Random ops: the reference draws from meshfuse's generator (ops/random/rng.py) at each element's
# row-major index, in float32 (float64 for Double results, whatever the reference's upcast
# inputs), cast to the result's dtype; what
# the samples check is the op's plumbing: shape, dtype, positions, seed and offset.
def _drawn(draw, shape, a, b, seed, offset, dtype, wide=None):
    wide = wide or (torch.float64 if dtype == torch.float64 else torch.float32)
    index = torch.arange(math.prod(shape)).view(shape)
    return draw(rng.stream_key(seed, offset), index, a, b, wide).to(dtype)


def distribution_sample(name: str, draw, dtype: DataType, a, b) -> Sample:
    shape = [3, 1, 5]
    return Sample((S(a), S(b, "const"), shape, S(11, "input"), S(2**40 + 3, "input"), dtype),
                  lambda a, b, shape, seed, offset, dtype: _drawn(
                      draw, shape, a, b, seed, offset, dtype.torch_dtype),
                  name=dtype.name)


def like_sample(draw, a: float, b: float) -> Sample:
    return Sample((T((4, 6)), S(5, "input"), S(0, "input")),
                  lambda x, seed, offset: _drawn(draw, list(x.shape), a, b, seed, offset,
                                                 x.dtype, torch.float32).to(x.device),
                  name="seeded")


RANDOM_DTYPES = (DataType.Float, DataType.BFloat16, DataType.Double)
UNIFORM = OpInfo("uniform", tuple(distribution_sample("uniform", rng.uniform, d, -1.0, 2.5)
                                  for d in RANDOM_DTYPES), (torch.float32,))
NORMAL = OpInfo("normal", tuple(distribution_sample("normal", rng.normal, d, 0.5, 2.0)
                                for d in RANDOM_DTYPES), (torch.float32,))
RAND_LIKE = OpInfo("rand_like", (like_sample(rng.uniform, 0.0, 1.0),), rejects=INTS + BOOL)
RANDN_LIKE = OpInfo("randn_like", (like_sample(rng.normal, 0.0, 1.0),), rejects=INTS + BOOL)


# Mixture of experts: torch references written here on whole tensors.
def _route_ref(logits, bias, k, score, normalize, scale, groups=None, top_groups=None):
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if groups is not None:
        g = choice.unflatten(-1, (groups, -1))
        best = g.topk(2, -1).values.sum(-1).topk(top_groups, -1).indices
        mask = torch.ones_like(g[..., 0]).scatter(-1, best, 0).bool()
        choice = g.masked_fill(mask[..., None], -math.inf).flatten(-2)
    idx = choice.topk(k, -1).indices
    w = scores.gather(-1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) if normalize else w
    return w * scale, idx


def _route_bwd_ref(grad, logits):
    x = logits.detach().requires_grad_()
    with torch.enable_grad():
        w, _ = _route_ref(x, None, 2, "softmax", True, 1.0)
        return torch.autograd.grad(w, x, grad)[0]


def _experts_ref(x, idx, weights, w1, w2, w3, capacity=None):
    y, rows = torch.zeros_like(x), torch.zeros(w1.shape[0])
    saved = x.new_zeros(*idx.shape, 2, w1.shape[1])  # each slot's products, dropped or not
    for t in range(x.shape[0]):
        for s in range(idx.shape[1]):
            e = idx[t, s]
            saved[t, s, 0], saved[t, s, 1] = w1[e] @ x[t], w3[e] @ x[t]
            if capacity is not None and rows[e] >= capacity:
                continue  # the expert is full: the slot is dropped
            rows[e] += 1
            h = F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
            y[t] += weights[t, s] * (w2[e] @ h)
    return y, rows, saved


def _experts_bwd_ref(grad, *args):
    leaves = [a if a.dtype == torch.int64 else a.detach().requires_grad_() for a in args]
    with torch.enable_grad():
        y, _, _ = _experts_ref(*leaves)
        x, _, weights, w1, w2, w3 = leaves
        return torch.autograd.grad(y, [x, weights, w1, w2, w3], grad)


def _experts_bsh_ref(x, idx, weights, *rest):
    """``_experts_ref`` on tokens ``[batch, seq, ...]`` (flattened row-major)."""
    y, rows, saved = _experts_ref(x.flatten(0, 1), idx.flatten(0, 1), weights.flatten(0, 1),
                                  *rest)
    return y.reshape(x.shape), rows, saved.unflatten(0, x.shape[:2])


def _experts_bwd_bsh_ref(grad, *args):
    leaves = [a if a.dtype == torch.int64 else a.detach().requires_grad_() for a in args]
    with torch.enable_grad():
        y = _experts_bsh_ref(*leaves)[0]
        x, _, weights, w1, w2, w3 = leaves
        return torch.autograd.grad(y, [x, weights, w1, w2, w3], grad)


_EXPERTS = (T((6, 8)), _index((6, 2), 3), T((6, 2)), T((4, 5, 8)), T((4, 8, 5)), T((4, 5, 8)))
_EXPERTS_BSH = (T((2, 3, 8)), _index((2, 3, 2), 3), T((2, 3, 2)), *_EXPERTS[3:])
MOE_ROUTE = OpInfo("moe_route", (
    Sample((T((6, 8)), None, 2, "softmax", True, 1.0), _route_ref, name="softmax"),
    Sample((T((6, 8)), T((8,)), 3, "sigmoid", False, 2.5), _route_ref, name="sigmoid-bias"),
    Sample((T((5, 8)), None, 2, "sigmoid", True, 1.0, 4, 2), _route_ref, name="groups"),
    Sample((T((2, 3, 8)), None, 2, "softmax", True, 1.0), _route_ref, name="batch-seq"),
), (torch.float32,))
MOE_ROUTE_BWD = OpInfo("moe_route_bwd", (
    Sample((T((6, 2)), T((6, 8))), _route_bwd_ref, name="softmax",
           define=lambda o, g, x: o.moe_route_bwd(g, x, o.moe_route(x, top_k=2)[1])),
), (torch.float32,))
MOE_TOKEN_COUNTS = OpInfo("moe_token_counts", (
    Sample((_index((6, 2), 4), 5), lambda i, e: torch.bincount(i.reshape(-1), minlength=e)
           .float(), name="empty-expert"),
), (torch.float32,))
MOE_EXPERTS = OpInfo("moe_experts", (
    Sample(_EXPERTS, _experts_ref, name="4-experts"),
    Sample((*_EXPERTS, 2), _experts_ref, name="capacity-2"),
    Sample(_EXPERTS_BSH, _experts_bsh_ref, name="batch-seq"),
    Sample((*_EXPERTS_BSH, 1), _experts_bsh_ref, name="batch-seq-capacity-1"),
), (torch.float32,))
MOE_EXPERTS_BWD = OpInfo("moe_experts_bwd", (
    Sample((T((6, 8)), *_EXPERTS), _experts_bwd_ref, name="4-experts"),
    Sample((T((6, 8)), *_EXPERTS), _experts_bwd_ref, name="saved",
           define=lambda o, g, *args: o.moe_experts_bwd(g, *args, None,
                                                        o.moe_experts(*args)[2])),
    Sample((T((2, 3, 8)), *_EXPERTS_BSH), _experts_bwd_bsh_ref, name="batch-seq-saved",
           define=lambda o, g, *args: o.moe_experts_bwd(g, *args, None,
                                                        o.moe_experts(*args)[2])),
), (torch.float32,))


def _ce_fwd_ref(ignore_index=-100, smoothing=0.0):
    """cross_entropy_fwd's outputs by PyTorch: the summed loss over count (float32, float64
    for float64 logits), its gradient, the applied scale."""
    def ref(x, t, count):
        # count is the number of rows counted (a constant), not a differentiable input
        count = count.detach() if isinstance(count, torch.Tensor) else count
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(wide)
        loss = F.cross_entropy(xf, t, reduction="sum", ignore_index=ignore_index,
                               label_smoothing=smoothing) / count
        classes = x.shape[1]
        w = F.one_hot(t.clamp(min=0), classes) * (1 - smoothing) + smoothing / classes
        keep = (t != ignore_index)[:, None]
        grad = (torch.softmax(xf, 1) - w) * keep / count
        return loss.to(wide), grad.to(x.dtype), torch.ones((), dtype=torch.float32, device=x.device)
    return ref


CROSS_ENTROPY_FWD = OpInfo("cross_entropy_fwd", (
    Sample((T((5, 7), low=-4, high=4), _index((5,), 6), T((), dtype=torch.float32, low=1,
                                                           high=5)),
           _ce_fwd_ref(), name="mean"),
    Sample((T((6, 9), low=-4, high=4), _index((6,), 8), 1.0), _ce_fwd_ref(2, 0.1),
           kwargs={"ignore_index": 2, "label_smoothing": 0.1}, name="sum-smoothing-ignored"),
), rejects=INTS)
CROSS_ENTROPY_BWD = OpInfo("cross_entropy_bwd", (
    # Through a copy: on CUDA the op scales its grad and applied in place (the forward's
    # residuals), which would change the reference's inputs here.
    Sample((T((5, 7)), T((), dtype=torch.float32, low=0.5, high=2), T(())),
           lambda grad, applied, g: (grad.double() * g.double() / applied).to(grad.dtype),
           name="scaled", define=lambda o, grad, applied, g: o.cross_entropy_bwd(
               o.set(grad), o.set(applied), g)),
))
def _carried(x, loss, grad, applied):
    """``loss``'s value with ``grad / applied`` as its gradient in ``x`` (cross_entropy_carry's
    contract: ``grad`` holds the gradient already scaled by ``applied``); loss, grad and
    applied themselves are residuals, they get no gradient."""
    linear = (x * (grad / applied).detach()).sum()
    return loss.detach() + linear - linear.detach()


CROSS_ENTROPY_CARRY = OpInfo("cross_entropy_carry", (
    Sample((T((5, 7)), _index((5,), 6), T(()), T((5, 7)), T((), dtype=torch.float32)),
           lambda x, t, loss, grad, applied: (_carried(x, loss, grad, applied), grad.detach()),
           name="passes-on"),
))


OP_TABLE: tuple[OpInfo, ...] = (
    *(unary_info(n) for n in UNARY_FLOAT + UNARY_SAME),
    *(binary_info(n) for n in BINARY_ARITH + COMPARE + LOGICAL),
    WHERE, GELU, GELU_BACKWARD, CAST, SET,
    *(reduction_info(n) for n in ("max", "mean", "min", "prod", "sum")), VAR_MEAN,
    BROADCAST_IN_DIM, BROADCAST, STRIDE_ORDER, EXPAND, SQUEEZE, PERMUTE, RESHAPE, SLICE,
    SLICE_BACKWARD, CAT, SPLIT, TAKE_ALONG_AXIS, GATHER, INDEX_SELECT, EMBEDDING_FWD,
    TAKE_ALONG_AXIS_BACKWARD, INDEX_SELECT_BACKWARD, IOTA, STOP_GRADIENT, MATMUL, LINEAR, GROUPED_MM, SDPFA_FWD, SDPFA_BWD,
    UNIFORM, NORMAL, RAND_LIKE, RANDN_LIKE,
    MOE_ROUTE, MOE_ROUTE_BWD, MOE_TOKEN_COUNTS, MOE_EXPERTS, MOE_EXPERTS_BWD,
    CROSS_ENTROPY_FWD, CROSS_ENTROPY_BWD, CROSS_ENTROPY_CARRY,
)
