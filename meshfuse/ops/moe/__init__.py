"""Mixture-of-experts ops (docs/experts.md): routing and token counts
(:mod:`~meshfuse.ops.moe.routing`), the routed experts with their token dispatch and
combine (:mod:`~meshfuse.ops.moe.experts`, kernels in :mod:`~meshfuse.ops.moe.kernels`),
load balancing (:mod:`~meshfuse.ops.moe.losses`). Expert parallelism's lowering is
:mod:`meshfuse.parallel.experts`."""

from meshfuse.ops.moe import experts, losses, routing  # noqa: F401  (registrations)
from meshfuse.ops.moe.experts import expert_parallel

__all__ = ["expert_parallel"]
