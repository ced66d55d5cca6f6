"""Entry point: ``python -m benchmarks.run [--quick] [--cases ...] [--out DIR]``.

One GPU: ``python -m benchmarks.run``; two: ``torchrun --nproc-per-node 2 -m benchmarks.run``.
Without CUDA it runs on the CPU with gloo (use ``--quick``). Rank 0 writes
``<out>/<date>-<gpu>-<n>gpu.{json,md,png}`` and prints a summary. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

import torch

from benchmarks import context, report, set_env_defaults
from benchmarks.cases import ALIASES, CASES, resolve
from benchmarks.harness import Record
from meshfuse.runtime.comm import pending

DEFAULT_OUT = os.path.join("benchmarks", "results")
QUICK_OUT = os.path.join(tempfile.gettempdir(), "meshfuse-benchmarks")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="meshfuse benchmarks; under torchrun, one process per GPU.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and 3 iterations: a smoke test (runs on CPU)")
    parser.add_argument("--cases", default="all",
                        help=f"comma-separated cases or aliases: {', '.join([*CASES, *ALIASES])}")
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {DEFAULT_OUT}; with --quick {QUICK_OUT})")
    return parser.parse_args(argv)


def _run_case(ctx: context.Context, name: str) -> list[Record]:
    """Runs one case; an exception becomes an error record (the run goes on)."""
    try:
        return CASES[name](ctx)
    except Exception as e:  # noqa: BLE001 - recorded
        if ctx.rank == 0:
            traceback.print_exc()
        return [Record(name, "-", "-", ctx.world, status="error",
                       message=f"{type(e).__name__}: {e}")]


def _command(world: int, argv: list[str] | None) -> str:
    args = " ".join(sys.argv[1:] if argv is None else argv)
    launcher = f"torchrun --nproc-per-node {world}" if "LOCAL_RANK" in os.environ else "python"
    return f"{launcher} -m benchmarks.run {args}".strip()


def main(argv: list[str] | None = None) -> int:
    set_env_defaults()  # done on import of the package already; kept for other importers
    args = parse_args(argv)
    try:
        names = resolve(args.cases)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    started = time.time()
    ctx = context.setup(args.quick)
    env = context.environment(ctx)
    ctx.log(f"meshfuse benchmarks: {', '.join(names)} on {ctx.world} rank(s), {ctx.device.type}"
            f"{' (quick)' if args.quick else ''}")
    records: list[Record] = []
    for name in names:
        ctx.log(f"== {name} ==")
        t0 = time.perf_counter()
        records += _run_case(ctx, name)
        ctx.log(f"== {name}: {time.perf_counter() - t0:.1f} s")
    elapsed = time.time() - started
    settled = _settle(ctx)
    if ctx.rank == 0:
        out_dir = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
        stem = report.file_stem(env, args.quick, started)
        meta = {"stem": stem, "command": _command(ctx.world, argv), "cases": names,
                "quick": args.quick, "started": time.strftime("%Y-%m-%dT%H:%M:%S",
                                                              time.localtime(started)),
                "elapsed_s": elapsed, **settled}
        paths = report.write(out_dir, records, env, meta)
        print(report.console(records, env, elapsed))
        print("wrote " + ", ".join(paths), flush=True)
    ctx.barrier()
    context.teardown()
    return 0


def _settle(ctx: context.Context) -> dict[str, int]:
    """Waits for the collectives meshfuse left in flight (none, when every program waited for
    its own) and returns, for the report's meta, how many there were and how many collectives
    torch still counts as unwaited (the most of any rank; functional collectives whose result nobody
    waited for: the number torch's exit warning, "there are still N unwaited collective
    calls", would give; each record's ``metrics["unwaited_collectives"]`` says which variant
    left them)."""
    left = pending.in_flight()
    pending.settle_in_flight()
    unwaited = torch._C._distributed_c10d._get_work_registry_size()
    ctx.log(f"at the end: {left} meshfuse collectives were in flight (now waited); torch "
            f"counts {unwaited} unwaited collective calls")
    per_rank = ctx.gather((left, unwaited))
    return {"meshfuse_in_flight_at_end": max(p[0] for p in per_rank),
            "torch_unwaited_collectives": max(p[1] for p in per_rank)}


if __name__ == "__main__":
    sys.exit(main())
