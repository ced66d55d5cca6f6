"""PyTorch SDPA kernels behind sdpfa_fwd/sdpfa_bwd, against a float64 reference.

The reference is ``torch.nn.functional.scaled_dot_product_attention`` on the same inputs cast
to float64, on PyTorch's math backend (an implementation independent of the fused kernels),
and its autograd gradients; the log-sum-exp reference is ``logsumexp(q @ k^T * scale + mask)``
in float64.
"""

from __future__ import annotations

import functools
import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.reproducibility import deterministic_algorithms
from meshfuse.errors import DefinitionError, InputError
from meshfuse.ops.attention import backends as ab
from meshfuse.ops.attention import kernels as ak
from meshfuse.ops.attention.backends import (
    AttentionBackend,
    check_deterministic_backward,
    cudnn_preferred,
    deterministic_only,
    select_backend,
)
from meshfuse.ops.attention.kernels import sdpa_backward, sdpa_forward

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

# (B, H, S, Skv, E, Ev). MEDIUM's lengths take torch's CPU flash kernel through its tiles
# for long sequences (256 query rows by 512 keys from 768 query rows on) on every path;
# one batch of two heads is enough for that, and keeps the float64 reference cheap.
SMALL = (2, 4, 128, 128, 64, 64)
MEDIUM = (1, 2, 1024, 1024, 64, 64)
MEDIUM_KV = (1, 2, 1024, 512, 64, 64)
ODD = (1, 3, 100, 77, 40, 40)  # lengths that are not multiples of 32


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(ab.ENV_VAR, raising=False)


# ----------------------------------------------------------------------------------------------
# Reference


def _case(shape, dtype, causal, scale, device="cpu"):
    """Inputs (BHSE) in ``dtype`` and float64 reference outputs."""
    inputs, reference = _reference(shape, causal, scale, device)
    return tuple(t.to(dtype) for t in inputs), reference


@functools.lru_cache(maxsize=2)
def _reference(shape, causal, scale, device):
    """Inputs (BHSE) and float64 reference outputs, cached across the layouts and dtypes of
    one case: the inputs are bfloat16 values, which float32 holds exactly, so that both dtypes
    run on the same numbers and share one (costly) float64 reference."""
    b, h, s, skv, e, ev = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, causal, scale)).encode()))
    q, k, v, g = (torch.randn(sz, generator=gen).to(torch.bfloat16).float().to(device)
                  for sz in ((b, h, s, e), (b, h, skv, e), (b, h, skv, ev), (b, h, s, ev)))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, scale=scale)
    out.backward(g.double())
    lse = _reference_lse(q.double(), k.double(), causal, scale)
    return (q, k, v, g), (out.detach(), lse, q64.grad, k64.grad, v64.grad)


def _reference_lse(q, k, causal, scale):
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    return torch.logsumexp(scores, dim=-1)


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.contiguous() if layout == "BHSE" else t.transpose(1, 2).contiguous().transpose(1, 2)


def _assert_close(name, actual, expected, dtype):
    """bf16 rounds relative to a tensor's magnitude, so atol scales with its largest entry."""
    assert actual.shape == expected.shape, name
    rtol, atol = (1.6e-2, 1e-2) if dtype != torch.float32 else (1e-4, 1e-5)
    atol *= max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol, msg=name)
    err = (actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)
    assert err < (1e-2 if dtype != torch.float32 else 1e-5), f"{name}: relative error {err}"


def _run_and_check(shape, dtype, layout, causal, scale, backend=None, device="cpu"):
    (q, k, v, g), (out, lse, dq, dk, dv) = _case(shape, dtype, causal, scale, device)
    q, k, v = (_layout(t, layout) for t in (q, k, v))
    backend = backend or select_backend(q, k, v, 0.0, causal)
    attn, log_sumexp, seed, offset = sdpa_forward(q, k, v, 0.0, causal, scale, backend)
    grads = sdpa_backward(g, q, k, v, attn, log_sumexp, 0.0, causal, seed, offset, scale,
                          backend)
    b, h, s, _, _, ev = shape
    assert attn.shape == (b, h, s, ev) and attn.dtype == dtype
    assert log_sumexp.shape == (b, h, s) and log_sumexp.dtype == torch.float32
    if backend in (AttentionBackend.CPU_FLASH, AttentionBackend.MATH):
        for t in (seed, offset):  # no RNG state: zeros; other kernels pass their own back
            assert t.dim() == 0 and t.dtype == torch.int64
    for grad, inp in zip(grads, (q, k, v)):
        assert grad.shape == inp.shape and grad.dtype == dtype
    _assert_close("attn", attn, out, dtype)
    # Every kernel computes the log-sum-exp in float32 whatever the input dtype.
    torch.testing.assert_close(log_sumexp.double(), lse, rtol=1e-5, atol=1e-4)
    for name, grad, ref in zip(("q_grad", "k_grad", "v_grad"), grads, (dq, dk, dv)):
        _assert_close(name, grad, ref, dtype)
    return ab.parse_backend(backend)


# ----------------------------------------------------------------------------------------------
# CPU: values, shapes, dtypes

_CPU_CASES = [
    pytest.param(shape, causal, id=f"{name}-{'causal' if causal else 'full'}")
    for name, shape in (("small", SMALL), ("medium", MEDIUM), ("odd", ODD))
    for causal in (True, False)
] + [pytest.param(MEDIUM_KV, False, id="medium_kv-full")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["BHSE", "BSHE"])
@pytest.mark.parametrize("scale", [None, 0.3], ids=["scale_default", "scale_0.3"])
@pytest.mark.parametrize("shape, causal", _CPU_CASES)
def test_cpu_flash_matches_reference(shape, causal, scale, layout, dtype):
    assert _run_and_check(shape, dtype, layout, causal, scale) is AttentionBackend.CPU_FLASH


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False])
def test_math_matches_reference(causal, dtype):
    _run_and_check(ODD, dtype, "BSHE", causal, 0.3, backend="math")


def test_math_runs_different_head_dims():
    shape = (2, 2, 64, 48, 32, 16)  # Ev != E: the CPU flash kernel refuses it
    assert _run_and_check(shape, torch.float32, "BHSE", True, None) is AttentionBackend.MATH


def test_strided_last_axis_and_broadcast_grad():
    (q, k, v, _), (out, *_) = _case(SMALL, torch.float32, False, None)
    q2 = torch.stack([q, q], dim=-1)[..., 0]  # last-axis stride 2
    attn, lse, seed, offset = sdpa_forward(q2, k, v, 0.0, False)
    _assert_close("attn", attn, out, torch.float32)
    ones = torch.ones(()).expand_as(attn)  # all strides 0
    grads = sdpa_backward(ones, q2, k, v, attn, lse, 0.0, False, seed, offset, None,
                          AttentionBackend.CPU_FLASH)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(q64, k64, v64).sum().backward()
    for name, grad, ref in zip("qkv", grads, (q64.grad, k64.grad, v64.grad)):
        _assert_close(name, grad, ref, torch.float32)


def test_backward_accepts_relaid_outputs():
    """The executor may lay attn and log_sumexp out differently before the backward."""
    (q, k, v, g), (_, _, dq, _, _) = _case(SMALL, torch.float32, True, None)
    q, k, v = (_layout(t, "BSHE") for t in (q, k, v))
    attn, lse, seed, offset = sdpa_forward(q, k, v, 0.0, True)
    grads = sdpa_backward(_layout(g, "BSHE"), q, k, v, attn.contiguous(), lse.contiguous(),
                          0.0, True, seed, offset, None, "cpu_flash")
    _assert_close("q_grad", grads[0], dq, torch.float32)


# ----------------------------------------------------------------------------------------------
# Selection and its overrides


def _qkv(shape=SMALL, dtype=torch.float32, device="cpu", generator=None):
    """Random q, k, v (from torch's global generator unless ``generator`` is given)."""
    b, h, s, skv, e, ev = shape
    return tuple(torch.randn(*size, generator=generator).to(dtype=dtype, device=device)
                 for size in ((b, h, s, e), (b, h, skv, e), (b, h, skv, ev)))


def test_select_backend_cpu():
    q, k, v = _qkv()
    assert select_backend(q, k, v, 0.0, True) is AttentionBackend.CPU_FLASH
    assert select_backend(*_qkv(dtype=torch.bfloat16), 0.0, False) is AttentionBackend.CPU_FLASH
    assert select_backend(q, k, v, 0.0, True, requested="math") is AttentionBackend.MATH
    assert select_backend(q, k, v, 0.0, True, AttentionBackend.MATH) is AttentionBackend.MATH


@pytest.mark.parametrize("value, expected", [
    ("math", AttentionBackend.MATH), ("MATH", AttentionBackend.MATH),
    ("cpu_flash", AttentionBackend.CPU_FLASH), ("auto", AttentionBackend.CPU_FLASH),
])
def test_env_override(monkeypatch, value, expected):
    monkeypatch.setenv(ab.ENV_VAR, value)
    assert select_backend(*_qkv(), 0.0, False) is expected


def test_explicit_request_beats_env(monkeypatch):
    monkeypatch.setenv(ab.ENV_VAR, "math")
    assert select_backend(*_qkv(), 0.0, False, requested="cpu_flash") is AttentionBackend.CPU_FLASH


@pytest.mark.parametrize("name", ["cudnn", "flash", "efficient"])
def test_cuda_backend_on_cpu_is_refused(monkeypatch, name):
    with pytest.raises(InputError, match=rf"'{name}' needs CUDA tensors"):
        select_backend(*_qkv(), 0.0, False, requested=name)
    monkeypatch.setenv(ab.ENV_VAR, name)
    with pytest.raises(InputError, match=rf"'{name}' needs CUDA tensors"):
        select_backend(*_qkv(), 0.0, False)
    with pytest.raises(InputError, match=rf"'{name}' needs CUDA tensors"):
        sdpa_forward(*_qkv(), 0.0, False, None, name)


def test_unknown_backend_names(monkeypatch):
    with pytest.raises(DefinitionError, match="unknown SDPA backend 'fast'.*cpu_flash"):
        select_backend(*_qkv(), 0.0, False, requested="fast")
    monkeypatch.setenv(ab.ENV_VAR, "fast")
    with pytest.raises(DefinitionError, match=f"{ab.ENV_VAR}: unknown SDPA backend"):
        select_backend(*_qkv(), 0.0, False)


def test_cpu_flash_refuses_different_head_dims():
    with pytest.raises(InputError, match="'cpu_flash' needs q/k/v with one head dim"):
        select_backend(*_qkv((1, 1, 8, 8, 16, 8)), 0.0, False, requested="cpu_flash")


def test_selection_is_cached(monkeypatch):
    monkeypatch.setattr(ab, "_SELECTION_CACHE", {})
    calls = []
    choose = ab._choose
    monkeypatch.setattr(ab, "_choose", lambda *a: calls.append(a) or choose(*a))
    q, k, v = _qkv((1, 2, 40, 40, 16, 16))
    for _ in range(3):
        assert select_backend(q, k, v, 0.0, True) is AttentionBackend.CPU_FLASH
    assert select_backend(q, k, v, 0.0, False) is AttentionBackend.CPU_FLASH
    monkeypatch.setenv(ab.ENV_VAR, "math")
    assert select_backend(q, k, v, 0.0, False) is AttentionBackend.MATH
    assert len(calls) == 3


@pytest.mark.parametrize("capability, version, s_q, s_kv, expected", [
    ((9, 0), 91501, 100, 77, True),
    ((9, 0), 91002, 1024, 512, True),
    ((9, 0), 91002, 1000, 1024, False),  # older cuDNN mishandles lengths that are not k*128
    ((10, 0), 91600, 128, 128, True),
    ((8, 0), 91600, 1024, 1024, False),  # A100: flash is faster
    ((12, 0), 91600, 1024, 1024, False),
    ((9, 0), None, 1024, 1024, False),
])
def test_cudnn_preferred_policy(capability, version, s_q, s_kv, expected):
    assert cudnn_preferred(capability, version, s_q, s_kv) is expected


# ----------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("make, match", [
    (lambda q, k, v: (q[0], k, v), r"q must have rank 4 \[B, H, S, E\], got shape \(4, 128, 64\)"),
    (lambda q, k, v: (q, k[:1], v), r"batch \(axis 0\) of k is 1 but q's is 2"),
    (lambda q, k, v: (q, k, v[:, :3]), r"heads \(axis 1\) of k is 4 but v's is 3"),
    (lambda q, k, v: (q, k.half(), v), r"k is torch.float16 but q is torch.float32"),
    (lambda q, k, v: (q, k, v[:, :, :64]), r"sequence \(axis 2\) of k is 128 but v's is 64"),
    (lambda q, k, v: (q, k[..., :32], v), r"head dim \(axis 3\) of k is 32 but q's is 64"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), r"torch.int32; use float16"),
    (lambda q, k, v: (q.numpy(), k, v), r"q must be a torch.Tensor, got ndarray"),
])
def test_bad_inputs(make, match):
    args = make(*_qkv())
    with pytest.raises(InputError, match=match):
        select_backend(*args, 0.0, False)
    with pytest.raises(InputError, match=match):
        sdpa_forward(*args, 0.0, False, None, "cpu_flash")


def test_bad_backward_inputs():
    q, k, v = _qkv()
    attn, lse, seed, offset = sdpa_forward(q, k, v, 0.0, False)
    args = (q, k, v, attn, lse, 0.0, False, seed, offset, None, "cpu_flash")
    with pytest.raises(InputError, match=r"grad_attn must be \[B, H, S, Ev\]"):
        sdpa_backward(attn[:, :, :5], *args)
    with pytest.raises(InputError, match=r"grad_attn is torch.bfloat16 but q is torch.float32"):
        sdpa_backward(attn.bfloat16(), *args)
    with pytest.raises(InputError, match=r"log_sumexp must be float32 \[B, H, S\]"):
        sdpa_backward(attn, q, k, v, attn, lse.double(), *args[5:])
    with pytest.raises(InputError, match=r"log_sumexp must be float32 \[B, H, S\]"):
        sdpa_backward(attn, q, k, v, attn, lse.unsqueeze(-1), *args[5:])


def test_float64_runs_the_math_kernel_in_float64():
    """float64 (tight checks of sharded attention against PyTorch) runs the math kernel,
    its log-sum-exp and accumulation in float64; a fused kernel requested for it is refused
    by name."""
    q, k, v = (t.double() for t in _qkv())
    assert select_backend(q, k, v, 0.0, True) is AttentionBackend.MATH
    attn, lse, seed, offset = sdpa_forward(q, k, v, 0.0, True)
    assert attn.dtype == lse.dtype == torch.float64
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    grad = torch.randn_like(attn)
    expected.backward(grad)
    torch.testing.assert_close(attn, expected.detach(), rtol=1e-12, atol=1e-12)
    grads = sdpa_backward(grad, q, k, v, attn, lse, 0.0, True, seed, offset, None, "math")
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(InputError, match=r"'cpu_flash' has no float64"):
        sdpa_forward(q, k, v, 0.0, False, None, "cpu_flash")


def test_dropout_on_cpu_runs_the_math_kernel():
    q, k, v = _qkv()
    assert select_backend(q, k, v, 0.1, False) is AttentionBackend.MATH
    with pytest.raises(InputError, match=r"'cpu_flash' has no dropout"):
        sdpa_forward(q, k, v, 0.1, False, None, "cpu_flash")
    with pytest.raises(InputError, match=r"needs dropout_mask, the bool keep mask"):
        sdpa_forward(q, k, v, 0.1, False, None, "math")
    with pytest.raises(InputError, match=r"dropout_mask must be a bool \[2, 4, 128, 128\]"):
        sdpa_forward(q, k, v, 0.1, False, None, "math",
                     dropout_mask=torch.ones(2, 4, 128, 128))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_math_kernel_dropout_matches_autograd_with_the_same_mask(causal, dtype):
    """The math kernel with a keep mask against autograd of softmax(q k^T) * mask / (1 - p)
    @ v in float64, forward and backward."""
    p, scale, shape = 0.3, 0.2, (2, 3, 24, 24, 8, 8)
    # Data of its own: drawn from the global generator, it depended on the tests before it,
    # and some draws took bf16's rounding past the tolerance.
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(shape, dtype, generator=gen)
    g = torch.randn(2, 3, 24, 8, generator=gen).to(dtype)
    keep = torch.rand(2, 3, 24, 24, generator=gen) >= p
    attn, lse, _, _ = sdpa_forward(q, k, v, p, causal, scale, "math", dropout_mask=keep)
    grads = sdpa_backward(g, q, k, v, attn, lse, p, causal, None, None, scale, "math", keep)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].transpose(-2, -1) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), -math.inf)
    ref = (torch.softmax(scores, -1) * keep / (1 - p)) @ leaves[2]
    ref.backward(g.double())
    _assert_close("attn", attn, ref.detach(), dtype)
    for name, grad, leaf in zip(("q_grad", "k_grad", "v_grad"), grads, leaves):
        _assert_close(name, grad, leaf.grad, dtype)


@pytest.mark.parametrize("p", [-0.1, 1.0])
def test_dropout_out_of_range(p):
    with pytest.raises(InputError, match=r"dropout_p must be in \[0, 1\)"):
        select_backend(*_qkv(), p, False)


def test_backward_needs_a_backend():
    q, k, v = _qkv()
    attn, lse, seed, offset = sdpa_forward(q, k, v, 0.0, False, None, "auto")
    with pytest.raises(DefinitionError, match="pass the backend that select_backend returned"):
        sdpa_backward(attn, q, k, v, attn, lse, 0.0, False, seed, offset, None, "auto")


# ----------------------------------------------------------------------------------------------
# Log-sum-exp and gradient layouts the CUDA kernels need (pure tensor logic, checked on CPU)


def test_lse_as_bhs_drops_cudnn_axis_and_padding():
    lse4 = torch.randn(2, 3, 100, 1)
    assert ak._lse_as_bhs(lse4, 100).data_ptr() == lse4.data_ptr()
    assert ak._lse_as_bhs(lse4, 100).shape == (2, 3, 100)
    padded = torch.randn(2, 3, 128)
    torch.testing.assert_close(ak._lse_as_bhs(padded, 100), padded[..., :100])


def test_efficient_lse_reuses_the_padded_buffer():
    padded = torch.randn(2, 3, 128)
    padded[..., 100:] = math.inf
    view = ak._lse_as_bhs(padded, 100)
    assert ak._efficient_lse(view) is padded  # the forward's own view: no copy
    rebuilt = ak._efficient_lse(view.contiguous())  # relaid out by the caller: pad again
    assert rebuilt.shape == (2, 3, 128) and rebuilt.is_contiguous()
    torch.testing.assert_close(rebuilt, padded)
    aligned = torch.randn(2, 3, 64)
    assert ak._efficient_lse(aligned) is aligned


def test_cudnn_lse_layout(monkeypatch):
    q, k, v = (_layout(t, "BSHE") for t in _qkv())
    attn = torch.empty_like(q)
    lse = torch.randn(2, 4, 128)
    lse4 = ak._cudnn_lse(lse, q, k, v, attn, ragged=False)
    assert lse4.shape == (2, 4, 128, 1) and lse4.data_ptr() == lse.data_ptr()
    assert ak._cudnn_lse(lse.transpose(1, 2).contiguous().transpose(1, 2), q, k, v,
                         attn, ragged=False).is_contiguous()
    monkeypatch.delenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", raising=False)
    assert not ak._cudnn_ragged()
    monkeypatch.setenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")
    assert ak._cudnn_ragged()
    ragged = ak._cudnn_lse(lse, q, k, v, attn, ragged=True)
    assert ragged.stride() == (4 * 128, 1, 4, 1)
    torch.testing.assert_close(ragged, lse.unsqueeze(-1))


def test_cudnn_grad_matches_out_strides_for_old_cudnn(monkeypatch):
    attn = _layout(torch.randn(2, 4, 128, 64), "BSHE")
    grad = torch.randn(2, 4, 128, 64)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90400)
    copied = ak._cudnn_grad(grad, attn)
    assert copied.stride() == attn.stride()
    torch.testing.assert_close(copied, grad)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90600)
    assert ak._cudnn_grad(grad, attn) is grad


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("layout", ["BHSE", "BSHE"])
@pytest.mark.parametrize("backend", [AttentionBackend.CUDNN, AttentionBackend.FLASH,
                                     AttentionBackend.EFFICIENT])
def test_cuda_kernel_calls_bind_on_meta(backend, layout, dropout_p):
    """The CUDA kernels' argument lists and output shapes, checked with their meta kernels."""
    ev = 64 if backend is AttentionBackend.FLASH else 32  # flash needs Ev == E
    q, k, v = (_layout(t.to("meta", torch.bfloat16), layout)
               for t in _qkv((2, 4, 100, 77, 64, ev)))
    forward, backward = ak._KERNELS[backend]
    attn, lse, seed, offset = forward(q, k, v, dropout_p, False, None)
    assert attn.shape == (2, 4, 100, ev) and attn.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 100) and lse.dtype == torch.float32
    grads = backward(torch.empty_like(attn), q, k, v, attn, lse, dropout_p, False, seed,
                     offset, 0.3)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ----------------------------------------------------------------------------------------------
# CUDA (run by the lead on an H200)

_CUDA_BACKENDS = ["cudnn", "flash", "efficient"]


def _skip_if_missing(name):
    if name == "cudnn" and torch.backends.cudnn.version() is None:
        pytest.skip("no cuDNN")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("fused SDPA kernels here need sm80+")


@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["BHSE", "BSHE"])
@pytest.mark.parametrize("shape", [SMALL, MEDIUM], ids=["small", "medium"])
@pytest.mark.parametrize("name", _CUDA_BACKENDS)
def test_cuda_backend_matches_reference(name, shape, layout, causal):
    _skip_if_missing(name)
    backend = _run_and_check(shape, torch.bfloat16, layout, causal, None, name, "cuda")
    assert backend is AttentionBackend(name)


@needs_cuda
@pytest.mark.parametrize("shape", [(2, 4, 256, 384, 64, 64), (1, 3, 100, 77, 64, 64)],
                         ids=["kv_longer", "odd"])
@pytest.mark.parametrize("name", _CUDA_BACKENDS)
def test_cuda_non_square(name, shape):
    _skip_if_missing(name)
    if name == "cudnn" and not cudnn_preferred((9, 0), torch.backends.cudnn.version(),
                                               shape[2], shape[3]):
        pytest.skip("this cuDNN is known to mishandle lengths that are not multiples of 128")
    _run_and_check(shape, torch.bfloat16, "BSHE", False, 0.3, name, "cuda")


@needs_cuda
def test_cuda_select_backend_picks_cudnn_on_hopper():
    if torch.cuda.get_device_capability() != (9, 0) or torch.backends.cudnn.version() is None:
        pytest.skip("needs sm90 and cuDNN")
    for layout in ("BHSE", "BSHE"):
        q, k, v = (_layout(t, layout) for t in _qkv(MEDIUM, torch.bfloat16, "cuda"))
        assert select_backend(q, k, v, 0.0, True) is AttentionBackend.CUDNN


@needs_cuda
def test_cuda_causal_non_square_goes_to_efficient():
    shape = (2, 4, 128, 256, 64, 64)
    backend = _run_and_check(shape, torch.bfloat16, "BHSE", True, None, device="cuda")
    assert backend is AttentionBackend.EFFICIENT
    q, k, v = _qkv(shape, torch.bfloat16, "cuda")
    for name in ("cudnn", "flash"):
        with pytest.raises(InputError, match="causal attention with S=128 != Skv=256"):
            select_backend(q, k, v, 0.0, True, requested=name)


@needs_cuda
def test_cuda_math_fallback():
    shape = (2, 2, 64, 64, 6, 6)  # fp32 with head dim 6: no fused kernel takes it
    assert _run_and_check(shape, torch.float32, "BHSE", True, None, device="cuda") is (
        AttentionBackend.MATH)


@needs_cuda
def test_cuda_efficient_lse_padding_round_trip():
    (q, k, v, g), (_, _, dq, dk, dv) = _case(ODD, torch.bfloat16, True, None, "cuda")
    attn, lse, seed, offset = sdpa_forward(q, k, v, 0.0, True, None, "efficient")
    assert lse.shape == (1, 3, 100) and ak._efficient_lse(lse) is lse._base  # no copy
    args = (0.0, True, seed, offset, None, "efficient")
    direct = sdpa_backward(g, q, k, v, attn, lse, *args)
    relaid = sdpa_backward(g, q, k, v, attn.contiguous(), lse.contiguous(), *args)
    # Both paths (the forward's padded buffer, and the padding rebuilt) against the
    # reference; the efficient backward accumulates dq with atomics, so the two paths are not
    # bitwise equal to each other.
    for grads in (direct, relaid):
        for name, a, b in zip("qkv", grads, (dq, dk, dv)):
            _assert_close(name, a, b, torch.bfloat16)


@needs_cuda
def test_cuda_cudnn_grad_in_another_layout():
    _skip_if_missing("cudnn")
    (q, k, v, g), (_, _, dq, dk, dv) = _case(SMALL, torch.bfloat16, True, None, "cuda")
    q, k, v = (_layout(t, "BSHE") for t in (q, k, v))
    attn, lse, seed, offset = sdpa_forward(q, k, v, 0.0, True, None, "cudnn")
    grads = sdpa_backward(_layout(g, "BHSE"), q, k, v, attn, lse, 0.0, True, seed, offset,
                          None, "cudnn")
    for name, grad, ref in zip("qkv", grads, (dq, dk, dv)):
        _assert_close(name, grad, ref, torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("name", _CUDA_BACKENDS)
def test_cuda_dropout_forward_backward_consistency(name):
    """With v = identity, attn is the dropped-out probability matrix itself, so the mask the
    forward drew can be read off attn and the backward checked against it exactly."""
    _skip_if_missing(name)
    b, h, s, p, scale = 2, 2, 128, 0.2, 0.1
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, s, s, generator=gen).to("cuda", torch.bfloat16) for _ in "qk")
    v = torch.eye(s, dtype=torch.bfloat16, device="cuda").expand(b, h, s, s).contiguous()
    g = torch.randn(b, h, s, s, generator=gen).to("cuda", torch.bfloat16)
    try:
        backend = select_backend(q, k, v, p, False, requested=name)
    except InputError as err:
        pytest.skip(f"{name} refuses dropout here: {err}")
    attn, lse, seed, offset = sdpa_forward(q, k, v, p, False, scale, backend)
    dq, dk, dv = sdpa_backward(g, q, k, v, attn, lse, p, False, seed, offset, scale, backend)
    probs = torch.softmax(q.double() @ k.double().transpose(-2, -1) * scale, dim=-1)
    dropped = attn.double()  # = probs * keep / (1 - p)
    keep = (dropped != 0).double()
    assert 0.6 < keep.mean().item() < 0.95, "dropout mask was not applied"
    go = g.double()
    d_dropped = go  # dO @ v^T with v = I
    ds = probs * (d_dropped * keep / (1 - p) - (go * dropped).sum(-1, keepdim=True))
    refs = (ds @ k.double() * scale, ds.transpose(-2, -1) @ q.double() * scale,
            dropped.transpose(-2, -1) @ go)
    for grad_name, grad, ref in zip(("q_grad", "k_grad", "v_grad"), (dq, dk, dv), refs):
        _assert_close(grad_name, grad, ref, torch.bfloat16)


def test_cudnn_backward_is_refused_under_deterministic_algorithms():
    """cuDNN's attention backward has no deterministic mode: with
    ``torch.use_deterministic_algorithms(True)`` it is refused with a typed error that says
    what to do (``warn_only``: a warning), and automatic selection leaves cuDNN out; other
    kernels, and every kernel outside the switch, pass."""
    check_deterministic_backward(AttentionBackend.CUDNN)
    with deterministic_algorithms(True):
        assert deterministic_only()
        with pytest.raises(InputError, match="cuDNN attention backward is not deterministic.*auto"):
            check_deterministic_backward(AttentionBackend.CUDNN)
        for backend in (AttentionBackend.FLASH, AttentionBackend.EFFICIENT, AttentionBackend.MATH):
            check_deterministic_backward(backend)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert not deterministic_only()
        with pytest.warns(UserWarning, match="not deterministic"):
            check_deterministic_backward(AttentionBackend.CUDNN)
    finally:
        torch.use_deterministic_algorithms(saved)
