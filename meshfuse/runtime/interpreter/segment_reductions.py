"""Which way a fused segment's reductions run over memory: along rows or across them.

:func:`reduces_along_rows` runs a segment's graph on fake tensors shaped and strided like its
real inputs (no kernel runs, nothing is allocated) and watches the ATen reductions it calls.
A reduction *along rows* reduces its input's innermost (stride-1) axis: a softmax's or a
norm's statistics over the features. One *across rows* keeps that axis and reduces outer ones
(a bias's gradient, the sum of a ``[tokens, features]`` cotangent over its tokens), so that
neighbouring output elements read neighbouring input elements.

The answer decides how Inductor compiles the segment on a GPU
(:func:`~meshfuse.runtime.interpreter.fused.inductor_patches`): reductions along rows of up
to 16384 elements get persistent kernels
(:mod:`~meshfuse.runtime.interpreter.persistent_rows`); where every reduction runs across
rows, Inductor's own heuristics are kept (looped over more than 64 rows, persistent below;
see docs/fusion.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# What running a graph on fake tensors may raise (an op that reads values, or has no fake
# implementation).
_NOT_FAKE = (DataDependentOutputException, DynamicOutputShapeException,
             UnsupportedFakeTensorException, UnsupportedOperatorException)

# Reductions (and scans) by the position of their reduced dimensions among the arguments
# (an int, a list, or None/absent/empty: every dimension).
_DIMS_AT = {**dict.fromkeys(
    (aten.sum, aten.mean, aten.var_mean, aten.var, aten.std, aten.std_mean, aten.amax,
     aten.amin, aten.max, aten.min, aten.prod, aten.logsumexp, aten.argmax, aten.argmin,
     aten.any, aten.all, aten._softmax, aten._log_softmax, aten.cumsum, aten.cumprod), 1),
    aten.linalg_vector_norm: 2, aten.norm: 2}


def reduces_along_rows(graph: fx.GraphModule, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether some reduction of ``graph`` (called with ``tensors``, the segment's inputs)
    reduces its input's innermost axis, or is of a kind this module does not know (then
    assumed to), or the graph cannot run on fake tensors (a value-dependent shape: then
    assumed too). False for a graph without reductions."""
    watcher = _Reductions()
    try:
        with FakeTensorMode() as mode:
            fakes = [mode.from_tensor(t) for t in tensors]
            with watcher:
                graph(*fakes)
    except _NOT_FAKE:
        return True
    return watcher.along_rows


class _Reductions(TorchDispatchMode):
    """Records whether an ATen call reduced along rows (see :func:`reduces_along_rows`)."""

    def __init__(self) -> None:
        super().__init__()
        self.along_rows = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        at = _DIMS_AT.get(func.overloadpacket)
        if at is not None and args and isinstance(args[0], torch.Tensor):
            dims = args[at] if len(args) > at else kwargs.get("dim")
            if not isinstance(dims, torch.Tensor):  # (max(a, b): elementwise)
                self.along_rows |= _along_rows(args[0], dims)
        elif _reduces(func, args):
            self.along_rows = True  # an unknown reduction: assumed along rows
        return func(*args, **kwargs)


def _along_rows(x: torch.Tensor, dims) -> bool:
    """Whether reducing ``x`` over ``dims`` (an int, a list, None) reads along its innermost
    axis: the axis of stride 1 among those of extent above 1."""
    if x.dim() == 0:
        return False
    if dims is None or (isinstance(dims, list | tuple) and len(dims) == 0):
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    reduced = {d % x.dim() for d in dims}
    inner = [d for d in range(x.dim()) if x.size(d) > 1 and x.stride(d) == 1]
    return not inner or inner[-1] in reduced


def _reduces(func, args) -> bool:
    """Whether an ATen call outside :data:`_DIMS_AT` is a reduction (torch's tag)."""
    return torch.Tag.reduction in getattr(func, "tags", ()) and bool(args) and \
        isinstance(args[0], torch.Tensor)
