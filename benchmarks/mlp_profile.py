"""Where the Megatron MLP's time goes: a profile of one forward + backward step of each
variant of the ``mlp`` case (a diagnostic, not a benchmark).

``torchrun --nproc-per-node 2 -m benchmarks.mlp_profile --out DIR`` (``--quick``: the
case's tiny sizes, runs on CPU ranks). For each variant, rank 0 writes
``DIR/mlp_profile_<variant>.txt`` (the kernels of a few back-to-back steps grouped by name
with their count and time per step, largest first, then the aten ops with their input
shapes) and each rank its trace, ``DIR/mlp_trace_<variant>_rank<r>.json.gz``; the summary
of every variant (step time, kernel time, communication kernels; on GPUs the busy and idle
time per step and the NCCL time no compute kernel hid, the SM clock and power) goes to
``DIR/mlp_profile.txt``. The same profiling as :mod:`benchmarks.gpt3_profile`.
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks import context
from benchmarks.cases import mlp
from benchmarks.gpt3_profile import profile_variant, write_summaries
from benchmarks.harness import Skip

DEFAULT_VARIANTS = "torch_1gpu,torch_manual,dtensor_tp,meshfuse," + ",".join(mlp.LOOP_VARIANTS)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where the tables and traces go")
    parser.add_argument("--quick", action="store_true", help="the case's tiny sizes")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="comma-separated variants of the mlp case")
    args = parser.parse_args(argv)
    ctx = context.setup(args.quick)
    ctx.out = args.out
    os.makedirs(args.out, exist_ok=True)
    sizes = mlp.QUICK_SIZES if args.quick else mlp.SIZES
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    wanted = args.variants.split(",")
    summaries = []
    inputs = mlp.tensors(ctx, sizes, dtype)
    for variant in mlp.variants(ctx, sizes, dtype, inputs):
        if variant.name not in wanted:
            continue
        try:
            made = variant.setup()
        except Skip as why:
            summaries.append(f"{variant.name}: skipped ({why})")
            continue
        step, metrics = made if isinstance(made, tuple) else (made, {})
        line = profile_variant(ctx, variant.name, step, prefix="mlp")
        summaries.append(line + "".join(f"; {m}" for m in metrics.get("loops", [])))
        del step, made
        if ctx.cuda:
            torch.cuda.empty_cache()
    write_summaries(ctx, os.path.join(args.out, "mlp_profile.txt"), summaries)
    context.teardown()


if __name__ == "__main__":
    main()
