"""Measures a machine's speeds for the cost model (:mod:`meshfuse.cost`), fits the model's
parameters to them (:mod:`meshfuse.cost.fit`) and writes its calibration file; ``--check``
then times 20 program variants the fit never saw (GEMMs, attention, pointwise and
memory-bound kernels: :mod:`benchmarks.calibrate_programs`) and compares each with the
model's prediction.

One GPU (GEMMs, attention, memory-bound kernels; estimated at about a minute on an H200,
5 s of it warm-up; prints the seconds it took)::

    python -m benchmarks.calibrate --out OUT/h200.json --base meshfuse/cost/data/h200.json --check

Several (collectives too, per group size of 2, 4, 8... up to the world)::

    torchrun --nproc-per-node 2 -m benchmarks.calibrate --out OUT/h200.json \\
        --base meshfuse/cost/data/h200.json --check

Offline (no device): a recorded check's measured times against a calibration's predictions::

    python -m benchmarks.calibrate --offline CHECK.json --calibration meshfuse/cost/data/h200.json

``--base``: a calibration whose figures this run does not measure are kept (the links across
nodes, the overlap contentions, the copy engines', the host costs) with their sources.
``--device cpu`` measures CPU ranks (gloo); ``--quick`` only checks that the script runs
(tiny shapes). Rank 0 writes the file, the microbenchmarks' samples (``OUT/…-samples.json``)
and ``--check``'s table (``OUT/…-check.json``) beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.calibrate_programs import (
    ATTENTION_SHAPES,
    GEMM_SHAPES,
    KERNEL_ELEMENTS,
    KERNEL_ROWS,
    KERNELS,
    TINY_ATTENTION,
    TINY_GEMMS,
    check_programs,
    make_call,
    predict,
)
from meshfuse.cost import CostModel, load
from meshfuse.cost.calibration import DATA, MemoryFit, from_dict
from meshfuse.cost.fit import fit_attention, fit_attention_blocks, fit_gemm, kernel_factors

MIB = 1 << 20
CPU_SCALE = 8  # CPU runs shapes this much smaller on each side
SIZES = [MIB * 2 ** i for i in range(0, 11, 2)]  # 1 MiB .. 1 GiB
GPU_TILES = [(256, 128), (128, 256), (128, 128), (256, 256), (192, 192)]  # cuBLAS's (sm90)


ITERS = {"iters": 15, "passes": 2}  # timed loops per measurement and passes over a
# family (``--quick``: 3 and 1); each program's least median over the passes is kept
LOOP_S = 1e-3  # a timed loop of back-to-back calls lasts about this long on a GPU
WARM_S = 3.0  # seconds of large GEMMs before any GPU measurement (clocks up, caches warm)


def warm_up(device: str, seconds: float = WARM_S) -> None:
    """Runs large GEMMs for ``seconds`` so that the GPU is at its working clocks before the
    first timing: an idle GPU starts slow, and the microbenchmarks ran first (the cold
    2026-12-03 14:32 run measured them 5-15% slower than the check run a minute later)."""
    if device != "cuda":
        return
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, iters: int | None = None,
          warmup: int = 3) -> float:
    """The seconds of one call of ``fn``: on GPUs, loops of back-to-back calls between two
    CUDA events (as a program queues its kernels: no host wait between them), about
    ``LOOP_S`` long, repeated ``iters`` times, the median loop over its calls; on CPUs the
    median wall clock of single calls. The microbenchmarks and the check are timed alike."""
    iters = min(iters or ITERS["iters"], ITERS["iters"])
    for _ in range(warmup):
        fn()
    if device != "cuda":
        samples = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        return statistics.median(samples)
    calls = max(1, min(100, math.ceil(LOOP_S / _loop_seconds(fn, 1))))
    return statistics.median(_loop_seconds(fn, calls) for _ in range(iters))


def _loop_seconds(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn`` (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def timed_all(calls: list[Callable[[], object]], device: str) -> list[float]:
    """:func:`timed` of each call, in ``ITERS["passes"]`` passes over all of them (a slow
    moment of the device falls on one pass of a few programs), the least of its passes."""
    best = [float("inf")] * len(calls)
    for _ in range(ITERS["passes"]):
        best = [min(b, timed(fn, device)) for b, fn in zip(best, calls, strict=True)]
    return best


def _scaled(shape, scale: int) -> tuple[int, ...]:
    return tuple(max(x // scale, 1) for x in shape)


def measure_gemms(dtype, device: str, scale: int) -> dict:
    """The GEMM samples ``[m, n, k, s]`` and the floor (tiny GEMMs' median, us)."""
    def call(m, n, k):
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        return lambda: a @ b

    shapes = [_scaled(s, scale) for s in GEMM_SHAPES + TINY_GEMMS]
    times = timed_all([call(*shape) for shape in shapes], device)
    samples = [(*shape, t) for shape, t in zip(shapes, times, strict=True)][:len(GEMM_SHAPES)]
    floor = statistics.median(times[len(GEMM_SHAPES):]) * 1e6
    return {"samples": samples, "floor_us": floor}


def measure_attention(dtype, device: str, scale: int) -> dict:
    """The causal attention samples ``[b, h, s, d, s]`` and the floor (us)."""
    def call(b, h, s, d):
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype, device=device) for _ in range(3))
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)

    shapes = [(b, h, max(s // scale, 16), d) for b, h, s, d in ATTENTION_SHAPES]
    times = timed_all([call(*shape) for shape in shapes + [TINY_ATTENTION]], device)
    samples = [(*shape, t) for shape, t in zip(shapes, times, strict=False)]
    return {"samples": samples, "floor_us": times[-1] * 1e6}


def measure_memory(dtype, device: str, scale: int) -> dict:
    """A copy's bandwidth, a tiny kernel's floor, and each kernel kind's samples
    ``[kind, row, least bytes, s]``."""
    x = torch.empty(256 * MIB // 2 // scale, dtype=dtype, device=device)
    gb_per_s = 2 * x.numel() * x.element_size() / timed(lambda: x.mul(2.0), device) / 1e9
    tiny = torch.ones(8, device=device)
    floor = timed(lambda: tiny.add(1.0), device) * 1e6
    programs, runs = [], []
    for cols in KERNEL_ROWS:
        x = torch.randn(max(KERNEL_ELEMENTS // cols // scale, 1), cols, dtype=dtype,
                        device=device)
        y, w = torch.randn_like(x), torch.ones(cols, dtype=dtype, device=device)
        for kind, (call, elements) in KERNELS.items():
            programs.append((kind, cols, elements * x.numel() * x.element_size()))
            runs.append(lambda c=call, x=x, y=y, w=w: c(x, y, w))
    samples = [(*program, t) for program, t in
               zip(programs, timed_all(runs, device), strict=True)]
    return {"samples": samples, "floor_us": floor, "gb_per_s": gb_per_s}


def measure_compute(dtype, device: str, scale: int) -> dict:
    """The microbenchmarks' samples (what ``OUT/…-samples.json`` holds; :func:`fit_compute`
    fits them), measured on a GPU warmed up first."""
    warm_up(device)
    memory = measure_memory(dtype, device, scale)
    warm_up(device, 1.0)
    gemm = measure_gemms(dtype, device, scale)
    attention = measure_attention(dtype, device, scale)
    units = torch.cuda.get_device_properties(torch.cuda.current_device()
                                             ).multi_processor_count if device == "cuda" else 1
    return {"gemm [m, n, k, s]": gemm["samples"],
            "attention [b, h, s, d, s]": attention["samples"],
            "memory [kind, row, least bytes, s]": memory["samples"],
            "memory_gb_per_s": memory["gb_per_s"],
            "floors_us": {"gemm": gemm["floor_us"], "attention": attention["floor_us"],
                          "memory": memory["floor_us"]},
            "device": device, "units": units,
            "itemsize": torch.empty(0, dtype=dtype).element_size(),
            "timing": "CUDA events over loops of back-to-back calls, after a warm-up"
                      if device == "cuda" else "wall clock per call"}


def _floors_below_samples(samples: dict, floors: dict) -> dict:
    """``floors`` (us), each at most the fastest sample of its kind: a floor is the least a
    call takes, and a sample took that long (on the H200 at 15:26 the tiny GEMMs' median
    came out at 19.4 us while a 512^3 GEMM ran in 13.4 us: every small GEMM was then
    predicted 47-49% slow)."""
    kinds = {"gemm": "gemm [m, n, k, s]", "attention": "attention [b, h, s, d, s]",
             "memory": "memory [kind, row, least bytes, s]"}
    result = dict(floors)
    for kind, key in kinds.items():
        times = [row[-1] * 1e6 for row in samples.get(key, [])]
        if times and kind in result:
            result[kind] = min(result[kind], min(times))
    return result


def fit_compute(samples: dict, floors_us: dict | None = None) -> dict:
    """The fitted compute models from :func:`measure_compute`'s samples (also a recorded
    samples file: ``--refit``); ``floors_us`` for a file that has none."""
    floors = _floors_below_samples(samples, samples.get("floors_us") or floors_us)
    gpu = samples.get("device", "cuda") == "cuda"
    units = samples.get("units", 132 if gpu else 1)
    itemsize = samples.get("itemsize", 2)
    gb_per_s = samples["memory_gb_per_s"]
    memory_samples = [tuple(x) for x in samples["memory [kind, row, least bytes, s]"]]
    memory = MemoryFit(gb_per_s, floors["memory"], kernel_factors(memory_samples, gb_per_s))
    gemm_samples = [tuple(x) for x in samples["gemm [m, n, k, s]"]]
    gemm = fit_gemm(gemm_samples, GPU_TILES if gpu else [(1, 1)], units, floors["gemm"],
                    memory, itemsize)
    attention_samples = [tuple(x) for x in samples["attention [b, h, s, d, s]"]]
    attention = (fit_attention_blocks(attention_samples, floors["attention"],
                                      (units, 2 * units)) if gpu
                 else fit_attention(attention_samples, floors["attention"]))
    return {"memory": {"fit": memory, "samples": memory_samples},
            "gemm": {"fit": gemm, "samples": gemm_samples},
            "attention": {"fit": attention, "samples": attention_samples}}


def _figure(x: float) -> float:
    """``x`` to 4 significant digits (CPU figures are small)."""
    return float(f"{x:.4g}")


def compute_json(memory: dict, gemm: dict, attention: dict, source: str) -> dict:
    """The calibration's ``gemm``, ``attention`` and ``memory`` entries of fitted figures."""
    g, a, m = gemm["fit"], attention["fit"], memory["fit"]
    fitted = f"fitted to {{}} samples of benchmarks/calibrate_programs.py, {source}"
    return {
        "gemm": {"tflops": _figure(g.tflops), "tile": list(g.tile), "units": g.units,
                 **({"alternatives": [list(t) for t in g.alternatives]}
                    if g.alternatives else {}),
                 "tile_us": _figure(g.tile_us), "floor_us": _figure(g.floor_us),
                 "source": fitted.format(len(gemm["samples"]))},
        "attention": {"tflops": {str(d): _figure(r) for d, r in a.tflops.items()},
                      "seq_overhead": a.seq_overhead, "floor_us": _figure(a.floor_us),
                      **({"block": a.block, "slots": a.slots, "block_cost": a.block_cost}
                         if a.block else {}),
                      "source": fitted.format(len(attention["samples"]))},
        "memory": {"gb_per_s": _figure(m.gb_per_s), "floor_us": _figure(m.floor_us),
                   "kernels": {k: {str(r): _figure(f) for r, f in rows.items()}
                               for k, rows in m.kernels.items()},
                   "source": fitted.format(len(memory["samples"]))}}


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



def check(cal: dict, dtype, device: str, scale: int) -> dict:
    """Measured against predicted seconds for the check programs."""
    model = CostModel(from_dict(cal, "measured"))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    warm_up(device)  # as before the microbenchmarks: both phases measure alike
    programs = check_programs(scale)
    times = timed_all([make_call(name, family, shape, dtype, device)
                       for name, family, shape in programs], device)
    return _summary([_row(name, measured, predict(name, family, shape, model, itemsize))
                     for (name, family, shape), measured in zip(programs, times, strict=True)])


def _row(name: str, measured: float, predicted: float) -> dict:
    return {"variant": name, "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
            "error": predicted / measured - 1}


def _summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {"rows": rows, "median_abs_error": statistics.median(errors),
            "max_abs_error": max(errors), "within_15pct": sum(e <= 0.15 for e in errors)}


def offline(check_path: str, calibration: str | dict, itemsize: int = 2) -> dict:
    """A recorded check's measured times against ``calibration``'s predictions (a name, a
    path or a calibration's dict), computed here without a device (the programs at scale 1,
    as an H200 check runs them)."""
    model = CostModel(from_dict(calibration) if isinstance(calibration, dict)
                      else load(calibration))
    measured = {r["variant"]: r["measured_ms"] * 1e-3
                for r in json.loads(Path(check_path).read_text())["rows"]}
    rows = [_row(name, measured[name], predict(name, family, shape, model, itemsize))
            for name, family, shape in check_programs(1) if name in measured]
    return _summary(rows)


def refit(samples_path: str, base: str) -> dict:
    """The calibration ``base`` (a name or a path) with its compute figures fitted anew, here,
    to a recorded samples file (a file without floors keeps ``base``'s)."""
    data = json.loads((DATA / f"{base}.json" if not Path(base).suffix else Path(base))
                      .read_text())
    kept = {name: _plain(data[name]["floor_us"]) for name in ("gemm", "attention", "memory")}
    compute = fit_compute(json.loads(Path(samples_path).read_text()), kept)
    data.update(compute_json(compute["memory"], compute["gemm"], compute["attention"],
                             f"refitted offline to {samples_path}"))
    return data


def _plain(entry) -> float:
    return float(entry["value"] if isinstance(entry, dict) else entry)


def print_table(result: dict, title: str) -> None:
    print(title)
    for r in result["rows"]:
        print(f"{r['variant']:28s} measured {r['measured_ms']:9.4f} ms  predicted "
              f"{r['predicted_ms']:9.4f} ms  {r['error']:+.1%}")
    print(f"median |error| {result['median_abs_error']:.1%}, max "
          f"{result['max_abs_error']:.1%}, {result['within_15pct']}/{len(result['rows'])} "
          "within 15%")
    met = result["within_15pct"] == len(result["rows"]) and result["median_abs_error"] <= 0.05
    print(f"bar (issue 38: every variant within 15%, the median within 5%): "
          f"{'met' if met else 'NOT met'}")


def build(args, compute: dict, collectives: dict) -> dict:
    """The calibration: ``--base``'s with this run's measurements and their sources."""
    base = json.loads(Path(args.base).read_text()) if args.base else {}
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    world = dist.get_world_size() if dist.is_initialized() else 1
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    source = f"measured by benchmarks/calibrate.py on {world} x {name}, {when}, torch " \
             f"{torch.__version__}"
    cal = {k: v for k, v in base.items()
           if k not in ("attention_tflops", "memory_gb_per_s", "launch_us")}  # older form
    cal.update({"device": f"{name} ({world} measured)", "source": source,
                "dtype_bytes": torch.empty(0, dtype=_dtype(args)).element_size()})
    cal.update(compute_json(compute["memory"], compute["gemm"], compute["attention"], source))
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
    p.add_argument("--out", help="the calibration JSON to write")
    p.add_argument("--base", default=None, help="a calibration to keep unmeasured figures of")
    p.add_argument("--check", action="store_true", help="time 20 variants against the model")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, few sizes and calls: checks the script runs, measures "
                        "nothing worth keeping")
    p.add_argument("--offline", metavar="CHECK_JSON",
                   help="no measurement: predict a recorded check's variants from "
                        "--calibration and compare with its measured times")
    p.add_argument("--calibration", default="h200",
                   help="with --offline: a calibration name or path (default h200)")
    p.add_argument("--refit", metavar="SAMPLES_JSON",
                   help="with --offline: fit the compute figures anew to a recorded samples "
                        "file (the rest from --calibration) before predicting; with --out, "
                        "write that calibration")
    args = p.parse_args(argv)
    if args.offline:
        cal = refit(args.refit, args.calibration) if args.refit else args.calibration
        if args.refit and args.out:
            Path(args.out).write_text(json.dumps(cal, indent=1) + "\n")
        result = offline(args.offline, cal)
        source = f"refitted to {args.refit}" if args.refit else repr(args.calibration)
        print_table(result, f"OFFLINE: measured times recorded in {args.offline}; predicted "
                            f"now by the model from calibration {source}")
        return
    if not args.out:
        p.error("--out is required unless --offline")
    if args.quick:
        ITERS.update(iters=3, passes=1)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    began = time.perf_counter()
    scale = 64 if args.quick else 1 if args.device == "cuda" else CPU_SCALE
    sizes = SIZES[:2] if args.quick else SIZES if args.device == "cuda" else SIZES[:3]
    samples = measure_compute(_dtype(args), args.device, scale)
    compute = fit_compute(samples)
    collectives = measure_collectives(args.device, sizes) if dist.is_initialized() else {}
    cal = build(args, compute, collectives)
    from_dict(cal)  # the file reads back
    if rank == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(cal, indent=1) + "\n")
        out.with_name(out.stem + "-samples.json").write_text(json.dumps(samples, indent=1))
        print(f"wrote {out}")
        if args.check:
            result = check(cal, _dtype(args), args.device, scale)
            out.with_name(out.stem + "-check.json").write_text(json.dumps(result, indent=1))
            print_table(result, f"check: {len(result['rows'])} variants measured here "
                                "against the calibration just fitted")
    if rank == 0:
        print(f"calibrate: {time.perf_counter() - began:.0f} s")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
