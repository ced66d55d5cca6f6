"""``decompose_sharded_ops``: ops whose fused kernel cannot run on the shardings the build
would give them, replaced by the same values written with fusion ops.

``cross_entropy_fwd`` computes a row's softmax whole; with its logits sharded over the classes
(loss parallel) it is replaced by :func:`~meshfuse.ops.cross_entropy.decomposed`, whose max,
sum of exponentials and target term are per-row partial results (an allreduce of one value
per row each) instead of an allgather of the logits. Whether the classes end up sharded is
known only after propagation, so the pass propagates a scratch copy first (only where a
mesh holds several devices), then rewrites the build's copy before its own propagation:
the decomposed ops are propagated like any the user wrote. Each output of the replaced op
keeps its tensor (now a ``set`` of the decomposed value), so the counterparts, the
outputs and a derived backward's residuals stay as they were.
"""

from __future__ import annotations

from meshfuse.ir.fusion import Expr, Fusion
from meshfuse.ops import lookup
from meshfuse.ops.cross_entropy import decomposed, needs_decomposition
from meshfuse.ops.namespace import Ops
from meshfuse.passes.propagation import propagate_shardings

_FUSED = "cross_entropy_fwd"


def decompose_sharded_ops(fusion: Fusion) -> None:
    """Replaces in ``fusion`` (not yet propagated) each ``cross_entropy_fwd`` whose logits
    propagation shards over the classes by its decomposition."""
    fused = [e for e in fusion.exprs if e.op is not None and e.op.name == _FUSED]
    if not fused or all(tv.mesh is None or tv.mesh.size == 1 for tv in fusion.tensors()):
        return
    scratch, copies = fusion.copy()
    propagate_shardings(scratch)
    for expr in fused:
        if needs_decomposition(copies[expr.outputs[0]].definition):
            _decompose(fusion, expr)


def _decompose(fusion: Fusion, expr: Expr) -> None:
    """``expr``'s outputs defined by its decomposition, in its place: the loss and the
    gradient by ``cross_entropy_carry`` (whose VJP keeps the gradient the residual), the
    applied scale by a ``set``."""
    position = fusion.exprs.index(expr)
    tail = fusion.exprs[position + 1:]
    del fusion.exprs[position:]
    logits, target, count, ignore_index, smoothing = expr.args
    loss, grad, applied = decomposed(Ops(fusion), logits, target, count, ignore_index,
                                     smoothing)
    old_loss, old_grad, old_applied = expr.outputs
    id_map = {i: (j,) for i, j in zip(old_loss.logical, loss.logical, strict=True)}
    # Materialized IDs: logits may carry a reduction (a linear's contracted axis).
    id_map.update({i: (j, k) for i, j, k in zip(old_grad.logical, logits.materialized(),
                                                grad.materialized(), strict=True)})
    id_map[old_grad.logical[0]] += (target.materialized()[0],)
    fusion.add_expr(Expr(lookup("cross_entropy_carry"),
                         (logits, target, loss, grad, applied, ignore_index), (old_loss, old_grad),
                         {"ignore_index": ignore_index}, id_map))
    fusion.add_expr(Expr(lookup("set"), (applied,), (old_applied,), {}, {}))
    fusion.exprs.extend(tail)
