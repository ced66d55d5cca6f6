"""Pipeline parallelism from ``meshfuse.parallelize(module, mesh, plan, pipeline=...)``:

- :mod:`~meshfuse.capture.pipeline.pipelined`: the spec, the stages on the mesh's ``pp``
  dimension and the :class:`Pipeline` that runs a step;
- :mod:`~meshfuse.capture.pipeline.cut`: the model's traced graph cut at the split points'
  modules, every value live across a boundary sent on;
- :mod:`~meshfuse.capture.pipeline.stage`: a stage's modules (under the model's names) and
  its piece of the graph;
- :mod:`~meshfuse.capture.pipeline.ties`: weights tied across stages (an embedding and its
  head), a copy per stage kept equal by adding their gradients.
"""

from meshfuse.capture.pipeline.pipelined import (
    Pipeline,
    PipelineSpec,
    default_pieces,
    pipeline_stages,
)

__all__ = ["Pipeline", "PipelineSpec", "default_pieces", "pipeline_stages"]
