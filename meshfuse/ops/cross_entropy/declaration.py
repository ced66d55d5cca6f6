"""``cross_entropy_fwd`` / ``cross_entropy_bwd``: the fused cross entropy on class indices.

``cross_entropy_fwd(logits[N, C], target[N], count)`` gives ``(loss, grad, applied)``:
the loss summed over the rows and divided by ``count`` (the number of rows not ignored,
for a mean; 1 for a sum), in float32 (float64 for float64 logits); ``grad``, the gradient of that loss in the logits,
``(softmax(logits) - w) / count`` with ``w`` the target distribution (zero on an ignored
row), in the logits' dtype; and ``applied``, the scale already applied to ``grad`` (1.0).
Its VJP is ``cross_entropy_bwd(grad, applied, g)``: ``grad`` scaled by the loss's cotangent
``g``, in place on CUDA and skipped when ``g`` is 1.0 (a loss backpropagated as it is), so
a training step reads the logits once (twice for rows that do not fit on chip) and writes
their gradient once, and the backward keeps the gradient as its residual, not the logits.
But where the forward returns the logits too (kept anyway), the backward keeps them and
computes the gradient from them with the same op, and the forward the loss alone.

``fd.ops.cross_entropy`` uses it for 2-D logits of a static class extent with class indices
and a ``mean`` or ``sum`` reduction (:mod:`meshfuse.ops.composites`). Sharding: rows shard
freely (the loss is then a partial sum over them, ``count`` a global one); where the build
finds the classes sharded (loss parallel), it replaces the op by :func:`decomposed`, the
same values from fusion ops whose reductions over the classes are per-row allreduces
(``passes/expansion.py``). Kernels: :mod:`meshfuse.ops.cross_entropy.kernels` (Triton, on
CUDA); elsewhere the torch implementation below.
"""

from __future__ import annotations

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError
from meshfuse.ir.iter_domain import IterType
from meshfuse.ir.layout import shard_factor
from meshfuse.ops.cross_entropy import kernels
from meshfuse.ops.indexing.checks import index_check
from meshfuse.ops.registry import (
    AxisSpec,
    OpDef,
    OutSpec,
    TensorMeta,
    Vjp,
    attr,
    operand,
    register,
    tensor,
)
from meshfuse.ops.shape_rules import require_tensor

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fwd_infer(logits, target, count, ignore_index, label_smoothing):
    op = "cross_entropy_fwd"
    logits, target = require_tensor(op, "logits", logits), require_tensor(op, "target", target)
    if logits.ndim != 2 or not logits.dtype.is_floating:
        raise DefinitionError(f"{op}: logits must be floating-point [rows, classes], got "
                              f"{logits.ndim} axes of {logits.dtype.name}")
    if target.ndim != 1 or target.dtype.is_floating or target.dtype is DataType.Bool:
        raise DefinitionError(f"{op}: target must be integer class indices [rows], got "
                              f"{target.ndim} axes of {target.dtype.name}")
    if None not in (logits.shape[0], target.shape[0]) and logits.shape[0] != target.shape[0]:
        raise DefinitionError(f"{op}: target has {target.shape[0]} rows, logits "
                              f"{logits.shape[0]}; give one class index per row")
    if isinstance(count, TensorMeta) and count.ndim != 0:
        raise DefinitionError(f"{op}: count must be a 0-d tensor or a number")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise DefinitionError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    if not isinstance(label_smoothing, int | float) or isinstance(label_smoothing, bool) or \
            not 0.0 <= label_smoothing <= 1.0:
        raise DefinitionError(f"{op}: label_smoothing must be a number in [0, 1], got "
                              f"{label_smoothing!r}")
    rows = ((0, 0), (1, 0))
    loss = (AxisSpec(logits.shape[0], IterType.Reduction, rows),)
    grad = (AxisSpec(logits.shape[0], logits.iter_types[0], rows),
            AxisSpec(logits.shape[1], logits.iter_types[1], ((0, 1),)))
    wide = DataType.Double if logits.dtype is DataType.Double else DataType.Float
    return [OutSpec(wide, loss), OutSpec(logits.dtype, grad),
            OutSpec(DataType.Float, ())]


def reference_forward(logits: torch.Tensor, target: torch.Tensor, count, ignore_index: int,
                      label_smoothing: float):
    """The forward in torch (float32 for half-precision logits): ``(loss, grad, applied)``."""
    x = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    classes = x.shape[1]
    ignored = target == ignore_index
    valid = (target >= 0) & (target < classes)
    safe = torch.where(valid, target, 0).long()
    lse = torch.logsumexp(x, 1)
    w = torch.full_like(x, label_smoothing / classes)
    w.scatter_add_(1, safe[:, None], torch.full_like(x[:, :1], 1.0 - label_smoothing))
    scale = torch.where(valid, 1.0, torch.nan).to(x.dtype)
    scale = torch.where(ignored, 0.0, scale / count).to(x.dtype)
    loss = (lse - (w * x).sum(1)) * scale
    grad = (torch.exp(x - lse[:, None]) - w) * scale[:, None]
    applied = torch.ones((), dtype=torch.float32, device=x.device)
    return loss.sum(), grad.to(logits.dtype).contiguous(), applied


def _forward(logits, target, count, ignore_index, label_smoothing, check=None,
             write_grad=True):
    """The Triton kernel where it runs (CUDA), else torch. Without ``write_grad`` (nothing
    reads the gradient: a forward alone) the kernel only reads the logits and the gradient
    output is a stride-0 zero of their shape."""
    if check is not None:
        check(target)
    if not isinstance(count, torch.Tensor) and count != 1:
        count = torch.tensor(float(count), device=logits.device)
    if logits.dtype in _KERNEL_DTYPES and kernels.available(logits):
        loss, grad, applied = kernels.forward(logits, target, count, ignore_index,
                                              label_smoothing, write_grad=write_grad)
    else:
        loss, grad, applied = reference_forward(logits, target, count, ignore_index,
                                                label_smoothing)
    if not write_grad:
        grad = logits.new_zeros(()).expand(logits.shape)
    return loss, grad, applied


def _fwd_grads(d, grads):
    g = grads[0]
    if g is None:
        return {}
    if not _returned(d.arg("logits")):
        return {"logits": lambda: d.ops.cross_entropy_bwd(d.out(1), d.out(2), g)}

    def recomputed():  # the logits are kept anyway: the gradient is made from them again
        _, grad, applied = d.ops.cross_entropy_fwd(
            d.value("logits"), d.value("target"), d.value("count"),
            ignore_index=d.attrs["ignore_index"], label_smoothing=d.attrs["label_smoothing"])
        return d.ops.cross_entropy_bwd(grad, applied, g)
    return {"logits": recomputed}


def _returned(logits) -> bool:
    """Whether the forward returns the values of ``logits`` (an output of its fusion, or a
    reshape of one: a model that hands its caller the logits beside the loss, as
    ``transformers``' causal language models do). Their memory is then held anyway, and a
    gradient kept beside them would double it (2 GiB more for a 1B Llama's 8k tokens of a
    128k vocabulary): the backward reads the logits instead and computes the gradient with
    the same kernel (the forward computes the loss alone), one more read of the logits."""
    outputs = set(logits.fusion.outputs())
    while logits not in outputs:
        expr = logits.definition
        if expr is None or expr.op is None or expr.op.name != "reshape":
            return False
        logits = expr.args[0]
    return True


def _localize(expr, here):
    """Whether anything reads the gradient (a forward run alone does not: then it is not
    written), and with ``MESHFUSE_CHECK_INDICES=1`` the host check of the targets."""
    logits, target = expr.args[:2]
    grad = expr.outputs[1]
    read = grad in grad.fusion.outputs() or any(grad in e.inputs for e in grad.fusion.exprs)
    attrs = index_check("cross_entropy_fwd", target, logits, 1, here.extents,
                        ignored=expr.attrs["ignore_index"])
    return attrs if read else {**attrs, "write_grad": False}, \
        "" if read else "the loss only (no gradient read)"


def whole_axes(expr) -> set:
    """The classes, needed whole by the kernel (the build decomposes a class-sharded op
    before it gets here: :func:`needs_decomposition`)."""
    return {expr.args[0].materialized()[1]}


def needs_decomposition(expr) -> bool:
    """Whether the op's logits are sharded over their classes (a propagated fusion)."""
    logits = expr.args[0]
    return logits.mesh is not None and shard_factor(logits, logits.materialized()[1]) > 1


register(OpDef(
    "cross_entropy_fwd",
    (tensor("logits"), tensor("target"), operand("count"), attr("ignore_index", -100),
     attr("label_smoothing", 0.0)),
    _fwd_infer, _forward,
    doc="the cross entropy of [rows, classes] logits on class indices, summed over the rows "
        "and divided by count, with its gradient in the logits (one fused kernel on CUDA)",
    sharding="rows shard freely (the loss is a partial sum over them); logits sharded over "
             "the classes are computed by per-row allreduces (the op decomposed)",
    whole_axes=whole_axes, vjp=Vjp(_fwd_grads, differentiable=(0,)), localize=_localize,
    # Row-major outputs, which also keeps the kernel out of torch.compile'd segments.
    output_layout="contiguous",
))


def _bwd_infer(grad, applied, g):
    op = "cross_entropy_bwd"
    grad = require_tensor(op, "grad", grad)
    for name, meta in (("applied", applied), ("g", g)):
        if require_tensor(op, name, meta).ndim != 0:
            raise DefinitionError(f"{op}: {name} must be a 0-d tensor")
    return [OutSpec(grad.dtype, tuple(AxisSpec(e, t, ((0, a),)) for a, (e, t) in
                                      enumerate(zip(grad.shape, grad.iter_types))))]


def _backward(grad, applied, g):
    """``grad * g``: in place on CUDA (``applied`` records the scale ``grad`` holds, so a
    second backward through kept residuals rescales from it); a new tensor elsewhere."""
    if grad.dtype in _KERNEL_DTYPES and kernels.available(grad):
        return kernels.scale_in_place(grad, applied, g.to(grad.device))
    wide = torch.promote_types(grad.dtype, torch.float32)
    return (grad.to(wide) * (g / applied)).to(grad.dtype).contiguous()


register(OpDef(
    "cross_entropy_bwd", (tensor("grad"), tensor("applied"), tensor("g")), _bwd_infer,
    _backward,
    doc="cross_entropy_fwd's gradient scaled by the loss's cotangent g (in place on CUDA, "
        "nothing done when g is 1)",
    sharding="pointwise in grad; applied and g replicated",
    # In place on CUDA: never inside a torch.compile'd segment.
    output_layout="contiguous",
))


def _carry_infer(logits, target, loss, grad, applied, ignore_index):
    op = "cross_entropy_carry"
    logits, loss = require_tensor(op, "logits", logits), require_tensor(op, "loss", loss)
    grad, target = require_tensor(op, "grad", grad), require_tensor(op, "target", target)
    if grad.ndim != 2 or target.ndim != 1:
        raise DefinitionError(f"{op}: grad must be [rows, classes] and target [rows]")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise DefinitionError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    partial = tuple(AxisSpec(e, IterType.Reduction, ((2, loss.ndim + k),))
                    for k, e in enumerate(loss.partial_axes))
    like_logits = (AxisSpec(grad.shape[0], grad.iter_types[0], ((0, 0), (3, 0), (1, 0))),
                   AxisSpec(grad.shape[1], grad.iter_types[1], ((0, 1), (3, 1))))
    return [OutSpec(loss.dtype, partial), OutSpec(grad.dtype, like_logits)]


def _carry(logits, target, loss, grad, applied, ignore_index, check=None):
    if check is not None:
        check(target)
    # grad is the decomposition's own value, read by nothing else: passed on, not copied.
    return loss.clone(), grad


def _carry_grads(d, grads):
    g = grads[0]
    if g is None:
        return {}
    return {"logits": lambda: d.ops.cross_entropy_bwd(d.out(1), d.value("applied"), g)}


def _carry_localize(expr, here):
    logits, target = expr.args[:2]
    return index_check("cross_entropy_fwd", target, logits, 1, here.extents,
                       ignored=expr.attrs["ignore_index"]), ""


register(OpDef(
    "cross_entropy_carry",
    (tensor("logits"), tensor("target"), tensor("loss"), tensor("grad"), tensor("applied"),
     attr("ignore_index", -100)),
    _carry_infer, _carry, localize=_carry_localize,
    doc="(loss, grad) as they are, grad being loss's gradient in logits: what the build puts "
        "in place of a cross_entropy_fwd decomposed over sharded classes",
    sharding="loss as it is; grad sharded as logits (the gradient of the loss, through "
             "cross_entropy_bwd)",
    vjp=Vjp(_carry_grads, differentiable=(0,)),
))


def decomposed(o, logits, target, count, ignore_index: int, smoothing: float):
    """``cross_entropy_fwd``'s three outputs written with fusion ops (``o``: a fusion's
    ``fd.ops``): with the classes sharded, the max, the sum of exponentials and the target
    term are partial over them (one allreduce of a value per row each) and the gradient is
    computed on each shard with no communication."""
    classes = logits.materialized()[1].extent
    low = logits.dtype in (DataType.BFloat16, DataType.Half)
    x = o.cast(logits, DataType.Float) if low else logits
    m = o.max(x, [1], keepdim=True)
    lse = o.add(o.log(o.sum(o.exp(o.sub(x, m)), [1])), o.squeeze(m, [1]))
    at_target = o.eq(o.broadcast_in_dim(o.iota(classes), [1, classes], [1]),
                     o.broadcast_in_dim(target, [-1, 1], [0]))
    uniform = smoothing / classes
    # Weights and scales in x's dtype (a Python number takes the tensor's dtype).
    w = o.add(o.mul(o.cast(at_target, x.dtype), 1.0 - smoothing), uniform)
    term = o.sum(o.mul(x, w) if smoothing else o.where(at_target, x, 0.0), [1])
    valid = o.logical_and(o.ge(target, 0), o.lt(target, classes))
    inverse = 1.0 / count if isinstance(count, int | float) else \
        o.reciprocal(o.cast(count, x.dtype))
    scale = o.where(valid, o.mul(o.cast(valid, x.dtype), inverse), float("nan"))
    scale = o.where(o.eq(target, ignore_index), 0.0, scale)
    loss = o.sum(o.mul(o.sub(lse, term), scale), [0])
    p = o.exp(o.sub(x, o.broadcast_in_dim(lse, [-1, 1], [0])))
    grad = o.mul(o.sub(p, w), o.broadcast_in_dim(scale, [-1, 1], [0]))
    grad = o.cast(grad, logits.dtype) if grad.dtype is not logits.dtype else grad
    applied = o.add(o.mul(o.cast(o.sum(o.iota(1)), DataType.Float), 0.0), 1.0)
    return loss, grad, applied
