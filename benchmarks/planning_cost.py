"""What a new input signature costs on the host: compiling a fusion and planning its program,
every rank in turn, in one process and without communicating (CPU only, no GPU needed).

For each program (the seed attention BHSE and BSHE, the Megatron MLP with its gradients,
ten pointwise ops, a GPT block with its backward written out) and world size (2 and 4),
each rank does what ``execute``'s first call does before it runs anything:
``compile`` (the build passes, once per rank as on a machine of its own), then
``bind``, ``check_no_resharding``, ``localize``, each communication's ``plan_resharding``
and ``build_program``. Reported per program and world size: the CPU milliseconds of one
rank (best of ``--repeat`` runs), for the build and for the per-signature stages.

Usage (from the repository root): ``PYTHONPATH=. python benchmarks/planning_cost.py
[OUT_DIR] [--repeat N]``; writes ``OUT_DIR/planning_cost.json`` when ``OUT_DIR`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from benchmarks.fusions import MegatronMlp, Pointwise10
from meshfuse import DeviceMesh
from meshfuse.examples.gpt import GptBlockWithBackward
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention
from meshfuse.ir.tensor_view import TensorView
from meshfuse.passes.localization import localize
from meshfuse.passes.pipeline import compile
from meshfuse.passes.sharding_check import check_no_resharding
from meshfuse.runtime.comm.reshard_plan import plan_resharding
from meshfuse.runtime.interpreter.binding import bind, held_here, local_context
from meshfuse.runtime.interpreter.program import build_program
from meshfuse.sharding import shard_tensor

PROGRAMS = {
    "seed_attention_bhse": lambda mesh: SeedAttention(QkvFormat.BHSE, mesh, 2, 8, 64, 128),
    "seed_attention_bshe": lambda mesh: SeedAttention(QkvFormat.BSHE, mesh, 2, 8, 64, 128),
    "megatron_mlp": lambda mesh: MegatronMlp(64, 32, 128, mesh),
    "pointwise10": lambda mesh: Pointwise10(64, mesh),
    "gpt_block_with_backward": lambda mesh: GptBlockWithBackward(2, 16, 32, 4, mesh=mesh),
    # GPT-3-like sizes: what depends on the extents (owner maps, shard indices) shows here.
    "megatron_mlp_large": lambda mesh: MegatronMlp(8192, 12288, 49152, mesh),
}


def _global_inputs(fusion) -> list:
    """A global tensor for each tensor input (its dtype and logical shape; on the meta
    device: planning reads shapes and strides only), a scalar's value."""
    return [torch.empty([i.extent for i in v.materialized()], dtype=v.dtype.torch_dtype,
                        device="meta") if isinstance(v, TensorView) else v.value
            for v in fusion.inputs()]


def _plan_rank(fd, inputs: list, world_size: int, rank: int) -> tuple[float, float]:
    """CPU seconds of rank ``rank``'s build and of its per-signature stages."""
    fusion = fd.fusion
    start = time.process_time()
    compiled = compile(fusion, world_size)  # a rank of its own: built anew, not memoized
    built = time.process_time()
    local = [shard_tensor(x, tv, rank) if isinstance(tv, TensorView) and held_here(
        compiled[tv], rank) else x for x, tv in zip(inputs, fusion.inputs())]
    start_signature = time.process_time()
    binding = bind(compiled.fusion, compiled.allocations, local, rank)
    check_no_resharding(compiled.fusion, binding.extents)
    here = local_context(binding, rank, torch.device("meta"))
    ran = localize(compiled.fusion, binding.extents, binding.layouts, here)

    def lower(expr, binding, donated):
        src, dst = expr.args[0], expr.outputs[0]
        steps = plan_resharding(src, dst, binding.extents) if src.mesh is not None else ()
        return torch.clone, tuple(steps), ""

    build_program(compiled.fusion, binding, ran, rank, lower)
    return built - start, time.process_time() - start_signature


def measure(repeat: int) -> dict:
    results = {}
    for name, make in PROGRAMS.items():
        for world_size in (2, 4):
            fd = make(DeviceMesh(range(world_size))).define()
            inputs = _global_inputs(fd.fusion)
            best = None
            for _ in range(repeat):
                times = [_plan_rank(fd, inputs, world_size, r) for r in range(world_size)]
                build = sum(t[0] for t in times) / world_size
                signature = sum(t[1] for t in times) / world_size
                if best is None or build + signature < sum(best):
                    best = (build, signature)
            results[f"{name}/ws{world_size}"] = {
                "exprs": len(fd.fusion.exprs), "build_ms": 1e3 * best[0],
                "signature_ms": 1e3 * best[1]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    results = measure(args.repeat)
    print(f"{'program':34s} {'exprs':>5s} {'build ms':>9s} {'signature ms':>13s}")
    for key, r in results.items():
        print(f"{key:34s} {r['exprs']:5d} {r['build_ms']:9.2f} {r['signature_ms']:13.2f}")
    total = sum(r["build_ms"] + r["signature_ms"] for r in results.values())
    print(f"{'total (one rank of each)':34s} {'':5s} {total:23.2f}")
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "planning_cost.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
