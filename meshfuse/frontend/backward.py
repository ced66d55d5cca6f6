"""``meshfuse.vjp(fd)``: the backward of a fusion as a FusionDefinition of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from meshfuse.autodiff.derivation import DEFAULT_REMAT, Derivation, derive
from meshfuse.frontend.fusion_definition import FusionDefinition
from meshfuse.ir.tensor_view import TensorView


class BackwardDefinition(FusionDefinition):
    """The backward of a fusion: inputs are the cotangents of the differentiable outputs,
    then the residuals; outputs are the gradients. It prints, explains and executes like any
    fusion (``bwd.explain()`` shows the collectives the backward runs).

    Attributes:
        forward: the user's program as a FusionDefinition whose outputs are the user's
            outputs followed by the residuals (run it instead of the user's fusion).
        derivation: which output each cotangent belongs to, where each residual comes from,
            which input each gradient is of (:class:`~meshfuse.autodiff.derivation.Derivation`).
    """

    forward: FusionDefinition
    derivation: Derivation

    def backward_inputs(self, cotangents: Sequence[torch.Tensor], inputs: Sequence[Any],
                        forward_outputs: Sequence[torch.Tensor]) -> list[Any]:
        """The backward's inputs: ``cotangents`` (one per output of the user's fusion, local
        shards laid out like the outputs), the residuals taken from the forward's
        ``inputs`` and ``forward_outputs``."""
        d = self.derivation
        residuals = [inputs[r.index] if r.kind == "input" else forward_outputs[r.index]
                     for r in d.residuals]
        return [cotangents[j] for j in d.cotangents] + residuals

    def input_gradients(self, gradients: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """The backward's outputs arranged per input of the user's fusion (None where an
        input gets no gradient)."""
        return [None if i is None else gradients[i] for i in self.derivation.gradients]


def vjp(fd: FusionDefinition, wrt: Sequence[TensorView] | None = None,
        remat: str = DEFAULT_REMAT, *, world_size: int | None = None) -> BackwardDefinition:
    """The backward of ``fd``, derived at global shapes; ``fd`` is not changed.

    Args:
        fd: a defined fusion (its ``definition`` and schedule are read).
        wrt: the input TensorViews to differentiate (default: every floating-point tensor
            input).
        remat: ``"recompute"``, ``"recompute_fused"`` (default), ``"recompute_gathers"``
            or ``"save"``; see
            :mod:`meshfuse.autodiff.derivation`.
        world_size: derive for this many ranks from one process, to print and explain the
            backward as those ranks would (``bwd.explain(world_size=N)``) without starting
            them; such a backward is not run (derive it without ``world_size`` for that).

    Returns:
        The backward definition; ``bwd.forward`` computes the outputs and residuals.

    Example:
        >>> bwd = meshfuse.vjp(fd)
        >>> outs = bwd.forward.execute(inputs)
        >>> grads = bwd.execute(bwd.backward_inputs(cotangents, inputs, outs))
        >>> per_input = bwd.input_gradients(grads)
    """
    fd.define()
    derivation = derive(fd.fusion, wrt, remat, world_size)
    bwd = BackwardDefinition.from_fusion(derivation.backward)
    bwd.forward = FusionDefinition.from_fusion(derivation.forward, derivation.forward_runner)
    bwd.derivation = derivation
    return bwd
