"""Which way a fused segment's reductions run over memory: along rows or across them.

:func:`longest_row` runs a segment's graph on fake tensors shaped and strided like its
real inputs (no kernel runs, nothing is allocated) and watches the ATen reductions it calls.
A reduction *along rows* reduces its input's innermost (stride-1) axis: a softmax's or a
norm's statistics over the features. One *across rows* keeps that axis and reduces outer ones
(a bias's gradient, the sum of a ``[tokens, features]`` cotangent over its tokens), so that
neighbouring output elements read neighbouring input elements.

The answer decides how Inductor compiles the segment on a GPU
(:func:`~meshfuse.runtime.interpreter.fused.inductor_patches`): reductions along rows longer
than Inductor keeps persistent (1024 elements) get a persistent and a looped kernel, the
faster kept on the first run (Inductor's ``triton.multi_kernel``); elsewhere (rows of at
most 1024, which Inductor reduces persistent anyway; every reduction across rows, looped over
more than 64 rows and persistent below) Inductor's own choice is kept, as that first-run pick
measured kernels of a few microseconds unreliably (see docs/fusion.md).
"""

from __future__ import annotations

import math
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
    return longest_row(graph, tensors) > 0


def longest_row(graph: fx.GraphModule, tensors: Sequence[torch.Tensor]) -> float:
    """The most elements that one reduction of ``graph`` (called with ``tensors``) reduces
    along rows (its input's innermost axis among those reduced): 0 where every reduction
    runs across rows or there is none; infinite where some reduction is of a kind this
    module does not know, or the graph cannot run on fake tensors."""
    watcher = _Reductions()
    try:
        with FakeTensorMode() as mode:
            fakes = [mode.from_tensor(t) for t in tensors]
            with watcher:
                graph(*fakes)
    except _NOT_FAKE:
        return math.inf
    return watcher.longest


class _Reductions(TorchDispatchMode):
    """Records the longest row an ATen call reduced along (see :func:`longest_row`)."""

    def __init__(self) -> None:
        super().__init__()
        self.longest: float = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        at = _DIMS_AT.get(func.overloadpacket)
        if at is not None and args and isinstance(args[0], torch.Tensor):
            dims = args[at] if len(args) > at else kwargs.get("dim")
            if not isinstance(dims, torch.Tensor):  # (max(a, b): elementwise)
                self.longest = max(self.longest, _row_along(args[0], dims))
        elif _reduces(func, args):
            self.longest = math.inf  # an unknown reduction: assumed along rows, long
        return func(*args, **kwargs)


def _row_along(x: torch.Tensor, dims) -> int:
    """The elements of one reduced row where reducing ``x`` over ``dims`` (an int, a list,
    None) reads along its innermost axis (the axis of stride 1 among those of extent above
    1): the product of the reduced extents; else 0."""
    if x.dim() == 0:
        return 0
    if dims is None or (isinstance(dims, list | tuple) and len(dims) == 0):
        return x.numel()
    dims = [dims] if isinstance(dims, int) else list(dims)
    reduced = {d % x.dim() for d in dims}
    inner = [d for d in range(x.dim()) if x.size(d) > 1 and x.stride(d) == 1]
    if inner and inner[-1] not in reduced:
        return 0
    return math.prod(x.size(d) for d in reduced)


def _reduces(func, args) -> bool:
    """Whether an ATen call outside :data:`_DIMS_AT` is a reduction (torch's tag)."""
    return torch.Tag.reduction in getattr(func, "tags", ()) and bool(args) and \
        isinstance(args[0], torch.Tensor)
