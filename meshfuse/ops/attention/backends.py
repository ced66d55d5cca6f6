"""Which of PyTorch's SDPA kernels runs an attention: validation and backend selection.

:func:`select_backend` picks, once per input signature, the fastest kernel that runs the
inputs: cuDNN on Hopper/Blackwell where PyTorch prefers it, then flash, then
memory-efficient, then the math kernel; the CPU flash kernel on CPU (the math kernel with
dropout, which the CPU flash kernel lacks).
``MESHFUSE_SDPA_BACKEND`` (or an explicit request) forces one, with a clear error when it
cannot run the inputs. The kernels themselves are called in
:mod:`meshfuse.ops.attention.kernels`.
"""

from __future__ import annotations

import enum
import os
import warnings

import torch

from meshfuse.errors import DefinitionError, InputError

ENV_VAR = "MESHFUSE_SDPA_BACKEND"
_AUTO = "auto"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CUDNN_SEQ_FIX_VERSION = 91501  # cuDNN 9.15.1 fixed sequence lengths that are not k*128
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


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
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
        if t.shape[0] != q.shape[0]:
            raise InputError(f"sdpa: batch (axis 0) of {name} is {t.shape[0]} but q's is "
                             f"{q.shape[0]}")
    check_heads("sdpa", q.shape[1], k.shape[1], v.shape[1], InputError)
    if q.dtype not in _DTYPES:
        raise InputError(f"sdpa: q/k/v are {q.dtype}; use float16, bfloat16, float32 or "
                         "float64")
    if k.shape[2] != v.shape[2]:
        raise InputError(f"sdpa: sequence (axis 2) of k is {k.shape[2]} but v's is {v.shape[2]}")
    if k.shape[3] != q.shape[3]:
        raise InputError(f"sdpa: head dim (axis 3) of k is {k.shape[3]} but q's is {q.shape[3]}")


def check_heads(op: str, q_heads, k_heads, v_heads, error=InputError) -> None:
    """Raise ``error`` unless k and v have one head count that divides q's (grouped-query
    attention, as PyTorch's SDPA with ``enable_gqa=True``: query head ``h`` attends with
    key/value head ``h // (q_heads // k_heads)``); None is a count not known yet; an empty
    shard (no heads of either) fits."""
    if None not in (k_heads, v_heads) and k_heads != v_heads:
        raise error(f"{op}: heads (axis 1) of k is {k_heads} but v's is {v_heads}; k and v "
                    "need one head count")
    if None not in (q_heads, k_heads) and (q_heads % k_heads if k_heads else q_heads):
        raise error(f"{op}: heads (axis 1) of k is {k_heads} but q's is {q_heads}, not a "
                    "multiple of it; k and v need as many heads as q, or a divisor of q's "
                    "(grouped-query attention)")


def is_grouped(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether q has more heads than k (grouped-query attention)."""
    return q.shape[1] != k.shape[1]


def check_dropout(q: torch.Tensor, dropout_p: float) -> None:
    """Raise :class:`InputError` unless ``dropout_p`` is in [0, 1)."""
    if not 0.0 <= dropout_p < 1.0:
        raise InputError(f"sdpa: dropout_p must be in [0, 1), got {dropout_p}")


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
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


def own_limits(backend: AttentionBackend, q, k, v, dropout_p: float, is_causal: bool):
    """Why meshfuse itself will not run ``backend`` on these inputs, or None.

    These add to PyTorch's ``can_use_*`` checks, which accept inputs that only the public
    ``scaled_dot_product_attention`` makes usable (it pads head dims before the kernel).
    """
    e, ev, s_q, s_kv = q.shape[3], v.shape[3], q.shape[2], k.shape[2]
    device = q.device.type
    if q.dtype == torch.float64 and backend is not AttentionBackend.MATH:
        return "has no float64 (the math kernel runs it, in float64)"
    if backend is AttentionBackend.CPU_FLASH:
        if device != "cpu":
            return f"needs CPU tensors, got {q.device}"
        if e != ev:
            return f"needs q/k/v with one head dim, got E={e} and Ev={ev}"
        if dropout_p > 0.0:
            return "has no dropout (the math kernel runs dropout on CPU)"
        return None
    if backend is AttentionBackend.MATH:
        return None
    if device != "cuda":
        return f"needs CUDA tensors, got {q.device}"
    if backend is AttentionBackend.EFFICIENT:
        return "has no grouped-query attention" if is_grouped(q, k) else None
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
    q, k, v = (unit_last_stride(t).detach() for t in (q, k, v))
    try:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    except RuntimeError:  # inference-mode tensors cannot require grad; ask without it
        pass
    params = torch.backends.cuda.SDPAParams(q, k, v, None, dropout_p, is_causal,
                                            is_grouped(q, k))
    with torch.cuda.device(q.device):  # the checks read the current device's properties
        if check(params, False):
            return None
    return (
        f"is refused by torch.backends.cuda.{names[backend]} (call it with debug=True for the "
        "reason; it may also be switched off by torch.backends.cuda.enable_*_sdp(False))"
    )


def _unusable_reason(backend: AttentionBackend, q, k, v, dropout_p: float, is_causal: bool):
    reason = own_limits(backend, q, k, v, dropout_p, is_causal)
    if reason is None and backend in _CUDA_FUSED:
        reason = _torch_can_use(backend, q, k, v, dropout_p, is_causal)
    return reason


def deterministic_only() -> bool:
    """Whether ``torch.use_deterministic_algorithms(True)`` is on without ``warn_only``: a
    kernel that may sum in a different order from call to call must not run."""
    return torch.are_deterministic_algorithms_enabled() and \
        not torch.is_deterministic_algorithms_warn_only_enabled()


def check_deterministic_backward(backend: AttentionBackend) -> None:
    """Refuses cuDNN's attention backward under :func:`deterministic_only` (it has no
    deterministic mode here: two same-seed calls gave ``q_grad`` bits differing by 3e-8 on
    H200 with cuDNN 9.19), as PyTorch refuses an op without a deterministic implementation;
    with ``warn_only``, warns as PyTorch does.

    Raises:
        InputError: cuDNN's backward with deterministic algorithms required.
    """
    if backend is not AttentionBackend.CUDNN or not torch.are_deterministic_algorithms_enabled():
        return
    message = (
        "the cuDNN attention backward is not deterministic, and "
        "torch.use_deterministic_algorithms(True) is set; let meshfuse choose the kernel "
        f"({ENV_VAR}=auto picks a deterministic one) or request flash, efficient or math"
    )
    if deterministic_only():
        raise InputError(message)
    warnings.warn(message, stacklevel=3)


def _auto_order(q: torch.Tensor, k: torch.Tensor) -> tuple[AttentionBackend, ...]:
    if q.device.type != "cuda":
        return (AttentionBackend.CPU_FLASH, AttentionBackend.MATH)
    capability = torch.cuda.get_device_capability(q.device)
    if deterministic_only():  # cuDNN's backward is not (check_deterministic_backward)
        return (AttentionBackend.FLASH, AttentionBackend.EFFICIENT, AttentionBackend.MATH)
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

    On CPU: ``CPU_FLASH`` (``MATH`` if E != Ev or with dropout). Empty inputs (an empty
    shard) get ``MATH``. On CUDA: cuDNN on sm90/sm100 when
    :func:`cudnn_preferred` and PyTorch's checks allow it, then flash, then memory-efficient,
    then ``MATH``. ``requested`` (a backend or its lowercase name) overrides the choice, and
    when it is None the environment variable ``MESHFUSE_SDPA_BACKEND`` (auto, cudnn, flash,
    efficient, cpu_flash, math) does. Decisions are cached per device, dtype, shapes, strides,
    causality, dropout, request and PyTorch's SDPA switches, so repeated calls are cheap.

    Args:
        q: ``[B, H, S, E]``. k: ``[B, Hkv, Skv, E]``. v: ``[B, Hkv, Skv, Ev]``, with
            ``Hkv`` dividing ``H`` (grouped-query attention). Same dtype (float16, bfloat16
            or float32) and device.
        dropout_p: dropout probability in [0, 1).
        is_causal: causal mask aligned top-left (query i sees keys 0..i), as in PyTorch.
        requested: backend to use instead of the automatic choice.

    Returns:
        The backend to pass to :func:`sdpa_forward` and :func:`sdpa_backward`.

    Raises:
        InputError: bad inputs, or a requested backend that cannot run them.
        DefinitionError: ``requested`` or ``MESHFUSE_SDPA_BACKEND`` names no backend.

    Example:
        >>> q = k = v = torch.randn(2, 4, 128, 64)
        >>> select_backend(q, k, v, 0.0, True)
        <AttentionBackend.CPU_FLASH: 'cpu_flash'>
    """
    check_qkv(q, k, v)
    check_dropout(q, dropout_p)
    if requested is None and min(q.numel(), k.numel(), v.numel()) == 0:
        # An empty shard (uneven sharding: a device with no heads): the fused kernels
        # divide by the extents, the math one computes an empty result.
        return AttentionBackend.MATH
    wanted = _requested(requested)
    key = _selection_key(q, k, v, dropout_p, is_causal, wanted)
    backend = _SELECTION_CACHE.get(key)
    if backend is None:
        backend = _choose(q, k, v, dropout_p, is_causal, wanted)
        if len(_SELECTION_CACHE) >= _CACHE_LIMIT:
            _SELECTION_CACHE.clear()
        _SELECTION_CACHE[key] = backend
    return backend
