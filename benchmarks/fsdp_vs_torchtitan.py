"""One training step of a Llama-family model of about 1B parameters at one rank: meshfuse's
fully sharded model against torchtitan's Llama 3 under FSDP2 + ``torch.compile`` (issue 33).

Both models have the same sizes (``--size 1b``: hidden 2048, 16 layers, 32 query and 8
key/value heads, SwiGLU 8192, an untied vocabulary of 32,000: 1.10B parameters), sequence
2048, bf16 parameters, gradients and AdamW state, the same batch. A step is forward, backward
(the mean cross entropy of the next-token logits) and ``AdamW.step`` (fused on CUDA):

- ``meshfuse``: :class:`~meshfuse.examples.llama.LlamaModel` on a one-rank ``dp`` mesh (each
  fusion a :class:`~meshfuse.autodiff.fsdp_module.FullyShardedModule`), derived backwards,
  meshfuse's defaults;
- ``torchtitan``: ``torchtitan.models.llama3.Llama3Model`` (its PyPI package; PyTorch's
  SDPA) as its trainer prepares it: ``torch.compile`` of each transformer block, then
  ``fully_shard`` of each block and of the root, on a one-rank mesh. Where torchtitan does not
  import, ``torch_fsdp2``: the same preparation of the plain-PyTorch twin
  (:class:`~meshfuse.examples.llama_torch.LlamaTorch`). The results say which ran.

Each variant is built and warmed up (compilation), then its peak memory is taken over two
steps (CUDA: the most allocated then, less what was allocated before it was built; the
variants built before it stay alive), and the most reserved (what it took from the device,
CUDA graph pools included, after the earlier variants' cached blocks were released). Then all are timed *interleaved*: rounds of
``--steps-per-round`` steps of each variant in turn (CUDA events around each block), the
order shuffled each round, ``--steps`` steps each in all (the median over rounds), so that the GPU's changing clocks weigh on all alike (timed
one after the other, the same program's ratio moved from 1.31x to 0.94x within half an
hour on 2026-12-04). Reported: tokens/s and peak memory of each, and meshfuse's ratios to
the other (tokens/s >= 1.0x and peak <= 1.0x are the issue's targets).

    python -m benchmarks.fsdp_vs_torchtitan --out benchmarks/results/fsdp_h200   # one GPU
    python -m benchmarks.fsdp_vs_torchtitan --quick                              # CPU dry run

``--quick``: a tiny model on CPU (one-rank gloo group), a few steps: checks the script only.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from benchmarks import context
from benchmarks.timing import interleaved

SIZES = {
    "1b": {"vocab": 32000, "hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8,
           "ffn": 8192, "seq": 2048},
    "tiny": {"vocab": 256, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128,
             "seq": 32},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes on CPU (a dry run)")
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    p.add_argument("--steps-per-round", type=int, default=2,
                   help="steps of a variant before the next variant's (interleaved rounds)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default="meshfuse,torchtitan",
                   help="comma separated: meshfuse, torchtitan (falls back to torch_fsdp2)")
    p.add_argument("--out", default=None, help="directory for fsdp_vs_torchtitan.json/.md")
    p.add_argument("--diagnose", action="store_true",
                   help="also where a step synchronizes and what is alive at its memory peak")
    p.add_argument("--origins", action="store_true",
                   help="record every allocation from the build on (CUDA): what each variant "
                        "holds after its warm-up, by the code that allocated it")
    p.add_argument("--plain", action="store_true",
                   help="meshfuse's model without its FSDP modules (one-device mesh)")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.batch, args.steps, args.warmup = "tiny", 2, 4, 1
    return args


def _config(args):
    from meshfuse.examples.llama import LlamaConfig
    return LlamaConfig(**SIZES[args.size], rope_theta=500000.0,
                       dtype="float32" if args.quick else "bfloat16")


def _batch(cfg, batch: int, step: int, device):
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def _training_step(loss_of, params, device):
    """A step of ``loss_of``'s model: forward and backward, then AdamW (fused on CUDA)."""
    opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if device.type == "cuda"
                                                else {"foreach": True}))

    def step(ids, targets):
        loss = loss_of(ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def meshfuse_variant(cfg, batch: int, device, plain: bool = False):
    """meshfuse's Llama model, fully sharded over a one-rank dp mesh (``plain``: the model
    without the FSDP modules, on a one-device mesh); its step."""
    from meshfuse.examples.llama import LlamaModel, init_parameters
    from meshfuse.ir.mesh import DeviceMesh
    from meshfuse.parallel.fsdp import NamedMesh
    mesh = DeviceMesh(range(1)) if plain else \
        NamedMesh(DeviceMesh(torch.arange(1).reshape(1, 1)), ("dp", "tp"))
    model = LlamaModel(cfg, batch, init_parameters(cfg), mesh, device)
    step = _training_step(model, model.parameters(), device)
    step.calls = lambda: _calls(model)
    return "meshfuse", step


def _calls(model) -> list[str]:
    """What the embedding's, the first block's and the head's autograd functions did over
    the steps (CUDA-graph replay, fused segments, host time per call): one line each."""
    lines = []
    for name, module in (("embed", model.embed), ("blocks.0", model.blocks[0]),
                         ("head", model.head)):
        lines += [f"{name}:", *(f"  {x}" for x in module._function.call_lines())]
    return lines


FALLBACK: dict[str, str] = {}  # why torchtitan did not run, if it did not


def _titan_model(cfg):
    """torchtitan's Llama 3 of ``cfg``'s sizes (untied, SDPA), or None (the reason in
    FALLBACK) where torchtitan does not import or build."""
    try:
        return _build_titan(cfg)
    except Exception as e:  # noqa: BLE001 - any failure: the fallback runs, and says why
        FALLBACK["reason"] = f"{type(e).__name__}: {e}"
        return None


def _build_titan(cfg):
    from torchtitan.models import llama3
    from torchtitan.models.common import attention
    llama3.get_attention_config = lambda backend: attention.ScaledDotProductAttention.Config()
    config = llama3.Llama3Model.Config(
        dim=cfg.hidden, vocab_size=cfg.vocab,
        tok_embeddings=llama3.Embedding.Config(num_embeddings=cfg.vocab,
                                               embedding_dim=cfg.hidden),
        norm=llama3.RMSNorm.Config(normalized_shape=cfg.hidden),
        lm_head=llama3.Linear.Config(in_features=cfg.hidden, out_features=cfg.vocab),
        layers=llama3._build_llama3_layers(
            n_layers=cfg.layers, dim=cfg.hidden, n_heads=cfg.heads, n_kv_heads=cfg.kv_heads,
            hidden_dim=cfg.ffn, attn_backend="sdpa", fuse_qkv=False,
            rope=llama3.ComplexRoPE.Config(dim=cfg.head_dim, max_seq_len=cfg.seq,
                                           theta=cfg.rope_theta)))
    return config.build()


def torch_variant(cfg, batch: int, device):
    """torchtitan's Llama 3 (else the plain-PyTorch twin) with each block compiled, then
    fully_shard of each block and the root on a one-rank mesh; its step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshfuse.examples.llama_torch import LlamaTorch
    torch.manual_seed(0)
    titan = _titan_model(cfg)
    name, model = ("torchtitan", titan) if titan is not None else ("torch_fsdp2",
                                                                   LlamaTorch(cfg))
    model = model.to(device=device, dtype=cfg.torch_dtype)
    blocks = model.layers if titan is not None else model.model.layers
    items = list(blocks.items()) if isinstance(blocks, torch.nn.ModuleDict) else \
        list(enumerate(blocks))
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    for key, block in items:
        compiled = torch.compile(block)
        blocks.register_module(str(key), compiled)
        fully_shard(compiled, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)

    def loss_of(ids, targets):
        if titan is None:
            return model(ids, targets)
        logits = model(ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return name, _training_step(loss_of, model.parameters(), device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(make, cfg, args, device) -> dict:
    """Builds a variant, warms it up, and runs ``PEAK_STEPS`` steps for its peak memory: the
    most allocated during them less what was allocated before it was built (the variants
    built before it stay alive, for the interleaved timing)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the earlier variants' cached blocks go back
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    reserved_before = torch.cuda.memory_reserved() if device.type == "cuda" else 0
    start = time.perf_counter()
    recording = args.origins and device.type == "cuda"
    if recording:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    name, step = make(cfg, args.batch, device)
    losses = [step(*_batch(cfg, args.batch, i, device)).item() for i in range(args.warmup)]
    first = time.perf_counter() - start
    origins = []
    if recording:
        from benchmarks import memory_peak
        origins = memory_peak.live_by_origin(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(PEAK_STEPS):
        losses.append(step(*_batch(cfg, args.batch, args.warmup + i, device)).item())
    peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
    # what the variant took from the device (graph pools' intermediates, cached blocks)
    reserved = torch.cuda.max_memory_reserved() - reserved_before \
        if device.type == "cuda" else None
    diagnosis = _diagnose(step, cfg, args, device) if args.diagnose else []
    return {"variant": name, "step": step, "peak_bytes": peak,
            "peak_reserved_bytes": reserved, "setup_and_warmup_s": first,
            "losses": losses, "diagnosis": origins + diagnosis}


PEAK_STEPS = 2


def _library_workspaces(device) -> None:
    """Runs a matrix product and a linear on the current stream, so that cuBLAS's and
    cuBLASLt's workspaces for it (kept for the process's life: 32 MiB each on an H200) exist
    before any variant is built: both variants use them, and neither's peak counts them
    (the variant built first did)."""
    if device.type == "cuda":
        a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
        torch.nn.functional.linear(a @ a, a, a[0])
        torch.cuda.synchronize()


def time_interleaved(built: list[dict], cfg, args, device) -> None:
    """``args.steps`` timed steps of each variant, in rounds of ``args.steps_per_round``
    steps of every variant in turn (:func:`benchmarks.timing.interleaved`), each step on a
    new batch; each variant's median step time."""
    rounds = max(1, args.steps // args.steps_per_round)
    steps = {v["variant"]: _next_batch_step(v, cfg, args, device) for v in built}
    times = interleaved(steps, rounds, args.steps_per_round, device)
    for v in built:
        v["median_step_s"] = statistics.median(times[v["variant"]]) / 1e3
        v["tokens_per_s"] = args.batch * cfg.seq / v["median_step_s"]
        v["losses"] = [float(loss) for loss in v["losses"]]
        v["calls"] = v["step"].calls() if hasattr(v["step"], "calls") else []
        del v["step"]


def _next_batch_step(v: dict, cfg, args, device):
    """A step of variant ``v`` on the next batch, its loss kept (read after the timing)."""
    index = itertools.count(args.warmup + PEAK_STEPS)

    def step():
        v["losses"].append(v["step"](*_batch(cfg, args.batch, next(index), device)).detach())
    return step


def _diagnose(step, cfg, args, device) -> list[str]:
    """Where a step synchronizes and what is alive at its memory peak (CUDA)."""
    if device.type != "cuda":
        return []
    from benchmarks import memory_peak
    batch = _batch(cfg, args.batch, 0, device)
    return memory_peak.diagnose(lambda: step(*batch))


def _ratios(results: list[dict]) -> dict:
    mine = next((r for r in results if r["variant"] == "meshfuse"), None)
    other = next((r for r in results if r["variant"] != "meshfuse"), None)
    if mine is None or other is None:
        return {}
    def ratio(key):
        return None if not mine.get(key) or not other.get(key) else mine[key] / other[key]
    return {"against": other["variant"],
            "tokens_per_s": mine["tokens_per_s"] / other["tokens_per_s"],
            "peak_memory": ratio("peak_bytes"), "peak_reserved": ratio("peak_reserved_bytes")}


def _markdown(record: dict) -> str:
    lines = [f"# meshfuse FSDP vs {record['ratios'].get('against', '-')}: one training step",
             "", (f"device {record['device']}, torch {record['torch']}, config "
                  f"{record['config']}, batch {record['batch']}, "
                  f"{record['parameters'] / 1e9:.2f}B parameters"), "",
             "| variant | step (ms) | tokens/s | peak allocated (GiB) | peak reserved (GiB) |",
             "|---|---|---|---|---|"]
    for r in record["results"]:
        peak, reserved = ("-" if r.get(k) is None else f"{r[k] / 2**30:.2f}"
                          for k in ("peak_bytes", "peak_reserved_bytes"))
        lines.append(f"| {r['variant']} | {r['median_step_s'] * 1e3:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {peak} | {reserved} |")
    ratios = record["ratios"]
    if ratios:
        peak, reserved = ("-" if ratios.get(k) is None else f"{ratios[k]:.3f}x"
                          for k in ("peak_memory", "peak_reserved"))
        lines += ["", (f"meshfuse / {ratios['against']}: tokens/s "
                       f"{ratios['tokens_per_s']:.3f}x (target >= 1.0x), peak memory {peak} "
                       f"(target <= 1.0x), peak reserved {reserved}")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = context.setup(args.quick, cpu=args.quick).device
    warnings.simplefilter("ignore")
    from meshfuse.examples.llama import parameter_shapes
    cfg = _config(args)
    makers = {"meshfuse": lambda *a: meshfuse_variant(*a, plain=args.plain),
              "torchtitan": torch_variant}
    _library_workspaces(device)
    results = [build(makers[name], cfg, args, device) for name in args.variants.split(",")]
    time_interleaved(results, cfg, args, device)
    for r in results:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f} GiB"
        print(f"{r['variant']}: {r['median_step_s'] * 1e3:.1f} ms/step, "
              f"{r['tokens_per_s']:.0f} tokens/s, peak {peak}", flush=True)
        print("\n".join(r["diagnosis"] + r["calls"]), flush=True)
    record = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "config": dataclasses.asdict(cfg),
              "batch": args.batch, "steps": args.steps, "results": results,
              "meshfuse_model": "plain" if args.plain else "fsdp dp=1",
              "parameters": sum(torch.Size(s).numel() for s in parameter_shapes(cfg).values()),
              "ratios": _ratios(results), "torchtitan_fallback": FALLBACK.get("reason")}
    text = _markdown(record)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fsdp_vs_torchtitan.json"), "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(args.out, "fsdp_vs_torchtitan.md"), "w") as f:
            f.write(text)
    context.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
