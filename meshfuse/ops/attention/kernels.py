"""PyTorch's fused SDPA kernels, called directly, behind ``sdpfa_fwd`` and ``sdpfa_bwd``.

Which kernel runs is chosen in :mod:`meshfuse.ops.attention.backends`. The kernels are called
through ``torch.ops.aten``, under ``no_grad`` and without
``torch.nn.functional.scaled_dot_product_attention``: meshfuse keeps the forward's outputs
(``attn``, ``log_sumexp``, the dropout RNG state) and hands them to the same kernel's
backward. Shapes, with B batch, H heads, S query and Skv key/value sequence, E the q/k
head dim and Ev the v head dim; ``Hkv`` divides ``H`` (grouped-query attention, PyTorch's
``enable_gqa=True``: query head ``h`` attends with key/value head ``h // (H / Hkv)``; the
CPU flash, flash and cuDNN kernels take it as it is, the math kernel broadcasts each
key/value head over its group, the memory-efficient kernel is not used)::

    q [B, H, S, E]   k [B, Hkv, Skv, E]   v [B, Hkv, Skv, Ev]   (any strides: BHSE, BSHE, ...)
    attn [B, H, S, Ev] (dtype of q)   log_sumexp [B, H, S] float32   seed, offset: RNG state

Backends (:class:`AttentionBackend`) and where their outputs live in memory, as PyTorch
allocates them; the caller lays outputs out as it needs, so none is copied to a fixed layout:

=========  ======================  ====================  ============================
backend    attn                    log_sumexp            q/k/v gradients
=========  ======================  ====================  ============================
CUDNN      layout of q             contiguous            layouts of q, k, v
FLASH      layout of q             contiguous            layouts of q, k, v
EFFICIENT  BSHE                    view of [B,H,S32]     BSHE
CPU_FLASH  layout of q             BSH                   BSHE
MATH       contiguous BHSE         contiguous            contiguous BHSE
=========  ======================  ====================  ============================

(S32 is S rounded up to a multiple of 32: the efficient kernel pads its log-sum-exp, and its
backward reads the padding; :func:`sdpa_backward` restores it.) ``seed`` and ``offset`` are
0-d int64 zeros on the CPU for the CPU flash and math kernels (the math kernel takes its
dropout mask as an argument: ``dropout_mask``). ``sdpfa_fwd`` hands them to its backward in
nvFuser's form (:mod:`meshfuse.ops.attention.dropout`). Otherwise they are the kernel's own RNG
state, opaque, to be passed back unchanged: flash gives a ``[2]`` uint64 (seed, offset) and a
0-d uint64 placeholder, on the GPU; cuDNN ``[1]`` int64 tensors on the GPU; efficient 0-d
int64 on the CPU (on the GPU under CUDA-graph capture).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from meshfuse.errors import DefinitionError, InputError
from meshfuse.ops.attention.backends import (
    AttentionBackend,
    check_deterministic_backward,
    check_dropout,
    check_qkv,
    own_limits,
    parse_backend,
    select_backend,
    unit_last_stride,
)

_EFFICIENT_LSE_ALIGN = 32  # kAlignLSE of PyTorch's memory-efficient kernel
_CUDNN_ANY_DO_STRIDES = 90501  # from cuDNN 9.5.1 on, dO need not have O's strides


# ----------------------------------------------------------------------------------------------
# Validation of the backward


def _check_backward(grad_attn, attn, log_sumexp, q, v) -> None:
    b, h, s, ev = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    for name, t in (("grad_attn", grad_attn), ("attn", attn)):
        if tuple(t.shape) != (b, h, s, ev):
            raise InputError(f"sdpa backward: {name} must be [B, H, S, Ev] = {[b, h, s, ev]}, "
                             f"got {list(t.shape)}")
        if t.dtype != q.dtype:
            raise InputError(f"sdpa backward: {name} is {t.dtype} but q is {q.dtype}")
    want = lse_dtype(q.dtype)
    if tuple(log_sumexp.shape) != (b, h, s) or log_sumexp.dtype != want:
        raise InputError(
            f"sdpa backward: log_sumexp must be {str(want).removeprefix('torch.')} [B, H, S] = "
            f"{[b, h, s]}, got "
            f"{log_sumexp.dtype} {list(log_sumexp.shape)}; pass the forward's log_sumexp"
        )


# ----------------------------------------------------------------------------------------------
# Log-sum-exp and gradient layouts


def _lse_as_bhs(lse: torch.Tensor, s_q: int) -> torch.Tensor:
    """View a kernel's log-sum-exp as ``[B, H, S]``: drop cuDNN's trailing 1, slice padding."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse if lse.shape[-1] == s_q else lse[..., :s_q]


def _efficient_lse(lse: torch.Tensor) -> torch.Tensor:
    """The padded ``[B, H, S32]`` log-sum-exp that the efficient backward reads.

    The forward pads rows S..S32 with +inf so that the backward skips bound checks. When
    ``lse`` is still the forward's view of that buffer, the buffer is returned (no copy);
    otherwise the padding is rebuilt.
    """
    b, h, s_q = lse.shape
    padded = -(-s_q // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN
    if padded == s_q:
        return unit_last_stride(lse)
    base = lse._base
    if (base is not None and tuple(base.shape) == (b, h, padded) and base.stride(-1) == 1
            and base.stride() == lse.stride() and base.data_ptr() == lse.data_ptr()):
        return base
    return torch.nn.functional.pad(lse, (0, padded - s_q), value=math.inf)


def _cudnn_ragged() -> bool:
    """Whether PyTorch's cuDNN attention may use ragged offsets
    (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE``)."""
    return os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "").lower() in ("1", "true", "on")


def _cudnn_lse(lse: torch.Tensor, q, k, v, attn, ragged: bool) -> torch.Tensor:
    """``[B, H, S, 1]`` in the layout cuDNN's forward allocates, copied only if it differs.

    cuDNN reads the statistics with the strides it was given, and its dense path wants them
    BHS; with ``ragged`` (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``) and all of q/k/v/attn BSHE
    it uses ragged offsets computed from the S stride, and allocates them BSH.
    """
    lse4 = lse.unsqueeze(-1)
    if ragged and all(t.transpose(1, 2).is_contiguous() for t in (q, k, v, attn)):
        if lse4.transpose(1, 2).is_contiguous():
            return lse4
        b, h, s_q, _ = lse4.shape
        return lse4.new_empty((b, s_q, h, 1)).transpose(1, 2).copy_(lse4)
    return lse4.contiguous()


def _cudnn_grad(grad_attn: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """grad_attn as cuDNN's backward accepts it, copied only when needed.

    cuDNN before 9.5.1 assumes dO has O's strides (PyTorch would copy with a warning); all
    versions need a unit innermost stride.
    """
    version = torch.backends.cudnn.version() or 0
    if version < _CUDNN_ANY_DO_STRIDES and grad_attn.stride() != attn.stride():
        return torch.empty_like(attn).copy_(grad_attn)
    return unit_last_stride(grad_attn)


# ----------------------------------------------------------------------------------------------
# Kernels: forward returns (attn, lse [B, H, S], seed, offset); backward (dq, dk, dv)


def _cudnn_fwd(q, k, v, dropout_p, is_causal, scale):
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, dropout_p, is_causal, False, scale=scale)
    return out[0], _lse_as_bhs(out[1], q.shape[2]), out[6], out[7]


def _cudnn_bwd(grad, q, k, v, attn, lse, dropout_p, is_causal, seed, offset, scale,
               ragged: bool | None = None):
    # ``ragged``: read from the environment per call unless bound once (bind_kernels).
    ragged = _cudnn_ragged() if ragged is None else ragged
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _cudnn_grad(grad, attn), q, k, v, attn, _cudnn_lse(lse, q, k, v, attn, ragged), seed,
        offset, None, None, None, q.shape[2], k.shape[2], dropout_p, is_causal, scale=scale)


def _flash_fwd(q, k, v, dropout_p, is_causal, scale):
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False, scale=scale)
    # out[6], out[7] (rng_state, unused) are the backward's philox_seed and philox_offset.
    return out[0], _lse_as_bhs(out[1], q.shape[2]), out[6], out[7]


def _flash_bwd(grad, q, k, v, attn, lse, dropout_p, is_causal, seed, offset, scale):
    # No cum_seq tensors (None is an undefined tensor): the dense, non-varlen kernel.
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, attn, lse.contiguous(), None, None, q.shape[2], k.shape[2], dropout_p,
        is_causal, seed, offset, scale=scale)


def _efficient_fwd(q, k, v, dropout_p, is_causal, scale):
    attn, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, dropout_p, is_causal, scale=scale)
    return attn, _lse_as_bhs(lse, q.shape[2]), seed, offset


def _efficient_bwd(grad, q, k, v, attn, lse, dropout_p, is_causal, seed, offset, scale):
    # The efficient forward allocates attn BSHE; its backward reads attn as laid out by the
    # forward (seen on an H200 with torch 2.11: a contiguous BHSE copy of attn gave wrong
    # gradients), so a re-laid attn goes back to BSHE.
    if not attn.transpose(1, 2).is_contiguous():
        attn = attn.transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, attn, _efficient_lse(lse), seed, offset, dropout_p,
        [True, True, True, False], is_causal, scale=scale)
    return dq, dk, dv


def _cpu_flash_fwd(q, k, v, dropout_p, is_causal, scale):
    attn, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, scale=scale)
    return attn, lse, None, None


def _cpu_flash_bwd(grad, q, k, v, attn, lse, dropout_p, is_causal, seed, offset, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, attn, lse, dropout_p, is_causal, scale=scale)


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``a @ b`` where ``a`` has ``G`` times as many heads (axis 1) as ``b``'s ``kv_heads``:
    head ``h`` of ``a`` with head ``h // G`` of ``b`` (grouped-query attention), by
    broadcasting, without copying ``b`` per group. Equal heads: a plain matmul."""
    if a.shape[1] == kv_heads:
        return torch.matmul(a, b)
    return torch.matmul(a.unflatten(1, (kv_heads, -1)), b.unsqueeze(2)).flatten(1, 2)


def _group_sum(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The sum over each group of ``t``'s heads (axis 1): ``[B, kv_heads, ...]``."""
    return t if t.shape[1] == kv_heads else t.unflatten(1, (kv_heads, -1)).sum(2)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the math kernel computes in and its log-sum-exp has: float32, float64 for
    float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _math_probs(q, k, is_causal, scale, lse=None):
    """``softmax(q k^T * scale)`` in :func:`lse_dtype`, and the log-sum-exp it used."""
    acc = lse_dtype(q.dtype)
    scores = _grouped_matmul(q.to(acc), k.to(acc).transpose(-2, -1), k.shape[1])
    scores.mul_(_scale_of(q, scale))
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores.masked_fill_(~keep, -math.inf)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return scores.sub_(lse.unsqueeze(-1)).exp_(), lse


def _math_fwd(q, k, v, dropout_p, is_causal, scale, keep=None):
    probs, lse = _math_probs(q, k, is_causal, scale)
    if keep is not None:
        probs = _dropped(probs, keep, dropout_p)
    return _grouped_matmul(probs, v.to(probs.dtype), v.shape[1]).to(q.dtype), lse, None, None


def _dropped(probs: torch.Tensor, keep: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """``probs * keep / (1 - p)``: the dropped-out probabilities, in place."""
    return probs.mul_(keep).mul_(1.0 / (1.0 - dropout_p))


def _math_bwd(grad, q, k, v, attn, lse, dropout_p, is_causal, seed, offset, scale, keep=None):
    acc = lse_dtype(q.dtype)
    probs, _ = _math_probs(q, k, is_causal, scale, lse.to(acc))
    g = grad.to(acc)
    dropped = probs if keep is None else _dropped(probs.clone(), keep, dropout_p)
    heads = k.shape[1]  # fewer than q's in grouped-query attention: sums over each group
    dv = _group_sum(torch.matmul(dropped.transpose(-2, -1), g), heads)
    del dropped
    # dS = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dO * O) (with dropout too:
    # dP = (dO V^T) * keep / (1 - p), and O = (P * keep / (1 - p)) V).
    delta = (g * attn.to(acc)).sum(dim=-1, keepdim=True)
    d_probs = _grouped_matmul(g, v.to(acc).transpose(-2, -1), heads)
    if keep is not None:
        d_probs = _dropped(d_probs, keep, dropout_p)
    ds = probs.mul_(d_probs.sub_(delta))
    ds.mul_(_scale_of(q, scale))
    dq = _grouped_matmul(ds, k.to(acc), heads)
    dk = _group_sum(torch.matmul(ds.transpose(-2, -1), q.to(acc)), heads)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _scale_of(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


_KERNELS = {
    AttentionBackend.CUDNN: (_cudnn_fwd, _cudnn_bwd),
    AttentionBackend.FLASH: (_flash_fwd, _flash_bwd),
    AttentionBackend.EFFICIENT: (_efficient_fwd, _efficient_bwd),
    AttentionBackend.CPU_FLASH: (_cpu_flash_fwd, _cpu_flash_bwd),
    AttentionBackend.MATH: (_math_fwd, _math_bwd),
}


def bind_kernels(q, k, v, dropout_p: float, is_causal: bool, backend=None):
    """Checks q/k/v once and returns ``(backend, forward, backward)``: the raw kernels for
    these inputs, for callers that run the same shapes many times (the executor).

    ``forward(q, k, v, dropout_p, is_causal, scale)`` returns ``(attn, lse, seed, offset)``
    with seed/offset None for kernels without an RNG state; ``backward(grad_attn, q, k, v,
    attn, lse, dropout_p, is_causal, seed, offset, scale)`` returns the gradients. Both expect
    what :func:`sdpa_forward`/:func:`sdpa_backward` would pass them (unit innermost strides,
    scale None or a float) and run without the per-call checks.
    """
    backend, forward, backward = _checked_kernels(q, k, v, dropout_p, is_causal, backend)
    if backward is _cudnn_bwd:  # decided once, not read from the environment per call
        backward = functools.partial(_cudnn_bwd, ragged=_cudnn_ragged())
    return backend, forward, backward


def _checked_kernels(q, k, v, dropout_p: float, is_causal: bool, backend):
    """Checks q/k/v and ``dropout_p``; returns ``(backend, forward, backward)``, the backend
    selected for these inputs where ``backend`` is None or auto."""
    check_qkv(q, k, v)
    check_dropout(q, dropout_p)
    if parse_backend(backend) is None:
        backend = select_backend(q, k, v, dropout_p, is_causal)
    forward, backward = _kernels_for(backend, q, k, v, dropout_p, is_causal)
    return parse_backend(backend), forward, backward


def _kernels_for(backend, q, k, v, dropout_p: float, is_causal: bool):
    """The (forward, backward) pair of ``backend``, after its cheap per-call limits."""
    backend = parse_backend(backend)
    if backend is None:
        raise DefinitionError("sdpa: pass the backend that select_backend returned, not auto")
    reason = own_limits(backend, q, k, v, dropout_p, is_causal)
    if reason is not None:
        raise InputError(f"sdpa: backend {backend.value!r} {reason}; use select_backend")
    return _KERNELS[backend]


@torch.no_grad()
def sdpa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                 is_causal: bool, scale: float | None = None,
                 backend: AttentionBackend | str | None = None,
                 dropout_mask: torch.Tensor | None = None):
    """Scaled dot-product attention forward with one of PyTorch's SDPA kernels.

    Args:
        q: ``[B, H, S, E]``; k: ``[B, Hkv, Skv, E]``; v: ``[B, Hkv, Skv, Ev]`` (``Hkv``
            divides ``H``: grouped-query attention): one dtype
            (float16, bfloat16, float32) and device, any strides (a strided last axis is
            copied; BHSE and BSHE are used as they are).
        dropout_p: dropout probability in [0, 1).
        is_causal: mask key j > query i (top-left aligned, as in PyTorch).
        scale: the factor of ``q @ k^T``; None is ``1 / sqrt(E)``.
        backend: from :func:`select_backend` (the backward must get the same one); None
            selects it here.
        dropout_mask: the math kernel's keep mask, bool ``[B, H, S, Skv]`` (True: kept),
            required there when ``dropout_p > 0``; the fused CUDA kernels draw their own from
            torch's CUDA generator.

    Returns:
        ``(attn, log_sumexp, seed, offset)``: attn ``[B, H, S, Ev]`` of q's dtype and
        log_sumexp float32 ``[B, H, S]`` (layouts per backend in the module docstring);
        seed and offset, the dropout RNG state the backward replays (0-d int64 CPU zeros
        when ``dropout_p == 0``; otherwise opaque, see the module docstring).

    Raises:
        InputError: bad inputs, a missing dropout mask, or a backend for the other device.
    """
    backend, forward, _ = _checked_kernels(q, k, v, dropout_p, is_causal, backend)
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    scale = None if scale is None else float(scale)
    if backend is AttentionBackend.MATH and dropout_p > 0.0:
        keep = _checked_mask(dropout_mask, q, k)
        attn, lse, seed, offset = forward(q, k, v, dropout_p, is_causal, scale, keep)
    else:
        attn, lse, seed, offset = forward(q, k, v, dropout_p, is_causal, scale)
    if seed is None:  # kernels without an RNG state (CPU flash, math)
        seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    # Otherwise the kernel's own tensors go back to its backward unchanged, as autograd does
    # (cuDNN's backward wants them on the GPU even without dropout).
    return attn, lse, seed, offset


@torch.no_grad()
def sdpa_backward(grad_attn: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attn: torch.Tensor, log_sumexp: torch.Tensor, dropout_p: float,
                  is_causal: bool, seed: torch.Tensor, offset: torch.Tensor,
                  scale: float | None, backend: AttentionBackend | str,
                  dropout_mask: torch.Tensor | None = None):
    """Gradients of :func:`sdpa_forward` with the same kernel family.

    Args:
        grad_attn: ``[B, H, S, Ev]``, q's dtype, any strides (cuDNN before 9.5.1 copies it
            to attn's strides when they differ).
        q, k, v, dropout_p, is_causal, scale: as given to the forward.
        attn, log_sumexp, seed, offset: the forward's outputs, in any layout; log_sumexp
            must be float32 ``[B, H, S]``.
        backend: the backend the forward ran with.
        dropout_mask: the math kernel's keep mask of the forward (with ``dropout_p > 0``).

    Returns:
        ``(q_grad, k_grad, v_grad)`` with the shapes and dtypes of q, k and v (layouts per
        backend in the module docstring).

    Raises:
        InputError: tensors that do not fit, or a backend for the other device.
    """
    check_qkv(q, k, v)
    check_dropout(q, dropout_p)
    _check_backward(grad_attn, attn, log_sumexp, q, v)
    _, backward = _kernels_for(backend, q, k, v, dropout_p, is_causal)
    check_deterministic_backward(parse_backend(backend))
    grad_attn, q, k, v, attn = (unit_last_stride(t) for t in (grad_attn, q, k, v, attn))
    scale = None if scale is None else float(scale)
    extra = ()
    if parse_backend(backend) is AttentionBackend.MATH and dropout_p > 0.0:
        extra = (_checked_mask(dropout_mask, q, k),)
    dq, dk, dv = backward(
        grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset, scale, *extra)
    return dq, dk, dv


def _checked_mask(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The math kernel's dropout keep mask, checked against ``[B, H, S, Skv]``."""
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if mask is None:
        raise InputError("sdpa: the math kernel with dropout_p > 0 needs dropout_mask, the bool "
                         f"keep mask {list(shape)} (sdpfa_fwd draws it from its RNG stream)")
    if tuple(mask.shape) != shape or mask.dtype != torch.bool or mask.device != q.device:
        raise InputError(f"sdpa: dropout_mask must be a bool {list(shape)} tensor on "
                         f"{q.device}, got {mask.dtype} {list(mask.shape)} on {mask.device}")
    return mask
