"""Pipeline parallelism: stages on sub-meshes run under a microbatch schedule
(docs/pipeline_parallel.md). Not the pass pipeline (:mod:`meshfuse.passes.pipeline`).

- :mod:`~meshfuse.parallel.stages.actions`: a rank's actions (forward, backward, its input
  and weight halves, sends and receives), printed and parsed;
- :mod:`~meshfuse.parallel.stages.schedules`: the schedules as data (GPipe, 1F1B,
  Interleaved1F1B, ZeroBubble, ZBV) and the communication they need;
- :mod:`~meshfuse.parallel.stages.simulate`: validation (dependencies, no deadlock) and the
  timeline and bubble from per-stage times;
- :mod:`~meshfuse.parallel.stages.table`: the action table, the stage map, ``explain``;
- :mod:`~meshfuse.parallel.stages.split`: a model's pieces cut into stages (by index, name or
  cost);
- :mod:`~meshfuse.parallel.stages.backward`: a stage's backward, whole or split into ``I``
  and ``W``;
- :mod:`~meshfuse.parallel.stages.runtime`: one rank running its stages under a schedule;
- :mod:`~meshfuse.parallel.stages.sharded`: a stage's parameters sharded over its
  data-parallel devices, gathered and reduced once per step.
"""

from meshfuse.parallel.stages.actions import Action, parse, text
from meshfuse.parallel.stages.runtime import PipelineRunner, create_stage_groups, locate
from meshfuse.parallel.stages.schedules import (
    NAMES,
    Schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule,
    zbv,
    zero_bubble,
)
from meshfuse.parallel.stages.sharded import ShardedStage
from meshfuse.parallel.stages.simulate import Costs, Timeline, simulate, validate
from meshfuse.parallel.stages.split import (
    StageModule,
    parameter_counts,
    split_pieces,
    stage_bounds,
)
from meshfuse.parallel.stages.table import action_lists, action_table, explain, stage_map

__all__ = [
    "NAMES",
    "Action",
    "Costs",
    "PipelineRunner",
    "Schedule",
    "ShardedStage",
    "StageModule",
    "Timeline",
    "action_lists",
    "action_table",
    "create_stage_groups",
    "explain",
    "gpipe",
    "interleaved_1f1b",
    "locate",
    "one_f_one_b",
    "parameter_counts",
    "parse",
    "schedule",
    "simulate",
    "split_pieces",
    "stage_bounds",
    "stage_map",
    "text",
    "validate",
    "zbv",
    "zero_bubble",
]
