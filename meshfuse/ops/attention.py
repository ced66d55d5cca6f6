"""Attention ops: ``sdpfa_fwd`` and ``sdpfa_bwd`` (names, arguments and outputs of the seed).

Both call PyTorch's SDPA kernels directly (see ``attention_kernels``): on CUDA the fastest
kernel for the inputs (cuDNN on Hopper), overridable with ``MESHFUSE_SDPA_BACKEND``, and the
same kernel for the forward and the backward; on CPU, PyTorch's CPU flash kernel.

Dropout (``dropout_p > 0``): every shard draws its mask from its own RNG stream, derived from
one seed (``rng_seed``/``rng_offset``, or drawn from torch's generator) and the shard's global
position; ``dropout_mode="global"`` makes the mask a function of the global position instead
(bitwise the unsharded run). See :mod:`meshfuse.ops.attention_dropout`.

Domain map: B and H map between q, k, v, attn, log_sumexp and the gradients; the query
sequence axis maps from q to attn and log_sumexp; the head dim of attn comes from v. The
contracted axes (the key/value sequence, the q/k head dim) are reduction IDs of attn, so a
sharded key/value sequence or head dim shows up as needing communication.
"""

from __future__ import annotations

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError, ShardingError
from meshfuse.ir.global_index import GlobalIndex
from meshfuse.ir.iter_domain import IterType
from meshfuse.ir.layout import device_ids
from meshfuse.ir.placement import shard_signature
from meshfuse.ir.tensor_view import Scalar
from meshfuse.ops import attention_kernels
from meshfuse.ops.attention_backends import AttentionBackend, select_backend
from meshfuse.ops.attention_dropout import (
    GLOBAL,
    SHARD,
    DropoutSite,
    attention_site,
    resolve_mode,
    run_in_stream,
)
from meshfuse.ops.random import check_rng_args, resolve_seed
from meshfuse.ops.registry import (
    AxisSpec,
    OpDef,
    OutSpec,
    ScalarMeta,
    Vjp,
    attr,
    register,
    scalar,
    tensor,
)
from meshfuse.ops.shape_rules import require_tensor

_RNG = OutSpec(DataType.Int, ())


def _bhse(op: str, names: tuple[str, ...], metas) -> None:
    for name, m in zip(names, metas):
        m = require_tensor(op, name, m)
        if m.ndim != 4:
            raise DefinitionError(
                f"{op}: {name} must be [batch, heads, sequence, head_dim], got {m.ndim} axes"
            )
    first = metas[0]
    for name, m in zip(names[1:], metas[1:]):
        for axis, label in ((0, "batch"), (1, "heads")):
            a, b = first.shape[axis], m.shape[axis]
            if None not in (a, b) and a != b:
                raise DefinitionError(
                    f"{op}: {label} (axis {axis}) of {name} is {b} but {names[0]}'s is {a}"
                )
        if m.dtype is not first.dtype:
            raise DefinitionError(
                f"{op}: {name} is {m.dtype.name} but {names[0]} is {first.dtype.name}; cast "
                "them to one dtype"
            )


def _check_kv(op: str, q, k, v) -> None:
    checks = ((k, 2, v, 2, "sequence (axis 2) of k and v"), (q, 3, k, 3, "head_dim of q and k"))
    for a, ia, b, ib, what in checks:
        if None not in (a.shape[ia], b.shape[ib]) and a.shape[ia] != b.shape[ib]:
            raise DefinitionError(f"{op}: {what} differ: {a.shape[ia]} and {b.shape[ib]}")


def _check_scalars(op: str, dropout_p, is_causal, scale) -> None:
    """Constant (or Python) dropout_p, is_causal and scale must make sense."""
    def value(x):
        return x.value if isinstance(x, ScalarMeta) else x

    p, causal, sc = value(dropout_p), value(is_causal), value(scale)
    if p is not None and (isinstance(p, bool) or not isinstance(p, int | float) or
                          not 0.0 <= p < 1.0):
        raise DefinitionError(f"{op}: dropout_p must be a number in [0, 1), got {p!r}")
    if causal is not None and not isinstance(causal, bool):
        raise DefinitionError(f"{op}: is_causal must be a bool, got {causal!r}")
    if sc is not None and (isinstance(sc, bool) or not isinstance(sc, int | float) or sc <= 0):
        raise DefinitionError(f"{op}: scale must be a positive number or None, got {sc!r}")


def _fwd_infer(q, k, v, dropout_p, is_causal, scale, rng_seed, rng_offset, dropout_mode):
    _check_scalars("sdpfa_fwd", dropout_p, is_causal, scale)
    check_rng_args("sdpfa_fwd", rng_seed, rng_offset)
    resolve_mode("sdpfa_fwd", dropout_mode)
    _bhse("sdpfa_fwd", ("q", "k", "v"), (q, k, v))
    _check_kv("sdpfa_fwd", q, k, v)
    batch = AxisSpec(q.shape[0], IterType.Iteration, ((0, 0), (1, 0), (2, 0)))
    heads = AxisSpec(q.shape[1], IterType.Iteration, ((0, 1), (1, 1), (2, 1)))
    seq = AxisSpec(q.shape[2], IterType.Iteration, ((0, 2),))
    attn = (
        batch, heads, seq,
        AxisSpec(v.shape[3], IterType.Iteration, ((2, 3),)),
        AxisSpec(k.shape[2], IterType.Reduction, ((1, 2), (2, 2))),
        AxisSpec(q.shape[3], IterType.Reduction, ((0, 3), (1, 3))),
    )
    return [OutSpec(q.dtype, attn), OutSpec(DataType.Float, (batch, heads, seq)), _RNG, _RNG]


def _fwd(q, k, v, dropout_p, is_causal, scale, rng_seed=None, rng_offset=None,
         dropout_mode=None, site: DropoutSite | None = None):
    if float(dropout_p) > 0.0:
        site = site or _whole_site(dropout_mode, q, k)
        return _dropout_fwd(q, k, v, float(dropout_p), is_causal, scale, rng_seed, rng_offset,
                            site)
    backend = select_backend(q, k, v, dropout_p, is_causal)
    return attention_kernels.sdpa_forward(q, k, v, dropout_p, is_causal, scale, backend)


def _whole_site(mode, q, k) -> DropoutSite:
    """The site of an attention run outside a program: the whole (unsharded) tensors."""
    index = GlobalIndex.whole(tuple(q.shape[:3]))
    return attention_site(resolve_mode("sdpfa_fwd", mode), index, k.shape[2])


def _dropout_backend(site: DropoutSite, q, k, v, dropout_p, is_causal) -> AttentionBackend:
    if site.mode == GLOBAL:
        return AttentionBackend.MATH
    return select_backend(q, k, v, dropout_p, is_causal)


def _dropout_fwd(q, k, v, dropout_p, is_causal, scale, rng_seed, rng_offset,
                 site: DropoutSite):
    """The forward with dropout: the math kernel with this shard's mask, or a fused CUDA
    kernel drawing from this shard's stream. Returns the fused kernel's RNG state, or the
    seed and offset for the math kernel."""
    seed, offset = resolve_seed("sdpfa_fwd", rng_seed, rng_offset)
    backend = _dropout_backend(site, q, k, v, dropout_p, is_causal)
    if backend is AttentionBackend.MATH:
        keep = site.keep_mask(seed, offset, dropout_p, q.device)
        attn, lse, _, _ = attention_kernels.sdpa_forward(
            q, k, v, dropout_p, is_causal, scale, backend, dropout_mask=keep)
        return attn, lse, torch.tensor(seed), torch.tensor(offset)
    return run_in_stream(site.stream(seed, offset), q.device, attention_kernels.sdpa_forward,
                         q, k, v, dropout_p, is_causal, scale, backend)


_NO_RNG = torch.zeros((), dtype=torch.int64)


class _Forward:
    """``sdpfa_fwd`` in a program: checks and picks the kernel on the first call (the
    program's shapes and strides are fixed), then calls it directly. With dropout, each call
    draws from this shard's stream (``site``)."""

    def __init__(self) -> None:
        self.kernels = {}  # dropout or not -> the bound forward kernel (None: math)

    def __call__(self, q, k, v, dropout_p, is_causal, scale, rng_seed, rng_offset,
                 dropout_mode, site):
        p = float(dropout_p)
        kernel = self.kernels.get(p > 0.0, False)
        if kernel is False:  # first call: checked, and the kernel bound
            self.kernels[p > 0.0] = _bound(0, q, k, v, p, is_causal, site)
            return _fwd(q, k, v, p, is_causal, scale, rng_seed, rng_offset, site=site)
        scale = None if scale is None else float(scale)
        if p == 0.0:
            attn, lse, seed, offset = kernel(q, k, v, p, is_causal, scale)
            return (attn, lse, _NO_RNG, _NO_RNG) if seed is None else (attn, lse, seed, offset)
        if kernel is None:  # the math kernel: the mask dominates, no shortcut
            return _dropout_fwd(q, k, v, p, is_causal, scale, rng_seed, rng_offset, site)
        seed, offset = resolve_seed("sdpfa_fwd", rng_seed, rng_offset)
        return run_in_stream(site.stream(seed, offset), q.device, kernel, q, k, v, p,
                             is_causal, scale)


def _bound(which: int, q, k, v, dropout_p, is_causal, site):
    """The raw forward (``which`` 0) or backward (1) kernel for these inputs, or None for
    the math kernel with dropout (which needs its mask)."""
    if dropout_p > 0.0:
        backend = _dropout_backend(site, q, k, v, dropout_p, is_causal)
        if backend is AttentionBackend.MATH:
            return None
        return attention_kernels.bind_kernels(q, k, v, dropout_p, is_causal, backend)[1 + which]
    return attention_kernels.bind_kernels(q, k, v, dropout_p, is_causal)[1 + which]


def _raw(expr, name: str):
    """The argument ``name`` of ``expr`` as given (a Val or a Python value)."""
    return expr.args[[p.name for p in expr.op.params].index(name)]


def _arg(expr, name: str):
    """The argument's constant value (None for a scalar input); tensors as they are."""
    value = _raw(expr, name)
    return value.value if isinstance(value, Scalar) else value


def _check_sharding(expr) -> None:
    """A sharded query sequence needs a mask offset in causal attention (not supported yet);
    a backward with per-shard dropout streams must be sharded as its forward was."""
    q = expr.args[1 if expr.op.name == "sdpfa_bwd" else 0]
    if _arg(expr, "is_causal") is not False and device_ids(q).get(q.logical[2]):
        raise ShardingError(
            f"{expr.op.name}: the query sequence (axis 2) of {q.name} is sharded and the "
            "attention is causal; the causal mask of a sequence shard is not supported yet: "
            "shard batch or heads, or gather the sequence first"
        )
    # sdpfa_bwd runs on a shard of the keys (its query gradient is then a partial sum), but
    # neither a causal mask nor a dropout mask knows the shard's offset.
    k = expr.args[2 if expr.op.name == "sdpfa_bwd" else 1]
    if device_ids(k).get(k.logical[2]) and (_arg(expr, "is_causal") is not False or
                                            _arg(expr, "dropout_p") != 0.0):
        raise ShardingError(
            f"{expr.op.name}: the key sequence (axis 2) of {k.name} is sharded and the "
            "attention is causal or drops out; gather the key/value sequence first"
        )
    forward = _forward_of(expr)
    if expr.op.name != "sdpfa_bwd" or forward is None or _arg(expr, "dropout_p") == 0.0:
        return
    if _bwd_mode(expr) == SHARD and any(
            shard_signature(a, a.logical[axis]) != shard_signature(b, b.logical[axis])
            for a, b in ((forward.outputs[0], expr.outputs[0]),) for axis in range(3)):
        raise ShardingError(
            f"sdpfa_bwd: {expr.outputs[0].name} is sharded otherwise than "
            f"{forward.outputs[0].name} on batch, heads or sequence, so the per-shard dropout "
            "streams of the forward cannot be replayed; schedule both alike, or use "
            "dropout_mode='global'"
        )


def _fwd_grads(d, grads):
    """``sdpfa_bwd`` with the saved attention output, log-sum-exp and RNG state (one call
    gives the three gradients). Only the attention output is differentiable (as PyTorch's
    flash attention: its log-sum-exp is a constant to autograd)."""
    computed = []

    def gradient(index: int):
        if not computed:
            computed.extend(d.ops.sdpfa_bwd(
                grads[0], *(d.value(n) for n in ("q", "k", "v")), d.out(0), d.out(1),
                d.value("dropout_p"), d.value("is_causal"), d.out(2), d.out(3),
                d.value("scale"), d.attrs["dropout_mode"]))
        return computed[index]

    return {"q": lambda: gradient(0), "k": lambda: gradient(1), "v": lambda: gradient(2)}


def _forward_of(expr):
    """The ``sdpfa_fwd`` whose seed an ``sdpfa_bwd`` reads, or None."""
    seed = _arg(expr, "seed") if expr.op.name == "sdpfa_bwd" else None
    forward = getattr(seed, "definition", None)
    return forward if forward is not None and forward.op.name == "sdpfa_fwd" else None


def _bwd_mode(expr) -> str:
    """The backward's dropout mode: its own, else its forward's, else the default."""
    mode = _arg(expr, "dropout_mode")
    forward = _forward_of(expr)
    if mode is None and forward is not None:
        mode = _arg(forward, "dropout_mode")
    return resolve_mode("sdpfa_bwd", mode)


def _seed_arg(expr, name: str):
    """A seed argument for ``explain``: its constant value, or the scalar input itself."""
    value = _raw(expr, name)
    return value.value if isinstance(value, Scalar) and value.is_constant else value


def _localize(expr, here):
    """This rank's dropout site: its shard's position in the global ``[B, H, S, Skv]``."""
    backward = expr.op.name == "sdpfa_bwd"
    mode = _bwd_mode(expr) if backward else resolve_mode("sdpfa_fwd", _arg(expr, "dropout_mode"))
    k = expr.args[2 if backward else 1]
    kv_length = here.index(k).extents[2]
    site = attention_site(mode, here.index(expr.outputs[0]), kv_length)
    p = _arg(expr, "dropout_p")
    if p == 0.0:
        return {"site": site}, ""
    forward = _forward_of(expr) if backward else expr
    if forward is None:
        return {"site": site}, f"dropout {mode} mode, the seed and offset given as inputs"
    note = site.describe(*(_seed_arg(forward, name) for name in ("rng_seed", "rng_offset")))
    return {"site": site}, note if not backward else f"replays the forward's {note}"


register(OpDef(
    "sdpfa_fwd",
    (tensor("q"), tensor("k"), tensor("v"), scalar("dropout_p", 0.0),
     scalar("is_causal", False), scalar("scale", None), scalar("rng_seed", None),
     scalar("rng_offset", None), attr("dropout_mode", None)),
    _fwd_infer, _fwd,
    doc="scaled dot-product attention forward: (attn, log_sumexp, seed, offset)",
    partial_reduce=None, check_sharding=_check_sharding, make_impl=_Forward,
    vjp=Vjp(_fwd_grads, differentiable=(0,)),
    localize=_localize,
))


def _bwd_infer(grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset, scale,
               dropout_mode):
    _check_scalars("sdpfa_bwd", dropout_p, is_causal, scale)
    if dropout_mode is not None:
        resolve_mode("sdpfa_bwd", dropout_mode)
    _bhse("sdpfa_bwd", ("grad_attn", "q", "k", "v", "attn"), (grad_attn, q, k, v, attn))
    _check_kv("sdpfa_bwd", q, k, v)
    for name, m in (("grad_attn", grad_attn), ("attn", attn)):
        if None not in (m.shape[2], q.shape[2]) and m.shape[2] != q.shape[2]:
            raise DefinitionError(
                f"sdpfa_bwd: sequence (axis 2) of {name} is {m.shape[2]} but q's is {q.shape[2]}"
            )
    others = ((0, 0), (4, 0), (5, 0)), ((0, 1), (4, 1), (5, 1))

    def grad_of(pos: int, meta):
        axes = [
            AxisSpec(meta.shape[0], IterType.Iteration, ((pos, 0),) + others[0]),
            AxisSpec(meta.shape[1], IterType.Iteration, ((pos, 1),) + others[1]),
            AxisSpec(meta.shape[2], IterType.Iteration, ((pos, 2),)),
            AxisSpec(meta.shape[3], IterType.Iteration, ((pos, 3),)),
        ]
        if pos == 1:  # q_grad's sequence is grad_attn's too; it sums over the keys
            axes[2] = AxisSpec(meta.shape[2], IterType.Iteration, ((1, 2), (0, 2), (4, 2), (5, 2)))
            axes.append(AxisSpec(k.shape[2], IterType.Reduction, ((2, 2), (3, 2))))
        else:  # k_grad and v_grad sum over the queries
            axes.append(AxisSpec(q.shape[2], IterType.Reduction, ((1, 2), (0, 2), (4, 2), (5, 2))))
        return OutSpec(meta.dtype, tuple(axes))

    return [grad_of(1, q), grad_of(2, k), grad_of(3, v)]


def _bwd(grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset, scale,
         dropout_mode=None, site: DropoutSite | None = None):
    if float(dropout_p) > 0.0:
        site = site or _whole_site(dropout_mode, q, k)
        return _dropout_bwd(grad_attn, q, k, v, attn, log_sumexp, float(dropout_p), is_causal,
                            seed, offset, scale, site)
    backend = select_backend(q, k, v, dropout_p, is_causal)
    return attention_kernels.sdpa_backward(
        grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset, scale, backend
    )


def _dropout_bwd(grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset,
                 scale, site: DropoutSite):
    """The backward with the forward's mask: the math kernel redraws it from the forward's
    seed and offset; a fused kernel replays the RNG state its forward returned."""
    backend = _dropout_backend(site, q, k, v, dropout_p, is_causal)
    mask = None
    if backend is AttentionBackend.MATH:
        mask = site.keep_mask(int(seed), int(offset), dropout_p, q.device)
    return attention_kernels.sdpa_backward(grad_attn, q, k, v, attn, log_sumexp, dropout_p,
                                           is_causal, seed, offset, scale, backend, mask)


class _Backward:
    """``sdpfa_bwd`` in a program: the kernel of the forward (the same selection), picked on
    the first call; a fused kernel replays the RNG state its forward returned."""

    def __init__(self) -> None:
        self.kernels = {}  # dropout or not -> the bound backward kernel (None: math)

    def __call__(self, grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset,
                 scale, dropout_mode, site):
        p = float(dropout_p)
        kernel = self.kernels.get(p > 0.0, False)
        if kernel is False:
            self.kernels[p > 0.0] = _bound(1, q, k, v, p, is_causal, site)
            return _bwd(grad_attn, q, k, v, attn, log_sumexp, p, is_causal, seed, offset, scale,
                        site=site)
        if kernel is None:
            return _dropout_bwd(grad_attn, q, k, v, attn, log_sumexp, p, is_causal, seed,
                                offset, scale, site)
        if grad_attn.stride(-1) != 1:
            grad_attn = grad_attn.contiguous()
        return kernel(grad_attn, q, k, v, attn, log_sumexp, p, is_causal, seed, offset,
                      None if scale is None else float(scale))


register(OpDef(
    "sdpfa_bwd",
    (tensor("grad_attn"), tensor("q"), tensor("k"), tensor("v"), tensor("attn"),
     tensor("log_sumexp"), scalar("dropout_p", 0.0), scalar("is_causal", False),
     tensor("seed"), tensor("offset"), scalar("scale", None), attr("dropout_mode", None)),
    _bwd_infer, _bwd,
    doc="scaled dot-product attention backward: (q_grad, k_grad, v_grad)",
    # On a shard of the queries, k_grad and v_grad are partial sums over them; on a shard
    # of the keys, q_grad is (the log-sum-exp makes each block's probabilities exact).
    partial_reduce="sum", check_sharding=_check_sharding, make_impl=_Backward,
    localize=_localize,
))
