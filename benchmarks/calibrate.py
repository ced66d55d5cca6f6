"""Measures a machine's speeds for the cost model (:mod:`meshfuse.cost`) and writes its
calibration file; ``--check`` then times 20 program variants the calibration did not measure
(GEMMs, attention, pointwise and memory-bound kernels) and compares each with the model's
prediction.

One GPU (GEMMs, attention, memory-bound kernels)::

    python -m benchmarks.calibrate --out OUT/h200.json --base meshfuse/cost/data/h200.json --check

Several (collectives too, per group size of 2, 4, 8... up to the world)::

    torchrun --nproc-per-node 2 -m benchmarks.calibrate --out OUT/h200.json \\
        --base meshfuse/cost/data/h200.json --check

``--base``: a calibration whose figures this run does not measure are kept (the links across
nodes, the overlap contentions, the copy engines', the host costs) with their sources.
``--device cpu`` measures CPU ranks (gloo); ``--quick`` only checks that the script runs
(tiny shapes). Rank 0 writes the file, and ``--check``'s table
(``OUT/…-check.json`` beside it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshfuse.cost import CostModel
from meshfuse.cost.calibration import from_dict

MIB = 1 << 20
GEMM_CLASSES = {  # the calibration's shape classes: (max_dim, shapes measured)
    1024: [(1024, 1024, 1024), (512, 4096, 4096), (1024, 8192, 1024)],
    4096: [(4096, 4096, 4096), (2048, 8192, 8192), (4096, 16384, 4096)],
    None: [(8192, 8192, 8192), (16384, 8192, 8192), (8192, 28672, 8192)],
}
CPU_SCALE = 8  # CPU runs shapes this much smaller on each side
SIZES = [MIB * 2 ** i for i in range(0, 11, 2)]  # 1 MiB .. 1 GiB


ITERS = {"iters": 20}  # timed calls per measurement (``--quick``: 3)


def timed(fn: Callable[[], object], device: str, iters: int | None = None,
          warmup: int = 3) -> float:
    """The median seconds of ``fn`` (CUDA events on GPUs, wall clock on CPUs)."""
    iters = min(iters or ITERS["iters"], ITERS["iters"])
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def gemm_seconds(m: int, n: int, k: int, dtype, device: str) -> float:
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    return timed(lambda: a @ b, device)


def attention_seconds(b: int, h: int, s: int, d: int, dtype, device: str) -> float:
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, device=device) for _ in range(3))
    return timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)


def attention_flops(b: int, h: int, s: int, d: int) -> float:
    return 2.0 * b * h * s * s * d  # causal: half of 2 products of 2 b h s s d


def measure_compute(dtype, device: str, scale: int) -> dict:
    """GEMM throughput per class, attention's, the memory bandwidth and a launch."""
    gemm = []
    for max_dim, shapes in GEMM_CLASSES.items():
        rates = [2.0 * m * n * k / gemm_seconds(m // scale, n // scale, k // scale, dtype,
                                                 device) / scale ** 3 / 1e12
                 for m, n, k in shapes]
        gemm.append({"max_dim": None if max_dim is None else max_dim // scale,
                     "tflops": _figure(statistics.median(rates)),
                     "source": f"median of {len(shapes)} GEMMs {shapes} / {scale}"})
    shape = (4, 32, 4096 // scale, 128)
    attention = attention_flops(*shape) / attention_seconds(*shape, dtype, device) / 1e12
    x = torch.empty(256 * MIB // 2 // scale, dtype=dtype, device=device)
    memory = 2 * x.numel() * x.element_size() / timed(lambda: x.mul(2.0), device) / 1e9
    tiny = torch.ones(8, device=device)
    launch = timed(lambda: tiny.add(1.0), device, iters=50) * 1e6
    return {"gemm": gemm, "attention_tflops": _figure(attention),
            "memory_gb_per_s": _figure(memory), "launch_us": _figure(launch)}


def _figure(x: float) -> float:
    """``x`` to 4 significant digits (CPU figures are small)."""
    return float(f"{x:.4g}")


def measure_collectives(device: str, sizes: list[int]) -> dict:
    """Bus GB/s per kind, group size and message size (nccl-tests' convention)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict = {}
    groups = [n for n in (2, 4, 8, 16, 32) if n <= world]
    for n in groups:
        group = dist.new_group(list(range(n)))
        kinds = ("allreduce", "allgather", "reduce_scatter", "alltoall") + \
            (("p2p",) if n == 2 else ())
        for kind in kinds:
            points = []
            for size in sizes:
                seconds = _collective_seconds(kind, size, n, group, rank, device)
                factor = {"allreduce": 2 * (n - 1) / n, "p2p": 1.0}.get(kind, (n - 1) / n)
                points.append([size, _figure(size * factor / seconds / 1e9)])
            small = _collective_seconds(kind, 8192, n, group, rank, device)
            out.setdefault(kind, {})[str(n)] = {"latency_us": _figure(small * 1e6),
                                                "points": points}
    return out


def _collective_seconds(kind, size, n, group, rank, device) -> float:
    if rank >= n:
        dist.barrier()
        return 1.0
    elems = size // 2 // n * n
    whole = torch.ones(elems, dtype=torch.bfloat16, device=device)
    part = torch.ones(elems // n, dtype=torch.bfloat16, device=device)
    received = torch.empty_like(whole)
    peer = 1 - rank if n == 2 else None
    calls = {"allreduce": lambda: dist.all_reduce(whole, group=group),
             "allgather": lambda: dist.all_gather_into_tensor(whole, part, group=group),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole, group=group),
             "alltoall": lambda: dist.all_to_all_single(received, whole, group=group),
             "p2p": lambda: _exchange(whole, received, peer)}
    seconds = timed(calls[kind], device, iters=10)
    dist.barrier()
    return seconds


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    """Both ranks of a pair send ``send`` to each other at once (a ring step)."""
    ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def variants(dtype, device: str, scale: int) -> list[tuple[str, Callable[[], object], Callable]]:
    """20 programs the calibration did not time: (name, the call, its prediction from a
    cost model)."""
    out, itemsize = [], torch.empty(0, dtype=dtype).element_size()
    for m, n, k in [(3072, 3072, 3072), (6144, 4096, 4096), (8192, 1024, 8192),
                    (12288, 4096, 12288), (2048, 2048, 512), (4096, 14336, 4096),
                    (768, 768, 768), (16384, 1024, 4096)]:
        m, n, k = m // scale, n // scale, k // scale
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        out.append((f"gemm {m}x{k}x{n}", lambda a=a, b=b: a @ b,
                    lambda cm, m=m, n=n, k=k: cm.gemm(m, n, k, itemsize)))
    for b_, h, s, d in [(2, 16, 8192, 128), (8, 32, 2048, 128), (1, 64, 16384, 128),
                        (4, 8, 4096, 64)]:
        s //= scale
        q, kk, v = (torch.randn(b_, h, s, d, dtype=dtype, device=device) for _ in range(3))
        out.append((f"attention {b_}x{h}x{s}x{d}",
                    lambda q=q, kk=kk, v=v: F.scaled_dot_product_attention(q, kk, v,
                                                                          is_causal=True),
                    lambda cm, shape=(b_, h, s, d): cm.attention(attention_flops(*shape))))
    x = torch.randn(8192 // scale, 8192, dtype=dtype, device=device)
    y = torch.randn_like(x)
    w = torch.ones(8192, dtype=dtype, device=device)
    nbytes = x.numel() * x.element_size()
    kernels = [("pointwise add", lambda: x + y, 3), ("pointwise mul", lambda: x * y, 3),
               ("pointwise gelu", lambda: F.gelu(x, approximate="tanh"), 2),
               ("pointwise silu*mul", lambda: F.silu(x) * y, 5),
               ("layer_norm", lambda: F.layer_norm(x, (8192,), w, w), 2),
               ("rms_norm", lambda: F.rms_norm(x, (8192,), w), 2),
               ("softmax", lambda: torch.softmax(x, -1), 2),
               ("sum rows", lambda: x.sum(-1), 1)]
    for name, call, passes in kernels:
        out.append((name, call, lambda cm, p=passes: cm.memory_bound(p * nbytes)))
    return out


def check(cal: dict, dtype, device: str, scale: int) -> dict:
    """Measured against predicted seconds for :func:`variants`."""
    model = CostModel(from_dict(cal, "measured"))
    rows = []
    for name, call, predict in variants(dtype, device, scale):
        measured, predicted = timed(call, device), predict(model)
        rows.append({"variant": name, "measured_ms": measured * 1e3,
                     "predicted_ms": predicted * 1e3, "error": predicted / measured - 1})
    errors = [abs(r["error"]) for r in rows]
    return {"rows": rows, "median_abs_error": statistics.median(errors),
            "max_abs_error": max(errors), "within_15pct": sum(e <= 0.15 for e in errors)}


def build(args, measured: dict, collectives: dict) -> dict:
    """The calibration: ``--base``'s with this run's measurements and their sources."""
    base = json.loads(Path(args.base).read_text()) if args.base else {}
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    world = dist.get_world_size() if dist.is_initialized() else 1
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    source = f"measured by benchmarks/calibrate.py on {world} x {name}, {when}, torch " \
             f"{torch.__version__}"
    cal = dict(base)
    cal.update({"device": f"{name} ({world} measured)", "source": source,
                "dtype_bytes": torch.empty(0, dtype=_dtype(args)).element_size(),
                "gemm": measured["gemm"]})
    for key in ("attention_tflops", "memory_gb_per_s", "launch_us"):
        cal[key] = {"value": measured[key], "source": source}
    if collectives:
        cal["collectives"] = {k: {n: {**c, "source": source} for n, c in by_n.items()}
                              for k, by_n in collectives.items()}
    for key, default in (("peak_tflops", {"value": 989.0, "source": "H100/H200 dense BF16"}),
                         ("copy_engine_gb_per_s", {"value": 0.0, "source": "not measured"})):
        cal.setdefault(key, default)
    cal.setdefault("collectives", {})
    cal.setdefault("links", {"intra_node_gb_per_s": 300.0, "inter_node_gb_per_s": 45.0,
                             "gpus_per_node": 8, "latency_us": 30.0})
    cal.setdefault("overlap", {"process_group_beside_gemm": 1.0,
                               "copy_engine_beside_gemm": 1.0, "async_contention": 0.2})
    cal.setdefault("host", {"loop_chunk_us": 20.0, "copy_engine_chunk_us": 25.0})
    return cal


def _dtype(args):
    return torch.bfloat16 if args.device == "cuda" else torch.float32


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.calibrate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, help="the calibration JSON to write")
    p.add_argument("--base", default=None, help="a calibration to keep unmeasured figures of")
    p.add_argument("--check", action="store_true", help="time 20 variants against the model")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, few sizes and calls: checks the script runs, measures "
                        "nothing worth keeping")
    args = p.parse_args(argv)
    if args.quick:
        ITERS["iters"] = 3
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    scale = 32 if args.quick else 1 if args.device == "cuda" else CPU_SCALE
    sizes = SIZES[:2] if args.quick else SIZES if args.device == "cuda" else SIZES[:3]
    measured = measure_compute(_dtype(args), args.device, scale)
    collectives = measure_collectives(args.device, sizes) if dist.is_initialized() else {}
    cal = build(args, measured, collectives)
    from_dict(cal)  # the file reads back
    if rank == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(cal, indent=1) + "\n")
        print(f"wrote {out}")
        if args.check:
            result = check(cal, _dtype(args), args.device, scale)
            out.with_name(out.stem + "-check.json").write_text(json.dumps(result, indent=1))
            for r in result["rows"]:
                print(f"{r['variant']:28s} measured {r['measured_ms']:9.4f} ms  predicted "
                      f"{r['predicted_ms']:9.4f} ms  {r['error']:+.1%}")
            print(f"median |error| {result['median_abs_error']:.1%}, max "
                  f"{result['max_abs_error']:.1%}, {result['within_15pct']}/20 within 15%")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
