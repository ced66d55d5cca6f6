"""Where a training step of the Llama-3.2-1B-shaped model of :mod:`benchmarks.capture_llama`
spends its GPU time and memory: ``torch.compile`` against ``meshfuse.parallelize``, one rank.

Per variant, after a warm-up: the device kernels of two profiled steps by total time (and
their busy and idle time on the GPU), and the memory of a step: what is allocated between
steps (parameters, gradients, optimizer state, and for meshfuse the outputs its CUDA graphs
hold), the peak during a step, and for meshfuse each signature's replay line (graphs, the
memory they hold) and, with shared pools (the default), each shared pool's bytes
against its graphs' outputs' (the rest is the memory of the programs' intermediates).

    python -m benchmarks.llama_step_profile --out OUT          # one H200
    python -m benchmarks.llama_step_profile --quick            # CPU smoke test

``--diagnose`` (CUDA) adds, per variant, where a step synchronizes the host with the device,
what is alive at its memory peak and where the host spends a step's time
(:mod:`benchmarks.memory_peak`), and writes the profiled steps' trace
(``<out>/llama_step_profile-<variant>.json.gz``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import gzip
import json
import tempfile
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import context, trace_summary
from benchmarks.capture_llama import _config, _step, _sync, _variant
from benchmarks.gpt3_profile import _kernels

WARMUP, PROFILED, ROWS = 4, 2, 40


def _graph_memory() -> list[str]:
    """The automatic CUDA graphs' shared pools (their bytes, and the bytes of the outputs
    their graphs hold), then each signature's replay line."""
    from meshfuse.runtime.replay import automatic, pools

    lines = []
    for (_, _, kind), pool in pools._POOLS.items():
        graphs = [g for g in (ref() for ref in pool.graphs) if g is not None]
        if pool.handle is None:
            continue
        total, _, _ = pools.pool_layout(pool.handle)
        held = sum(b - a for g in graphs for a, b in g.output_ranges())
        lines.append(f"{kind} pool: {len(graphs)} graphs, {total / 2**30:.2f} GiB, their "
                     f"outputs {held / 2**30:.2f} GiB")
    for replay in automatic._LIVE:
        if replay.graphs or replay.waits:
            lines.append(f"  program {id(replay._program) % 10000:04d}: {replay.describe()}")
    return lines


def profile_variant(name: str, base, inputs, device, out: Path | None,
                    diagnose: bool = False) -> list[str]:
    import meshfuse

    model = _variant(name, base, meshfuse.DeviceMesh([0]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    for _ in range(WARMUP):
        _step(model, optimizer, inputs)
    _sync(device)
    lines = [f"## {name}"]
    if device.type == "cuda":
        between = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(model, optimizer, inputs)
        _sync(device)
        state = sum(p.numel() * p.element_size() for p in model.parameters())
        lines.append(f"memory: between steps {between / 2**30:.2f} GiB allocated (parameters "
                     f"{state / 2**30:.2f} GiB), peak in a step "
                     f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, reserved "
                     f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB")
        if name.startswith("meshfuse"):
            lines += _graph_memory()
        if diagnose:
            from benchmarks import memory_peak
            lines += memory_peak.diagnose(lambda: _step(model, optimizer, inputs),
                                          host=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED):
            _step(model, optimizer, inputs)
        _sync(device)
    kernels = _kernels(prof, device.type == "cuda")
    total = sum(t for _, _, t in kernels) / PROFILED
    lines.append(f"kernels per step: {total:.3f} ms in "
                 f"{sum(c for _, c, _ in kernels) / PROFILED:g} launches")
    if device.type == "cuda":
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            if diagnose and out is not None:
                with open(f.name, "rb") as trace, \
                        gzip.open(out / f"llama_step_profile-{name}.json.gz", "wb") as z:
                    z.write(trace.read())
            with open(f.name) as trace:
                whole = trace_summary.summarize(json.load(trace))[0]
        lines.append(f"GPU per step: busy {whole['compute_busy_ms'] / PROFILED:.3f} ms, idle "
                     f"{whole['idle_ms'] / PROFILED:.3f} ms; longest idle gaps (ms, after):")
        lines += [f"  {gap['ms']:.3f} after {gap['after']}" for gap in whole["longest_idle_gaps"]]
    lines += [f"{c / PROFILED:6g} {t / PROFILED:9.3f} ms  {n[:140]}"
              for n, c, t in kernels[:ROWS]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU")
    parser.add_argument("--variants", default="compile,meshfuse")
    parser.add_argument("--out", default=None, help="directory for the summary")
    parser.add_argument("--diagnose", action="store_true",
                        help="synchronizations, the memory peak's blocks, the trace (CUDA)")
    args = parser.parse_args()
    device = context.setup(args.quick, cpu=args.quick).device
    warnings.simplefilter("ignore")
    from transformers import LlamaForCausalLM

    batch, seq = (2, 16) if args.quick else (4, 2048)
    torch.manual_seed(0)
    base = LlamaForCausalLM(_config(args.quick)).to(device, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    vocab = base.config.vocab_size
    inputs = {"input_ids": torch.randint(0, vocab, (batch, seq), generator=g).to(device),
              "labels": torch.randint(0, vocab, (batch, seq), generator=g).to(device)}
    out = Path(args.out) if args.out else None
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    title = f"# Llama-3.2-1B-shaped training step, {batch} x {seq}, {where}, "
    lines = [title + f"torch {torch.__version__}"]
    for name in args.variants.split(","):
        lines += profile_variant(name, copy.deepcopy(base), inputs, device, out,
                                 args.diagnose and device.type == "cuda")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if out is not None:
            (out / "llama_step_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    context.teardown()


if __name__ == "__main__":
    main()
