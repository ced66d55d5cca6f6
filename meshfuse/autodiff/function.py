"""A fusion as a ``torch.autograd.Function``: ``fd.as_autograd_function()``.

Calling it runs the forward (the user's program plus residual outputs) on this rank's local
shards and saves the residuals; ``backward()`` runs the derived backward fusion on the
cotangents and the residuals and returns each input's gradient, as this rank's shard laid out
like the input (replicated inputs get complete gradients on every rank).

The backward is derived for the floating-point inputs that require grad in a call (and are in
``wrt``), once per such set, then cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from meshfuse.autodiff.derivation import Derivation, derive
from meshfuse.errors import InputError
from meshfuse.ir.fusion import Fusion
from meshfuse.ir.tensor_view import TensorView
from meshfuse.runtime.runner import FusionRunner


class FusionFunction:
    """``f(inputs) -> outputs`` with autograd: takes what ``execute`` takes, returns what it
    returns (this rank's local shards), and records one autograd node for the fusion.

    Args:
        fusion: the user's fusion (read, never changed).
        wrt: the inputs that may get gradients (default: every floating-point tensor input);
            an input gets one when it is in ``wrt`` and its tensor requires grad.
        remat: the rematerialization policy (``"recompute"`` or ``"save"``, see
            :mod:`meshfuse.autodiff.derivation`).
    """

    def __init__(self, fusion: Fusion, wrt: Sequence[TensorView] | None = None,
                 remat: str = "recompute") -> None:
        self.fusion = fusion
        self.remat = remat
        inputs = fusion.inputs()
        self.wrt = [v for v in inputs if isinstance(v, TensorView) and v.dtype.is_floating] \
            if wrt is None else list(wrt)
        self._derivations: dict[tuple[int, ...], _Compiled] = {}

    def derivation(self, requires_grad: Sequence[bool]) -> _Compiled:
        """The compiled forward and backward for inputs whose ``requires_grad`` flags are
        ``requires_grad`` (one per fusion input)."""
        inputs = self.fusion.inputs()
        wrt = tuple(i for i, v in enumerate(inputs) if v in self.wrt and requires_grad[i])
        if wrt not in self._derivations:
            derivation = derive(self.fusion, [inputs[i] for i in wrt], self.remat)
            self._derivations[wrt] = _Compiled(derivation)
        return self._derivations[wrt]

    def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        inputs = list(inputs)
        if len(inputs) != len(self.fusion.inputs()):
            raise InputError(
                f"the fusion takes {len(self.fusion.inputs())} inputs, got {len(inputs)}"
            )
        flags = [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
        compiled = self.derivation(flags if torch.is_grad_enabled() else [False] * len(flags))
        return list(_FusionAutograd.apply(compiled, *inputs))


class _Compiled:
    """A derivation and the runner of its backward (built on the first backward)."""

    def __init__(self, derivation: Derivation) -> None:
        self.derivation = derivation
        self._backward: FusionRunner | None = None

    def run_backward(self, inputs: list) -> list[torch.Tensor]:
        if self._backward is None:
            self._backward = FusionRunner(self.derivation.backward)
        return self._backward.execute(inputs)


class _FusionAutograd(torch.autograd.Function):
    """One node per call; see the module doc."""

    @staticmethod
    def forward(ctx, compiled: _Compiled, *inputs):
        d = compiled.derivation
        results = d.forward_runner.execute(list(inputs))
        outputs = results[:d.num_outputs]
        residuals = [inputs[r.index] if r.kind == "input" else results[r.index]
                     for r in d.residuals]
        tensors = [x for x in residuals if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.scalars = [None if isinstance(x, torch.Tensor) else x for x in residuals]
        ctx.compiled = compiled
        ctx.layouts = [(o.shape, o.stride()) for o in outputs]
        carried = set(d.cotangents)
        ctx.mark_non_differentiable(*(o for j, o in enumerate(outputs) if j not in carried))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *cotangents):
        d = ctx.compiled.derivation
        saved = iter(ctx.saved_tensors)
        residuals = [next(saved) if x is None else x for x in ctx.scalars]
        laid_out = [_laid_out(cotangents[j], *ctx.layouts[j]) for j in d.cotangents]
        needed = any(i is not None for i in d.gradients)
        grads = ctx.compiled.run_backward(laid_out + residuals) if needed else []
        return (None, *(None if i is None else grads[i] for i in d.gradients))


def _laid_out(x: torch.Tensor, shape, strides) -> torch.Tensor:
    """``x`` with the strides the backward expects for a cotangent (its output's)."""
    if x.stride() == strides:
        return x
    out = torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)
    return out.copy_(x)
