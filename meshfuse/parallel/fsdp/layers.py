"""Which layer each parameter of a fully sharded fusion belongs to, and what that makes of
the communications of a compiled fusion.

:func:`register_layers` records, for a fusion, the layer of some of its input and output
tensors: a forward's parameter storages, a derived backward's parameters (residual inputs)
and their gradients (outputs). The record is a side table held weakly by the fusion (the IR
is not changed). The program builder asks :func:`communications_by_layer` for a compiled
fusion's gathers and reductions of parameters, by layer: a gather is a communication whose
source is, through local copies and casts, an input of a layer; a reduction one whose result
becomes, through local copies, casts and communications, an output of a layer.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping, Sequence

import torch

from meshfuse.ir.fusion import Expr, Fusion, Reshard
from meshfuse.ir.tensor_view import TensorView

# local ops a parameter passes through between its storage and its communication
_PASS_THROUGH = ("set", "cast")

_layers: weakref.WeakKeyDictionary[Fusion, dict[TensorView, int]] = weakref.WeakKeyDictionary()
_reduce_dtypes: weakref.WeakKeyDictionary[Fusion, torch.dtype] = weakref.WeakKeyDictionary()


def register_layers(fusion: Fusion, layer_of: Mapping[TensorView, int],
                    reduce_dtype: torch.dtype | None = None) -> None:
    """Records the layer of inputs and outputs of ``fusion`` (keys: its tensors), and the
    dtype its gradients are reduced in (None: their own)."""
    _layers[fusion] = dict(layer_of)
    if reduce_dtype is not None:
        _reduce_dtypes[fusion] = reduce_dtype


def layers_of(fusion: Fusion) -> dict[TensorView, int] | None:
    """What :func:`register_layers` recorded for ``fusion``, or None."""
    return _layers.get(fusion)


def reduce_dtype_of(fusion: Fusion) -> torch.dtype | None:
    """The dtype :func:`register_layers` recorded for ``fusion``'s reductions, or None."""
    return _reduce_dtypes.get(fusion)


@dataclasses.dataclass(frozen=True)
class LayerCommunications:
    """A compiled fusion's communications of parameters: each gather's and each reduction's
    layer; ``widened``: the reductions whose result is cast to ``reduce_dtype`` on its way
    to the gradient (run in that dtype, the cast then changes nothing)."""

    gathers: dict[Expr, int]
    reductions: dict[Expr, int]
    widened: frozenset[Expr] = frozenset()
    reduce_dtype: torch.dtype | None = None

    def __bool__(self) -> bool:
        return bool(self.gathers or self.reductions)


def communications_by_layer(fusion: Fusion, layer_of: Mapping[TensorView, int],
                            reduce_dtype: torch.dtype | None = None) -> LayerCommunications:
    """The gathers and reductions of parameters in ``fusion`` (compiled: communications are
    :class:`Reshard` expressions), by the layers ``layer_of`` gives its tensors."""
    uses = fusion.uses()
    outputs = set(fusion.outputs())
    gathers, reductions, widened = {}, {}, set()
    for expr in fusion.exprs:
        if not isinstance(expr, Reshard):
            continue
        source = _back_to_input(expr.args[0])
        if source in layer_of:
            gathers[expr] = layer_of[source]
            continue
        result, casts = _on_to_output(expr.outputs[0], uses, outputs)
        if result in layer_of:
            reductions[expr] = layer_of[result]
            if reduce_dtype is not None and any(c.torch_dtype == reduce_dtype for c in casts):
                widened.add(expr)
    return LayerCommunications(gathers, reductions, frozenset(widened), reduce_dtype)


def _back_to_input(tv: TensorView) -> TensorView:
    """``tv``, or the tensor it is a local copy or cast of (repeatedly)."""
    while tv.definition is not None and not isinstance(tv.definition, Reshard) \
            and tv.definition.op.name in _PASS_THROUGH:
        tv = tv.definition.args[0]
    return tv


def _on_to_output(tv: TensorView, uses: Mapping, outputs: set) -> tuple[TensorView, list]:
    """``tv``, or what it becomes through local copies, casts and further communications
    (HSDP's allreduce across replicas after the reduce-scatter) read by nothing else; and
    the dtypes of the casts on the way."""
    casts = []
    while tv not in outputs:
        readers = uses.get(tv, [])
        if len(readers) != 1 or not (isinstance(readers[0], Reshard) or
                                     readers[0].op.name in _PASS_THROUGH):
            break
        tv = readers[0].outputs[0]
        if not isinstance(readers[0], Reshard) and readers[0].op.name == "cast":
            casts.append(tv.dtype)
    return tv, casts


def register_derivation(fusion: Fusion, forward: Fusion, backward: Fusion,
                        residuals: Sequence, gradients: Sequence[int | None],
                        num_cotangents: int) -> None:
    """Carries the layers of ``fusion`` (registered) to its derived ``forward`` (the same
    inputs, by position) and ``backward`` (each parameter's residual input and gradient
    output). ``residuals``: per residual input of the backward, its ``kind`` and ``index``;
    ``gradients``: per input of ``fusion``, its gradient's output position or None."""
    layer_of = layers_of(fusion)
    if not layer_of:
        return
    reduce_dtype = reduce_dtype_of(fusion)
    position = {tv: i for i, tv in enumerate(fusion.inputs())}
    by_position = {position[tv]: k for tv, k in layer_of.items() if tv in position}
    register_layers(forward, {forward.inputs()[p]: k for p, k in by_position.items()},
                    reduce_dtype)
    inputs, outputs = backward.inputs(), backward.outputs()
    back: dict[TensorView, int] = {}
    for i, r in enumerate(residuals):
        if r.kind == "input" and r.index in by_position:
            back[inputs[num_cotangents + i]] = by_position[r.index]
    for p, j in enumerate(gradients):
        if j is not None and p in by_position:
            back[outputs[j]] = by_position[p]
    register_layers(backward, back, reduce_dtype)
