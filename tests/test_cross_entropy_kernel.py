"""The fused cross entropy on class indices (``meshfuse/ops/cross_entropy``).

Its Triton kernels run on CUDA where there is a GPU, else under the Triton interpreter (CPU
tensors): Triton reads ``TRITON_INTERPRET`` when it is imported, so
``test_under_the_triton_interpreter`` runs this file's ``test_kernel_`` tests in a process
started with ``TRITON_INTERPRET=1`` (they run in this one when it was started so). Each is checked against
``F.cross_entropy(logits.float())`` and its autograd gradient: bf16 and float32, class
counts that are and are not a power of two, rows read whole and in blocks, ignored rows,
``mean`` and ``sum``, cotangents 1.0 and not. Without Triton they skip. The op's contract
(the backward's residual is the gradient, not the logits) is checked without Triton.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import meshfuse
from meshfuse import DataType, FusionDefinition
from meshfuse.ops.cross_entropy import kernels
from meshfuse.testing.utils import current_device

INTERPRETED = kernels.INTERPRETED and kernels.triton is not None
ON_GPU = kernels.triton is not None and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
kernel_test = pytest.mark.skipif(
    not (INTERPRETED or ON_GPU), reason="needs a GPU, or TRITON_INTERPRET=1 when Triton is "
    "imported (test_under_the_triton_interpreter runs these so)")
IGNORE = -100
MEAN_SUM = [("mean", 0.0), ("sum", 0.1)]
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 2e-3}}


def _inputs(rows: int, classes: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, classes, generator=gen) * 3).to(dtype)
    t = torch.randint(0, classes, (rows,), generator=gen)
    t[1] = IGNORE
    return x.to(DEVICE), t.to(DEVICE)


def _reference(x, t, reduction: str, smoothing: float, cotangent: float = 1.0):
    """``F.cross_entropy(x.float())`` and its gradient in ``x``'s dtype."""
    leaf = x.float().requires_grad_()
    loss = F.cross_entropy(leaf, t, reduction=reduction, ignore_index=IGNORE,
                           label_smoothing=smoothing)
    (loss * cotangent).backward()
    return loss.detach(), leaf.grad.to(x.dtype)


def test_under_the_triton_interpreter():
    if INTERPRETED or ON_GPU:
        pytest.skip("the kernel tests run in this process")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          __file__, "-k", "test_kernel_"], env=env, capture_output=True,
                         text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 20 and "skipped" not in run.stdout, run.stdout


@kernel_test
@pytest.mark.parametrize("reduction,smoothing", MEAN_SUM)
@pytest.mark.parametrize("variant", ["one_block", "blocks", "long_row_blocks"])
@pytest.mark.parametrize("classes", [16, 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_forward(dtype, classes, variant, reduction, smoothing):
    """Loss and gradient of the summed (or mean) loss; a row held whole, or read in blocks
    of 8 classes (37: the last block partial), in either configuration of a row read in
    blocks."""
    x, t = _inputs(5, classes, dtype)
    count = (t != IGNORE).sum().float() if reduction == "mean" else None
    loss, grad, applied = kernels.forward(x, t, count, IGNORE, smoothing,
                                          one_block_max=64 if variant == "one_block" else 8,
                                          chunk=8, long_row=8 if "long_row" in variant else 64)
    ref_loss, ref_grad = _reference(x, t, reduction, smoothing)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grad.dtype == dtype and applied.item() == 1.0
    torch.testing.assert_close(grad, ref_grad, **TOL[dtype])
    assert (grad[1] == 0).all()  # the ignored row


@kernel_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_a_row_whose_later_block_is_far_above_its_first(dtype):
    """A later logit 100 above the first block's maximum (its exponential from there would
    overflow float32) rescales the sums kept so far, and the loss and gradient stay exact;
    no row is NaN or infinite."""
    x, t = _inputs(4, 37, dtype)
    x[0, 30] = 100.0  # block 3 of row 0
    x[2, 9] = -100.0  # far below: exp underflows to 0, as in any softmax
    count = (t != IGNORE).sum().float()
    loss, grad, _ = kernels.forward(x, t, count, IGNORE, 0.0, one_block_max=8, chunk=8,
                                    long_row=8)
    ref_loss, ref_grad = _reference(x, t, "mean", 0.0)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, **TOL[dtype])


@kernel_test
def test_kernel_target_out_of_range_is_nan_not_a_value():
    x, t = _inputs(4, 16, torch.float32)
    t[2] = 16
    for one_block_max in (64, 8):
        loss, grad, _ = kernels.forward(x, t, None, IGNORE, 0.0, one_block_max=one_block_max,
                                        chunk=8)
        assert loss.isnan() and grad[2].isnan().all() and grad[0].isfinite().all()


@kernel_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_scale_in_place(dtype):
    """Nothing moves for a cotangent of 1.0; another scales in place from the scale
    applied before (a second backward through kept residuals)."""
    grad = torch.randn(3, 37).to(dtype).to(DEVICE)
    original = grad.clone()
    applied = torch.ones((), device=DEVICE)
    def cotangent(value):
        return torch.tensor(value, dtype=dtype, device=DEVICE)

    assert kernels.scale_in_place(grad, applied, cotangent(1.0)) is grad
    assert torch.equal(grad, original)
    kernels.scale_in_place(grad, applied, cotangent(0.5))
    assert torch.equal(grad, original * 0.5) and applied.item() == 0.5
    kernels.scale_in_place(grad, applied, cotangent(-3.0))
    torch.testing.assert_close(grad, original * -3.0, **TOL[dtype])
    assert applied.item() == -3.0


def _fusion(rows: int, classes: int, dtype: DataType, reduction: str, smoothing: float):
    with FusionDefinition() as fd:
        x = fd.define_tensor([rows, classes], dtype=dtype)
        t = fd.define_tensor([rows], dtype=DataType.Int)
        fd.add_output(fd.ops.cross_entropy(x, t, reduction=reduction, ignore_index=IGNORE,
                                           label_smoothing=smoothing))
    return fd


@kernel_test
@pytest.mark.parametrize("cotangent", [1.0, 2.5])
@pytest.mark.parametrize("reduction,smoothing", MEAN_SUM)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_fusion_forward_and_backward(dtype, reduction, smoothing, cotangent):
    """``fd.ops.cross_entropy`` through ``as_autograd_function``: the loss in the logits'
    dtype, the gradient scaled by the loss's cotangent."""
    x, t = _inputs(6, 37, dtype, seed=1)
    function = _fusion(6, 37, DataType.from_torch(dtype), reduction,
                       smoothing).as_autograd_function()
    leaf = x.clone().requires_grad_()
    (loss,) = function([leaf, t])
    (loss * cotangent).backward()
    ref_loss, ref_grad = _reference(x, t, reduction, smoothing, cotangent)
    assert loss.dtype == dtype
    torch.testing.assert_close(loss.float(), ref_loss, **TOL[dtype])
    torch.testing.assert_close(leaf.grad, ref_grad, **TOL[dtype])


def test_backward_keeps_the_gradient_not_the_logits():
    """The derived backward reads one [rows, classes] residual, the forward's gradient (the
    logits are not kept), and only scales it."""
    bwd = meshfuse.vjp(_fusion(4, 10, DataType.BFloat16, "mean", 0.0))
    big = [r for r in bwd.derivation.residuals
           if r.kind == "input" or _extents(bwd.forward, r) == [4, 10]]
    assert [r.kind for r in big] == ["output"], bwd.derivation.residuals
    ops = [e.op.name for e in bwd.fusion.exprs if e.op is not None]
    assert ops.count("cross_entropy_bwd") == 1 and "exp" not in ops, ops


@pytest.mark.parametrize("cotangent", [1.0, 2.5])
def test_float32_cast_of_half_logits_is_read_through(cotangent):
    """``F.cross_entropy(logits.float().view(-1, V), t)`` (Hugging Face's losses): the op
    reads the bf16 logits (the float32 copy is never made: the derived forward has no cast
    of them) and keeps a bf16 gradient as the residual; loss and gradient are torch's."""
    b, s, v = 2, 3, 37
    with FusionDefinition() as fd:
        x = fd.define_tensor([b, s, v], dtype=DataType.BFloat16)
        t = fd.define_tensor([b * s], dtype=DataType.Int)
        wide = fd.ops.reshape(fd.ops.cast(x, DataType.Float), [b * s, v])
        fd.add_output(fd.ops.cross_entropy(wide, t, ignore_index=IGNORE))
    bwd = meshfuse.vjp(fd)
    forward = bwd.forward.fusion
    assert not any(e.op is not None and e.op.name == "cast" and e.outputs[0].ndim == 3
                   for e in forward.exprs), forward
    big = [forward.outputs()[r.index] for r in bwd.derivation.residuals
           if r.kind == "output" and forward.outputs()[r.index].ndim == 2]
    assert [r.dtype for r in big] == [DataType.BFloat16]
    logits, target = _inputs(b * s, v, torch.bfloat16, seed=3)
    logits = logits.reshape(b, s, v)
    leaf = logits.clone().requires_grad_()
    (loss,) = fd.as_autograd_function()([leaf, target])
    (loss * cotangent).backward()
    ref = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref.float().view(-1, v), target, ignore_index=IGNORE)
    (ref_loss * cotangent).backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad, ref.grad, **TOL[torch.bfloat16])


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_logits_the_forward_returns_are_kept_not_a_gradient(smoothing):
    """A model that returns its logits beside the loss (``transformers``' causal language
    models do): the logits' memory is held anyway, so the backward keeps them (no
    [rows, classes] gradient beside them: that doubled the head's memory) and computes the
    gradient from them; the forward computes the loss alone (no gradient written). Loss
    and gradients are PyTorch's."""
    b, s, h, v = 2, 3, 8, 37
    with FusionDefinition() as fd:
        x = fd.define_tensor([b, s, h], dtype=DataType.Double)
        w = fd.define_tensor([v, h], dtype=DataType.Double)
        t = fd.define_tensor([b * s], dtype=DataType.Int)
        logits = fd.ops.linear(x, w)
        fd.add_output(logits)
        fd.add_output(fd.ops.cross_entropy(fd.ops.reshape(logits, [b * s, v]), t,
                                           ignore_index=IGNORE, label_smoothing=smoothing))
    bwd = meshfuse.vjp(fd)
    forward = bwd.forward.fusion
    kept = [forward.outputs()[r.index] for r in bwd.derivation.residuals
            if r.kind == "output" and forward.outputs()[r.index].ndim >= 2]
    assert kept == [forward.outputs()[0]], bwd.derivation.residuals  # the logits alone
    xs = torch.randn(b, s, h, dtype=torch.float64)
    ws = torch.randn(v, h, dtype=torch.float64)
    _, target = _inputs(b * s, v, torch.float64, seed=4)
    here = [t.to(current_device()) for t in (xs, ws, target)]
    assert "the loss only (no gradient read)" in bwd.forward.explain(here, verbose=True)
    leaves = [here[0].clone().requires_grad_(), here[1].clone().requires_grad_()]
    out_logits, loss = fd.as_autograd_function()([*leaves, here[2]])
    (2.5 * loss + (out_logits * 0.5).sum()).backward()
    ref = [xs.clone().requires_grad_(), ws.clone().requires_grad_()]
    ref_logits = F.linear(*ref)
    ref_loss = F.cross_entropy(ref_logits.view(-1, v), target.cpu(), ignore_index=IGNORE,
                               label_smoothing=smoothing)
    (2.5 * ref_loss + (ref_logits * 0.5).sum()).backward()
    torch.testing.assert_close(loss.cpu(), ref_loss.detach())
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad.cpu(), want.grad)


def _extents(forward, residual) -> list:
    out = forward.fusion.outputs()[residual.index]
    return [i.extent for i in out.materialized()]


def test_symbolic_classes_and_none_reduction_are_not_fused():
    """Where the kernel's conditions fail (a symbolic class extent, ``reduction="none"``),
    the composite of fusion ops computes the loss."""
    for shape, reduction in (([4, -1], "mean"), ([4, 10], "none")):
        with FusionDefinition() as fd:
            x = fd.define_tensor(shape)
            t = fd.define_tensor([4], dtype=DataType.Int)
            fd.add_output(fd.ops.cross_entropy(x, t, reduction=reduction))
        assert not any(e.op.name == "cross_entropy_fwd" for e in fd.fusion.exprs)


@kernel_test
@pytest.mark.parametrize("one_block", [True, False])
def test_kernel_loss_alone(one_block):
    """Without the gradient store (nothing reads it) the loss is the same."""
    x, t = _inputs(5, 37, torch.float32)
    loss, grad, _ = kernels.forward(x, t, None, IGNORE, 0.1, write_grad=False,
                                    one_block_max=64 if one_block else 8, chunk=8)
    assert grad is None
    torch.testing.assert_close(loss, _reference(x, t, "sum", 0.1)[0], rtol=1e-5, atol=1e-5)


def test_a_forward_alone_does_not_write_the_gradient():
    """``execute`` of the loss alone: the op is told that nothing reads its gradient (its
    note in explain), and the loss is PyTorch's."""
    fd = _fusion(4, 10, DataType.Float, "mean", 0.0)
    x, t = _inputs(4, 10, torch.float32, seed=2)
    assert "the loss only (no gradient read)" in fd.explain([x, t], verbose=True)
    (loss,) = fd.execute([x, t])
    torch.testing.assert_close(loss, _reference(x, t, "mean", 0.0)[0])


@kernel_test
def test_kernel_second_backward_through_kept_residuals():
    """The in-place scaling rescales from the scale the first backward left: two backwards
    (cotangents 2 and 0.5) accumulate 2.5 times the gradient."""
    x, t = _inputs(6, 37, torch.float32, seed=3)
    function = _fusion(6, 37, DataType.Float, "mean", 0.0).as_autograd_function(
        keep_residuals=True)
    leaf = x.clone().requires_grad_()
    (loss,) = function([leaf, t])
    (loss * 2.0).backward(retain_graph=True)
    (loss * 0.5).backward()
    torch.testing.assert_close(leaf.grad, _reference(x, t, "mean", 0.0, 2.5)[1], **TOL[x.dtype])
