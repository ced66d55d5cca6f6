"""Context parallelism: attention with its sequence sharded, run as a ring, an all-gather or
an all-to-all (docs/context_parallel.md).

- :mod:`~meshfuse.parallel.context.record`: the record of one rank's part (rows, ranks,
  options) and the kernel calls each position makes;
- :mod:`~meshfuse.parallel.context.planning`: the build pass that picks each attention's
  strategy, with the estimate of :mod:`~meshfuse.parallel.context.cost`;
- :mod:`~meshfuse.parallel.context.blocks`: the per-block kernels and the sums of their
  results;
- :mod:`~meshfuse.parallel.context.lowering`: each strategy's forward and backward on a
  rank's group, and what the ranks agree on before running;
- :mod:`~meshfuse.parallel.context.explain`: its lines in ``fd.explain()``.

The attention op's own side (which attentions run sequence-parallel, the strategy names) is
:mod:`meshfuse.ops.attention.sequence`. Importing this package registers the build pass, the
local attribute and the explain lines with the core.
"""

from meshfuse.parallel.context import explain, planning, record  # noqa: F401  (registrations)
from meshfuse.parallel.context.lowering import agreed_facts, lower_attention

__all__ = ["agreed_facts", "lower_attention"]
