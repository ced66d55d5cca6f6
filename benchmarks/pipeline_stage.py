"""A pipeline stage's per-microbatch programs on one GPU: the forward, the whole backward,
and the backward split into its input-gradient (``I``) and weight-gradient (``W``) halves as
the zero-bubble schedules run them (:mod:`meshfuse.parallel.stages.backward`).

Issue 35 asks ``I + W <= 1.05x`` the unsplit backward for a Llama-class stage (hidden 4096,
sequence 4096, bf16). One run measures both, so the ratio is of the same process and clocks::

    python -m benchmarks.pipeline_stage --out benchmarks/results/pipeline_stage

writes ``pipeline_stage.json`` and ``pipeline_stage.md`` under ``--out``. On a CPU it runs
a small configuration (``--small``) to check that the script works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from meshfuse.examples.llama import LlamaConfig
from meshfuse.examples.llama_stages import llama_pieces, model
from meshfuse.parallel.stages import StageModule, backward


def _config(args) -> LlamaConfig:
    if args.small:
        return LlamaConfig(vocab=64, hidden=64, layers=args.layers, heads=4, kv_heads=2,
                           ffn=128, seq=128, dtype="float32")
    return LlamaConfig(vocab=128, hidden=4096, layers=args.layers, heads=32, kv_heads=8,
                       ffn=14336, seq=args.seq, dtype=args.dtype)


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        return run

    def run_cpu(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return run_cpu


def measure(cfg: LlamaConfig, batch: int, iters: int, warmup: int,
            device: torch.device) -> dict[str, float]:
    """Median seconds of the stage's forward, whole backward, I and W on one microbatch."""
    stage = StageModule(llama_pieces(model(cfg))[1:-1]).to(device)
    notes = backward.LinearNotes(stage)
    deferred = notes.deferred_parameters()
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, cfg.seq, cfg.hidden, generator=g, device=device,
                    dtype=cfg.torch_dtype)
    dy = torch.randn(x.shape, generator=g, device=device, dtype=cfg.torch_dtype)
    timed = _timer(device)
    times: dict[str, list[float]] = {"forward": [], "backward": [], "I": [], "W": []}
    for i in range(warmup + iters):
        measured = _once(stage, notes, deferred, x, dy, timed)
        if i >= warmup:
            for key, t in zip(times, measured):
                times[key].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def _once(stage, notes, deferred, x, dy, timed) -> tuple[float, float, float, float]:
    """One microbatch: forward + whole backward, then forward + I + W; their times."""
    saved: list = []

    def forward(note: bool = False) -> None:
        notes.active = linears = [] if note else None
        xin = x.detach().requires_grad_(True)
        saved.append(backward.Saved(xin, stage(xin), linears or []))
        notes.active = None

    t_f = timed(forward)
    t_b = timed(lambda: backward.full(saved.pop(), dy))
    stage.zero_grad(set_to_none=False)
    timed(lambda: forward(note=True))
    split = saved.pop()
    t_i = timed(lambda: backward.input_half(split, dy, stage, deferred))
    t_w = timed(lambda: backward.weight_half(split))
    return t_f, t_b, t_i, t_w


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline_stage"))
    parser.add_argument("--layers", type=int, default=2, help="decoder layers in the stage")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="microbatch size")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a tiny stage (CPU check)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = _config(args)
    t = measure(cfg, args.batch, args.iters, args.warmup, device)
    ratio = (t["I"] + t["W"]) / t["backward"]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "config": {"hidden": cfg.hidden, "ffn": cfg.ffn, "heads": cfg.heads,
                         "kv_heads": cfg.kv_heads, "seq": cfg.seq, "layers": cfg.layers,
                         "batch": args.batch, "dtype": cfg.dtype},
              "seconds": t, "split_over_whole": ratio, "bound": 1.05, "ok": ratio <= 1.05}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline_stage.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "pipeline_stage.md").write_text(_markdown(result))
    print(_markdown(result))
    return result


def _markdown(r: dict) -> str:
    c, t = r["config"], r["seconds"]
    rows = "\n".join(f"| {k} | {v * 1e3:.3f} |" for k, v in t.items())
    return (f"# Pipeline stage: forward, whole and split backward ({r['device']})\n\n"
            f"{c['layers']} Llama layers, hidden {c['hidden']}, ffn {c['ffn']}, heads "
            f"{c['heads']}/{c['kv_heads']}, seq {c['seq']}, microbatch {c['batch']}, "
            f"{c['dtype']}; medians.\n\n| program | ms |\n|---|---|\n{rows}\n\n"
            f"I + W over the whole backward: **{r['split_over_whole']:.3f}** "
            f"(bound {r['bound']}: {'ok' if r['ok'] else 'over'})\n")


if __name__ == "__main__":
    main()
