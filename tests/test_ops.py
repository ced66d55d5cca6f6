"""Every registered op against its PyTorch reference: an op table, as Thunder's OpInfo.

Each :class:`OpInfo` lists :class:`Sample` s: the op's arguments, written as input specs
(:class:`T` a tensor input, :class:`S` a scalar) and static values, and a torch reference.
Each sample runs as a fusion of that one op (``Sample.define`` may add a producer, as for
``sdpfa_bwd``), for every dtype the op supports and every device, with its tensor inputs
declared twice: with static extents and with symbolic (``-1``) extents. Checked:

- the output's dtype and shape equal the reference's on the same inputs, and so does the
  output TensorView the shape rule declared (its dtype and materialized extents: exact when
  the inputs are static; where symbolic, every static extent it claims);
- the values equal the reference's computed in float64 from the same inputs (floating inputs
  upcast), within a tolerance for the dtype under test.

Axes of extent 1 are always declared 1 (broadcast). A test checks that every op of the
registry has samples, so a new op without samples fails here.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from meshfuse import DataType, DefinitionError, FusionDefinition
from meshfuse.ops.registry import REGISTRY, Kind

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


def unary_info(name: str) -> OpInfo:
    fn = _torch_fn(name)
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
    fn = binary_ref(_torch_fn(name))
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

# Expr.inputs does not look into list arguments (ir/fusion.py), so the sharding check of any
# fusion with cat fails; strict, so that the fix turns these into failures to remove the mark.
CAT = OpInfo("cat", (
    Sample(([T((2, 6)), T((3, 6))], 0), lambda xs, d: torch.cat(xs, d), name="dim0"),
    Sample(([T((4, 2)), T((4, 1)), T((4, 3))], -1), lambda xs, d: torch.cat(xs, d),
           name="three-negative-dim"),
    Sample(([T((2, 6), dtype=torch.bfloat16), T((2, 6))], 1), lambda xs, d: torch.cat(xs, d),
           name="promotes"),
), FLOATS + INTS + BOOL)


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
))


# Attention: the reference is torch's SDPA (and its autograd) on the math backend.
def _sdpa(q, k, v, is_causal, scale):
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
    return _sdpa(q, k, v, is_causal, scale), _lse(q, k, is_causal, scale)


def sdpfa_bwd_ref(grad, q, k, v, is_causal, scale=None):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out = _sdpa(*leaves, is_causal, scale)
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


def _qkv(shape):
    b, h, s, skv, e = shape
    return T((b, h, s, e)), T((b, h, skv, e)), T((b, h, skv, e))


SDPFA_FWD = OpInfo("sdpfa_fwd", tuple(
    Sample((*_qkv(shape), 0.0, causal, scale), sdpfa_fwd_ref, name=name, check=(0, 1),
           tol=ATTENTION_TOL, scaled_atol=True)
    for name, (shape, causal, scale) in ATTENTION_CASES.items()
))
SDPFA_BWD = OpInfo("sdpfa_bwd", tuple(
    Sample((T(shape[:3] + shape[4:]), *_qkv(shape), causal, scale), sdpfa_bwd_ref,
           define=_fwd_then_bwd, name=name, tol=ATTENTION_TOL, scaled_atol=True)
    for name, (shape, causal, scale) in ATTENTION_CASES.items()
))


OP_TABLE: tuple[OpInfo, ...] = (
    *(unary_info(n) for n in UNARY_FLOAT + UNARY_SAME),
    *(binary_info(n) for n in BINARY_ARITH + COMPARE + LOGICAL),
    WHERE, GELU, GELU_BACKWARD, CAST, SET,
    *(reduction_info(n) for n in ("max", "mean", "min", "prod", "sum")), VAR_MEAN,
    BROADCAST_IN_DIM, EXPAND, SQUEEZE, PERMUTE, RESHAPE, SLICE, CAT,
    MATMUL, LINEAR, SDPFA_FWD, SDPFA_BWD,
)


# ----------------------------------------------------------------------------------------------
# Running a sample


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def make_tensor(spec: T, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    dtype = spec.dtype or dtype
    if dtype is torch.bool:
        x = torch.rand(spec.shape, generator=gen) < 0.5
    elif dtype.is_floating_point:
        x = torch.rand(spec.shape, generator=gen, dtype=torch.float64)
        x = (spec.low + (spec.high - spec.low) * x).to(dtype)
    else:
        low, high = math.ceil(spec.low), math.floor(spec.high)
        x = torch.randint(low, max(high, low) + 1, spec.shape, generator=gen, dtype=dtype)
    if spec.stride_order is not None:
        x = to_stride_order(x, spec.stride_order)
    return x.to(device)


def to_stride_order(x: torch.Tensor, stride_order) -> torch.Tensor:
    """``x``'s values laid out in ``stride_order`` (0 = innermost axis)."""
    memory = sorted(range(x.ndim), key=lambda a: -stride_order[a])
    return x.permute(memory).contiguous().permute([memory.index(a) for a in range(x.ndim)])


def concrete(args, dtype, device, gen) -> list:
    """The sample's arguments with T made tensors and S made values (same structure)."""
    def one(a):
        if isinstance(a, T):
            return make_tensor(a, dtype, device, gen)
        if isinstance(a, S):
            return a.value
        if isinstance(a, list) and a and isinstance(a[0], T):
            return [one(x) for x in a]
        return a

    return [one(a) for a in args]


def declared_shape(spec: T, x: torch.Tensor, symbolic: bool) -> list[int]:
    return [1 if n == 1 else -1 if symbolic and not spec.static else n for n in x.shape]


def declare(fd: FusionDefinition, spec, value, symbolic: bool, inputs: list):
    """The fusion value for one argument (T: a tensor input, S: a scalar), appending what
    execute must get to ``inputs``; static arguments are returned as they are."""
    if isinstance(spec, T):
        inputs.append(value)
        return fd.define_tensor(declared_shape(spec, value, symbolic),
                                dtype=DataType.from_torch(value.dtype),
                                stride_order=spec.stride_order)
    if isinstance(spec, S) and spec.how == "const":
        return fd.define_scalar(spec.value)
    if isinstance(spec, S) and spec.how == "input":
        inputs.append(spec.value)
        return fd.define_scalar(dtype=_scalar_dtype(spec.value))
    if isinstance(spec, list) and spec and isinstance(spec[0], T):
        return [declare(fd, s, v, symbolic, inputs) for s, v in zip(spec, value)]
    return value


def build_and_run(sample: Sample, op: str, values: list, symbolic: bool):
    """Defines the sample's fusion; returns the output TensorViews and the executed outputs."""
    inputs = []
    with FusionDefinition() as fd:
        args = [declare(fd, s, v, symbolic, inputs) for s, v in zip(sample.args, values)]
        if sample.define is not None:
            outs = sample.define(fd.ops, *args, **sample.kwargs)
        else:
            outs = getattr(fd.ops, op)(*args, **sample.kwargs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for o in outs:
            fd.add_output(o)
    return outs, fd.execute(inputs)


def _scalar_dtype(value) -> DataType:
    if isinstance(value, bool):
        return DataType.Bool
    return DataType.Int if isinstance(value, int) else DataType.Double


def upcast(values):
    """Floating tensors made float64 (the reference computes in double precision)."""
    def one(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.double()
        if isinstance(v, list):
            return [one(x) for x in v]
        return v

    return [one(v) for v in values]


def as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def assert_matches(actual: torch.Tensor, like: torch.Tensor, precise: torch.Tensor,
                   sample: Sample, what: str, dtype: torch.dtype | None = None) -> None:
    """``actual`` has the dtype, shape and device of ``like`` (the reference on the same
    inputs) and the values of ``precise`` (the float64 reference) within the tolerance of the
    looser of its dtype and ``dtype`` (the inputs' floating dtype)."""
    assert actual.dtype == like.dtype, f"{what}: dtype {actual.dtype}, reference {like.dtype}"
    assert actual.shape == like.shape, f"{what}: shape {list(actual.shape)}, reference " \
        f"{list(like.shape)}"
    assert actual.device == like.device, what
    if not like.is_floating_point() and not like.is_complex():
        torch.testing.assert_close(actual, precise.to(like.dtype), rtol=0, atol=0, msg=what)
        return
    tolerances = sample.tol or TOLERANCES
    candidates = [d for d in (like.dtype, dtype) if d is not None and d.is_floating_point]
    rtol, atol = max(tolerances.get(d, TOLERANCES[d]) for d in candidates)
    if sample.scaled_atol and precise.numel():
        atol *= max(1.0, precise.abs().max().item())
    torch.testing.assert_close(actual.double(), precise.double(), rtol=rtol, atol=atol,
                               equal_nan=True, msg=lambda m: f"{what}: {m}")


def assert_declared(tv, like: torch.Tensor, symbolic: bool, what: str) -> None:
    """The shape rule's TensorView agrees with the reference's dtype and shape."""
    assert tv.dtype.torch_dtype == like.dtype, f"{what}: declared {tv.dtype}, got {like.dtype}"
    ids = tv.materialized()
    extents = [i.extent for i in ids]
    assert len(extents) == like.ndim, f"{what}: declared {extents}, reference {list(like.shape)}"
    for axis, (id_, n) in enumerate(zip(ids, like.shape)):
        assert id_.extent in ((None, n) if symbolic else (n,)), \
            f"{what}: declared extents {extents}, reference shape {list(like.shape)}"
        assert not id_.is_broadcast or n == 1, f"{what}: axis {axis} is declared broadcast"


# ----------------------------------------------------------------------------------------------
# Tests


def _modes(sample: Sample, dtype, info: OpInfo) -> tuple[str, ...]:
    # Symbolic extents are a matter of the shape rule, not of the dtype: once per sample.
    if sample.needs_static or dtype is not info.dtypes[0]:
        return ("static",)
    return ("static", "symbolic")


def _cases():
    for info in OP_TABLE:
        for sample in info.samples:
            for device in DEVICES:
                for dtype in info.dtypes:
                    for mode in _modes(sample, dtype, info):
                        dt = str(dtype).removeprefix("torch.")
                        yield pytest.param(info, sample, dtype, device, mode,
                                           id=f"{info.name}-{sample.name}-{dt}-{device}-{mode}",
                                           )


@pytest.mark.parametrize("info, sample, dtype, device, mode", list(_cases()))
def test_op_matches_torch(info: OpInfo, sample: Sample, dtype, device, mode):
    values = concrete(sample.args, dtype, device, _generator(info.name, sample.name, dtype))
    tvs, outs = build_and_run(sample, info.name, values, symbolic=mode == "symbolic")
    like = as_tuple(sample.ref(*values))
    precise = as_tuple(sample.ref(*upcast(values)))
    checked = sample.check if sample.check is not None else range(len(like))
    assert len(outs) == len(tvs) == (len(like) if sample.check is None else len(outs))
    for i in checked:
        what = f"{info.name}[{sample.name}] output {i}"
        assert_declared(tvs[i], like[i], mode == "symbolic", what)
        assert_matches(outs[i], like[i], precise[i], sample, what, dtype)


def test_every_registered_op_has_samples():
    assert {info.name for info in OP_TABLE} == set(REGISTRY)
    assert len(OP_TABLE) == len(REGISTRY), "an op has two OpInfos"
    assert all(info.samples for info in OP_TABLE)


def _rejections():
    for info in OP_TABLE:
        for dtype in info.rejects:
            yield pytest.param(info, dtype, id=f"{info.name}-{str(dtype).removeprefix('torch.')}")


@pytest.mark.parametrize("info, dtype", list(_rejections()))
def test_unsupported_dtype_is_a_definition_error(info: OpInfo, dtype):
    """A dtype PyTorch has no kernel for is refused when the op is defined, not at run time."""
    sample = info.samples[0]
    values = concrete(sample.args, dtype, "cpu", _generator(info.name, dtype))
    with pytest.raises(DefinitionError, match=info.name):
        build_and_run(sample, info.name, values, symbolic=False)


# A value of the wrong kind for each kind of parameter; TENSOR stands for a tensor input.
TENSOR = object()
WRONG_VALUES = {
    Kind.TENSOR: (("string", "x"),),
    Kind.TENSORS: (("string", "x"),),
    Kind.OPERAND: (("string", "x"),),
    Kind.SCALAR: (("tensor", TENSOR),),
    Kind.ATTR: (("tensor", TENSOR), ("string", "x")),
}


def _wrong_arguments():
    for info in OP_TABLE:
        sample = next((s for s in info.samples if s.define is None), None)
        for param in REGISTRY[info.name].params if sample else ():
            for label, value in WRONG_VALUES[param.kind]:
                yield pytest.param(info, sample, param.name, value,
                                   id=f"{info.name}-{param.name}-{label}")


@pytest.mark.parametrize("info, sample, name, wrong", list(_wrong_arguments()))
def test_wrong_argument_is_a_definition_error(info: OpInfo, sample: Sample, name: str, wrong):
    """Every parameter of every op refuses a value of the wrong kind when the op is added
    (never a bare Python or PyTorch exception, never a failure at run time)."""
    values = concrete(sample.args, info.dtypes[0], "cpu", _generator(info.name))
    params = [p.name for p in REGISTRY[info.name].params]
    with pytest.raises(DefinitionError, match=info.name), FusionDefinition() as fd:
        args = [declare(fd, s, v, False, []) for s, v in zip(sample.args, values)]
        call = dict(zip(params, args)) | sample.kwargs
        call[name] = fd.define_tensor([2]) if wrong is TENSOR else wrong
        getattr(fd.ops, info.name)(**call)


def test_sdpfa_fwd_rng_state_is_zero_dim_int64():
    values = concrete(_qkv((1, 2, 8, 8, 8)), torch.float32, DEVICES[-1], _generator("rng"))
    with FusionDefinition() as fd:
        q, k, v = (fd.define_tensor([-1] * 4) for _ in range(3))
        _, _, seed, offset = fd.ops.sdpfa_fwd(q, k, v, 0.0, False)
        fd.add_output(seed)
        fd.add_output(offset)
    for tv, out in zip((seed, offset), fd.execute(values)):
        assert tv.dtype is DataType.Int and tv.ndim == 0
        assert out.dtype == torch.int64 and out.ndim == 0


# ----------------------------------------------------------------------------------------------
# Memory order: outputs follow their inputs' layout


def stride_order_of(x: torch.Tensor) -> list[int]:
    """``stride_order`` of ``x`` (0 = innermost), ties broken toward row-major."""
    order = sorted(range(x.ndim), key=lambda a: (x.stride(a), -a))
    return [order.index(a) for a in range(x.ndim)]


COLUMN_MAJOR = (0, 1)
BSHE = (3, 1, 2, 0)
LAYOUT_CASES = {
    "relu-column-major": ("relu", (T((6, 5), stride_order=COLUMN_MAJOR),), {}),
    "add-number-column-major": ("add", (T((6, 5), stride_order=COLUMN_MAJOR), S(1.5)), {}),
    "mul-broadcast-row": ("mul", (T((6, 5), stride_order=COLUMN_MAJOR), T((1, 5))), {}),
    "cast-bshe": ("cast", (T((2, 3, 4, 5), stride_order=BSHE), DataType.BFloat16), {}),
    "gelu-bshe": ("gelu", (T((2, 3, 4, 5), stride_order=BSHE), "tanh"), {}),
    "where-bshe": ("where", (T((2, 3, 4, 5), dtype=torch.bool, stride_order=BSHE),
                             T((2, 3, 4, 5), stride_order=BSHE), S(0.5)), {}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["static", "symbolic"])
@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_pointwise_output_follows_input_stride_order(case, mode, device):
    op, args, kwargs = LAYOUT_CASES[case]
    sample = Sample(args, lambda *a: None, kwargs, case)
    values = concrete(args, torch.float32, device, _generator(case))
    (out,) = build_and_run(sample, op, values, symbolic=mode == "symbolic")[1]
    assert stride_order_of(out) == list(args[0].stride_order)
    assert out.stride() == to_stride_order(out, args[0].stride_order).stride()  # dense


@pytest.mark.parametrize("device", DEVICES)
def test_reduction_keeps_input_order_of_remaining_axes(device):
    sample = Sample((T((2, 3, 4, 5), stride_order=BSHE),), lambda x: None, {"dims": [3]})
    values = concrete(sample.args, torch.float32, device, _generator("bshe-sum"))
    (out,) = build_and_run(sample, "sum", values, symbolic=True)[1]
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out, values[0].sum(3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_bshe_in_gives_bshe_out(causal, dtype, device):
    """BSHE q/k/v (and grad) give BSHE attn and gradients, with the reference's values."""
    shape = (2, 3, 16, 8)
    specs = (T(shape, stride_order=BSHE),) * 4
    grad, q, k, v = concrete(specs, dtype, device, _generator("bshe", causal, dtype))
    assert q.transpose(1, 2).is_contiguous() and not q.is_contiguous()
    sample = Sample(specs, sdpfa_bwd_ref, tol=ATTENTION_TOL, scaled_atol=True)

    def define(ops, g, q, k, v):
        attn, lse, seed, offset = ops.sdpfa_fwd(q, k, v, 0.0, causal)
        return (attn, *ops.sdpfa_bwd(g, q, k, v, attn, lse, 0.0, causal, seed, offset))

    sample = dataclasses.replace(sample, define=define)
    _, outs = build_and_run(sample, "sdpfa_bwd", [grad, q, k, v], symbolic=True)
    for name, out in zip(("attn", "q_grad", "k_grad", "v_grad"), outs):
        assert out.transpose(1, 2).is_contiguous(), f"{name} strides {out.stride()}"
    precise = upcast([grad, q, k, v])
    expected = (_sdpa(*precise[1:], causal, None), *sdpfa_bwd_ref(*precise, causal))
    for name, out, ref in zip(("attn", "q_grad", "k_grad", "v_grad"), outs, expected):
        assert_matches(out, ref.to(dtype), ref, sample, name)
