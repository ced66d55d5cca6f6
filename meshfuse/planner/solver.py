"""The exact choice among layouts and per-block recomputation: a small integer program solved
by HiGHS (``highspy``).

Every block of a model is the same, so the blocks are one problem: for each feasible layout
``i`` a binary ``y_i`` (the layout is chosen) and an integer ``r_i`` in ``[0, blocks_i]``
(how many of a rank's blocks recompute their forward in the backward), and::

    minimize   sum_i  step_i y_i + recompute_i r_i
    subject to sum_i  y_i = 1
               r_i <= blocks_i y_i                              (for each i)
               sum_i  memory_i y_i - saves_i r_i <= budget      (with a budget)

Its size is twice the number of layouts, whatever the number of layers: a 32-layer model is
solved as one block's problem (:attr:`Solution.variables` says how many there were).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import highspy

from meshfuse.planner.estimate import LayoutCost

GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Solution:
    """The chosen cost (an index into the costs given), its recomputed blocks, the
    objective (seconds per step) and the integer program's size."""

    index: int
    recomputed: int
    step_s: float
    variables: int
    constraints: int


def solve(costs: Sequence[LayoutCost], budget: float | None,
          exclude: Sequence[int] = ()) -> Solution | None:
    """The best of ``costs`` (feasible ones, not in ``exclude``) within ``budget`` bytes per
    rank (None: no limit), or None when none fits."""
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 0.0)
    inf = highspy.kHighsInf
    n = len(costs)
    for i, c in enumerate(costs):  # y_i
        allowed = not c.infeasible and i not in exclude
        h.addCol(c.step_s if allowed else 0.0, 0.0, 1.0 if allowed else 0.0, 0, [], [])
    for c in costs:  # r_i
        h.addCol(c.recompute_s if not c.infeasible else 0.0, 0.0, float(c.blocks), 0, [], [])
    h.changeColsIntegrality(2 * n, list(range(2 * n)), [highspy.HighsVarType.kInteger] * (2 * n))
    h.addRow(1.0, 1.0, n, list(range(n)), [1.0] * n)
    for i, c in enumerate(costs):
        h.addRow(-inf, 0.0, 2, [n + i, i], [1.0, -float(c.blocks)])
    rows = n + 1
    if budget is not None:
        values = [c.memory_bytes / GIB if not c.infeasible else 0.0 for c in costs] + \
            [-c.recompute_saves / GIB for c in costs]
        h.addRow(-inf, budget / GIB, 2 * n, list(range(2 * n)), values)
        rows += 1
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    x = h.getSolution().col_value
    index = max(range(n), key=lambda i: x[i])
    return Solution(index, round(x[n + index]), h.getInfo().objective_function_value,
                    2 * n, rows)
