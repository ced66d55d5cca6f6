"""Expert parallelism (docs/experts.md): the routed experts of ``moe_experts`` split over a
mesh axis that also splits the tokens, each token's rows sent to the ranks of its experts and
back by a dropless ragged all-to-all (:mod:`~meshfuse.parallel.experts.exchange`), lowered
for the forward and the backward op (:mod:`~meshfuse.parallel.experts.lowering`).

The op's side (its declaration, domain map, which expressions run expert-parallel, the
kernels written over an exchange) is :mod:`meshfuse.ops.moe`.
"""

from meshfuse.parallel.experts.lowering import lower_experts

__all__ = ["lower_experts"]
