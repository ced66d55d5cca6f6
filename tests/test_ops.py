"""Every registered op against its PyTorch reference: an op table, as Thunder's OpInfo.

The table (``op_table.py``) gives each op an :class:`OpInfo` of :class:`Sample` s: the op's
arguments, written as input specs (:class:`T` a tensor input, :class:`S` a scalar) and
static values, and a torch reference. Each sample runs as a fusion of that one op (``Sample.define`` may add a producer, as for
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

import pytest
import torch
from op_table import (
    ATTENTION_TOL,
    DEVICES,
    FLOATS,
    OP_TABLE,
    TOLERANCES,
    OpInfo,
    S,
    Sample,
    T,
    qkv_specs,
    sdpa_ref,
    sdpfa_bwd_ref,
)

from meshfuse import DataType, DefinitionError, FusionDefinition
from meshfuse.ops.registry import REGISTRY, Kind

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
        # a broadcast axis of extent above 1 is an expanded one: its values repeat (the
        # reference's too: a stride-0 axis)
        assert not id_.is_broadcast or n == 1 or like.stride(axis) == 0, \
            f"{what}: axis {axis} is declared broadcast but the reference varies along it"


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


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_sdpfa_fwd_rng_state_has_nvfusers_form(dropout_p):
    """seed: uint64 [2] (the stream's Philox seed and offset), offset: uint64 0-d; zeros
    without dropout. A backward in another fusion takes them as inputs."""
    values = concrete(qkv_specs((1, 2, 8, 8, 8)), torch.float32, DEVICES[-1], _generator("rng"))
    with FusionDefinition() as fd:
        q, k, v = (fd.define_tensor([-1] * 4) for _ in range(3))
        attn, lse, seed, offset = fd.ops.sdpfa_fwd(q, k, v, dropout_p, False, rng_seed=5,
                                                   rng_offset=1)
        for t in (attn, lse, seed, offset):
            fd.add_output(t)
    attn_out, lse_out, *state = fd.execute(values)
    for tv, out, shape in zip((seed, offset), state, ((2,), ())):
        assert tv.dtype is DataType.UInt64 and tv.ndim == len(shape)
        assert out.dtype == torch.uint64 and tuple(out.shape) == shape
    assert (state[0].view(torch.int64) != 0).any() == (dropout_p > 0)
    with FusionDefinition() as bwd:
        g, q, k, v, attn = (bwd.define_tensor([-1] * 4) for _ in range(5))
        lse = bwd.define_tensor([-1] * 3)
        seed = bwd.define_tensor([2], dtype=DataType.UInt64)
        offset = bwd.define_tensor([], dtype=DataType.UInt64)
        for t in bwd.ops.sdpfa_bwd(g, q, k, v, attn, lse, dropout_p, False, seed, offset):
            bwd.add_output(t)
    grads = bwd.execute([torch.ones_like(attn_out), *values, attn_out, lse_out, *state])
    assert all(t.isfinite().all() for t in grads)


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
    expected = (sdpa_ref(*precise[1:], causal, None), *sdpfa_bwd_ref(*precise, causal))
    for name, out, ref in zip(("attn", "q_grad", "k_grad", "v_grad"), outs, expected):
        assert_matches(out, ref.to(dtype), ref, sample, name)


@pytest.mark.parametrize("info", [i for i in OP_TABLE if REGISTRY[i.name].view],
                         ids=lambda i: i.name)
def test_view_ops_return_views_of_their_input(info: OpInfo):
    """An op declared a view (``OpDef.view``: the derivation saves the value it views, not
    the view) runs no kernel: on a contiguous input, its result lies in the input's memory."""
    op = REGISTRY[info.name]
    checked = 0
    for sample in info.samples:
        dtype = info.dtypes[0]
        values = concrete(sample.args, dtype, "cpu", _generator(info.name, sample.name, dtype))
        x = values[0]
        if not x.is_contiguous():
            continue
        checked += 1
        shapes = {"out_shapes": [tuple(sample.ref(*values).shape)]} if op.needs_out_shape else {}
        out = op.impl(*op.bind(values, sample.kwargs), **shapes)
        assert out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), \
            f"{info.name}[{sample.name}]: its result is a copy"
    assert checked, f"{info.name}: no sample with a contiguous input"
