"""Communication/computation overlap (docs/overlap.md): stream-parallel loops that chunk a
communication and the GEMM beside it, loops of chunked allreduces, and the estimate that
decides where a loop pays.

- planning, on a compiled fusion: :mod:`~meshfuse.parallel.overlap.stream_parallel` (the
  user's ``ParallelType.Stream`` loops), :mod:`~meshfuse.parallel.overlap.candidates` (the
  communications next to a GEMM), :mod:`~meshfuse.parallel.overlap.allreduce_pattern` (a GEMM
  whose partial result is allreduced);
- the choice, per input signature: :mod:`~meshfuse.parallel.overlap.cost`,
  :mod:`~meshfuse.parallel.overlap.allreduce_loop_cost`, gathered by
  :mod:`~meshfuse.parallel.overlap.planner`;
- the runtime: :mod:`~meshfuse.parallel.overlap.stream_loop` (the loop step),
  :mod:`~meshfuse.parallel.overlap.stream_loop_lowering` (a loop's steps grouped and bound to
  its transport), :mod:`~meshfuse.parallel.overlap.allreduce_loop`.
"""

from meshfuse.parallel.overlap.planner import OverlapPlan
from meshfuse.parallel.overlap.stream_loop_lowering import group_stream_loops

__all__ = ["OverlapPlan", "group_stream_loops"]
