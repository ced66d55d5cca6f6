"""Load balancing of the experts, written with fusion ops: the switch-style auxiliary loss
(``fd.ops.moe_aux_loss``) and the auxiliary-loss-free bias update (``fd.ops.moe_bias_update``).

Both read :func:`moe_token_counts <meshfuse.ops.moe.routing>` (token slots per expert), a
sum over the tokens: with the tokens sharded, the counts are partial sums that the engine
reduces before the products below (one small allreduce each).
"""

from __future__ import annotations

from meshfuse.errors import DefinitionError


def _static(op: str, x, axis: int) -> int:
    extent = x.materialized()[axis].extent
    if extent is None:
        raise DefinitionError(f"{op}: axis {axis} of {x.name} must be static")
    return extent


def moe_aux_loss(o, scores, indices):
    """The switch transformer's load-balancing loss, ``E * sum_e f_e * P_e``: ``f_e`` the
    fraction of the token slots routed to expert ``e``, ``P_e`` the mean score of ``e`` over
    the tokens (``scores [T, E]`` normalized per token, ``indices [T, K]``). 1 when balanced."""
    n = len(scores.materialized())
    tokens = list(range(n - 1))
    t = 1
    for axis in tokens:
        t *= _static("moe_aux_loss", scores, axis)
    e, k = _static("moe_aux_loss", scores, n - 1), _static("moe_aux_loss", indices, n - 1)
    counts = o.cast(o.moe_token_counts(indices, e), scores.dtype)
    mean_scores = o.sum(scores, tokens)
    return o.mul(o.sum(o.mul(counts, mean_scores), [0]), e / (t * k * t))


def moe_bias_update(o, bias, indices, rate: float):
    """DeepSeek-V3's auxiliary-loss-free balancing: ``bias + rate * sign(mean - counts)``
    (experts below the mean load get chosen more often, those above less)."""
    e = _static("moe_bias_update", bias, 0)
    counts = o.cast(o.moe_token_counts(indices, e), bias.dtype)
    mean = o.div(o.sum(counts, [0]), float(e))
    return o.add(bias, o.mul(o.sign(o.sub(mean, counts)), rate))


COMPOSITES = {"moe_aux_loss": moe_aux_loss, "moe_bias_update": moe_bias_update}
