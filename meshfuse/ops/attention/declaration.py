"""Attention ops: ``sdpfa_fwd`` and ``sdpfa_bwd`` (names, arguments and outputs of the seed).

Both call PyTorch's SDPA kernels directly (see ``attention_kernels``): on CUDA the fastest
kernel for the inputs (cuDNN on Hopper), overridable with ``MESHFUSE_SDPA_BACKEND``, and the
same kernel for the forward and the backward; on CPU, PyTorch's CPU flash kernel.

Dropout (``dropout_p > 0``): every shard draws its mask from its own RNG stream, derived from
one seed (``rng_seed``/``rng_offset``, or drawn from torch's generator) and the shard's global
position; ``dropout_mode="global"`` makes the mask a function of the global position instead
(bitwise the unsharded run). See :mod:`meshfuse.ops.attention.dropout`.

q, k and v are ``[..., B, H, S, E]``: leading axes before B (nvFuser's logical device axis
``[DIDx, b, h, s, e]``) are batch-like and come first in every output too.

Grouped-query attention: k and v may have fewer heads than q, a divisor of them (PyTorch's
``enable_gqa=True``: query head ``h`` attends with key/value head ``h // (H / Hkv)``); their
head axes still map together, and sharding planning checks that each rank holds the
key/value heads of its query heads, sharded by groups or replicated
(:mod:`meshfuse.ops.attention.groups`); k_grad and v_grad then reduce over the query heads.

Domain map: the leading axes, B and H map between q, k, v, attn, log_sumexp and the
gradients; the query sequence axis maps from q to attn and log_sumexp; the head dim of attn
comes from v. The contracted axes (the key/value sequence, the q/k head dim) are reduction IDs
of attn; in the backward, q_grad reduces over the key/value sequence and k_grad, v_grad over
the query sequence. The sharding rule (:func:`meshfuse.ops.attention.rules.whole_axes`) says
which input axes the kernels need whole; the engine gathers them, so a sequence-sharded
non-causal attention computes its local query rows against all keys, and its key/value
gradients are partial sums over the query shards.
"""

from __future__ import annotations

import functools

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError
from meshfuse.ir.global_index import GlobalIndex
from meshfuse.ir.iter_domain import IterType
from meshfuse.ops.attention import kernels as attention_kernels
from meshfuse.ops.attention.backends import (
    AttentionBackend,
    check_deterministic_backward,
    check_heads,
    select_backend,
    unit_last_stride,
)
from meshfuse.ops.attention.dropout import (
    GLOBAL,
    OFFSET_SPEC,
    SEED_SPEC,
    DropoutSite,
    FusedDropout,
    attention_site,
    check_kernel_form,
    from_legacy_state,
    kernel_state,
    no_rng_state,
    resolve_mode,
    rng_state,
    run_in_stream,
    seed_and_offset,
    state_of_kernel,
)
from meshfuse.ops.attention.groups import plan_grouped_heads, with_kv_heads
from meshfuse.ops.attention.rules import check_sharding, localize, replayed_sharding, whole_axes
from meshfuse.ops.attention.sequence import requested_strategy
from meshfuse.ops.random.declaration import check_rng_args, resolve_seed
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


def _bhse(op: str, names: tuple[str, ...], metas) -> None:
    """Every tensor ``[..., batch, heads, sequence, head_dim]`` of one dtype, the leading,
    batch and head extents equal, except that k and v may have fewer heads than q, a
    divisor of them (grouped-query attention)."""
    for name, m in zip(names, metas):
        m = require_tensor(op, name, m)
        if m.ndim < 4 or m.ndim != metas[0].ndim:
            raise DefinitionError(
                f"{op}: {name} must be [batch, heads, sequence, head_dim], optionally after "
                f"leading axes ({names[0]} has {metas[0].ndim} axes); got {m.ndim} axes"
            )
    first = metas[0]
    heads = {n: m.shape[first.ndim - 3] for n, m in zip(names, metas)}
    check_heads(op, heads["q"], heads["k"], heads["v"], DefinitionError)
    batch_like = [(a, "batch" if a == first.ndim - 4 else "heads" if a == first.ndim - 3
                   else f"leading axis {a}") for a in range(first.ndim - 2)]
    for name, m in zip(names[1:], metas[1:]):
        for axis, label in batch_like:
            if label == "heads" and name in ("k", "v"):
                continue  # checked against q's above
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
    checks = ((k, -2, v, -2, "sequence (axis -2) of k and v"),
              (q, -1, k, -1, "head_dim of q and k"))
    for a, ia, b, ib, what in checks:
        if None not in (a.shape[ia], b.shape[ib]) and a.shape[ia] != b.shape[ib]:
            raise DefinitionError(f"{op}: {what} differ: {a.shape[ia]} and {b.shape[ib]}")


def _batch_axes(meta, sources: tuple[int, ...]) -> list[AxisSpec]:
    """The leading, batch and head axes of ``meta``, each mapped from the same axis of the
    tensor arguments at ``sources``."""
    return [AxisSpec(meta.shape[a], IterType.Iteration, tuple((t, a) for t in sources))
            for a in range(meta.ndim - 2)]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[..., B, H, S, E]`` as ``[B', H, S, E]`` for the kernels (a view for the leading
    axes of extent 1 a shard has)."""
    return t if t.ndim == 4 else t.flatten(0, t.ndim - 4)


def _flat_lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return lse if q.ndim == 4 else lse.flatten(0, q.ndim - 4)


def _unflat(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A kernel output back to the leading axes of ``like`` (a ``[..., B, H, S, E]`` input)."""
    return t if like.ndim == 4 else t.unflatten(0, like.shape[:like.ndim - 3])


def _leading_folded(fn):
    """``fn(q, k, v, ...)`` on inputs with leading axes: run on the folded 4-D tensors, the
    attention output and log-sum-exp unfolded. The dropout site keeps the leading axes: a
    shard's stream and a global mask are keyed by the position on them too."""
    def call(q, k, v, *args, **kwargs):
        if q.ndim == 4:
            return fn(q, k, v, *args, **kwargs)
        attn, lse, seed, offset = fn(_flat(q), _flat(k), _flat(v), *args, **kwargs)
        return _unflat(attn, q), _unflat(lse, q), seed, offset
    return call


def _leading_folded_bwd(fn):
    """``fn(grad_attn, q, k, v, attn, log_sumexp, ...)`` likewise, gradients unfolded."""
    def call(grad_attn, q, k, v, attn, lse, *args, **kwargs):
        if q.ndim == 4:
            return fn(grad_attn, q, k, v, attn, lse, *args, **kwargs)
        grads = fn(_flat(grad_attn), _flat(q), _flat(k), _flat(v), _flat(attn),
                   _flat_lse(lse, q), *args, **kwargs)
        return tuple(_unflat(g, x) for g, x in zip(grads, (q, k, v)))
    return call


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


def _fwd_infer(q, k, v, dropout_p, is_causal, scale, rng_seed, rng_offset, dropout_mode,
               context_parallel=None):
    _check_scalars("sdpfa_fwd", dropout_p, is_causal, scale)
    requested_strategy("sdpfa_fwd", context_parallel)
    check_rng_args("sdpfa_fwd", rng_seed, rng_offset)
    resolve_mode("sdpfa_fwd", dropout_mode)
    _bhse("sdpfa_fwd", ("q", "k", "v"), (q, k, v))
    _check_kv("sdpfa_fwd", q, k, v)
    batch = _batch_axes(q, (0, 1, 2))
    seq = AxisSpec(q.shape[-2], IterType.Iteration, ((0, q.ndim - 2),))
    attn = (
        *batch, seq,
        AxisSpec(v.shape[-1], IterType.Iteration, ((2, v.ndim - 1),)),
        AxisSpec(k.shape[-2], IterType.Reduction, ((1, k.ndim - 2), (2, v.ndim - 2))),
        AxisSpec(q.shape[-1], IterType.Reduction, ((0, q.ndim - 1), (1, k.ndim - 1))),
    )
    lse = DataType.Double if q.dtype is DataType.Double else DataType.Float
    return [OutSpec(q.dtype, attn), OutSpec(lse, (*batch, seq)), SEED_SPEC, OFFSET_SPEC]


@_leading_folded
def _fwd(q, k, v, dropout_p, is_causal, scale, rng_seed=None, rng_offset=None,
         dropout_mode=None, context_parallel=None, site: DropoutSite | None = None,
         kernel_form: bool = False):
    site = site or _whole_site(dropout_mode, q, k)
    backend = _backend(site, q, k, v, float(dropout_p), is_causal)
    return _forward(backend, None, q, k, v, float(dropout_p), is_causal, scale, rng_seed,
                    rng_offset, site, kernel_form)


def _whole_site(mode, q, k) -> DropoutSite:
    """The site of an attention run outside a program: the whole (unsharded) tensors."""
    index = GlobalIndex.whole(tuple(q.shape))
    return attention_site(resolve_mode("sdpfa_fwd", mode), index, k.shape[-2])


def _backend(site: DropoutSite, q, k, v, dropout_p, is_causal) -> AttentionBackend:
    """The global dropout mask needs the math kernel; otherwise the fastest that runs."""
    if dropout_p > 0.0 and site.mode == GLOBAL:
        return AttentionBackend.MATH
    return select_backend(q, k, v, dropout_p, is_causal)


def _forward(backend, kernel, q, k, v, dropout_p, is_causal, scale, rng_seed, rng_offset,
             site: DropoutSite, kernel_form: bool = False):
    """One forward with ``backend``: through ``sdpa_forward`` (checked), or ``kernel``, the
    raw kernel already bound to these inputs. With dropout, the math kernel gets this shard's
    mask, a fused kernel draws from this shard's stream. Returns attn, log_sumexp and the RNG
    state in nvFuser's form (a fused kernel's own in ``kernel_form``; see
    :mod:`meshfuse.ops.attention.dropout`)."""
    scale = None if scale is None else float(scale)
    call = kernel or functools.partial(attention_kernels.sdpa_forward, backend=backend)
    if dropout_p == 0.0:
        attn, lse, _, _ = call(q, k, v, dropout_p, is_causal, scale)
        return (attn, lse, *no_rng_state(q.device))
    seed, offset = resolve_seed("sdpfa_fwd", rng_seed, rng_offset)
    if backend is AttentionBackend.MATH:
        keep = _flat(site.keep_mask(seed, offset, dropout_p, q.device))
        attn, lse, _, _ = attention_kernels.sdpa_forward(
            q, k, v, dropout_p, is_causal, scale, backend, dropout_mask=keep)
        return (attn, lse, *rng_state(seed, offset, q.device))
    attn, lse, kernel_seed, kernel_offset = run_in_stream(
        site.stream(seed, offset), q.device, call, q, k, v, dropout_p, is_causal, scale)
    if kernel_form:
        return attn, lse, kernel_seed, kernel_offset
    return (attn, lse, *state_of_kernel(backend, kernel_seed, kernel_offset, q.device))


class _Forward:
    """``sdpfa_fwd`` in a program: checks and picks the kernel on the first call (the
    program's shapes and strides are fixed), then calls it directly. With dropout, each call
    draws from this shard's stream (``site``), through a :class:`FusedDropout` made once."""

    def __init__(self) -> None:
        # dropout or not -> (backend, raw forward kernel or None for math, FusedDropout or None)
        self.bound = {}

    def dropout_kernel(self) -> tuple[AttentionBackend, FusedDropout | None] | None:
        """The kernel bound for calls with dropout and its :class:`FusedDropout` (None for
        the math kernel, which draws its mask on the host's seed), or None before the first
        such call."""
        bound = self.bound.get(True)
        return None if bound is None else (bound[0], bound[2])

    def __call__(self, q, k, v, dropout_p, is_causal, scale, rng_seed, rng_offset,
                 dropout_mode, context_parallel, site, kernel_form=False, kv_heads=None):
        if kv_heads is not None:  # this rank's key/value heads, cut to those it needs
            return with_kv_heads(self, backward=False)(
                q, k, v, dropout_p, is_causal, scale, rng_seed, rng_offset, dropout_mode,
                context_parallel, site, kernel_form, kv_heads=kv_heads)
        if q.ndim > 4:
            return _leading_folded(self)(q, k, v, dropout_p, is_causal, scale, rng_seed,
                                         rng_offset, dropout_mode, context_parallel, site)
        p = float(dropout_p)
        if (p > 0.0) not in self.bound:  # first call: checked, and the kernel bound
            self.bound[p > 0.0] = _bind(0, q, k, v, p, is_causal, site, kernel_form)
            return _fwd(q, k, v, p, is_causal, scale, rng_seed, rng_offset, site=site,
                        kernel_form=kernel_form)
        backend, kernel, dropout = self.bound[p > 0.0]
        # The bound kernels take what the checked call passes them: unit innermost strides
        # (a tensor laid out otherwise, e.g. gathered from uneven shards, would be misread).
        q, k, v = (unit_last_stride(t) for t in (q, k, v))
        if dropout is not None:
            seed, offset = resolve_seed("sdpfa_fwd", rng_seed, rng_offset)
            return dropout.forward(kernel, seed, offset, q, k, v, p, is_causal,
                                   None if scale is None else float(scale))
        return _forward(backend, kernel, q, k, v, p, is_causal, scale, rng_seed, rng_offset,
                        site, kernel_form)


def _bind(which: int, q, k, v, dropout_p, is_causal, site, kernel_form: bool = False):
    """``(backend, kernel, dropout)``: the raw forward (``which`` 0) or backward (1) kernel
    for these inputs, None for the math kernel with dropout (it needs its mask: the checked
    path); a forward's :class:`FusedDropout` when a fused CUDA kernel draws the mask (its
    RNG state in ``kernel_form`` or not)."""
    backend = _backend(site, q, k, v, dropout_p, is_causal)
    if dropout_p > 0.0 and backend is AttentionBackend.MATH:
        return backend, None, None
    kernel = attention_kernels.bind_kernels(q, k, v, dropout_p, is_causal, backend)[1 + which]
    fused = dropout_p > 0.0 and which == 0 and q.device.type == "cuda"
    return backend, kernel, FusedDropout(site, backend, q.device, kernel_form) if fused else None


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
                d.value("scale"), d.attrs["dropout_mode"], d.attrs.get("context_parallel")))
        return computed[index]

    return {"q": lambda: gradient(0), "k": lambda: gradient(1), "v": lambda: gradient(2)}


register(OpDef(
    "sdpfa_fwd",
    (tensor("q"), tensor("k"), tensor("v"), scalar("dropout_p", 0.0),
     scalar("is_causal", False), scalar("scale", None), scalar("rng_seed", None),
     scalar("rng_offset", None), attr("dropout_mode", None), attr("context_parallel", None)),
    _fwd_infer, _fwd,
    doc="scaled dot-product attention forward: (attn, log_sumexp, seed, offset)",
    sharding="batch and heads shard freely (grouped key/value heads alike); the head dims "
    "and key/value sequence are gathered, as is a causal query sequence, unless context "
    "parallelism runs it sequence-sharded",
    partial_reduce=None, whole_axes=whole_axes, check_sharding=check_sharding,
    make_impl=_Forward, vjp=Vjp(_fwd_grads, differentiable=(0,)), contiguous_outputs=(1,),
    localize=localize, plan=plan_grouped_heads,
))


def _bwd_infer(grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset, scale,
               dropout_mode, context_parallel=None):
    _check_scalars("sdpfa_bwd", dropout_p, is_causal, scale)
    requested_strategy("sdpfa_bwd", context_parallel)
    if dropout_mode is not None:
        resolve_mode("sdpfa_bwd", dropout_mode)
    _bhse("sdpfa_bwd", ("grad_attn", "q", "k", "v", "attn"), (grad_attn, q, k, v, attn))
    _check_kv("sdpfa_bwd", q, k, v)
    n = q.ndim
    for name, m in (("grad_attn", grad_attn), ("attn", attn)):
        if None not in (m.shape[-2], q.shape[-2]) and m.shape[-2] != q.shape[-2]:
            raise DefinitionError(
                f"sdpfa_bwd: sequence (axis -2) of {name} is {m.shape[-2]} but q's is "
                f"{q.shape[-2]}"
            )
    # Batch-like axes (leading, batch, heads) are one axis of all six tensors: a gradient's
    # map lists them all (its own tensor first), so the outputs agree on how they are sharded.
    tensors = (1, 2, 3, 0, 4, 5)
    query_rows = ((1, n - 2), (0, n - 2), (4, n - 2), (5, n - 2))  # q, grad_attn, attn, lse

    # Grouped-query heads (H query, Hkv key/value heads, both known): a key/value head's
    # gradient sums over the query heads of its group, a reduction of k_grad and v_grad
    # mapped from the query heads (partial where the query heads are sharded and the
    # key/value heads replicated: meshfuse.ops.attention.groups); their head axis maps from
    # k and v only.
    grouped = None not in (q.shape[n - 3], k.shape[n - 3]) and q.shape[n - 3] != k.shape[n - 3]
    query_heads = ((1, n - 3), (0, n - 3), (4, n - 3), (5, n - 3))

    def sources(pos: int, a: int) -> tuple:
        if grouped and a == n - 3 and pos in (2, 3):
            return ((pos, a),) + tuple((t, a) for t in (2, 3) if t != pos)
        return ((pos, a),) + tuple((t, a) for t in tensors if t != pos)

    def grad_of(pos: int, meta):
        axes = [AxisSpec(meta.shape[a], IterType.Iteration, sources(pos, a))
                for a in range(n - 2)]
        if pos == 1:  # q_grad's sequence is grad_attn's too; it sums over the keys
            axes.append(AxisSpec(meta.shape[-2], IterType.Iteration, query_rows))
        else:
            axes.append(AxisSpec(meta.shape[-2], IterType.Iteration, ((pos, n - 2),)))
        axes.append(AxisSpec(meta.shape[-1], IterType.Iteration, ((pos, n - 1),)))
        if pos == 1:
            axes.append(AxisSpec(k.shape[-2], IterType.Reduction, ((2, n - 2), (3, n - 2))))
        else:  # k_grad and v_grad sum over the queries
            axes.append(AxisSpec(q.shape[-2], IterType.Reduction, query_rows))
            if grouped:
                axes.append(AxisSpec(q.shape[n - 3], IterType.Reduction, query_heads))
        return OutSpec(meta.dtype, tuple(axes))

    return [grad_of(1, q), grad_of(2, k), grad_of(3, v)]


@_leading_folded_bwd
def _bwd(grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset, scale,
         dropout_mode=None, context_parallel=None, site: DropoutSite | None = None,
         kernel_form: bool = False):
    site = site or _whole_site(dropout_mode, q, k)
    backend = _backend(site, q, k, v, float(dropout_p), is_causal)
    return _backward(backend, None, grad_attn, q, k, v, attn, log_sumexp, float(dropout_p),
                     is_causal, seed, offset, scale, site, kernel_form)


def _backward(backend, kernel, grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal,
              seed, offset, scale, site: DropoutSite, kernel_form: bool = False):
    """One backward with the forward's mask: the math kernel redraws it from the forward's
    seed and offset (and this shard's site); a fused kernel replays its forward's RNG state
    (its own tensors in ``kernel_form``, checked on the checked call only).
    ``kernel``: the raw kernel bound to these inputs, or None for the checked call."""
    scale = None if scale is None else float(scale)
    if not kernel_form:  # (a kernel's own form may look like PyTorch's before 2.7)
        seed, offset = from_legacy_state(seed, offset, q.device)
    if backend is AttentionBackend.MATH and dropout_p > 0.0:
        mask = _flat(site.keep_mask(*seed_and_offset(seed, offset), dropout_p, q.device))
        return attention_kernels.sdpa_backward(grad_attn, q, k, v, attn, log_sumexp,
                                               dropout_p, is_causal, seed, offset, scale,
                                               backend, mask)
    if kernel is None and kernel_form and dropout_p > 0.0:
        check_kernel_form(backend, seed, offset)
    seed, offset = kernel_state(backend, seed, offset, dropout_p, q.device, kernel_form)
    if kernel is None:
        return attention_kernels.sdpa_backward(grad_attn, q, k, v, attn, log_sumexp,
                                               dropout_p, is_causal, seed, offset, scale,
                                               backend)
    # the bound kernel takes unit innermost strides, as the checked call passes them
    grad_attn, q, k, v, attn = (unit_last_stride(t) for t in (grad_attn, q, k, v, attn))
    return kernel(grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset,
                  scale)


class _Backward:
    """``sdpfa_bwd`` in a program: the kernel of the forward (the same selection), picked on
    the first call; a fused kernel replays the RNG state its forward returned."""

    def __init__(self) -> None:
        self.bound = {}  # dropout or not -> (backend, raw backward kernel or None for math)

    def dropout_kernel(self) -> tuple[AttentionBackend, None] | None:
        """The kernel bound for calls with dropout (with None: a backward draws nothing, it
        replays its forward's RNG state), or None before the first such call."""
        bound = self.bound.get(True)
        return None if bound is None else (bound[0], None)

    def __call__(self, grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset,
                 scale, dropout_mode, context_parallel, site, kernel_form=False, kv_heads=None):
        if kv_heads is not None:  # the gradients of the heads it needs, put back in place
            return with_kv_heads(self, backward=True)(
                grad_attn, q, k, v, attn, log_sumexp, dropout_p, is_causal, seed, offset,
                scale, dropout_mode, context_parallel, site, kernel_form, kv_heads=kv_heads)
        if q.ndim > 4:
            return _leading_folded_bwd(self)(grad_attn, q, k, v, attn, log_sumexp, dropout_p,
                                             is_causal, seed, offset, scale, dropout_mode,
                                             context_parallel, site)
        p = float(dropout_p)
        if (p > 0.0) not in self.bound:
            self.bound[p > 0.0] = _bind(1, q, k, v, p, is_causal, site)
            return _bwd(grad_attn, q, k, v, attn, log_sumexp, p, is_causal, seed, offset, scale,
                        site=site, kernel_form=kernel_form)
        backend, kernel, _ = self.bound[p > 0.0]
        check_deterministic_backward(backend)  # the switch may have been turned on since
        return _backward(backend, kernel, grad_attn, q, k, v, attn, log_sumexp, p, is_causal,
                         seed, offset, scale, site, kernel_form)


register(OpDef(
    "sdpfa_bwd",
    (tensor("grad_attn"), tensor("q"), tensor("k"), tensor("v"), tensor("attn"),
     tensor("log_sumexp"), scalar("dropout_p", 0.0), scalar("is_causal", False),
     tensor("seed"), tensor("offset"), scalar("scale", None), attr("dropout_mode", None),
     attr("context_parallel", None)),
    _bwd_infer, _bwd,
    doc="scaled dot-product attention backward: (q_grad, k_grad, v_grad)",
    sharding="as sdpfa_fwd; a sharded query sequence makes k_grad and v_grad partial sums, "
    "and it replays the forward's per-shard dropout where the forward had it",
    # On a shard of the queries, k_grad and v_grad are partial sums over them; on a shard
    # of the keys, q_grad is (the log-sum-exp makes each block's probabilities exact).
    partial_reduce="sum", whole_axes=whole_axes, replays=replayed_sharding,
    check_sharding=check_sharding, make_impl=_Backward,
    localize=localize, plan=plan_grouped_heads,
))
