"""A stage's backward, whole or split into its input-gradient and weight-gradient halves.

The split (zero-bubble schedules' ``I`` and ``W``) keeps the weight-gradient GEMMs of the
stage's ``torch.nn.Linear`` layers for later: while the forward runs, each Linear's input
``x`` and output ``y`` are noted; ``I`` asks autograd for the gradients of the stage's
input, of every ``y`` and of the other parameters only (autograd skips the weight-gradient
products nobody asked for), and ``W`` computes ``dW = dy^T x`` (and the bias's ``sum dy``)
into ``.grad``. Parameters of other modules (norms, embeddings, meshfuse fusions) get their
gradients in ``I``. A Linear whose weight is also used elsewhere, or is a DTensor (a
tensor-parallel stage: its dW is not a local product), is not deferred.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Saved:
    """What a stage's forward of one microbatch keeps for its backward."""

    inputs: tuple[torch.Tensor, ...]  # the stage's inputs that need a gradient
    outputs: tuple[torch.Tensor, ...]  # its outputs that carry one (the last stage: the
    # scaled loss)
    linears: list[tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]]  # (layer, x, y)
    deferred: list[tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]] | None = None


class LinearNotes:
    """Notes each deferrable Linear's (x, y) while active (forward hooks on ``module``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.linears = _deferrable(module)
        self.active: list | None = None
        for layer in self.linears:
            layer.register_forward_hook(self._note)

    def _note(self, layer, args, output) -> None:
        if self.active is not None and torch.is_grad_enabled():
            self.active.append((layer, args[0], output))


def _deferrable(module: torch.nn.Module) -> list[torch.nn.Linear]:
    owners: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [m for m in module.modules() if isinstance(m, torch.nn.Linear)
            and all(owners[id(p)] == 1 and type(p.data) is torch.Tensor
                    for p in m.parameters(recurse=False))]


def full(saved: Saved, grads: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...]:
    """The whole backward: parameter gradients accumulated, the inputs' gradients returned
    (zeros for an input the outputs do not depend on)."""
    if saved.outputs:
        torch.autograd.backward(saved.outputs, grads)
    return tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in saved.inputs)


def input_half(saved: Saved, grads: tuple[torch.Tensor, ...] | None, module: torch.nn.Module
               ) -> tuple[torch.Tensor, ...]:
    """``I``: the inputs' gradients (returned) and the gradients of the parameters that are
    not deferred (accumulated): those of the Linears the forward ran (``saved.linears``; a
    stage that runs none defers nothing) wait for ``W``, their output gradients kept in
    ``saved``."""
    deferred = {id(p) for layer, _, _ in saved.linears for p in layer.parameters(recurse=False)}
    others = [p for p in module.parameters() if p.requires_grad and id(p) not in deferred]
    ys = [y for _, _, y in saved.linears]
    wanted = list(saved.inputs) + ys + others
    if not wanted or not saved.outputs:
        saved.deferred = []
        return tuple(torch.zeros_like(x) for x in saved.inputs)
    got = torch.autograd.grad(saved.outputs, wanted, grads, allow_unused=True)
    n = len(saved.inputs)
    dxs = tuple(g if g is not None else torch.zeros_like(x)
                for x, g in zip(saved.inputs, got[:n]))
    for p, g in zip(others, got[n + len(ys):]):
        _accumulate(p, g)
    saved.deferred = [(layer, x, dy) for (layer, x, _), dy in zip(saved.linears,
                                                                 got[n:n + len(ys)])
                      if dy is not None]
    return dxs


def weight_half(saved: Saved) -> None:
    """``W``: the deferred Linears' weight (and bias) gradients, accumulated."""
    for layer, x, dy in saved.deferred or []:
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        _accumulate(layer.weight, dy2.t() @ x2)
        if layer.bias is not None:
            _accumulate(layer.bias, dy2.sum(0))
    saved.deferred = None


def _accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    if g is None:
        return
    if p.grad is None:
        p.grad = g.detach().clone()
    else:
        p.grad.add_(g)
