"""One cost model for every estimate and for the planner: a machine's measured speeds
(:mod:`.calibration`, files under ``data/``) and the times of ops, collectives and overlap
computed from them (:mod:`.model`). See docs/planner.md."""

from meshfuse.cost.calibration import Calibration, for_device, load
from meshfuse.cost.model import CostModel

__all__ = ["Calibration", "CostModel", "for_device", "load"]
