"""Issue 32's GPU check: a Llama-3.2-1B-shaped ``transformers.LlamaForCausalLM`` (1.24B
parameters, vocabulary 128,256, 16 layers, GQA 32/8, bf16), one training step (forward,
backward, AdamW) on batch 4 x 2,048 at one rank, through ``meshfuse.parallelize`` against
``torch.compile`` (``compile_ro``: its reduce-overhead mode, CUDA graphs) and eager PyTorch
of the same module, timed in the same run.

    python -m benchmarks.capture_llama --out benchmarks/results      # one H200
    python -m benchmarks.capture_llama --quick                       # smoke test, CPU

Reports per variant: the first step's time (capture + build + run: for torch.compile its
compile time), then the median step time over ``--steps`` and tokens/s, and the peak memory
of the variant's steps (CUDA): allocated, and reserved (what the process took from the
device: CUDA graph pools' intermediates count there only), with what was allocated and
reserved at the variant's start (the base model, the batch, and with ``--interleaved`` the
variants kept alive, which the peaks include; without it torch.compile's code and CUDA-graph
trees are reset after each of its variants); ``--trace``: why each of meshfuse's calls
replayed, captured or ran the interpreter, step by step (:mod:`benchmarks.replay_trace`);
with ``--interleaved``, every variant is kept and timed again in rounds of one step of each
(the order shuffled each round; ``interleaved_*``), so that the GPU's changing clocks weigh
on all alike; for meshfuse, what each fusion's calls did (``calls``:
CUDA-graph replay, fused segments, host time per call, from
``FusionFunction.call_lines``). The optimizer is AdamW, fused (``fused=True``). Random
weights (no download); the models start equal (bf16, also with ``--quick``: a tiny bf16
model on the CPU), each variant trains its own copy. A variant that fails is recorded with
its error and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import torch

from benchmarks import context
from benchmarks.timing import interleaved


def _config(quick: bool):
    from transformers import LlamaConfig
    if quick:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           use_cache=False)
    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                       tie_word_embeddings=True, use_cache=False)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step(model, optimizer, step_inputs) -> torch.Tensor:
    """One training step (forward, backward, optimizer step; not synchronized); its loss.
    It starts with autograd's device threads on, torch's default (a meshfuse model's
    forward switches them off for its thread: meshfuse.autodiff.engine_thread)."""
    with torch.autograd.set_multithreading_enabled(True):
        optimizer.zero_grad(set_to_none=True)
        if getattr(model, "meshfuse_marks_steps", False):  # compile_ro: a new step of graphs
            torch.compiler.cudagraph_mark_step_begin()
        loss = model(**step_inputs).loss
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        loss.backward()
        optimizer.step()
    return loss


def _time_steps(model, optimizer, step_inputs, steps: int, device, trace=None) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # what the peaks below include that is not this variant's: the base model (kept to
        # copy the other variants from), the batch, and with --interleaved the variants
        # built before, kept alive
        at_start = {"allocated_at_start_gib": torch.cuda.memory_allocated() / 2**30,
                    "reserved_at_start_gib": torch.cuda.memory_reserved() / 2**30}
    times, losses = [], []
    for i in range(steps + 1):
        if trace is not None:
            trace.step = i
        _sync(device)
        start = time.perf_counter()
        loss = _step(model, optimizer, step_inputs)
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    tokens = step_inputs["input_ids"].numel()
    median = statistics.median(times[1:])
    result = {"first_step_s": times[0], "median_step_s": median,
              "tokens_per_s": tokens / median, "losses": losses}
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        # what the process took from the device: graph pools' intermediates included
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        result.update(at_start)
    return result


def _variant(name: str, base, mesh):
    import meshfuse

    # meshfuse_private_pools: each automatic CUDA graph has a memory pool of its own (the
    # graphs share pools by default), read at each capture
    os.environ["MESHFUSE_SHARED_GRAPH_POOLS"] = "0" if "private" in name else "1"
    model = copy.deepcopy(base)
    if name == "compile":
        return torch.compile(model)
    if name == "compile_ro":  # with CUDA graphs (cudagraph trees)
        compiled = torch.compile(model, mode="reduce-overhead")
        compiled.meshfuse_marks_steps = True
        return compiled
    if name.startswith("meshfuse"):
        # meshfuse_recompute: remat="recompute" (the default before 2026-12-05: the values
        # the forward writes for a product or attention are recomputed, not saved)
        remat = "recompute" if name.endswith("_recompute") else None
        return meshfuse.parallelize(model, mesh, {}, remat=remat)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--variants", default="eager,compile,meshfuse",
                        help="also compile_ro (torch.compile's reduce-overhead mode: CUDA "
                             "graphs), meshfuse_private_pools "
                             "(MESHFUSE_SHARED_GRAPH_POOLS=0) and meshfuse_recompute "
                             "(remat=\"recompute\")")
    parser.add_argument("--out", default=None, help="directory for the JSON result")
    parser.add_argument("--trace", action="store_true",
                        help="record why meshfuse's graphs replay or not, call by call")
    parser.add_argument("--interleaved", action="store_true",
                        help="keep every variant and time them again in alternating steps")
    args = parser.parse_args()
    device = context.setup(args.quick, cpu=args.quick).device
    warnings.simplefilter("ignore")
    from transformers import LlamaForCausalLM

    import meshfuse

    batch, seq = (2, 16) if args.quick else (args.batch, args.seq)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    base = LlamaForCausalLM(_config(args.quick)).to(device, dtype)
    g = torch.Generator().manual_seed(1)
    vocab = base.config.vocab_size
    inputs = {"input_ids": torch.randint(0, vocab, (batch, seq), generator=g).to(device),
              "labels": torch.randint(0, vocab, (batch, seq), generator=g).to(device)}
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "parameters": sum(p.numel() for p in base.parameters()),
               "batch": batch, "seq": seq, "dtype": str(dtype), "torch": torch.__version__}
    path = None
    if args.out and not args.quick:
        path = Path(args.out) / f"{time.strftime('%Y-%m-%d-%H%M')}-capture-llama-1b.json"
    kept: dict = {}  # --interleaved: variant -> (model, optimizer)
    for variant in args.variants.split(","):
        try:
            model = _variant(variant, base, meshfuse.DeviceMesh([0]))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
            trace = None
            if args.trace and variant.startswith("meshfuse"):
                from benchmarks.replay_trace import ReplayTrace
                trace = ReplayTrace()
            with trace or contextlib.nullcontext():
                results[variant] = _time_steps(model, optimizer, inputs, args.steps, device,
                                               trace)
            if variant.startswith("meshfuse"):
                results[variant]["calls"] = _calls(model)
                # graphs refused for memory: later calls ran the interpreter (a regression
                # of 2026-12-06 showed only so)
                results[variant]["graph_pools_full"] = _pools_full(model)
            if trace is not None:
                results[variant]["calls"] += trace.report()
            if args.interleaved:
                kept[variant] = (model, optimizer)
        except Exception as error:  # noqa: BLE001 - recorded; the other variants still run
            results[variant] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        print(variant, {k: v for k, v in results[variant].items()
                        if k not in ("losses", "calls")}, flush=True)
        print("\n".join(results[variant].get("calls", [])), flush=True)
        model = optimizer = None
        if not args.interleaved and variant.startswith("compile"):
            # its compiled code and CUDA-graph trees (reduce-overhead's pool) would stay
            # allocated and count in the next variant's peak (2.3 GiB after compile_ro,
            # 2026-12-05)
            torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda" and not args.interleaved:
            torch.cuda.empty_cache()
        _record(results, path)  # after each variant: a run cut short keeps what it measured
    if kept:
        steps = {v: functools.partial(_step, model, optimizer, inputs)
                 for v, (model, optimizer) in kept.items()}
        for variant, ms in interleaved(steps, args.steps, 1, device).items():
            seconds = statistics.median(ms) / 1e3
            results[variant]["interleaved_median_step_s"] = seconds
            results[variant]["interleaved_tokens_per_s"] = inputs["input_ids"].numel() / seconds
        _record(results, path)
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}))
    context.teardown()


def _calls(model) -> list[str]:
    """What each fusion of the parallelized model did over the steps (one autograd function
    per distinct fusion, shared by identical layers): its forward's and backward's CUDA-graph
    replay, fused segments and host time per call, and the autograd node's host time."""
    program = model._meshfuse.last
    lines = []
    for n, (_, function) in enumerate(program.built.values()):
        lines += [f"function {n}:", *(f"  {x}" for x in function.call_lines())]
    return lines


def _pools_full(model) -> bool:
    """Whether some program of the parallelized model was refused a capture because the
    automatic graphs' pools held their share of the device's memory."""
    return any(replay.capped
               for function in model._meshfuse.last.built.values()
               for compiled in function[1]._derivations.values()
               for runner in compiled.runners() for replay in runner._replays.values())


def _record(results: dict, path: Path | None) -> None:
    """The ratios of meshfuse to torch.compile (once both ran), written to ``path``."""
    mine, theirs = results.get("meshfuse", {}), results.get("compile", {})
    if "tokens_per_s" in theirs and "tokens_per_s" in mine:
        results["meshfuse_over_compile_tokens"] = mine["tokens_per_s"] / theirs["tokens_per_s"]
        results["meshfuse_over_compile_first_step"] = (mine["first_step_s"]
                                                       / theirs["first_step_s"])
    if "interleaved_tokens_per_s" in theirs and "interleaved_tokens_per_s" in mine:
        results["meshfuse_over_compile_tokens_interleaved"] = (
            mine["interleaved_tokens_per_s"] / theirs["interleaved_tokens_per_s"])
    graphs = results.get("compile_ro", {})
    for suffix in ("tokens_per_s", "interleaved_tokens_per_s"):
        if suffix in graphs and suffix in mine:
            results[f"meshfuse_over_compile_ro_{suffix}"] = mine[suffix] / graphs[suffix]
    if path is not None:
        path.write_text(json.dumps(results, indent=1))
        print("wrote", path, flush=True)


if __name__ == "__main__":
    main()
