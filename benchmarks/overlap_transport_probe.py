"""Does a copy-engine transport hide the linear layers' communications under their GEMMs?
(issue 18; a diagnostic with direct calls, not a benchmark case)

``torchrun --nproc-per-node 2 -m benchmarks.overlap_transport_probe --out DIR``: at nvFuser's
overlap sizes (t = h = 8192, bf16), per layer, the median time of 20 steps (CUDA events,
the slowest rank's) of:

- ``gemm_only``: the layer's GEMM alone (the floor: no communication);
- ``nccl``: the communication whole then the GEMM (or the GEMM then it), NCCL;
- ``torch_fused``: torch's async-TP op (``torch.ops.symm_mem.fused_all_gather_matmul``,
  ``fused_matmul_reduce_scatter``): copy-engine pulls under GEMM chunks;
- ``copy_engine_loop``: meshfuse's copy-engine transport
  (:mod:`meshfuse.runtime.comm.copy_engine`) driving one GEMM per block, as a stream loop does;
  for the column layer also ``copy_engine_loop_early`` (the pulls issued before the own
  block's GEMM, not after it), ``copy_engine_two_streams`` (every other block's GEMM on a
  side stream, as torch's fused op runs them), ``copy_engine_barrier_aside`` (the staging
  barrier on the copy stream: the own block's GEMM does not wait for the other ranks) and
  ``copy_engine_push`` / ``copy_engine_push_early`` (each rank pushes its shard into the
  peers' workspaces after / before issuing its own block's GEMM: no staging copy, no barrier
  before that GEMM; one barrier before the other blocks');
- ``async_tp_compiled``: ``torch.compile`` with ``_micro_pipeline_tp`` over the functional
  collective and the matmul.

Layers: ``column`` (allgather of the tokens, then ``x @ w.T`` with ``w`` split on its rows),
``row_sp`` (``x @ w.T`` with the contracted axis split, then a reduce-scatter of the tokens)
and ``row`` (the same GEMM, then an allreduce: as ``nccl``, and as ``fused_rs_then_ag``:
torch's fused reduce-scatter, then a NCCL allgather).

Writes ``DIR/api.txt`` (what torch offers), ``DIR/probe.txt`` (the times and checks) and
``DIR/overlap_profile.txt`` (per variant, from a profile of one step: the copies' and NCCL
kernels' time, and how much of it ran while a GEMM ran).
"""

from __future__ import annotations

import argparse
import os
import statistics
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

from benchmarks import context
from benchmarks.timing import cuda_kernel_events, timed_samples
from meshfuse.runtime.comm import copy_engine
from meshfuse.runtime.comm.collectives import Group

ITERS, WARMUP = 20, 5


def api_lines() -> list[str]:
    """What this torch offers for async TP."""
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    lines = [f"torch {torch.__version__}, cuda {torch.version.cuda}, nccl {nccl}"]
    for name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter",
                 "_low_contention_all_gather", "_low_contention_reduce_scatter",
                 "get_remote_tensors"):
        lines.append(f"torch.ops.symm_mem.{name}: {hasattr(torch.ops.symm_mem, name)}")
    for name in ("enable_symm_mem_for_group", "get_symm_mem_workspace", "empty", "rendezvous",
                 "_pipelined_all_gather_and_consume", "_pipelined_produce_and_all2all",
                 "is_nvshmem_available", "get_backend", "set_backend"):
        lines.append(f"symm_mem.{name}: {hasattr(symm_mem, name)}")
    for call in ("is_nvshmem_available()", "get_backend(torch.device('cuda'))"):
        try:
            lines.append(f"symm_mem.{call} = {eval('symm_mem.' + call)}")
        except Exception as error:  # noqa: BLE001 (a probe reports whatever fails)
            lines.append(f"symm_mem.{call}: {type(error).__name__}: {error}")
    from torch._C._distributed_c10d import _SymmetricMemory
    lines.append("_SymmetricMemory: " + ", ".join(m for m in dir(_SymmetricMemory)
                                                   if not m.startswith("__")))
    from torch._inductor import config
    lines.append(f"inductor config _micro_pipeline_tp: {hasattr(config, '_micro_pipeline_tp')}")
    return lines


def _median_ms(ctx, step) -> float:
    for _ in range(WARMUP):
        step()
    mine = statistics.median(timed_samples(ctx, step, ITERS))
    return max(ctx.gather(mine))


def _overlap_line(step, pulls: list | None = None) -> str:
    """From a profile of one step: copies' and NCCL kernels' time, and the share under GEMMs;
    the peer copies' durations (us) are appended to ``pulls``."""
    events = cuda_kernel_events(step)
    if pulls is not None:
        pulls += [e.time_range.end - e.time_range.start for e in events
                  if "memcpy ptop" in e.name.lower()]
    moving = [e for e in events if "nccl" in e.name.lower() or "memcpy" in e.name.lower()]
    gemms = [e for e in events if any(k in e.name.lower() for k in ("gemm", "sm90", "cutlass",
                                                                     "nvjet"))]
    total = sum(e.time_range.end - e.time_range.start for e in moving)
    covered = sum(max(0.0, min(m.time_range.end, g.time_range.end) -
                      max(m.time_range.start, g.time_range.start))
                  for m in moving for g in gemms)
    names = sorted({e.name[:60] for e in moving})
    return (f"transfers {total / 1e3:.3f} ms, {covered / max(total, 1e-9):.0%} under GEMMs "
            f"({len(gemms)} GEMM kernels); {names}\n    timeline (us from the first): "
            + _timeline(moving + gemms + [e for e in events if "barrier" in e.name.lower()]))


def _timeline(events) -> str:
    """``name start-end`` of ``events`` in start order, in microseconds from the first."""
    if not events:
        return "-"
    events = sorted(events, key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start
    short = {"memcpy ptop": "PtoP", "memcpy dtod": "DtoD", "barrier": "barrier",
             "nccl": "nccl"}
    parts = []
    for e in events:
        name = next((v for k, v in short.items() if k in e.name.lower()), "gemm")
        parts.append(f"{name} {e.time_range.start - t0:.0f}-{e.time_range.end - t0:.0f}")
    return ", ".join(parts)


def _group(ctx) -> Group:
    world = dist.group.WORLD
    return Group(world, tuple(range(ctx.world)), ctx.rank, 0)


def _compiled(kind, x, w, group_name):
    import torch.distributed._functional_collectives as funcol
    from torch._inductor import config as inductor_config

    def column(x_local, weight):
        return torch.matmul(funcol.all_gather_tensor(x_local, 0, group_name), weight.t())

    def row_sp(x_local, weight):
        return funcol.reduce_scatter_tensor(torch.matmul(x_local, weight.t()), "sum", 0,
                                            group_name)

    with inductor_config.patch(_micro_pipeline_tp=True):
        compiled = torch.compile(column if kind == "column" else row_sp, fullgraph=True)
        compiled(x, w)
    return lambda: compiled(x, w)


def column_variants(ctx, t, h, dtype):
    d, group = ctx.world, _group(ctx)
    name = dist.group.WORLD.group_name
    gen = torch.Generator(ctx.device).manual_seed(0)
    x = torch.randn(t // d, h, generator=gen, device=ctx.device, dtype=dtype) * h ** -0.5
    w = torch.randn(4 * h // d, h, generator=gen, device=ctx.device, dtype=dtype) * h ** -0.5
    full = torch.empty(t, h, device=ctx.device, dtype=dtype)
    out = torch.empty(t, 4 * h // d, device=ctx.device, dtype=dtype)
    shapes = [tuple(x.shape)] * d

    def nccl():
        dist.all_gather_into_tensor(full, x)
        return torch.matmul(full, w.t(), out=out)

    def loop(early: bool = False, side: torch.cuda.Stream | None = None, aside: bool = False):
        gathering = copy_engine.Gathering(x, group, shapes, place=0, barrier_aside=aside)
        if early:  # the pulls issued before the own block's GEMM (session 8's order)
            gathering.issue()
        main = torch.cuda.current_stream()
        if side is not None:  # after the staging, before the own block's GEMM (as torch)
            side.wait_stream(main)
        for i in range(d):
            b = (ctx.rank + i) % d
            stream = side if side is not None and i % 2 else main
            with torch.cuda.stream(stream):
                torch.matmul(gathering.block(b), w.t(),
                             out=out[b * (t // d):(b + 1) * (t // d)])
        if side is not None:
            main.wait_stream(side)
        gathering.finish()
        return out

    side = torch.cuda.Stream(ctx.device)
    q = t // d
    slot_bytes = x.numel() * x.element_size()

    def push(early: bool = False):
        """Each rank pushes its shard into every peer's workspace (no staging copy, no
        barrier before the own block's GEMM); one barrier, once the pushes have landed,
        before the other blocks' GEMMs. Block ``c`` lands at the receiver ``r`` in slot
        ``(c - r - 1) mod d``."""
        me, main = ctx.rank, torch.cuda.current_stream()
        space = copy_engine.next_workspace(group, "push", slot_bytes * (d - 1), ctx.device)
        copier = copy_engine._copy_stream(ctx.device)
        ready = torch.cuda.Event()
        ready.record(main)  # the shard is written: the pushes need not wait for the GEMM

        def issue():
            copier.wait_event(ready)
            with torch.cuda.stream(copier):
                for s in range(1, d):  # the peer that works on this block soonest first
                    receiver = (me - s) % d
                    space.remote(copy_engine.peer(group, receiver),
                                 ((me - receiver - 1) % d) * slot_bytes, x.shape,
                                 x.dtype).copy_(x)
            pushed = torch.cuda.Event()
            pushed.record(copier)
            return pushed

        pushed = issue() if early else None
        torch.matmul(x, w.t(), out=out[me * q:(me + 1) * q])
        if pushed is None:
            pushed = issue()
        main.wait_event(pushed)
        space.barrier()
        for i in range(1, d):
            b = (me + i) % d
            block = space.local(((b - me - 1) % d) * slot_bytes, x.shape, x.dtype)
            torch.matmul(block, w.t(), out=out[b * q:(b + 1) * q])
        return out

    return {
        "gemm_only": lambda: torch.matmul(full, w.t(), out=out),
        "nccl": nccl,
        "torch_fused": lambda: torch.ops.symm_mem.fused_all_gather_matmul(
            x, [w.t()], 0, name, return_A=False)[1][0],
        "copy_engine_loop": loop,
        "copy_engine_loop_early": lambda: loop(early=True),
        "copy_engine_two_streams": lambda: loop(side=side),
        "copy_engine_barrier_aside": lambda: loop(aside=True),
        "copy_engine_push": push,
        "copy_engine_push_early": lambda: push(early=True),
        "async_tp_compiled": lambda: _compiled("column", x, w, name),
    }, nccl


def row_variants(ctx, t, h, dtype, kind):
    d, group = ctx.world, _group(ctx)
    name = dist.group.WORLD.group_name
    gen = torch.Generator(ctx.device).manual_seed(1)
    x = torch.randn(t, 4 * h // d, generator=gen, device=ctx.device, dtype=dtype) * h ** -0.5
    w = torch.randn(h, 4 * h // d, generator=gen, device=ctx.device, dtype=dtype) * h ** -0.5
    scattered = torch.empty(t // d, h, device=ctx.device, dtype=dtype)
    gathered = torch.empty(t, h, device=ctx.device, dtype=dtype)
    shapes = [(t // d, h)] * d

    def gemm():
        return torch.matmul(x, w.t())

    def nccl():
        partial = torch.matmul(x, w.t())
        if kind == "row":
            dist.all_reduce(partial)
            return partial
        dist.reduce_scatter_tensor(scattered, partial)
        return scattered

    def fused():
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w.t(), "sum", 0, name)

    def fused_then_ag():
        dist.all_gather_into_tensor(gathered, fused())
        return gathered

    def loop():
        reducing = copy_engine.Reducing(group, shapes, dtype, "sum", 1, ctx.device)
        mine = None
        for b in reducing.order(ctx.rank, d):
            xb = x[b * (t // d):(b + 1) * (t // d)]
            target = reducing.target(b)
            partial = torch.matmul(xb, w.t()) if target is None else \
                torch.matmul(xb, w.t(), out=target)
            result = reducing.partial(b, partial)
            if b == ctx.rank:
                mine = result
        reducing.finish()
        return mine

    if kind == "row":
        return {"gemm_only": gemm, "nccl": nccl, "fused_rs_then_ag": fused_then_ag}, nccl
    return {"gemm_only": gemm, "nccl": nccl, "torch_fused": fused, "copy_engine_loop": loop,
            "async_tp_compiled": lambda: _compiled("row_sp", x, w, name)}, nccl


def calibration_line(layer: str, times: dict, pulls: list, flops: float, block_bytes: float,
                     d: int) -> str:
    """The copy-engine figures of :mod:`meshfuse.parallel.overlap.cost` that this layer's
    times give: GEMM TFLOP/s (``gemm_only``), the pulls' GB/s (the profile's peer copies), and
    what the loop took beyond the model's overlap ``max(t_g, t_c + t_g / d)``, as a cost per
    chunk (contention 0) and as a contention (no cost per chunk)."""
    if "gemm_only" not in times or "copy_engine_loop" not in times or not pulls:
        return f"{layer} calibration: needs gemm_only, copy_engine_loop and a profiled pull"
    t_g = times["gemm_only"]
    pull_ms = statistics.median(pulls) / 1e3
    t_c = pull_ms * (d - 1)
    extra = times["copy_engine_loop"] - max(t_g, t_c + t_g / d)
    return (f"{layer} calibration: GEMM {flops / t_g / 1e9:.0f} TFLOP/s, pulls "
            f"{block_bytes / pull_ms / 1e6:.0f} GB/s ({pull_ms:.3f} ms per block), loop "
            f"{extra * 1e3:+.0f} us beyond the model's overlap: {extra * 1e3 / d:+.0f} us per "
            f"chunk, or a contention of {extra / min(t_g, t_c):+.2f}")


def probe_layer(ctx, layer: str, variants, reference, lines, profile_lines,
                size: tuple[float, float] | None = None) -> None:
    """Times and profiles each variant; ``size``: (GEMM FLOPs, bytes of one block) of the
    layer, for a calibration line."""
    expected = reference().clone()
    times, pulls = {}, []
    for variant, make in variants.items():
        try:
            step = make() if variant == "async_tp_compiled" else make
            got = step()
            err = (got.float() - expected.float()).abs().max().item() \
                if variant != "gemm_only" else 0.0
            ms = _median_ms(ctx, step)
            times[variant] = ms
            base = times.get("nccl")
            ratio = f", {base / ms:.3f}x faster than nccl" if base else ""
            lines.append(f"{layer} {variant}: {ms:.3f} ms{ratio}; max abs err vs nccl {err:.2e}")
            profile_lines.append(f"{layer} {variant}: " + _overlap_line(
                step, pulls if variant == "copy_engine_loop" else None))
        except Exception as error:  # noqa: BLE001 (a probe reports each failure, goes on)
            lines.append(f"{layer} {variant}: FAILED {type(error).__name__}: {error}")
            traceback.print_exc()
        if ctx.rank == 0:
            print(lines[-1], flush=True)
    if size is not None:
        lines.append(calibration_line(layer, times, pulls, *size, ctx.world))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--layers", default="column,row_sp,row")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variants to run (default: all)")
    args = parser.parse_args()
    ctx = context.setup(quick=False)
    os.makedirs(args.out, exist_ok=True)
    if ctx.rank == 0:
        with open(os.path.join(args.out, "api.txt"), "w") as f:
            f.write("\n".join(api_lines()) + "\n")
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed by older torch (the fused ops), deprecated in newer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(dist.group.WORLD.group_name)
    t, h, dtype = args.tokens, args.hidden, torch.bfloat16
    lines = [f"t={t} h={h} bf16, {ctx.world} ranks; median of {ITERS} steps, slowest rank"]
    profile_lines: list[str] = []
    for layer in args.layers.split(","):
        if layer == "column":
            variants, reference = column_variants(ctx, t, h, dtype)
        else:
            variants, reference = row_variants(ctx, t, h, dtype, layer)
        if args.variants:
            variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
        # both layers: a GEMM of 2 t h (4h / d) FLOPs, blocks of t / d rows of h
        size = (2.0 * t * h * 4 * h / ctx.world, t // ctx.world * h * dtype.itemsize)
        probe_layer(ctx, layer, variants, reference, lines, profile_lines,
                    size if layer != "row" else None)
    if ctx.rank == 0:
        with open(os.path.join(args.out, "probe.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "overlap_profile.txt"), "w") as f:
            f.write("\n".join(profile_lines) + "\n")
    context.teardown()


if __name__ == "__main__":
    main()
