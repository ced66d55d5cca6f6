"""Composite ops (``fd.ops.softmax``, ``log_softmax``, ``layer_norm``, ``rms_norm``,
``cross_entropy``) against torch, as a table: each composite, its arguments, the torch call
it stands for; in float32 and bfloat16 (computed in float32, as PyTorch does), on one
process and through the compiled path; bad arguments as DefinitionErrors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshfuse import DataType, DefinitionError, FusionDefinition

SHAPE = (4, 6)
TORCH_DTYPE = {DataType.Float: torch.float32, DataType.BFloat16: torch.bfloat16}


def _weight(fd, dtype):
    return fd.define_tensor([SHAPE[-1]], dtype=dtype)


# name -> (define(fd, x, dtype) -> (output, extra inputs' shapes), torch(x, *extra))
CASES = {
    "softmax": (lambda fd, x, dt: (fd.ops.softmax(x, -1), []),
                lambda x: torch.softmax(x, -1)),
    "softmax_dim0": (lambda fd, x, dt: (fd.ops.softmax(x, 0), []),
                     lambda x: torch.softmax(x, 0)),
    "log_softmax": (lambda fd, x, dt: (fd.ops.log_softmax(x, 1), []),
                    lambda x: torch.log_softmax(x, 1)),
    "layer_norm": (lambda fd, x, dt: _affine(fd, x, dt, fd.ops.layer_norm, bias=True),
                   lambda x, w, b: F.layer_norm(x, [SHAPE[-1]], w, b)),
    "layer_norm_plain": (lambda fd, x, dt: (fd.ops.layer_norm(x, eps=1e-3), []),
                         lambda x: F.layer_norm(x, [SHAPE[-1]], eps=1e-3)),
    "rms_norm": (lambda fd, x, dt: _affine(fd, x, dt, fd.ops.rms_norm, bias=False),
                 lambda x, w: F.rms_norm(x, [SHAPE[-1]], w)),
    "cross_entropy": (lambda fd, x, dt: _probabilities(fd, x, dt, "mean"),
                      lambda x, t: F.cross_entropy(x.float(), t.float()).to(x.dtype)),
    "cross_entropy_none": (lambda fd, x, dt: _probabilities(fd, x, dt, "none"),
                           lambda x, t: F.cross_entropy(x.float(), t.float(),
                                                        reduction="none").to(x.dtype)),
}


def _affine(fd, x, dtype, op, bias):
    w = _weight(fd, dtype)
    if not bias:
        return op(x, w), [w]
    b = _weight(fd, dtype)
    return op(x, w, b), [w, b]


def _probabilities(fd, x, dtype, reduction):
    t = fd.define_tensor(list(SHAPE), dtype=dtype)
    return fd.ops.cross_entropy(x, t, reduction), [t]


def _run(name, dtype, compile):
    define, reference = CASES[name]
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(SHAPE), dtype=dtype)
        out, extra = define(fd, x, dtype)
        fd.add_output(out)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(SHAPE, generator=gen).to(TORCH_DTYPE[dtype])]
    for tv in extra:
        shape = [int(i.extent) for i in tv.materialized()]
        value = torch.rand(shape, generator=gen)
        if name.startswith("cross_entropy"):
            value = value / value.sum(1, keepdim=True)  # class probabilities
        inputs.append(value.to(TORCH_DTYPE[dtype]))
    got, = fd.execute(inputs, compile=compile)
    want = reference(*inputs)
    assert got.dtype == want.dtype
    tol = 1e-5 if dtype is DataType.Float else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.BFloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_composite_matches_torch(name, dtype):
    _run(name, dtype, compile=False)


@pytest.mark.parametrize("name", ["softmax", "layer_norm"])
def test_composite_compiled_matches_torch(name):
    _run(name, DataType.Float, compile="aot_eager")


def test_composite_arguments_are_checked():
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(SHAPE), dtype=DataType.Float)
        with pytest.raises(DefinitionError, match=r"softmax: dim 2 is out of range for T0"):
            fd.ops.softmax(x, 2)
        with pytest.raises(DefinitionError, match=r"layer_norm: normalized_ndim 3"):
            fd.ops.layer_norm(x, normalized_ndim=3)
        labels = fd.define_tensor([SHAPE[0], 2], dtype=DataType.Int)
        with pytest.raises(DefinitionError, match=r"cross_entropy: target T1 of class indices"):
            fd.ops.cross_entropy(x, labels)
        with pytest.raises(DefinitionError, match=r"cross_entropy: label_smoothing 2"):
            fd.ops.cross_entropy(x, labels, label_smoothing=2.0)
    assert {"softmax", "rms_norm"} <= set(dir(fd.ops))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [DataType.Float, DataType.BFloat16])
def test_cross_entropy_result_has_one_structure_for_static_and_symbolic_extents(dtype,
                                                                                 reduction):
    """With a static class extent the loss is the fused kernel's, elsewhere fusion ops: both
    are a sum over the rows (one reduced loop axis), so a schedule drawn for one applies to
    the other (fuzz seed 2107)."""
    def loop_of(shape):
        with FusionDefinition() as fd:
            logits = fd.define_tensor(shape, dtype=dtype)
            target = fd.define_tensor(shape[:1], dtype=DataType.Int32)
            loss = fd.ops.cross_entropy(logits, target, reduction=reduction)
            fd.add_output(loss)
        return [i.iter_type for i in loss.loop]

    assert loop_of([5, 3]) == loop_of([-1, -1]) == loop_of([5, -1]) != []
