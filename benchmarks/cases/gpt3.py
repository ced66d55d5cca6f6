"""Case: the GPT-3 layer of nvFuser's transformer test, forward and backward, TP + SP
(issues 17 and 19).

e=12288, s=2048, h=96, b=1, bf16 (nvFuser's sizes). Variants, each computing ``y`` and the
gradients of ``x`` and of every parameter from a given ``dy``:

- ``torch_1gpu``: the unsharded layer on one GPU with autograd (every rank runs it);
- ``dtensor_tp_sp`` (the baseline with 2 or more ranks): ``parallelize_module`` of the same
  module, Megatron TP + SP (:func:`~meshfuse.examples.gpt_torch.parallelize`), autograd;
- ``meshfuse``: :class:`~meshfuse.examples.gpt.GptBlockWithBackward`, one fusion with the
  forward and the backward written out, TP + SP (unsharded on one rank);
- ``meshfuse_compiled``: the same with ``compile=True`` (GPUs only): the reference of the
  derived backward's compiled variant;
- ``meshfuse_autograd``: :class:`~meshfuse.examples.gpt.GptBlock`, the forward only, its
  backward derived, through torch autograd (``as_autograd_function``), TP + SP;
- ``meshfuse_autograd_compiled``: the same with ``compile=True`` (each run of pointwise,
  reduction and shape ops fused by Inductor; GPUs only);
- ``meshfuse_autograd_compiled_save``: the same with ``remat="save"`` (the backward reads
  saved GELU and layer-norm results instead of recomputing them: more memory, fewer
  kernels);
- ``meshfuse_autograd_compiled_whole``: the same with ``MESHFUSE_OVERLAP=off``: every
  collective whole (``meshfuse_autograd_compiled`` leaves the choice to the estimate, which
  with NCCL's figures keeps them whole too);
- ``meshfuse_autograd_compiled_overlap``: the same built with
  ``MESHFUSE_OVERLAP_COST="300,700,0,0"`` (no contention, no host cost per chunk), with which
  the estimate decomposes every allgather -> GEMM and GEMM -> reduce-scatter it finds into a
  stream loop, and ``MESHFUSE_OVERLAP_TRANSPORT=copy_engine``: their blocks move by the
  copy engines through symmetric memory (docs/overlap.md);
- ``meshfuse_autograd_compiled_overlap_nccl``: the same loops, their blocks moved by NCCL.

Ratios are medians over the baseline's; drift of the GPUs' clocks between variants (power
limits, heat) can move those by a few percent, so each meshfuse variant is also timed
*interleaved* with the baseline (alternating blocks of steps, the median of the per-round
ratios: ``interleaved_ratio`` in its record's metrics).

FLOPs: :func:`~benchmarks.gpt3_layer.layer_flops` (3 x forward, attention counted whole).
"""

from __future__ import annotations

import os
from unittest import mock

import torch

import meshfuse
from benchmarks.context import Context
from benchmarks.gpt3_layer import layer_flops
from benchmarks.harness import (
    Plan,
    Record,
    Skip,
    Variant,
    autograd_step,
    check_close,
    interleave,
    kept,
    run_variants,
)
from meshfuse.examples.gpt import GptBlock, GptBlockWithBackward, init_parameters
from meshfuse.examples.gpt_torch import Gpt3Block, parallelize

SIZES = {"b": 1, "s": 2048, "h": 96, "e": 12288}
QUICK_SIZES = {"b": 1, "s": 16, "h": 4, "e": 32}
LAYER_TOL = 5e-2  # bf16 relative error of y and dx against the one-GPU layer


def _one_gpu_reference(params, heads: int, x, dy) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` and ``dx`` of the unsharded layer (the parameters' gradients are let go)."""
    block = Gpt3Block(params, heads)
    y, grads = autograd_step(block, [x], dy, block.parameters())()
    return y.detach(), grads[0]


def variants(ctx: Context, sizes, dtype: torch.dtype, x, dy, params) -> list[Variant]:
    """The case's variants; ``x``, ``dy`` and ``params`` are global (the same on every rank)."""
    b, s, e, heads = sizes["b"], sizes["s"], sizes["e"], sizes["h"]
    mesh = meshfuse.DeviceMesh(range(ctx.world)) if ctx.world > 1 else None
    mf_dtype = meshfuse.DataType.from_torch(dtype)
    # For the checks, made before any variant: the same leftover for all of them.
    ref_y, ref_dx = _one_gpu_reference(params, heads, x, dy)

    def check(what, tv_y, tv_x, y, dx):
        check_close(f"{what} vs the one-GPU layer", [y, dx],
                    [meshfuse.shard_tensor(ref_y, tv_y), meshfuse.shard_tensor(ref_dx, tv_x)],
                    LAYER_TOL)

    def one_gpu():
        block = Gpt3Block(params, heads)
        return autograd_step(block, [x], dy, block.parameters())

    def dtensor_tp_sp():
        if ctx.world == 1:
            raise Skip("tensor parallelism needs 2 or more ranks")
        from torch.distributed.tensor import DTensor, Shard

        dmesh = ctx.dtensor_mesh()
        block = parallelize(Gpt3Block(params, heads), dmesh)

        def run(local_x):
            y = block(DTensor.from_local(local_x, dmesh, [Shard(1)]))
            return y.to_local() if isinstance(y, DTensor) else y

        return autograd_step(run, [x.chunk(ctx.world, 1)[ctx.rank]],
                             dy.chunk(ctx.world, 1)[ctx.rank].contiguous(), block.parameters())

    def hand_written(compile=False):  # the interpreter (fusion is on by default on CUDA)
        fd = GptBlockWithBackward(b, s, e, heads, mf_dtype, mesh).define()
        inputs = [meshfuse.shard_tensor(t, tv) for t, tv in
                  zip((x, dy, *params.values()), (fd.x, fd.dy, *fd.params.values()))]
        y, dx, *_ = fd.execute(inputs, compile=compile)
        check("meshfuse", fd.y, fd.x, y, dx)
        return (lambda: fd.execute(inputs, compile=compile)), {"sharded": mesh is not None}

    def hand_written_compiled():
        if not ctx.cuda:
            raise Skip("Inductor's fused segments are measured on GPUs")
        return hand_written(compile=True)

    def derived(compile=False, **options):  # (the library's default remat, unless given)
        block = GptBlock(b, s, e, heads, mf_dtype, mesh).define()
        function = block.as_autograd_function(compile=compile, **options)
        local = [meshfuse.shard_tensor(t, tv)
                 for t, tv in zip((x, *params.values()), (block.x, *block.params.values()))]
        step = autograd_step(lambda *leaves: function(leaves)[0], local,
                             meshfuse.shard_tensor(dy, block.y))
        y, (dx, *_) = step()
        check("meshfuse_autograd", block.y, block.x, y.detach(), dx)
        return step

    def derived_compiled(**options):
        if not ctx.cuda:
            raise Skip("Inductor's fused segments are measured on GPUs")
        return derived(compile=True, **options)

    def derived_compiled_overlap(transport: str):
        # The programs are built by the setup's first step: with these figures then (no
        # contention, no host cost per chunk), the estimate decomposes every allgather ->
        # GEMM and GEMM -> reduce-scatter it finds into a stream loop, whose blocks move by
        # ``transport``.
        with mock.patch.dict(os.environ, {"MESHFUSE_OVERLAP_COST": "300,700,0,0",
                                          "MESHFUSE_OVERLAP_TRANSPORT": transport}):
            return derived_compiled()

    def derived_compiled_whole():
        with mock.patch.dict(os.environ, {"MESHFUSE_OVERLAP": "off"}):
            return derived_compiled()

    return [
        Variant("torch_1gpu", one_gpu, "unsharded layer on each GPU, autograd", gpus=1),
        Variant("dtensor_tp_sp", dtensor_tp_sp, "parallelize_module, Megatron TP + SP"),
        Variant("meshfuse", hand_written, "one fusion, forward + hand-written backward"),
        Variant("meshfuse_compiled", hand_written_compiled,
                "as meshfuse, pointwise runs fused by Inductor (compile=True)"),
        Variant("meshfuse_autograd", derived, "forward-only fusion, derived backward, autograd"),
        Variant("meshfuse_autograd_compiled", derived_compiled,
                "as meshfuse_autograd, pointwise runs fused by Inductor (compile=True)"),
        Variant("meshfuse_autograd_compiled_save", lambda: derived_compiled(remat="save"),
                "as meshfuse_autograd_compiled, remat='save' (no recomputation)"),
        Variant("meshfuse_autograd_compiled_whole", derived_compiled_whole,
                "as meshfuse_autograd_compiled, no stream loop (MESHFUSE_OVERLAP=off)"),
        Variant("meshfuse_autograd_compiled_overlap",
                lambda: derived_compiled_overlap("copy_engine"),
                "as meshfuse_autograd_compiled, every candidate collective decomposed into a "
                "stream loop, blocks moved by the copy engines"),
        Variant("meshfuse_autograd_compiled_overlap_nccl",
                lambda: derived_compiled_overlap("process_group"),
                "as meshfuse_autograd_compiled_overlap, blocks moved by NCCL"),
    ]


def run(ctx: Context) -> list[Record]:
    sizes = QUICK_SIZES if ctx.quick else SIZES
    if sizes["h"] % ctx.world or sizes["s"] % ctx.world:
        raise ValueError(f"heads {sizes['h']} and sequence {sizes['s']} must split over "
                         f"{ctx.world} ranks")
    # gloo has no bf16 reductions everywhere: fp32 on the CPU
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=5, iters=30)
    plan = Plan(plan.warmup, plan.iters, flops=layer_flops(sizes["b"], sizes["s"], sizes["e"]))
    gen = torch.Generator(ctx.device).manual_seed(1)
    shape = (sizes["b"], sizes["s"], sizes["e"])
    x = torch.randn(shape, generator=gen, device=ctx.device).to(dtype)
    dy = torch.randn(shape, generator=gen, device=ctx.device).to(dtype)
    params = init_parameters(sizes["e"], dtype=dtype, device=ctx.device)
    config = f"b{sizes['b']} s{sizes['s']} h{sizes['h']} e{sizes['e']}"
    baseline = "dtensor_tp_sp" if ctx.world > 1 else "torch_1gpu"
    steps: dict = {}
    cases = [kept(v, steps) for v in variants(ctx, sizes, dtype, x, dy, params)]
    records = run_variants(ctx, "gpt3_layer", config, cases, plan, baseline,
                           dict(sizes, dtype=str(dtype).removeprefix("torch.")))
    rounds, iters = (2, 2) if ctx.quick else (7, 10)
    interleave(ctx, records, steps, baseline, rounds, iters,
               [r.variant for r in records if r.variant.startswith("meshfuse")])
    return records
