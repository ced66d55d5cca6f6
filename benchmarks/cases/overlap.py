"""Issue 18: communication hidden under GEMMs by stream-parallel loops (nvFuser's overlap
benchmarks: ``tests/python/multidevice/test_overlap.py``), forward only, bf16.

Three configurations at nvFuser's sizes (h = 8192, t = 8192 tokens):

- ``row``: row-parallel linear ``out[t, h] = x[t, 4h] @ w[h, 4h].T`` with the contracted
  ``4h`` sharded: a partial product allreduced. Variants: ``torch`` (baseline: ``mm`` then
  ``all_reduce``, what runs without overlap), ``meshfuse`` (the same fusion without a stream
  axis, ``set_overlap(False)``), ``meshfuse_auto`` (no stream axis: the engine's estimate
  decides whether the GEMM and its allreduce run as a loop of row chunks, by the copy
  engines: ``docs/overlap.md``), ``meshfuse_s{2,4}`` (the tokens of x on ``ParallelType.stream``: s chunks, each its
  GEMM written into its block then allreduced in place, on its own stream), ``torch_s{2,4}``
  (nvFuser's hand-written reference: the same chunks on a stream pool, direct calls), and
  ``torch_async_tp`` (recorded as skipped: ``_micro_pipeline_tp`` decomposes
  allgather->matmul and matmul->reduce-scatter, not an allreduce).
- ``row_sp``: the same GEMM in a sequence-parallel layer: its output reduce-scattered onto
  the tokens. Variants: ``torch`` (baseline: ``mm`` then ``reduce_scatter_tensor``),
  ``meshfuse`` (``set_overlap(False)``), ``meshfuse_auto`` (the engine's cost estimate
  decides), ``meshfuse_overlap`` (``set_overlap(True)``: d chunks, each reduced onto its
  owner, over NCCL), ``meshfuse_overlap_copy_engine`` (the same loop, its partial blocks
  pulled by the copy engines through symmetric memory: :mod:`meshfuse.runtime.comm.copy_engine`),
  ``torch_fused`` (``torch.ops.symm_mem.fused_matmul_reduce_scatter`` called directly) and
  ``torch_async_tp`` (micro-pipeline TP over matmul + reduce-scatter).
Each meshfuse variant fixes its loops' transport (``MESHFUSE_OVERLAP_TRANSPORT``) while its
program is built: ``process_group`` (NCCL) but where named ``copy_engine``, and for
``meshfuse_auto`` (the estimate then uses the copy engines' figures).

- ``column``: sequence-parallel column linear ``out[t, 4h/d] = allgather(x[t/d, h]) @
  w[4h/d, h].T``. Variants: ``torch`` (baseline: ``all_gather_into_tensor`` then ``mm``),
  ``meshfuse`` (no stream axis, ``set_overlap(False)``), ``meshfuse_auto`` (no stream
  axis: the engine's cost estimate decides; metric ``loops``), ``meshfuse_permute`` (the gathered x on stream with
  ``swizzle1d``: d GEMMs, d-1 point-to-point transfers under them), ``meshfuse_broadcast``
  (the same with one broadcast per block), ``meshfuse_copy_engine`` (the ring-order loop
  with its blocks pulled by the copy engines), ``torch_fused``
  (``torch.ops.symm_mem.fused_all_gather_matmul`` called directly) and ``torch_async_tp``
  (``torch.compile`` with
  ``torch._inductor.config._micro_pipeline_tp = True`` over a functional allgather and a
  matmul; symmetric memory enabled for the group; its metric ``fused`` says whether
  Inductor emitted ``fused_all_gather_matmul``).

Ratios are median times over ``torch``'s (below 1: faster than no overlap). In each
configuration the estimate's choice and the loops (``row``: the stream axes; ``row_sp``,
``column``: the copy-engine loop and torch's async TP) are also timed interleaved with
``meshfuse`` without overlap (metric ``interleaved_ratio``: their time over its).
"""

from __future__ import annotations

import os
import warnings
from unittest import mock

import torch
import torch.distributed as dist

import meshfuse
from benchmarks.context import Context
from benchmarks.harness import (
    Plan,
    Record,
    Skip,
    Variant,
    check_close,
    interleave,
    kept,
    run_variants,
    skipped,
)
from meshfuse import DataType, FusionDefinition, ParallelType

SIZES = {"tokens": 8192, "hidden": 8192}
QUICK_SIZES = {"tokens": 32, "hidden": 8}
TOL = 2e-2  # bf16, relative: partial sums reduced in another order
CHUNKS = (2, 4)


def _randn(ctx: Context, *shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(ctx.device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=ctx.device, dtype=dtype) * shape[-1] ** -0.5


def _block(x: torch.Tensor, axis: int, ctx: Context) -> torch.Tensor:
    return x.chunk(ctx.world, axis)[ctx.rank].contiguous()


def row_fusion(ctx: Context, tokens: int, hidden: int, chunks: int | None, dtype: DataType,
               overlap: bool | None = None):
    """nvFuser's row-parallel linear; ``chunks`` None: no stream axis (``overlap``:
    ``set_overlap``'s choice of an allreduce loop)."""
    mesh = meshfuse.DeviceMesh(range(ctx.world))
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, 4 * hidden], dtype=dtype)
        w = fd.define_tensor([hidden, 4 * hidden], dtype=dtype)
        fd.add_output(fd.ops.linear(x, w))
    for tv in (x, w):
        tv.set_device_mesh(mesh)
    if chunks is not None:
        x.outer_split(0, chunks)
        x.axis(0).parallelize(ParallelType.stream)
    else:
        x.set_overlap(overlap)
    x.outer_split(-1, ctx.world)
    x.axis(-2).parallelize(ParallelType.mesh_x)
    w.outer_split(1, ctx.world)
    w.axis(1).parallelize(ParallelType.mesh_x)
    return fd


def row_sp_fusion(ctx: Context, tokens: int, hidden: int, overlap: bool | None,
                  dtype: DataType):
    """The row-parallel linear of a sequence-parallel layer: its output sharded on the
    tokens (a reduce-scatter); ``overlap`` is ``set_overlap``'s choice."""
    mesh = meshfuse.DeviceMesh(range(ctx.world))
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, 4 * hidden], dtype=dtype)
        w = fd.define_tensor([hidden, 4 * hidden], dtype=dtype)
        out = fd.ops.linear(x, w)
        fd.add_output(out)
    for tv, axis in ((x, 1), (w, 1), (out, 0)):
        tv.set_device_mesh(mesh)
        tv.outer_split(axis, ctx.world)
        tv.axis(axis).parallelize(ParallelType.mesh_x)
    x.set_overlap(overlap)
    return fd


def column_fusion(ctx: Context, tokens: int, hidden: int, order: str | None, dtype: DataType):
    """nvFuser's column-parallel linear after a sequence-parallel allgather; ``order``:
    None (no stream axis, no loop), ``"auto"`` (no stream axis: the engine's cost estimate
    decides), ``"permute"`` (ring order) or ``"broadcast"``."""
    mesh = meshfuse.DeviceMesh(range(ctx.world))
    with FusionDefinition() as fd:
        x = fd.define_tensor([tokens, hidden], dtype=dtype)
        w = fd.define_tensor([4 * hidden, hidden], dtype=dtype)
        gathered = fd.ops.set(x)
        fd.add_output(fd.ops.linear(gathered, w))
    for tv in (x, w):
        tv.set_device_mesh(mesh)
        tv.outer_split(0, ctx.world)
        tv.axis(0).parallelize(ParallelType.mesh_x)
    gathered.set_device_mesh(mesh)
    if order is None:
        x.set_overlap(False)
    elif order != "auto":
        gathered.outer_split(0, ctx.world)
        if order == "permute":
            gathered.swizzle1d(0, ParallelType.mesh_x)
        gathered.axis(0).parallelize(ParallelType.stream)
    return fd


def _meshfuse(fd: FusionDefinition, inputs: list, expected: torch.Tensor, what: str,
              transport: str = "process_group"):
    """A variant running ``fd``; its program (built by the first call) moves the blocks of
    its stream loops by ``transport`` (``MESHFUSE_OVERLAP_TRANSPORT``)."""
    def setup():
        with mock.patch.dict(os.environ, {"MESHFUSE_OVERLAP_TRANSPORT": transport}):
            out = fd.execute(inputs)
            text = fd.explain(inputs)
        check_close(what, out, [expected], TOL)
        return lambda: fd.execute(inputs), {"loops": text.count("stream loop:"),
                                            "copy_engine": "by copy engines" in text}
    return setup


def _torch_fused(kind: str, x: torch.Tensor, w: torch.Tensor, expected: torch.Tensor):
    """torch's async-TP op called directly (copy-engine pulls under GEMM chunks):
    ``fused_all_gather_matmul`` ("column") or ``fused_matmul_reduce_scatter`` ("row_sp")."""
    def setup():
        if not x.is_cuda or dist.get_world_size() < 2:
            raise Skip("torch's fused ops need CUDA and at least 2 ranks")
        name = dist.group.WORLD.group_name
        _enable_symmetric_memory(dist.group.WORLD)
        if kind == "column":
            def step():
                return torch.ops.symm_mem.fused_all_gather_matmul(
                    x, [w.t()], 0, name, return_A=False)[1][0]
        else:
            def step():
                return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w.t(), "sum", 0, name)
        check_close("torch_fused vs torch", [step()], [expected], TOL)
        return step
    return setup


def _enable_symmetric_memory(group) -> None:
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    except ImportError:  # newer torch: enabled on demand
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(group.group_name)


def _torch_streams(x: torch.Tensor, w: torch.Tensor, chunks: int, group):
    """nvFuser's reference row-parallel forward: each chunk's GEMM and allreduce on a stream
    of a pool (direct torch calls)."""
    streams = [torch.cuda.Stream(x.device) for _ in range(chunks)] if x.is_cuda else []
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)

    def step():
        main = torch.cuda.current_stream(x.device) if x.is_cuda else None
        for i, (xc, oc) in enumerate(zip(x.chunk(chunks), out.chunk(chunks))):
            if main is None:
                torch.matmul(xc, w.t(), out=oc)
                dist.all_reduce(oc, group=group)
                continue
            streams[i].wait_stream(main)
            with torch.cuda.stream(streams[i]):
                torch.matmul(xc, w.t(), out=oc)
                dist.all_reduce(oc, group=group)
        for s in streams:
            main.wait_stream(s)
        return out

    return step


def _async_tp(kind: str, x: torch.Tensor, w: torch.Tensor, expected: torch.Tensor):
    """``torch.compile`` with micro-pipeline TP (symmetric memory) over a functional
    allgather + matmul (``kind`` "column") or matmul + reduce-scatter ("row_sp")."""
    def setup():
        if not x.is_cuda or dist.get_world_size() < 2:
            raise Skip("async TP needs CUDA and at least 2 ranks")
        import torch.distributed._functional_collectives as funcol
        from torch._inductor import config as inductor_config
        from torch._inductor.utils import run_and_get_code

        group = dist.group.WORLD
        _enable_symmetric_memory(group)

        def column(x_local, weight):
            full = funcol.all_gather_tensor(x_local, gather_dim=0, group=group)
            return torch.matmul(full, weight.t())

        def row_sp(x_local, weight):
            partial = torch.matmul(x_local, weight.t())
            return funcol.reduce_scatter_tensor(partial, "sum", scatter_dim=0, group=group)

        with inductor_config.patch(_micro_pipeline_tp=True):
            compiled = torch.compile(column if kind == "column" else row_sp, fullgraph=True)
            out, code = run_and_get_code(compiled, x, w)
        check_close("torch_async_tp vs torch", [out], [expected], TOL)
        fused = any("fused_all_gather_matmul" in c or "fused_matmul_reduce_scatter" in c
                    for c in code)
        return (lambda: compiled(x, w)), {"fused": fused}
    return setup


def _row(ctx: Context, sizes, dtype, plan, params) -> list[Record]:
    t, h = sizes["tokens"], sizes["hidden"]
    x = _block(_randn(ctx, t, 4 * h, dtype=dtype, seed=0), 1, ctx)
    w = _block(_randn(ctx, h, 4 * h, dtype=dtype, seed=1), 1, ctx)
    group = dist.group.WORLD if ctx.world > 1 else None

    def direct():
        def step():
            out = torch.matmul(x, w.t())
            if group is not None:
                dist.all_reduce(out, group=group)
            return out
        return step

    expected = direct()()
    mf = DataType.from_torch(dtype)
    variants = [Variant("torch", direct, "mm then all_reduce (no overlap)")]
    for name, overlap, transport, note in (
            ("meshfuse", False, "process_group", "no stream axis, set_overlap(False)"),
            ("meshfuse_auto", None, "copy_engine",
             "no stream axis: the engine decides, copy engines")):
        fd = row_fusion(ctx, t, h, None, mf, overlap)
        variants.append(Variant(name, _meshfuse(fd, [x, w], expected, name, transport), note))
    for s in CHUNKS:
        fd = row_fusion(ctx, t, h, s, mf)
        variants.append(Variant(f"meshfuse_s{s}", _meshfuse(fd, [x, w], expected, f"s{s}"),
                                f"tokens on stream: {s} chunks"))
        variants.append(Variant(f"torch_s{s}", lambda s=s: _torch_streams(x, w, s, group),
                                f"nvFuser's reference: {s} chunks on a stream pool"))
    config = f"row T{t} H{h}"
    records = _with_interleaved(ctx, config, variants, plan, params,
                                ["meshfuse_auto", *(f"meshfuse_s{s}" for s in CHUNKS)])
    records.append(skipped(ctx, "overlap", config, "torch_async_tp",
                           "_micro_pipeline_tp decomposes allgather->matmul and "
                           "matmul->reduce-scatter; this layer ends in an allreduce", params))
    return records


def _row_sp(ctx: Context, sizes, dtype, plan, params) -> list[Record]:
    t, h = sizes["tokens"], sizes["hidden"]
    x = _block(_randn(ctx, t, 4 * h, dtype=dtype, seed=0), 1, ctx)
    w = _block(_randn(ctx, h, 4 * h, dtype=dtype, seed=1), 1, ctx)
    out = torch.empty(t // ctx.world, h, dtype=dtype, device=ctx.device)

    def direct():
        def step():
            partial = torch.matmul(x, w.t())
            if ctx.world == 1:
                return partial
            dist.reduce_scatter_tensor(out, partial)
            return out
        return step

    expected = direct()().clone()
    mf = DataType.from_torch(dtype)
    variants = [Variant("torch", direct, "mm then reduce_scatter_tensor (no overlap)")]
    for name, overlap, transport, note in (
            ("meshfuse", False, "process_group", "set_overlap(False)"),
            ("meshfuse_auto", None, "copy_engine", "the engine decides, copy engines"),
            ("meshfuse_overlap", True, "process_group", "set_overlap(True): d chunks, NCCL"),
            ("meshfuse_overlap_copy_engine", True, "copy_engine",
             "set_overlap(True): d chunks, copy engines")):
        fd = row_sp_fusion(ctx, t, h, overlap, mf)
        variants.append(Variant(name, _meshfuse(fd, [x, w], expected, name, transport), note))
    variants.append(Variant("torch_fused", _torch_fused("row_sp", x, w, expected),
                            "torch.ops.symm_mem.fused_matmul_reduce_scatter, direct"))
    variants.append(Variant("torch_async_tp", _async_tp("row_sp", x, w, expected),
                            "torch.compile, _micro_pipeline_tp, symmetric memory"))
    return _with_interleaved(ctx, f"row_sp T{t} H{h}", variants, plan, params,
                             ["meshfuse_auto", "meshfuse_overlap_copy_engine", "torch_async_tp"])


def _column(ctx: Context, sizes, dtype, plan, params) -> list[Record]:
    t, h = sizes["tokens"], sizes["hidden"]
    x_global = _randn(ctx, t, h, dtype=dtype, seed=0)
    x = _block(x_global, 0, ctx)
    w = _block(_randn(ctx, 4 * h, h, dtype=dtype, seed=1), 0, ctx)
    full = torch.empty(t, h, dtype=dtype, device=ctx.device)

    def direct():
        def step():
            if ctx.world > 1:
                dist.all_gather_into_tensor(full, x)
                return torch.matmul(full, w.t())
            return torch.matmul(x, w.t())
        return step

    expected = torch.matmul(x_global, w.t())
    mf = DataType.from_torch(dtype)
    variants = [Variant("torch", direct, "all_gather_into_tensor then mm (no overlap)")]
    for name, order, transport, note in (
            ("meshfuse", None, "process_group", "no stream axis, set_overlap(False)"),
            ("meshfuse_auto", "auto", "copy_engine",
             "no stream axis: the engine decides, copy engines"),
            ("meshfuse_permute", "permute", "process_group", "swizzle1d: d-1 NCCL transfers"),
            ("meshfuse_broadcast", "broadcast", "process_group", "one broadcast per block"),
            ("meshfuse_copy_engine", "permute", "copy_engine",
             "stream axis, blocks pulled by copy engines")):
        fd = column_fusion(ctx, t, h, order, mf)
        variants.append(Variant(name, _meshfuse(fd, [x, w], expected, name, transport), note))
    variants.append(Variant("torch_fused", _torch_fused("column", x, w, expected),
                            "torch.ops.symm_mem.fused_all_gather_matmul, direct"))
    variants.append(Variant("torch_async_tp", _async_tp("column", x, w, expected),
                            "torch.compile, _micro_pipeline_tp, symmetric memory"))
    return _with_interleaved(ctx, f"column T{t} H{h}", variants, plan, params,
                             ["meshfuse_auto", "meshfuse_copy_engine", "torch_async_tp"])


def _with_interleaved(ctx: Context, config: str, variants: list[Variant], plan: Plan, params,
                      overlapped: list[str]) -> list[Record]:
    """The records of ``variants`` (ratios over ``torch``), and those named in ``overlapped``
    also timed interleaved with ``meshfuse`` (no overlap; metric ``interleaved_ratio``): the
    issue's "with overlap over without" and "no slower than async TP" read from one
    alternating measurement, which a drift of the clocks between variants does not bias."""
    steps: dict = {}
    records = run_variants(ctx, "overlap", config, [kept(v, steps) for v in variants], plan,
                           "torch", params)
    rounds, iters = (2, 2) if ctx.quick else (7, 10)
    interleave(ctx, records, steps, "meshfuse", rounds, iters, overlapped)
    return records


def run(ctx: Context) -> list[Record]:
    sizes = QUICK_SIZES if ctx.quick else SIZES
    if (4 * sizes["hidden"]) % ctx.world or sizes["tokens"] % ctx.world:
        raise ValueError(f"sizes {sizes} do not split over {ctx.world} ranks")
    # gloo has no bf16 reductions everywhere: fp32 on the CPU
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=3, iters=20)
    flops = 2.0 * sizes["tokens"] * 4 * sizes["hidden"] * sizes["hidden"]
    plan = Plan(plan.warmup, plan.iters, flops=flops)
    params = dict(sizes, dtype=str(dtype).removeprefix("torch."))
    return _row(ctx, sizes, dtype, plan, params) + _row_sp(ctx, sizes, dtype, plan, params) + \
        _column(ctx, sizes, dtype, plan, params)
