"""The lowering of expert-parallel ``moe_experts``/``moe_experts_bwd``: the op's kernels
(:mod:`meshfuse.ops.moe.kernels`) run over the ragged all-to-all exchange of the rank's
expert group, in place of the one-rank implementation.

Forward: one split-size exchange, the dispatch and the combine (two ragged all-to-alls); a
third where the fusion itself reads the op's saved products (the derived backward does not:
it recomputes them where the experts live).
Backward: one split-size exchange, the transposed combine (the token rows with their
cotangents and weights) and the transposed dispatch (their gradients back).
"""

from __future__ import annotations

from meshfuse.ops.moe import expert_parallel
from meshfuse.ops.moe.kernels import experts_backward, experts_forward
from meshfuse.parallel.experts.exchange import ExpertExchange


def lower_experts(expr, group_of):
    """An expert-parallel op's implementation bound to this rank's expert group, or None for
    any other op (and on a rank outside the mesh, or alone on its mesh axis). ``group_of(mesh, mesh_axis)``: this rank's
    group there (every rank takes part in creating it)."""
    pt = expert_parallel(expr)
    if pt is None:
        return None
    w1 = expr.args[[p.name for p in expr.op.params].index("w1")]
    group = group_of(w1.mesh, w1.mesh.axis_of(pt))
    if group is None or group.size == 1:  # every expert here: the op's own implementation
        return None
    exchange = ExpertExchange(group, w1.materialized()[0].extent)
    if expr.op.name == "moe_experts":
        def forward(x, indices, weights, w1, w2, w3, capacity, residual=False):
            return experts_forward(x, indices, weights, w1, w2, w3, exchange.num_experts,
                                   exchange, capacity, residual)
        return forward

    def backward(grad, x, indices, weights, w1, w2, w3, capacity, saved=None):
        # saved is None: expert-parallel, moe_experts saves no products (they recompute here)
        return experts_backward(grad, x, indices, weights, w1, w2, w3, exchange.num_experts,
                                exchange, capacity)
    return backward
