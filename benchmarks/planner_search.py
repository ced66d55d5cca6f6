"""How long ``meshfuse.plan`` searches (issue 38's bar: under 1 s for a 32-layer Llama on a
4x8 mesh with a memory budget, under 5 s with pipeline stages on 8x8). CPU only.

Each case is planned once cold (the first call of this process: HiGHS's import and first
solve included) and ``--repeat`` times warm; printed and written as JSON: the wall seconds of
``meshfuse.plan``, the plan's own ``search_s``, the layouts costed, the solver's variables
and whether the chosen or any costed layout has pipeline stages.

Usage: ``PYTHONPATH=. python -m benchmarks.planner_search [--out OUT/planner-search.json]
[--repeat 5]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from meshfuse.planner import plan
from meshfuse.planner.layouts import enumerate_layouts
from meshfuse.planner.spec import GPT3_175B, LLAMA3_8B, LLAMA3_70B

GIB = 2**30
CASES = [  # name, spec, mesh, budget per rank
    ("Llama-3 8B (32 layers), 4x8, 60 GiB", LLAMA3_8B, (4, 8), 60 * GIB),
    ("Llama-3 8B (32 layers), 8x8 with pipeline stages, 60 GiB", LLAMA3_8B, (8, 8),
     60 * GIB),
    ("Llama-3 70B (80 layers), 8x8 with pipeline stages, 72 GiB",
     dataclasses.replace(LLAMA3_70B, batch=64), (8, 8), 72 * GIB),
    ("GPT-3 175B (96 layers, 1,536 sequences), 8x8 with pipeline stages, 72 GiB", GPT3_175B,
     (8, 8), 72 * GIB),
]


def run(repeat: int) -> list[dict]:
    rows = []
    for name, spec, mesh, budget in CASES:
        walls, chosen = [], None
        for _ in range(1 + repeat):
            start = time.perf_counter()
            chosen = plan(spec, mesh, budget, calibration="h200")
            walls.append(time.perf_counter() - start)
        layouts = enumerate_layouts(mesh)
        rows.append({"case": name, "cold_s": walls[0], "warm_best_s": min(walls[1:]),
                     "search_s": chosen.search_s, "layouts": chosen.considered,
                     "variables": chosen.variables,
                     "pipelined_layouts": sum("pp" in lay.roles for lay in layouts),
                     "plan": chosen.layout.describe(), "step_s": chosen.step_s})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner_search",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    rows = run(args.repeat)
    for r in rows:
        print(f"{r['case']}: cold {r['cold_s']:.3f} s, warm {r['warm_best_s']:.3f} s; "
              f"{r['layouts']} layouts ({r['pipelined_layouts']} pipelined), "
              f"{r['variables']} variables; plan {r['plan']}, {r['step_s']:.3f} s/step")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
