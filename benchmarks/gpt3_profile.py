"""Where the GPT-3 layer's time goes: a profile of one forward + backward step of each
variant of the ``gpt3_layer`` case (a diagnostic, not a benchmark).

``torchrun --nproc-per-node 2 -m benchmarks.gpt3_profile --out DIR`` (``--quick``: the
case's tiny sizes, runs on CPU ranks; ``--interleave``: each variant also timed interleaved
with the first, the ratio in the summary). For each variant, rank 0 writes
``DIR/gpt3_profile_<variant>.txt``: the kernels (CUDA; on the CPU, the aten ops) of
``STEPS`` back-to-back steps grouped by name with their count and total time per step,
largest first, then the aten ops with their input shapes; and a summary of every variant's
step time, kernel time, communication kernels and collectives in ``DIR/gpt3_profile.txt``.
On GPUs the summary also gives, per step, how long the compute kernels kept the device busy,
how long it sat idle and how much NCCL time no compute kernel hid (from the trace:
:mod:`benchmarks.trace_summary`), and the SM clock and power while the steps were timed
(a GPU that draws more power runs its GEMMs at a lower clock); each rank's trace of the
profiled steps is kept as ``DIR/gpt3_trace_<variant>_rank<r>.json.gz``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import statistics
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import context, trace_summary
from benchmarks.cases import gpt3
from benchmarks.cp_probe import Clocks
from benchmarks.harness import Skip, waited
from benchmarks.timing import interleaved_ratio, timed_samples
from meshfuse.examples.gpt import init_parameters

WARMUP, ITERS, ROWS, STEPS = 3, 20, 60, 3


def _step_of(variant):
    made = variant.setup()
    return made[0] if isinstance(made, tuple) else made


def _kernels(prof, cuda: bool) -> list[tuple[str, int, float]]:
    """(name, count, total ms) of the device kernels (CUDA) or aten ops (CPU). On CUDA the
    GPU spans of ``record_function`` ranges (user annotations: ``nccl:all_reduce`` around
    each NCCL kernel, ``## Call CompiledFxGraph ##`` around each compiled segment's kernels)
    are not kernels: counting them would count each collective twice and each compiled
    segment once more than its kernels."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if cuda and (e.device_type.name != "CUDA" or getattr(e, "is_user_annotation", False)):
            continue
        if not cuda and not e.name.startswith(("aten::", "c10d")):
            continue
        spent = (e.time_range.end - e.time_range.start) / 1e3
        totals[e.name][0] += 1
        totals[e.name][1] += spent
    return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda r: -r[2])


def _shapes(prof) -> list[str]:
    """The aten ops with their input shapes, by total host time (self)."""
    table = prof.key_averages(group_by_input_shape=True)
    return table.table(sort_by="self_cpu_time_total", row_limit=ROWS, max_name_column_width=50,
                       max_shapes_column_width=80).splitlines()


def _timeline(prof, steps: int, keep: str) -> str:
    """Busy, idle and exposed-NCCL milliseconds per step from the profile's GPU trace (NCCL
    counting the copy engines' peer copies and barriers, also given apart); the
    trace is kept, gzipped, at ``keep`` (for a timeline viewer)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name, "rb") as trace, gzip.open(keep, "wb") as kept:
            shutil.copyfileobj(trace, kept)
        with open(f.name) as trace:
            whole = trace_summary.summarize(json.load(trace))[0]
    return (f"per step on the GPU: busy {whole['compute_busy_ms'] / steps:.3f} ms, idle "
            f"{whole['idle_ms'] / steps:.3f} ms, NCCL {whole['nccl_ms'] / steps:.3f} ms of which "
            f"{whole['nccl_exposed_ms'] / steps:.3f} ms not hidden; copies "
            f"{whole['memcpy_ms'] / steps:.3f} ms of which "
            f"{whole['memcpy_beside_kernels_ms'] / steps:.3f} ms beside kernels; peer copies "
            f"{whole['peer_copy_ms'] / steps:.3f} ms of which "
            f"{whole['peer_copy_beside_kernels_ms'] / steps:.3f} ms beside kernels; barriers "
            f"{whole['barrier_ms'] / steps:.3f} ms; {_gemms(whole['gemms'], steps)}")


def _gemms(split: dict, steps: int) -> str:
    """The GEMM kernels' time per step, how much of it ran beside a transfer, and per
    kernel name the mean time of one alone and of one beside a transfer (NCCL's kernels
    take SMs from a GEMM that runs beside them)."""
    means = []
    for name, by in split["by_name"].items():
        shown = [f"{where} {ms / n:.3f} ms x{n / steps:g}" for where, (n, ms) in by.items() if n]
        means.append(f"{name[-36:]}: {', '.join(shown)}")
    return (f"GEMMs {split['ms'] / steps:.3f} ms in {split['count'] / steps:g}, of which "
            f"{split['beside_ms'] / steps:.3f} ms in {split['beside_count'] / steps:g} beside a "
            f"transfer (per kernel: {'; '.join(means)})")


def profile_variant(ctx, name: str, step, prefix: str = "gpt3") -> str:
    """Profiles ``step``; returns a summary line; writes the tables on rank 0 (files named
    ``<prefix>_profile_<name>.txt``, traces ``<prefix>_trace_<name>_rank<r>.json.gz``)."""
    for _ in range(WARMUP):
        waited(step())
    ctx.sync()
    clocks = Clocks(ctx.device) if ctx.cuda else None
    with clocks or contextlib.nullcontext():
        median = statistics.median(timed_samples(ctx, lambda: waited(step()), ITERS))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(STEPS):
            waited(step())
        ctx.sync()
    kernels = [(n, c / STEPS, t / STEPS) for n, c, t in _kernels(prof, ctx.cuda)]
    comm = [k for k in kernels if "nccl" in k[0].lower() or k[0].startswith("c10d")]
    total = sum(t for _, _, t in kernels)
    comm_ms = sum(t for _, _, t in comm)
    summary = (f"{name}: step {median:.3f} ms; kernels {total:.3f} ms in "
               f"{sum(c for _, c, _ in kernels):g} launches; communication {comm_ms:.3f} ms in "
               f"{sum(c for _, c, _ in comm):g}")
    if ctx.cuda:
        trace = os.path.join(ctx.out, f"{prefix}_trace_{name}_rank{ctx.rank}.json.gz")
        summary += f"; {_timeline(prof, STEPS, trace)}; clocks {clocks.summary()}"
    if ctx.rank == 0:
        lines = [summary, "", f"per step (of {STEPS}):", f"{'count':>6} {'total ms':>10}  name"]
        lines += [f"{c:6g} {t:10.3f}  {n[:150]}" for n, c, t in kernels[:ROWS]]
        lines += ["", "aten ops by input shapes:", *_shapes(prof)]
        with open(os.path.join(ctx.out, f"{prefix}_profile_{name}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return summary


def _interleaved(ctx, steps: dict, rounds: int, iters: int) -> list[str]:
    """Each step's time over the first one's, timed interleaved with it (alternating blocks,
    so that a drift of the GPUs' clocks hits both alike)."""
    (base_name, base), *others = steps.items()
    lines = []
    for name, step in others:
        ratio = interleaved_ratio(ctx, lambda: waited(base()), lambda s=step: waited(s()),
                                  rounds, iters)
        lines.append(f"{name}: interleaved with {base_name} ({rounds} rounds of {iters} steps "
                     f"each): {ratio:.3f}x")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where rank 0 writes the tables")
    parser.add_argument("--quick", action="store_true", help="the case's tiny sizes")
    parser.add_argument("--variants", default="dtensor_tp_sp,meshfuse_autograd_compiled,"
                        "meshfuse_compiled",
                        help="comma-separated variants of the gpt3_layer case")
    parser.add_argument("--interleave", action="store_true",
                        help="also time each variant interleaved with the first one of "
                        "--variants "
                        "(alternating blocks of steps: the median of the per-round ratios)")
    args = parser.parse_args(argv)
    ctx = context.setup(args.quick)
    ctx.out = args.out
    os.makedirs(args.out, exist_ok=True)
    sizes = gpt3.QUICK_SIZES if args.quick else gpt3.SIZES
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator(ctx.device).manual_seed(1)
    shape = (sizes["b"], sizes["s"], sizes["e"])
    x = torch.randn(shape, generator=gen, device=ctx.device).to(dtype)
    dy = torch.randn(shape, generator=gen, device=ctx.device).to(dtype)
    params = init_parameters(sizes["e"], dtype=dtype, device=ctx.device)
    wanted = args.variants.split(",")
    summaries, steps = [], {}
    known = {v.name: v for v in gpt3.variants(ctx, sizes, dtype, x, dy, params)}
    if set(wanted) - set(known):
        parser.error(f"unknown variants {sorted(set(wanted) - set(known))}; the case has "
                     f"{sorted(known)}")
    for variant in (known[name] for name in wanted):  # in the order asked
        try:
            step = _step_of(variant)
        except Skip as why:  # e.g. DTensor on one rank, Inductor's segments on CPUs
            summaries.append(f"{variant.name}: skipped ({why})")
            continue
        summaries.append(profile_variant(ctx, variant.name, step))
        if args.interleave:
            steps[variant.name] = step
        else:
            del step
        torch.cuda.empty_cache() if ctx.cuda else None
    if steps:
        summaries += _interleaved(ctx, steps, *((3, 3) if args.quick else (7, 10)))
    write_summaries(ctx, os.path.join(args.out, "gpt3_profile.txt"), summaries)
    context.teardown()


def write_summaries(ctx, path: str, summaries: list[str]) -> None:
    """On rank 0: the variants' summary lines to ``path``, and printed."""
    if ctx.rank == 0:
        with open(path, "w") as f:
            f.write("\n".join(summaries) + "\n")
        print("\n".join(summaries))


if __name__ == "__main__":
    main()
