"""meshfuse's pipeline runtime against ``torch.distributed.pipelining`` on the same model,
ranks, stages, microbatches and schedule: the step time of each (and the CPU time of a
step summed over the ranks, which a loaded host disturbs less) (a step: zero the
gradients, every microbatch forward and backward under the schedule, AdamW) and their ratio,
with the per-step losses of both (they must agree).

Issue 35 asks meshfuse's step time <= 1.0x torch's. The two runtimes alternate step by step
in one run (each with its own copy of the model, initialised alike), so load on the host
touches both alike; a step is timed on rank 0 from a barrier before it to a barrier after
it. On CPU (gloo)::

    python -m benchmarks.pipeline_vs_torch --ranks 2 --out benchmarks/results/NAME
    python -m benchmarks.pipeline_vs_torch --ranks 4 --out benchmarks/results/NAME

(``--ranks N`` starts N processes; under ``torchrun`` it runs at the launcher's world
size.) Rank 0 writes ``pipeline_vs_torch-<ranks>.json`` and ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from meshfuse.examples.llama import LlamaConfig
from meshfuse.examples.llama_stages import batches, llama_pieces, lm_loss, model
from meshfuse.launch import spawn, under_launcher
from meshfuse.parallel.stages import PipelineRunner, schedule, split_pieces
from meshfuse.runtime.comm.communicator import Communicator

TORCH = {"GPipe": pipelining.ScheduleGPipe, "1F1B": pipelining.Schedule1F1B,
         "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
         "ZeroBubble": pipelining.ScheduleInterleavedZeroBubble}
MULTI_STAGE = {"Interleaved1F1B", "ZeroBubble"}  # torch takes a list of stages


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes to start (no launcher)")
    p.add_argument("--schedules", default="GPipe,1F1B,Interleaved1F1B,ZeroBubble")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed steps of each runtime")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="directory for the results (rank 0)")
    return p.parse_args(argv)


def _config(args) -> LlamaConfig:
    return LlamaConfig(vocab=256, hidden=args.hidden, layers=args.layers, heads=4,
                       kv_heads=2, ffn=2 * args.hidden, seq=args.seq)


def _ours(cfg, name: str, d: int, m: int):
    plan = schedule(name, d, m)
    stages = split_pieces(llama_pieces(model(cfg)), plan.n_stages)
    rank = dist.get_rank()
    mine = {s: stages[s] for s in plan.stages_of(rank)}
    runner = PipelineRunner(plan, mine, lm_loss)
    opt = torch.optim.AdamW([p for s in mine.values() for p in s.parameters()], lr=1e-2)

    def step(ids, targets):
        opt.zero_grad()
        loss = runner.step(ids, targets)
        opt.step()
        return None if loss is None else loss.item()
    return step, plan


def _theirs(cfg, name: str, d: int, m: int, plan):
    """torch's schedule over the same stages (the same cut, the same placement)."""
    stages = split_pieces(llama_pieces(model(cfg)), plan.n_stages)
    rank, device = dist.get_rank(), torch.device("cpu")
    mine = plan.stages_of(rank)
    wrapped = [pipelining.PipelineStage(stages[s], s, plan.n_stages, device) for s in mine]
    kind = TORCH[name]
    runtime = kind(wrapped if name in MULTI_STAGE else wrapped[0], m, loss_fn=lm_loss)
    opt = torch.optim.AdamW([p for s in mine for p in stages[s].parameters()], lr=1e-2)
    first, last = 0 in mine, plan.n_stages - 1 in mine

    def step(ids, targets):
        opt.zero_grad()
        losses: list = []
        runtime.step(*([ids] if first else []), **({"target": targets, "losses": losses}
                                                   if last else {}))
        opt.step()
        return torch.stack(losses).mean().item() if losses else None
    return step


def _timed(step, ids, targets) -> tuple[float, float, float | None]:
    """Wall seconds of the step (barrier to barrier), this rank's CPU seconds in it, and
    its loss."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    loss = step(ids, targets)
    cpu = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - start, cpu, loss


def compare(args, name: str) -> dict:
    cfg, d, m = _config(args), dist.get_world_size(), args.microbatches
    ours, plan = _ours(cfg, name, d, m)
    theirs = _theirs(cfg, name, d, m, plan)
    times: dict[str, list[float]] = {"meshfuse": [], "torch": []}
    cpu: dict[str, list[float]] = {"meshfuse": [], "torch": []}
    losses: dict[str, list] = {"meshfuse": [], "torch": []}
    for i, (ids, targets) in enumerate(batches(cfg, args.batch, args.warmup + args.steps)):
        for label, step in (("meshfuse", ours), ("torch", theirs)):
            seconds, cpu_s, loss = _timed(step, ids, targets)
            losses[label].append(loss)
            if i >= args.warmup:
                times[label].append(seconds)
                cpu[label].append(cpu_s)
    every = Communicator.instance().allgather_object((losses, cpu))
    final = next(x for x, _ in every if x["meshfuse"][0] is not None)
    worst = max(abs(a - b) / abs(b) for a, b in zip(final["meshfuse"], final["torch"]))
    ours_s, theirs_s = (statistics.median(times[k]) for k in ("meshfuse", "torch"))
    # CPU seconds of a step summed over the ranks (the host work, whatever the load)
    ours_cpu, theirs_cpu = (statistics.median(map(sum, zip(*(c[k] for _, c in every))))
                            for k in ("meshfuse", "torch"))
    return {"schedule": name, "stages": plan.n_stages, "microbatches": m,
            "meshfuse_s": ours_s, "torch_s": theirs_s, "ratio": ours_s / theirs_s,
            "meshfuse_cpu_s": ours_cpu, "torch_cpu_s": theirs_cpu,
            "cpu_ratio": ours_cpu / theirs_cpu,
            "worst_loss_rel_diff": worst, "meshfuse_losses": final["meshfuse"],
            "torch_losses": final["torch"]}


def _commit() -> str:
    if "MESHFUSE_COMMIT" in os.environ:
        return os.environ["MESHFUSE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _report(args, rows: list[dict]) -> str:
    d = dist.get_world_size()
    title = f"# meshfuse pipeline vs torch.distributed.pipelining, {d} CPU ranks (gloo)"
    setup = (f"commit {_commit()}, torch {torch.__version__}, {os.cpu_count()} CPUs "
             f"({platform.machine()}); Llama hidden {args.hidden}, {args.layers} layers, "
             f"seq {args.seq}, batch {args.batch}, float32; median of {args.steps} steps "
             f"after {args.warmup}, the runtimes alternating; host load average "
             f"{os.getloadavg()[0]:.1f} at the end")
    header = ("| schedule | stages | microbatches | meshfuse ms | torch ms | ratio | "
              "meshfuse CPU ms | torch CPU ms | CPU ratio | worst loss rel. diff |")
    lines = [title, "", setup, "", header, "|---" * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['stages']} | {r['microbatches']} | "
                     f"{r['meshfuse_s'] * 1e3:.1f} | {r['torch_s'] * 1e3:.1f} | "
                     f"{r['ratio']:.2f}x | {r['meshfuse_cpu_s'] * 1e3:.1f} | "
                     f"{r['torch_cpu_s'] * 1e3:.1f} | {r['cpu_ratio']:.2f}x | "
                     f"{r['worst_loss_rel_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = _args(argv)
    if not under_launcher():
        codes = spawn(args.ranks, ["-m", "benchmarks.pipeline_vs_torch", *sys.argv[1:]])
        sys.exit(max(codes))
    Communicator.instance()
    rows = [compare(args, name) for name in args.schedules.split(",")]
    if dist.get_rank() == 0:
        text = _report(args, rows)
        print(text)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            stem = f"pipeline_vs_torch-{dist.get_world_size()}"
            (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
            (out / f"{stem}.md").write_text(text)


if __name__ == "__main__":
    main()
