"""PyTorch's fused SDPA kernels, called directly, behind ``sdpfa_fwd`` and ``sdpfa_bwd``.

The kernels are called through ``torch.ops.aten``, under ``no_grad`` and without
``torch.nn.functional.scaled_dot_product_attention``: meshfuse keeps the forward's outputs
(``attn``, ``log_sumexp``, the dropout RNG state) and hands them to the same kernel's
backward. Shapes, with B batch, H heads, S query and Skv key/value sequence, E the q/k
head dim and Ev the v head dim::

    q [B, H, S, E]   k [B, H, Skv, E]   v [B, H, Skv, Ev]   (any strides: BHSE, BSHE, ...)
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
0-d int64 zeros on the CPU for the CPU flash and math kernels. Otherwise they are the kernel's own RNG
state, opaque, to be passed back unchanged: flash gives a ``[2]`` uint64 (seed, offset) and a
0-d uint64 placeholder, on the GPU; cuDNN ``[1]`` int64 tensors on the GPU; efficient 0-d
int64 on the CPU (on the GPU under CUDA-graph capture).
"""

from __future__ import annotations

import enum
import math
import os

import torch

from meshfuse.errors import DefinitionError, InputError

ENV_VAR = "MESHFUSE_SDPA_BACKEND"
_AUTO = "auto"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_EFFICIENT_LSE_ALIGN = 32  # kAlignLSE of PyTorch's memory-efficient kernel
_CUDNN_SEQ_FIX_VERSION = 91501  # cuDNN 9.15.1 fixed sequence lengths that are not k*128
_CUDNN_ANY_DO_STRIDES = 90501  # from cuDNN 9.5.1 on, dO need not have O's strides
_CUDNN_PREFERRED_SM = ((9, 0), (10, 0), (10, 3))  # PyTorch's own list, Hopper and Blackwell
_CACHE_LIMIT = 4096


class AttentionBackend(enum.Enum):
    """A PyTorch SDPA kernel family; the value is the name ``MESHFUSE_SDPA_BACKEND`` takes."""

    CUDNN = "cudnn"
    FLASH = "flash"
    EFFICIENT = "efficient"
    CPU_FLASH = "cpu_flash"
    MATH = "math"


# Fused CUDA kernels, fastest first for the shapes meshfuse targets.
_CUDA_FUSED = (AttentionBackend.CUDNN, AttentionBackend.FLASH, AttentionBackend.EFFICIENT)


# ----------------------------------------------------------------------------------------------
# Validation


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise :class:`InputError` unless q/k/v are rank-4 tensors that fit together."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"sdpa: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"sdpa: {name} must have rank 4 [B, H, S, E], got shape "
                             f"{tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise InputError(f"sdpa: {name} is {t.dtype} but q is {q.dtype}; cast to one dtype")
        if t.device != q.device:
            raise InputError(f"sdpa: {name} is on {t.device} but q is on {q.device}")
        for axis, label in ((0, "batch"), (1, "heads")):
            if t.shape[axis] != q.shape[axis]:
                raise InputError(f"sdpa: {label} (axis {axis}) of {name} is {t.shape[axis]} "
                                 f"but q's is {q.shape[axis]}")
    if q.dtype not in _DTYPES:
        raise InputError(f"sdpa: q/k/v are {q.dtype}; use float16, bfloat16 or float32")
    if k.shape[2] != v.shape[2]:
        raise InputError(f"sdpa: sequence (axis 2) of k is {k.shape[2]} but v's is {v.shape[2]}")
    if k.shape[3] != q.shape[3]:
        raise InputError(f"sdpa: head dim (axis 3) of k is {k.shape[3]} but q's is {q.shape[3]}")


def _check_dropout(q: torch.Tensor, dropout_p: float) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise InputError(f"sdpa: dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0 and q.device.type == "cpu":
        raise InputError(
            f"sdpa: dropout_p > 0 is not supported on CPU yet; got dropout_p={dropout_p}. The "
            "CPU flash kernel cannot replay its dropout mask in the backward, so the "
            "gradients would be wrong. Use dropout_p=0.0 on CPU, or run on CUDA."
        )


def _check_backward(grad_attn, attn, log_sumexp, q, v) -> None:
    b, h, s, ev = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    for name, t in (("grad_attn", grad_attn), ("attn", attn)):
        if tuple(t.shape) != (b, h, s, ev):
            raise InputError(f"sdpa backward: {name} must be [B, H, S, Ev] = {[b, h, s, ev]}, "
                             f"got {list(t.shape)}")
        if t.dtype != q.dtype:
            raise InputError(f"sdpa backward: {name} is {t.dtype} but q is {q.dtype}")
    if tuple(log_sumexp.shape) != (b, h, s) or log_sumexp.dtype != torch.float32:
        raise InputError(
            f"sdpa backward: log_sumexp must be float32 [B, H, S] = {[b, h, s]}, got "
            f"{log_sumexp.dtype} {list(log_sumexp.shape)}; pass the forward's log_sumexp"
        )


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a contiguous copy if its last axis is strided (every kernel needs 1)."""
    return t if t.stride(-1) == 1 or t.size(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------
# Backend selection


def parse_backend(name: AttentionBackend | str | None) -> AttentionBackend | None:
    """Turn a backend or its name into an :class:`AttentionBackend`; None or "auto" is None.

    Raises:
        DefinitionError: the name is not one of auto, cudnn, flash, efficient, cpu_flash, math.
    """
    if name is None or isinstance(name, AttentionBackend):
        return name
    key = str(name).strip().lower()
    if key in ("", _AUTO):
        return None
    try:
        return AttentionBackend(key)
    except ValueError:
        known = ", ".join([_AUTO] + [b.value for b in AttentionBackend])
        raise DefinitionError(f"unknown SDPA backend {name!r}; choose one of: {known}") from None


def _requested(requested: AttentionBackend | str | None) -> AttentionBackend | None:
    """The explicit request if any, else the one in ``MESHFUSE_SDPA_BACKEND``, else None."""
    if requested is not None:
        return parse_backend(requested)
    try:
        return parse_backend(os.environ.get(ENV_VAR))
    except DefinitionError as err:
        raise DefinitionError(f"{ENV_VAR}: {err}") from None


def cudnn_preferred(capability: tuple[int, int], cudnn_version: int | None, s_q: int,
                    s_kv: int) -> bool:
    """Whether automatic selection tries cuDNN before flash attention.

    PyTorch prefers cuDNN on sm90/sm100/sm103 from cuDNN 9.15.1 on, the first version that
    handles sequence lengths that are not multiples of 128; before it, meshfuse still takes
    cuDNN (about 1.7x flash on H200) when both sequence lengths are multiples of 128.
    """
    if cudnn_version is None or tuple(capability) not in _CUDNN_PREFERRED_SM:
        return False
    return cudnn_version >= _CUDNN_SEQ_FIX_VERSION or (s_q % 128 == 0 and s_kv % 128 == 0)


def _own_limits(backend: AttentionBackend, q, k, v, dropout_p: float, is_causal: bool):
    """Why meshfuse itself will not run ``backend`` on these inputs, or None.

    These add to PyTorch's ``can_use_*`` checks, which accept inputs that only the public
    ``scaled_dot_product_attention`` makes usable (it pads head dims before the kernel).
    """
    e, ev, s_q, s_kv = q.shape[3], v.shape[3], q.shape[2], k.shape[2]
    device = q.device.type
    if backend is AttentionBackend.CPU_FLASH:
        if device != "cpu":
            return f"needs CPU tensors, got {q.device}"
        if e != ev:
            return f"needs q/k/v with one head dim, got E={e} and Ev={ev}"
        return None
    if backend is AttentionBackend.MATH:
        if dropout_p > 0.0:
            return "cannot replay a dropout mask in the backward; use dropout_p=0.0"
        return None
    if device != "cuda":
        return f"needs CUDA tensors, got {q.device}"
    if backend is AttentionBackend.EFFICIENT:
        return None
    if e % 8 or ev % 8:
        return f"needs head dims that are multiples of 8, got E={e} and Ev={ev}"
    if is_causal and s_q != s_kv:
        # Flash aligns a non-square causal mask bottom-right, torch top-left; cuDNN's alignment
        # has changed across versions. The efficient kernel is top-left, like torch.
        return f"is not used for causal attention with S={s_q} != Skv={s_kv}"
    return None


def _torch_can_use(backend: AttentionBackend, q, k, v, dropout_p: float, is_causal: bool):
    """Why PyTorch's ``can_use_*`` refuses ``backend`` for these inputs, or None."""
    names = {
        AttentionBackend.CUDNN: "can_use_cudnn_attention",
        AttentionBackend.FLASH: "can_use_flash_attention",
        AttentionBackend.EFFICIENT: "can_use_efficient_attention",
    }
    check = getattr(torch.backends.cuda, names[backend], None)
    if check is None:
        return f"cannot be checked: torch {torch.__version__} has no {names[backend]}"
    # Some limits only hold for training; meshfuse always may run the backward, so ask as if
    # the inputs required grad. detach() makes views, not copies.
    q, k, v = (_unit_last_stride(t).detach() for t in (q, k, v))
    try:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    except RuntimeError:  # inference-mode tensors cannot require grad; ask without it
        pass
    params = torch.backends.cuda.SDPAParams(q, k, v, None, dropout_p, is_causal, False)
    with torch.cuda.device(q.device):  # the checks read the current device's properties
        if check(params, False):
            return None
    return (
        f"is refused by torch.backends.cuda.{names[backend]} (call it with debug=True for the "
        "reason; it may also be switched off by torch.backends.cuda.enable_*_sdp(False))"
    )


def _unusable_reason(backend: AttentionBackend, q, k, v, dropout_p: float, is_causal: bool):
    reason = _own_limits(backend, q, k, v, dropout_p, is_causal)
    if reason is None and backend in _CUDA_FUSED:
        reason = _torch_can_use(backend, q, k, v, dropout_p, is_causal)
    return reason


def _auto_order(q: torch.Tensor, k: torch.Tensor) -> tuple[AttentionBackend, ...]:
    if q.device.type != "cuda":
        return (AttentionBackend.CPU_FLASH, AttentionBackend.MATH)
    capability = torch.cuda.get_device_capability(q.device)
    if cudnn_preferred(capability, torch.backends.cudnn.version(), q.shape[2], k.shape[2]):
        return _CUDA_FUSED + (AttentionBackend.MATH,)
    # Not cuDNN at all here: where it is not preferred it is slower or has known bugs.
    return (AttentionBackend.FLASH, AttentionBackend.EFFICIENT, AttentionBackend.MATH)


def _choose(q, k, v, dropout_p: float, is_causal: bool, wanted: AttentionBackend | None):
    if wanted is not None:
        reason = _unusable_reason(wanted, q, k, v, dropout_p, is_causal)
        if reason is not None:
            raise InputError(
                f"SDPA backend {wanted.value!r} {reason} (q {tuple(q.shape)} {q.dtype} on "
                f"{q.device}, causal={is_causal}, dropout_p={dropout_p}); request another "
                f"backend or set {ENV_VAR}=auto"
            )
        return wanted
    reasons = []
    for backend in _auto_order(q, k):
        reason = _unusable_reason(backend, q, k, v, dropout_p, is_causal)
        if reason is None:
            return backend
        reasons.append(f"{backend.value} {reason}")
    raise InputError(
        f"no SDPA backend runs q {tuple(q.shape)} {q.dtype} on {q.device} (causal={is_causal}, "
        f"dropout_p={dropout_p}): " + "; ".join(reasons)
    )


_SELECTION_CACHE: dict[tuple, AttentionBackend] = {}


def _selection_key(q, k, v, dropout_p, is_causal, wanted) -> tuple:
    key = (q.device, q.dtype, tuple(q.shape), tuple(k.shape), tuple(v.shape), q.stride(),
           k.stride(), v.stride(), bool(is_causal), float(dropout_p), wanted)
    if q.device.type == "cuda":
        # Global switches that PyTorch's can_use_* read (torch.nn.attention.sdpa_kernel flips
        # them), so a decision is never reused across a change of them.
        key += (torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.cudnn_sdp_enabled(),
                torch.are_deterministic_algorithms_enabled())
    return key


def select_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                   is_causal: bool,
                   requested: AttentionBackend | str | None = None) -> AttentionBackend:
    """Pick the SDPA kernel for these inputs; the same inputs always get the same answer.

    On CPU: ``CPU_FLASH`` (``MATH`` if E != Ev). On CUDA: cuDNN on sm90/sm100 when
    :func:`cudnn_preferred` and PyTorch's checks allow it, then flash, then memory-efficient,
    then ``MATH``. ``requested`` (a backend or its lowercase name) overrides the choice, and
    when it is None the environment variable ``MESHFUSE_SDPA_BACKEND`` (auto, cudnn, flash,
    efficient, cpu_flash, math) does. Decisions are cached per device, dtype, shapes, strides,
    causality, dropout, request and PyTorch's SDPA switches, so repeated calls are cheap.

    Args:
        q: ``[B, H, S, E]``. k: ``[B, H, Skv, E]``. v: ``[B, H, Skv, Ev]``. Same dtype
            (float16, bfloat16 or float32) and device.
        dropout_p: dropout probability in [0, 1); must be 0 on CPU.
        is_causal: causal mask aligned top-left (query i sees keys 0..i), as in PyTorch.
        requested: backend to use instead of the automatic choice.

    Returns:
        The backend to pass to :func:`sdpa_forward` and :func:`sdpa_backward`.

    Raises:
        InputError: bad inputs, dropout on CPU, or a requested backend that cannot run them.
        DefinitionError: ``requested`` or ``MESHFUSE_SDPA_BACKEND`` names no backend.

    Example:
        >>> q = k = v = torch.randn(2, 4, 128, 64)
        >>> select_backend(q, k, v, 0.0, True)
        <AttentionBackend.CPU_FLASH: 'cpu_flash'>
    """
    _check_qkv(q, k, v)
    _check_dropout(q, dropout_p)
    wanted = _requested(requested)
    key = _selection_key(q, k, v, dropout_p, is_causal, wanted)
    backend = _SELECTION_CACHE.get(key)
    if backend is None:
        backend = _choose(q, k, v, dropout_p, is_causal, wanted)
        if len(_SELECTION_CACHE) >= _CACHE_LIMIT:
            _SELECTION_CACHE.clear()
        _SELECTION_CACHE[key] = backend
    return backend


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
        return _unit_last_stride(lse)
    base = lse._base
    if (base is not None and tuple(base.shape) == (b, h, padded) and base.stride(-1) == 1
            and base.stride() == lse.stride() and base.data_ptr() == lse.data_ptr()):
        return base
    return torch.nn.functional.pad(lse, (0, padded - s_q), value=math.inf)


def _cudnn_lse(lse: torch.Tensor, q, k, v, attn) -> torch.Tensor:
    """``[B, H, S, 1]`` in the layout cuDNN's forward allocates, copied only if it differs.

    cuDNN reads the statistics with the strides it was given, and its dense path wants them
    BHS; with ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` and all of q/k/v/attn BSHE it uses
    ragged offsets computed from the S stride, and allocates them BSH.
    """
    lse4 = lse.unsqueeze(-1)
    ragged = os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "").lower() in ("1", "true", "on")
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
    return _unit_last_stride(grad_attn)


# ----------------------------------------------------------------------------------------------
# Kernels: forward returns (attn, lse [B, H, S], seed, offset); backward (dq, dk, dv)


def _cudnn_fwd(q, k, v, dropout_p, is_causal, scale):
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, dropout_p, is_causal, False, scale=scale)
    return out[0], _lse_as_bhs(out[1], q.shape[2]), out[6], out[7]


def _cudnn_bwd(grad, q, k, v, attn, lse, dropout_p, is_causal, seed, offset, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _cudnn_grad(grad, attn), q, k, v, attn, _cudnn_lse(lse, q, k, v, attn), seed, offset,
        None, None, None, q.shape[2], k.shape[2], dropout_p, is_causal, scale=scale)


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


def _math_probs(q, k, is_causal, scale, lse=None):
    """float32 ``softmax(q k^T * scale)``, and the log-sum-exp it used."""
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)).mul_(_scale_of(q, scale))
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores.masked_fill_(~keep, -math.inf)
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return scores.sub_(lse.unsqueeze(-1)).exp_(), lse


def _math_fwd(q, k, v, dropout_p, is_causal, scale):
    probs, lse = _math_probs(q, k, is_causal, scale)
    return torch.matmul(probs, v.float()).to(q.dtype), lse, None, None


def _math_bwd(grad, q, k, v, attn, lse, dropout_p, is_causal, seed, offset, scale):
    probs, _ = _math_probs(q, k, is_causal, scale, lse.float())
    g = grad.float()
    dv = torch.matmul(probs.transpose(-2, -1), g)
    # dS = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dO * O).
    delta = (g * attn.float()).sum(dim=-1, keepdim=True)
    ds = probs.mul_(torch.matmul(g, v.float().transpose(-2, -1)).sub_(delta))
    ds.mul_(_scale_of(q, scale))
    dq = torch.matmul(ds, k.float())
    dk = torch.matmul(ds.transpose(-2, -1), q.float())
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
    _check_qkv(q, k, v)
    _check_dropout(q, dropout_p)
    if parse_backend(backend) is None:
        backend = select_backend(q, k, v, dropout_p, is_causal)
    forward, backward = _kernels_for(backend, q, k, v, dropout_p, is_causal)
    return parse_backend(backend), forward, backward


def _kernels_for(backend, q, k, v, dropout_p: float, is_causal: bool):
    """The (forward, backward) pair of ``backend``, after its cheap per-call limits."""
    backend = parse_backend(backend)
    if backend is None:
        raise DefinitionError("sdpa: pass the backend that select_backend returned, not auto")
    reason = _own_limits(backend, q, k, v, dropout_p, is_causal)
    if reason is not None:
        raise InputError(f"sdpa: backend {backend.value!r} {reason}; use select_backend")
    return _KERNELS[backend]


@torch.no_grad()
def sdpa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                 is_causal: bool, scale: float | None = None,
                 backend: AttentionBackend | str | None = None):
    """Scaled dot-product attention forward with one of PyTorch's SDPA kernels.

    Args:
        q: ``[B, H, S, E]``; k: ``[B, H, Skv, E]``; v: ``[B, H, Skv, Ev]``: one dtype
            (float16, bfloat16, float32) and device, any strides (a strided last axis is
            copied; BHSE and BSHE are used as they are).
        dropout_p: dropout probability in [0, 1); 0 on CPU.
        is_causal: mask key j > query i (top-left aligned, as in PyTorch).
        scale: the factor of ``q @ k^T``; None is ``1 / sqrt(E)``.
        backend: from :func:`select_backend` (the backward must get the same one); None
            selects it here.

    Returns:
        ``(attn, log_sumexp, seed, offset)``: attn ``[B, H, S, Ev]`` of q's dtype and
        log_sumexp float32 ``[B, H, S]`` (layouts per backend in the module docstring);
        seed and offset, the dropout RNG state the backward replays (0-d int64 CPU zeros
        when ``dropout_p == 0``; otherwise opaque, see the module docstring).

    Raises:
        InputError: bad inputs, dropout on CPU, or a backend for the other device.
    """
    _check_qkv(q, k, v)
    _check_dropout(q, dropout_p)
    if parse_backend(backend) is None:
        backend = select_backend(q, k, v, dropout_p, is_causal)
    forward, _ = _kernels_for(backend, q, k, v, dropout_p, is_causal)
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    scale = None if scale is None else float(scale)
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
                  scale: float | None, backend: AttentionBackend | str):
    """Gradients of :func:`sdpa_forward` with the same kernel family.

    Args:
        grad_attn: ``[B, H, S, Ev]``, q's dtype, any strides (cuDNN before 9.5.1 copies it
            to attn's strides when they differ).
        q, k, v, dropout_p, is_causal, scale: as given to the forward.
        attn, log_sumexp, seed, offset: the forward's outputs, in any layout; log_sumexp
            must be float32 ``[B, H, S]``.
        backend: the backend the forward ran with.

    Returns:
        ``(q_grad, k_grad, v_grad)`` with the shapes and dtypes of q, k and v (layouts per
        backend in the module docstring).

    Raises:
        InputError: tensors that do not fit, or a backend for the other device.
    """
    _check_qkv(q, k, v)
    _check_dropout(q, dropout_p)
    _check_backward(grad_attn, attn, log_sumexp, q, v)
    _, backward = _kernels_for(backend, q, k, v, dropout_p, is_causal)
    grad_attn, q, k, v, attn = (_unit_last_stride(t) for t in (grad_attn, q, k, v, attn))
    scale = None if scale is None else float(scale)
    dq, dk, dv = backward(
        grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset, scale)
    return dq, dk, dv
