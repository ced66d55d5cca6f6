"""The planner: the fastest layout of a transformer on a mesh within a memory budget, chosen
by the calibrated cost model (:mod:`meshfuse.cost`), and its projection to larger machines.
See docs/planner.md."""

from meshfuse.planner.plan import Plan
from meshfuse.planner.search import plan
from meshfuse.planner.spec import TransformerSpec, spec_of

__all__ = ["Plan", "TransformerSpec", "plan", "spec_of"]
