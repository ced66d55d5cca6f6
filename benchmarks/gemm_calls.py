"""The GPT-3 layer's GEMM calls, meshfuse's against DTensor's, rank by rank, and their times
at the layer's real per-rank shapes on one device.

``PYTHONPATH=. python -m benchmarks.gemm_calls OUT`` (``--quick``: time the lists at the
recorded sizes, for a CPU):

1. Records (:mod:`benchmarks.gemm_record`) one forward + backward step of the ``gpt3_layer``
   case's ``dtensor_tp_sp`` and ``meshfuse_autograd_compiled`` on 2 CPU ranks (gloo, started
   here: no GPU is needed), bf16, at :data:`RECORD_SIZES`: small, with every extent of the
   layer's GEMMs distinct, so that each maps to one real extent. meshfuse's segments are
   compiled by Inductor's C++ backend (the interpreter's calls where no compiler is at hand;
   the GEMMs are outside the segments either way).
2. Writes ``OUT/gemm_calls.txt``: per rank, each list in program order with the collectives
   launched between the GEMMs (so which GEMMs run while one is in flight), then the calls
   only one of the two makes (as multisets of operand layouts).
3. Scales both ranks' lists to the case's :data:`~benchmarks.cases.gpt3.SIZES` and times them
   on this machine's device (CUDA; the CPU with ``--quick``): each list run back to back with
   an event between calls, DTensor's and meshfuse's alternated round by round; per call the
   median over rounds, paired by problem (output shape and contracted extent: an ``addmm``
   with its bias and the ``mm`` without it are one problem), and the totals' ratio (median
   of the per-round ratios). ``OUT/gemm_timing.txt`` and ``OUT/gemm_calls.json``.
4. On CUDA, a contention probe (``OUT/gemm_contention.txt``): each distinct GEMM of rank 0
   alone, and beside ``k`` one-block spinning kernels on side streams started just before
   it and spinning about as long as it runs, each holding one SM as an NCCL channel does:
   what a GEMM that runs while a collective is in flight loses.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import pickle
import statistics
import tempfile
import time
from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist

import meshfuse
from benchmarks import context
from benchmarks.cases.gpt3 import SIZES
from benchmarks.cp_probe import Clocks
from benchmarks.gemm_record import Event, GemmRecorder, gemms, replay, scaled
from benchmarks.harness import autograd_step
from benchmarks.timing import _sleep_cycles_per_ms
from meshfuse import launch
from meshfuse.examples.gpt import GptBlock, init_parameters
from meshfuse.examples.gpt_torch import Gpt3Block, parallelize

WORLD = 2
# Every extent of the layer's GEMMs differs from the others (s, s/d, e, e/d, 4e, 4e/d).
RECORD_SIZES = {"b": 1, "s": 48, "h": 4, "e": 80}
VARIANTS = ("dtensor", "meshfuse")
PROBE_BLOCKS = (8, 32)


def extents(small: dict, real: dict, world: int = WORLD) -> dict[int, int]:
    """Each extent of the layer at ``small`` sizes mapped to its counterpart at ``real``."""
    def named(z):
        s, e, h = z["s"], z["e"], z["h"]
        return {"s": s, "s/d": s // world, "e": e, "e/d": e // world, "4e": 4 * e,
                "4e/d": 4 * e // world, "h": h, "h/d": h // world, "e/h": e // h}

    small_n, real_n = named(small), named(real)
    mapping = {small_n[k]: real_n[k] for k in small_n}
    if len(mapping) != len(small_n):
        raise ValueError(f"extents of {small} coincide ({small_n}): pick other record sizes")
    return mapping


def layer_steps(ctx, sizes: dict, compile: bool) -> dict:
    """This rank's forward + backward step of DTensor's TP + SP layer and of meshfuse's
    derived-backward layer (as the gpt3_layer case builds them)."""
    from torch.distributed.tensor import DTensor, Shard

    b, s, e, heads = sizes["b"], sizes["s"], sizes["e"], sizes["h"]
    gen = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(b, s, e, generator=gen).to(torch.bfloat16) for _ in range(2))
    params = init_parameters(e, dtype=torch.bfloat16)
    dmesh = ctx.dtensor_mesh()
    module = parallelize(Gpt3Block(params, heads), dmesh)

    def dtensor_layer(local_x):
        return module(DTensor.from_local(local_x, dmesh, [Shard(1)])).to_local()

    def shard(t, axis=1):
        return t.chunk(ctx.world, axis)[ctx.rank].contiguous()

    block = GptBlock(b, s, e, heads, meshfuse.DataType.BFloat16,
                     meshfuse.DeviceMesh(range(ctx.world))).define()
    function = block.as_autograd_function(compile=compile)
    local = [meshfuse.shard_tensor(t, tv)
             for t, tv in zip((x, *params.values()), (block.x, *block.params.values()))]
    return {
        "dtensor": autograd_step(dtensor_layer, [shard(x)], shard(dy), module.parameters()),
        "meshfuse": autograd_step(lambda *leaves: function(leaves)[0], local,
                                  meshfuse.shard_tensor(dy, block.y)),
    }


def _inductor_compiles() -> str | None:
    """None where Inductor compiles for the CPU here (a C++ compiler is at hand), else why
    not; every rank learns whether all of them can."""
    try:
        torch.compile(lambda t: t * 2 + 1, backend="inductor")(torch.ones(4))
        why = None
    except Exception as e:  # noqa: BLE001 - no compiler: the interpreter, said so
        why = f"{type(e).__name__}: {str(e)[:200]}".replace("\n", " ")
    able = torch.tensor([0 if why else 1])
    dist.all_reduce(able, op=dist.ReduceOp.MIN)
    return why or (None if able.item() else "another rank cannot compile")


def record_rank(path: str, sizes: dict = RECORD_SIZES) -> None:
    """On each rank of a launched job: records both variants' calls (their third step: the
    first compiles, the second runs from the caches) into ``path.rank<r>`` (a pickle)."""
    ctx = context.setup(quick=True)
    why_not = _inductor_compiles()
    how = ("compiled segments (Inductor, C++)" if why_not is None else
           f"interpreter (Inductor could not compile: {why_not})")
    steps = layer_steps(ctx, sizes, compile=why_not is None)
    lists = {}
    for name in VARIANTS:
        steps[name]()
        steps[name]()
        with GemmRecorder() as recorder:
            steps[name]()
        lists[name] = recorder.events
    with open(f"{path}.rank{ctx.rank}", "wb") as f:
        pickle.dump({"lists": lists, "meshfuse": how}, f)
    context.teardown()


def extract(workdir: str, world: int = WORLD) -> tuple[list[dict[str, list[Event]]], str]:
    """Both variants' events on each of ``world`` CPU ranks started here (the GPUs hidden
    from them); and how meshfuse's segments ran."""
    path = os.path.join(workdir, "events")
    hidden = {"CUDA_VISIBLE_DEVICES": "", "MESHFUSE_BACKEND": "gloo"}
    with mock.patch.dict(os.environ, hidden):
        codes = launch.spawn(world, ["-m", "benchmarks.gemm_calls", "--record", path])
    if any(codes):
        raise RuntimeError(f"recording ranks exited with {codes}")
    loaded = []
    for r in range(world):
        with open(f"{path}.rank{r}", "rb") as f:
            loaded.append(pickle.load(f))
    return [d["lists"] for d in loaded], loaded[0]["meshfuse"]


def differences(lists: dict[str, list[Event]]) -> list[str]:
    """The GEMM calls (op and operand layouts) only one variant makes, with their counts."""
    counts = {n: Counter(e.describe() for e in gemms(lists[n])) for n in VARIANTS}
    lines = []
    for a, b in (VARIANTS, VARIANTS[::-1]):
        for call, n in sorted((counts[a] - counts[b]).items()):
            lines.append(f"  only {a} ({n}x): {call}")
    return lines or ["  none: the same calls with the same operand layouts"]


def listing(per_rank: list[dict[str, list[Event]]], how: str) -> str:
    lines = [(f"GEMM calls of one forward + backward step at {RECORD_SIZES}, bf16, "
             f"{len(per_rank)} CPU ranks; meshfuse ran {how}"), ""]
    for r, lists in enumerate(per_rank):
        for name in VARIANTS:
            lines.append(f"rank {r}, {name}: {len(gemms(lists[name]))} GEMMs")
            lines += [f"  {e.describe()}" for e in lists[name]]
        lines += [f"rank {r}, differences:", *differences(lists), ""]
    return "\n".join(lines) + "\n"


def pairs(base: list[Event], other: list[Event]) -> list[tuple[int | None, int | None]]:
    """Indices of ``base`` and ``other`` paired by problem, in order (None: unpaired)."""
    free = list(range(len(base)))
    result = []
    for j, e in enumerate(other):
        i = next((i for i in free if base[i].problem() == e.problem()), None)
        if i is not None:
            free.remove(i)
        result.append((i, j))
    return result + [(i, None) for i in free]


def _run_once(calls, cuda: bool) -> list[float]:
    """Milliseconds of each call, the calls back to back."""
    if not cuda:
        times = []
        for call in calls:
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
    events[0].record()
    for call, event in zip(calls, events[1:]):
        call()
        event.record()
    events[-1].synchronize()
    return [a.elapsed_time(b) for a, b in itertools.pairwise(events)]


def time_lists(calls: dict[str, list], rounds: int, warmup: int, cuda: bool) -> dict:
    """Per variant, per round, each call's milliseconds; the variants alternate which goes
    first from round to round (a drift of the clock hits both alike)."""
    samples = {n: [] for n in calls}
    for round_ in range(warmup + rounds):
        order = list(calls) if round_ % 2 == 0 else list(calls)[::-1]
        for name in order:
            times = _run_once(calls[name], cuda)
            if round_ >= warmup:
                samples[name].append(times)
    return samples


def timing_report(rank: int, lists: dict[str, list[Event]], samples: dict) -> tuple[list, dict]:
    base, other = (gemms(lists[n]) for n in VARIANTS)
    median = {n: [statistics.median(t[i] for t in samples[n]) for i in range(len(g))]
              for n, g in zip(VARIANTS, (base, other))}
    totals = {n: [sum(t) for t in samples[n]] for n in VARIANTS}
    ratio = statistics.median(m / d for d, m in zip(totals["dtensor"], totals["meshfuse"]))
    lines = [(f"rank {rank}: total dtensor {statistics.median(totals['dtensor']):.3f} ms, "
             f"meshfuse {statistics.median(totals['meshfuse']):.3f} ms, meshfuse/dtensor "
             f"{ratio:.4f} (median of {len(totals['dtensor'])} per-round ratios)")]
    rows = []
    for i, j in pairs(base, other):
        d = median["dtensor"][i] if i is not None else None
        m = median["meshfuse"][j] if j is not None else None
        call = (other[j] if j is not None else base[i])
        shown = f"{d:8.3f}" if d is not None else "       -"
        shown += f" {m:8.3f}" if m is not None else "        -"
        shown += f" {m / d:7.4f}" if None not in (d, m) else "       -"
        same = i is not None and j is not None and base[i].describe() == other[j].describe()
        lines.append(f"  {shown}  {call.describe()}" +
                     ("" if same or i is None or j is None else
                      f"  (dtensor: {base[i].describe()})"))
        rows.append({"dtensor_ms": d, "meshfuse_ms": m, "call": call.describe(),
                     "dtensor_call": base[i].describe() if i is not None else None})
    return lines, {"ratio": ratio, "calls": rows,
                   **{f"{n}_ms": statistics.median(totals[n]) for n in VARIANTS}}


def _replays(events: list[Event], mapping, device) -> list:
    gen = torch.Generator(device).manual_seed(0)
    return [replay(scaled(e, mapping) if mapping else e, device, gen) for e in gemms(events)]


def contention(ctx, events: list[Event], mapping, reps: int = 5) -> list[str]:
    """Each distinct GEMM alone and beside ``k`` one-block spinning kernels (CUDA)."""
    lines = [("GEMM alone and beside k one-block spinning kernels on side streams (ms; "
             f"median of {reps}): each spin lasts the GEMM's time alone")]
    streams = [torch.cuda.Stream(ctx.device) for _ in range(max(PROBE_BLOCKS))]
    seen = set()
    for event in gemms(events):
        if event.describe() in seen:
            continue
        seen.add(event.describe())
        call = _replays([event], mapping, ctx.device)[0]
        alone = statistics.median(_run_once([call], True)[0] for _ in range(reps + 2))
        cycles = int(alone * _sleep_cycles_per_ms(ctx))
        beside = []
        for k in PROBE_BLOCKS:
            times = []
            for _ in range(reps):
                ctx.sync()
                for stream in streams[:k]:
                    with torch.cuda.stream(stream):
                        torch.cuda._sleep(cycles)
                times.append(_run_once([call], True)[0])
            beside.append(f"k={k}: {statistics.median(times):.3f} "
                          f"({statistics.median(times) / alone:.2f}x)")
        ctx.sync()
        shown = scaled(event, mapping).describe() if mapping else event.describe()
        lines.append(f"  alone {alone:.3f}; {'; '.join(beside)}  {shown}")
    return lines


def bias_probe(ctx, events: list[Event], mapping, rounds: int) -> list[str]:
    """Each distinct ``addmm`` of ``events`` against the ``mm`` of its operands without the
    bias (what a rank whose partial result leaves the bias out called before it added a
    zero bias), timed interleaved."""
    with_bias, seen = [], set()
    for event in gemms(events):
        if event.op == "addmm.default" and event.describe() not in seen:
            seen.add(event.describe())
            with_bias.append(scaled(event, mapping) if mapping else event)
    without = [dataclasses.replace(e, op="mm.default", args=e.args[1:3]) for e in with_bias]
    calls = {"addmm": _replays(with_bias, None, ctx.device),
             "mm": _replays(without, None, ctx.device)}
    samples = time_lists(calls, rounds, 2, ctx.cuda)
    lines = ["addmm with its bias against mm without it (ms, median; mm/addmm):"]
    for i, event in enumerate(with_bias):
        a, m = (statistics.median(t[i] for t in samples[n]) for n in ("addmm", "mm"))
        lines.append(f"  {a:8.3f} {m:8.3f} {m / a:7.4f}  {event.describe()}")
    return lines


def time_ranks(ctx, per_rank, mapping, rounds: int, warmup: int) -> tuple[list[str], list]:
    """Both variants' lists of each rank timed interleaved; the report's lines and data."""
    lines = [(f"GEMM lists at {SIZES if mapping else RECORD_SIZES} per rank on {ctx.device} "
             "(ms, median over rounds): dtensor, meshfuse, meshfuse/dtensor, the call"), ""]
    data = []
    for rank, lists in enumerate(per_rank):
        calls = {n: _replays(lists[n], mapping, ctx.device) for n in VARIANTS}
        samples = time_lists(calls, rounds, warmup, ctx.cuda)
        shown = {n: [scaled(e, mapping) if mapping and e.kind == "gemm" else e
                     for e in lists[n]] for n in VARIANTS}  # the calls as timed
        rank_lines, rank_data = timing_report(rank, shown, samples)
        lines += [*rank_lines, ""]
        data.append(rank_data)
        del calls
        torch.cuda.empty_cache() if ctx.cuda else None
    return lines, data


def _jsonable(per_rank: list[dict[str, list[Event]]]) -> list:
    return [{n: [e.describe() for e in lists[n]] for n in VARIANTS} for lists in per_rank]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="the directory the results go to")
    parser.add_argument("--quick", action="store_true",
                        help="time the lists at the recorded sizes (a CPU run)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--record", help=argparse.SUPPRESS)  # a recording rank's file stem
    args = parser.parse_args(argv)
    if args.record:
        return record_rank(args.record)
    if not args.out:
        parser.error("give the directory the results go to")
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        per_rank, how = extract(workdir)
    text = listing(per_rank, how)
    with open(os.path.join(args.out, "gemm_calls.txt"), "w") as f:
        f.write(text)
    print(text)
    ctx = context.setup(quick=args.quick)
    mapping = None if args.quick else extents(RECORD_SIZES, SIZES)
    rounds = args.rounds or (3 if args.quick else 15)
    clocks = Clocks(ctx.device) if ctx.cuda else None
    with clocks or contextlib.nullcontext():
        lines, data = time_ranks(ctx, per_rank, mapping, rounds, warmup=1 if args.quick else 3)
    if clocks:
        lines.append(f"SM clock and power while the lists ran: {clocks.summary()}")
    lines += ["", *bias_probe(ctx, per_rank[0]["dtensor"], mapping, rounds)]
    if ctx.cuda:
        lines += ["", *contention(ctx, per_rank[0]["meshfuse"], mapping)]
    with open(os.path.join(args.out, "gemm_timing.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "gemm_calls.json"), "w") as f:
        json.dump({"calls": _jsonable(per_rank), "timing": data, "meshfuse": how,
                   "environment": context.environment(ctx)}, f, indent=1, default=str)
    print("\n".join(lines))
    context.teardown()


if __name__ == "__main__":
    main()
