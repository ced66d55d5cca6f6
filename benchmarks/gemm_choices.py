"""Which kernel each GEMM of the GPT layer's training step runs fastest with on this device
(issue 34's bars of 0.97x ``torch.compile`` at the medium and big layers, where every variant
runs the same cuBLAS products and lands within 1% of the others).

For each size of :mod:`benchmarks.training_step`, the step's GEMM problems at their real
layouts (per linear ``x [T, K]``, ``w [N, K]``, bias ``[N]``, ``dy [T, N]``: the forward
``addmm(b, x, w.t())``, the input's gradient ``mm(dy, w)``, the weight's ``mm(dy.t(), x)``;
the layer's linears are q, k, v and the output projection (``N = K = e``) and the MLP's two
(``4e x e``, ``e x 4e``)), each timed as

- ``cublas``: the ``torch.ops.aten`` call with torch's default BLAS library (what every
  variant of the layer runs now);
- ``cublaslt``: the same call with ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
- ``autotuned``: ``torch.compile(mode="max-autotune-no-cudagraphs")`` of the same call:
  Inductor measures its Triton GEMM templates against the extern cuBLAS call and keeps the
  fastest (its choice is reported).

Timing: the variants of one problem in alternating blocks (CUDA events around a block of
calls, the order shuffled each round); per variant the median over rounds, its TFLOP/s and
its ratio to ``cublas``. Per size, the step's GEMM time with each choice (every problem
weighted by how often the step runs it) and with the fastest choice per problem.

    python -m benchmarks.gemm_choices --sizes medium,big --out DIR   # CUDA
    python -m benchmarks.gemm_choices --quick                        # tiny shapes, CPU

Results: ``DIR/gemm_choices.json`` and ``DIR/gemm_choices.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time

import torch

from benchmarks.context import environment, setup
from benchmarks.timing import interleaved
from benchmarks.training_step import SIZES, TINY

VARIANTS = ("cublas", "cublaslt", "autotuned")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One GEMM of the step: ``kind`` (forward, input or weight gradient) of a linear with
    ``n`` outputs and ``k`` inputs over ``tokens`` rows, run ``count`` times per step."""

    kind: str
    tokens: int
    n: int
    k: int
    count: int

    @property
    def flops(self) -> float:
        return 2.0 * self.tokens * self.n * self.k

    @property
    def name(self) -> str:
        return f"{self.kind} T={self.tokens} N={self.n} K={self.k}"


def problems(batch: int, seq: int, embed: int) -> list[Problem]:
    tokens = batch * seq
    linears = [(embed, embed, 4), (4 * embed, embed, 1), (embed, 4 * embed, 1)]
    return [Problem(kind, tokens, n, k, count)
            for n, k, count in linears for kind in ("forward", "grad_input", "grad_weight")]


def _call(kind: str):
    if kind == "forward":
        return lambda b, x, w, dy: torch.ops.aten.addmm(b, x, w.t())
    if kind == "grad_input":
        return lambda b, x, w, dy: torch.ops.aten.mm(dy, w)
    return lambda b, x, w, dy: torch.ops.aten.mm(dy.t(), x)


@contextlib.contextmanager
def _blas(library: str):
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _operands(problem: Problem, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(device=device, dtype=dtype)

    return (rand(problem.n), rand(problem.tokens, problem.k), rand(problem.n, problem.k),
            rand(problem.tokens, problem.n))


def time_problem(problem: Problem, device: torch.device, dtype: torch.dtype, rounds: int,
                 iters: int) -> dict:
    operands = _operands(problem, device, dtype)
    call = _call(problem.kind)
    on_cuda = device.type == "cuda"

    def cublas():
        return call(*operands)

    def cublaslt():
        with _blas("cublaslt") if on_cuda else contextlib.nullcontext():
            return call(*operands)

    begin = time.perf_counter()
    mode = "max-autotune-no-cudagraphs" if on_cuda else None
    compiled = torch.compile(call, mode=mode, dynamic=False, fullgraph=True)
    reference = cublas()
    got = compiled(*operands)
    compile_s = time.perf_counter() - begin
    error = ((got.float() - reference.float()).norm() / reference.float().norm()).item()
    steps = {"cublas": cublas, "cublaslt": cublaslt, "autotuned": lambda: compiled(*operands)}
    for step in steps.values():  # warm-up
        step()
    times = interleaved(steps, rounds, iters, device)
    medians = {n: statistics.median(t) for n, t in times.items()}
    return {
        "problem": problem.name, **dataclasses.asdict(problem),
        "ms": medians,
        "tflops": {n: problem.flops / (ms * 1e-3) / 1e12 for n, ms in medians.items()},
        "ratio_to_cublas": {n: statistics.median(a / b for a, b in
                                                 zip(times[n], times["cublas"]))
                            for n in VARIANTS},
        "autotune_s": compile_s, "autotuned_relative_error": error,
    }


def step_totals(rows: list[dict]) -> dict[str, float]:
    totals = {n: sum(r["ms"][n] * r["count"] for r in rows) for n in VARIANTS}
    totals["best_per_problem"] = sum(min(r["ms"].values()) * r["count"] for r in rows)
    return totals


def write(out: str, report: dict) -> None:
    with open(os.path.join(out, "gemm_choices.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [(f"# The GPT layer's GEMMs by kernel choice, "
             f"{report['env'].get('gpu_name') or report['env'].get('device')} "
             f"({report['env'].get('torch', '')})"), ""]
    for size, sized in report["sizes"].items():
        lines += [f"## {size}: b, s, heads, embed = {sized['shape']}", "",
                  ("| problem | per step | cublas ms | cublaslt / cublas | autotuned / cublas "
                  "| cublas TFLOP/s | best TFLOP/s | autotune s |"),
                  "|---|---|---|---|---|---|---|---|"]
        for r in sized["problems"]:
            lines.append(
                f"| {r['problem']} | {r['count']} | {r['ms']['cublas']:.3f} | "
                f"{r['ratio_to_cublas']['cublaslt']:.3f} | "
                f"{r['ratio_to_cublas']['autotuned']:.3f} | "
                f"{r['tflops']['cublas']:.0f} | {max(r['tflops'].values()):.0f} | "
                f"{r['autotune_s']:.1f} |")
        totals = sized["step_ms"]
        lines += ["", "step's GEMM time, ms: " + ", ".join(
            f"{n} {ms:.3f} ({ms / totals['cublas']:.3f}x)" for n, ms in totals.items()), ""]
    with open(os.path.join(out, "gemm_choices.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="medium,big")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="stop starting new problems after this many seconds")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU dry run)")
    args = parser.parse_args()
    ctx = setup(args.quick, cpu=args.quick)
    dtype = torch.float32 if ctx.device.type == "cpu" else torch.bfloat16
    os.makedirs(args.out, exist_ok=True)
    report = {"env": environment(ctx), "sizes": {}}
    begin = time.perf_counter()
    for size in args.sizes.split(","):
        batch, seq, _heads, embed = TINY if args.quick else SIZES[size]
        rows = []
        for problem in problems(batch, seq, embed):
            if time.perf_counter() - begin > args.budget_s:
                print(f"budget spent: {problem.name} of {size} and after not timed")
                break
            row = time_problem(problem, ctx.device, dtype, args.rounds,
                               iters=2 if args.quick else 20)
            print(json.dumps(row), flush=True)
            rows.append(row)
        report["sizes"][size] = {"shape": [batch, seq, _heads, embed], "problems": rows,
                                 "step_ms": step_totals(rows)}
        write(args.out, report)


if __name__ == "__main__":
    main()
