"""Token-choice top-k routing (``moe_route``, its gradient ``moe_route_bwd``) and the count of
token slots per expert (``moe_token_counts``).

``moe_route(logits [*tokens, E], bias=None, top_k, score, normalize, scale, groups,
top_groups)`` returns ``(weights [*tokens, K], indices [*tokens, K])`` (tokens: one axis,
``[T]``, or several, ``[B, S]`` as transformer blocks hold them): scores are ``softmax`` or
``sigmoid`` of the logits; the experts are chosen by ``scores + bias`` (DeepSeek-V3's auxiliary-loss-free
balancing: the bias steers the choice, never the weights), optionally within the
``top_groups`` best of ``groups`` equal groups of experts (a group scored by its two best
experts); the weights are the chosen experts' scores, divided by their sum with
``normalize``, times ``scale``. Tokens shard freely; the experts' axis is needed whole.
"""

from __future__ import annotations

import torch

from meshfuse.dtypes import DataType
from meshfuse.errors import DefinitionError
from meshfuse.ir.iter_domain import IterType
from meshfuse.ops.registry import (
    AxisSpec,
    Kind,
    OpDef,
    OutSpec,
    Param,
    Vjp,
    attr,
    register,
    tensor,
)
from meshfuse.ops.shape_rules import require_tensor

SCORES = ("softmax", "sigmoid")


def _check_weighting(op: str, score, normalize, scale) -> None:
    if score not in SCORES:
        raise DefinitionError(f"{op}: score {score!r} is not one of {SCORES}")
    if not isinstance(normalize, bool):
        raise DefinitionError(f"{op}: normalize must be True or False, got {normalize!r}")
    if not isinstance(scale, int | float) or isinstance(scale, bool):
        raise DefinitionError(f"{op}: scale must be a number, got {scale!r}")


def _check(op: str, logits, bias, top_k, groups, top_groups) -> None:
    logits = require_tensor(op, "logits", logits)
    if logits.ndim < 2 or not logits.dtype.is_floating:
        raise DefinitionError(f"{op}: logits must be floating [*tokens, E] (2 axes or more), "
                              f"got {logits.ndim} axes of {logits.dtype.name}")
    e = logits.shape[-1]
    if bias is not None and (require_tensor(op, "bias", bias).ndim != 1 or
                             None not in (bias.shape[0], e) and bias.shape[0] != e):
        raise DefinitionError(f"{op}: bias must be [E] = [{e}], got {list(bias.shape)}")
    if not isinstance(top_k, int) or top_k < 1 or e is not None and top_k > e:
        raise DefinitionError(f"{op}: top_k must be an int in [1, {e}], got {top_k!r}")
    for name, value in (("groups", groups), ("top_groups", top_groups)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise DefinitionError(f"{op}: {name} must be an int or None, got {value!r}")
    if groups is not None:
        if e is not None and (e % groups or e // groups < 2):
            raise DefinitionError(
                f"{op}: groups={groups} must divide the {e} experts into groups of 2 or more")
        if top_groups is None or not 1 <= top_groups <= groups:
            raise DefinitionError(f"{op}: top_groups must be in [1, {groups}] with groups, "
                                  f"got {top_groups!r}")


def _route_infer(logits, bias, top_k, score, normalize, scale, groups, top_groups):
    _check("moe_route", logits, bias, top_k, groups, top_groups)
    _check_weighting("moe_route", score, normalize, scale)
    slots = (*_tokens(logits, (0,)), AxisSpec(top_k))
    return [OutSpec(logits.dtype, slots), OutSpec(DataType.Int, slots)]


def _tokens(t, inputs: tuple, iter_type=None) -> tuple:
    """One axis per token axis of ``t`` (all but its last), mapped from that axis of the
    tensor inputs ``inputs`` (iteration axes like ``t``'s, or ``iter_type``)."""
    return tuple(AxisSpec(t.shape[i], iter_type or t.iter_types[i],
                          tuple((j, i) for j in inputs))
                 for i in range(t.ndim - 1))


def scores_of(logits: torch.Tensor, score: str) -> torch.Tensor:
    return torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)


def choose(scores: torch.Tensor, bias, top_k: int, groups, top_groups) -> torch.Tensor:
    """The indices ``[T, K]`` of each token's experts, by ``scores + bias`` within the best
    groups."""
    choice = scores if bias is None else scores + bias
    if groups is not None:
        grouped = choice.unflatten(-1, (groups, -1))
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(top_groups, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(-1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
    return choice.topk(top_k, dim=-1).indices


def weights_of(scores: torch.Tensor, indices: torch.Tensor, normalize: bool, scale: float):
    weights = scores.gather(-1, indices)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale


def _route(logits, bias, top_k, score, normalize, scale, groups, top_groups):
    scores = scores_of(logits, score)
    indices = choose(scores, bias, top_k, groups, top_groups)
    return weights_of(scores, indices, normalize, scale), indices


def _route_grads(d, grads):
    attrs = {n: d.attrs[n] for n in ("score", "normalize", "scale")}
    return {"logits": lambda: d.ops.moe_route_bwd(grads[0], d.value("logits"), d.out(1),
                                                  **attrs)}


_ROUTE_ATTRS = (attr("top_k"), attr("score", "softmax"), attr("normalize", True),
                attr("scale", 1.0), attr("groups", None), attr("top_groups", None))

register(OpDef(
    "moe_route", (tensor("logits"), Param("bias", Kind.TENSOR, None), *_ROUTE_ATTRS),
    _route_infer, _route,
    doc="top-k routing: (weights [*T, K], indices [*T, K]) from router logits [*T, E]",
    sharding="tokens shard freely; the experts' axis is gathered",
    partial_reduce=None, whole_axes=lambda expr: {a.materialized()[-1] for a in expr.tensor_inputs},
    vjp=Vjp(_route_grads, differentiable=(0,)),
))


def _route_bwd_infer(grad, logits, indices, score, normalize, scale):
    for name, m in (("grad", grad), ("logits", logits), ("indices", indices)):
        require_tensor("moe_route_bwd", name, m)
    _check_weighting("moe_route_bwd", score, normalize, scale)
    if not logits.ndim == grad.ndim == indices.ndim >= 2:
        raise DefinitionError("moe_route_bwd: grad, logits and indices must have one number "
                              "of axes, 2 or more ([*tokens, K], [*tokens, E], [*tokens, K])")
    last = logits.ndim - 1
    return [OutSpec(logits.dtype, (
        *_tokens(logits, (1, 0, 2)),
        AxisSpec(logits.shape[-1], logits.iter_types[-1], ((1, last),)),
        AxisSpec(grad.shape[-1], IterType.Reduction, ((0, last), (2, last)))))]


def _route_bwd(grad, logits, indices, score, normalize, scale):
    with torch.enable_grad():
        x = logits.detach().requires_grad_()
        weights = weights_of(scores_of(x, score), indices, normalize, scale)
        (result,) = torch.autograd.grad(weights, x, grad)
    return result


register(OpDef(
    "moe_route_bwd", (tensor("grad"), tensor("logits"), tensor("indices"),
                      attr("score", "softmax"), attr("normalize", True), attr("scale", 1.0)),
    _route_bwd_infer, _route_bwd,
    doc="gradient of moe_route's weights with respect to its logits",
    sharding="tokens shard freely; experts and slots are gathered",
    partial_reduce=None,
    whole_axes=lambda expr: {t.materialized()[-1] for t in expr.tensor_inputs},
))


def _counts_infer(indices, num_experts):
    indices = require_tensor("moe_token_counts", "indices", indices)
    if indices.ndim < 2 or indices.dtype not in (DataType.Int, DataType.Int32):
        raise DefinitionError("moe_token_counts: indices must be integer [*tokens, K]")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise DefinitionError(f"moe_token_counts: num_experts must be a positive int, got "
                              f"{num_experts!r}")
    return [OutSpec(DataType.Float, (
        AxisSpec(num_experts), *_tokens(indices, (0,), IterType.Reduction),
        AxisSpec(indices.shape[-1], IterType.Reduction, ((0, indices.ndim - 1),))))]


def _counts(indices, num_experts):
    return torch.bincount(indices.reshape(-1), minlength=num_experts).to(torch.float32)


register(OpDef(
    "moe_token_counts", (tensor("indices"), attr("num_experts")), _counts_infer, _counts,
    doc="token slots routed to each expert, [E] (float32) from indices [*T, K]",
    sharding="tokens sharded: partial counts (summed where needed)",
))
