"""Case: the GPT-3 layer of nvFuser's transformer test, forward and backward, TP + SP.

e=12288, s=2048, h=96, b=1, bf16 (nvFuser's sizes). Variants, each computing ``y`` and the
gradients of ``x`` and of every parameter from a given ``dy``:

- ``torch_1gpu`` (baseline): the unsharded layer on one GPU with autograd (every rank runs it);
- ``dtensor_tp_sp``: ``parallelize_module`` of the same module with ``ColwiseParallel`` (qkv,
  fc1) / ``RowwiseParallel`` (proj, fc2) and ``SequenceParallel`` (the layer norms), autograd;
- ``meshfuse``: :class:`~benchmarks.gpt3_layer.Gpt3Layer`, one fusion with the forward and
  backward written out, scheduled TP + SP (unsharded on one rank).

FLOPs: :func:`~benchmarks.gpt3_layer.layer_flops` (3 x forward, attention counted whole).
"""

from __future__ import annotations

import torch

import meshfuse
from benchmarks.context import Context
from benchmarks.gpt3_layer import Gpt3Block, Gpt3Layer, layer_flops, make_params
from benchmarks.harness import Plan, Record, Skip, Variant, check_close, run_variants

SIZES = {"b": 1, "s": 2048, "h": 96, "e": 12288}
QUICK_SIZES = {"b": 1, "s": 16, "h": 4, "e": 32}
LAYER_TOL = 5e-2  # bf16 relative error of y and dx against the one-GPU layer


def _module(sizes, params, device) -> Gpt3Block:
    block = Gpt3Block(sizes["e"], sizes["h"]).to(device=device, dtype=params["w_o"].dtype)
    return block.load(params)


def _autograd_step(block: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().requires_grad_()
    params = list(block.parameters())

    def step():
        y = block(x)
        return y, torch.autograd.grad(y, [x, *params], dy)

    return step


def variants(ctx: Context, sizes, dtype: torch.dtype, x, dy, params) -> list[Variant]:
    """The case's variants; ``x``, ``dy`` and ``params`` are global (the same on every rank)."""
    seq_part = x.chunk(ctx.world, 1)[ctx.rank]

    def one_gpu():
        return _autograd_step(_module(sizes, params, ctx.device), x, dy)

    def dtensor_tp_sp():
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )
        from torch.distributed.tensor.placement_types import Shard

        if ctx.world == 1:
            raise Skip("one rank: nothing to parallelize")
        plan = {"ln1": SequenceParallel(use_local_output=True),
                "qkv": ColwiseParallel(input_layouts=Shard(1)),
                "proj": RowwiseParallel(output_layouts=Shard(1)),
                "ln2": SequenceParallel(use_local_output=True),
                "fc1": ColwiseParallel(input_layouts=Shard(1)),
                "fc2": RowwiseParallel(output_layouts=Shard(1))}
        block = parallelize_module(_module(sizes, params, ctx.device), ctx.dtensor_mesh(), plan)
        return _autograd_step(block, seq_part, dy.chunk(ctx.world, 1)[ctx.rank])

    def mesh_fused():
        mesh = meshfuse.DeviceMesh(range(ctx.world)) if ctx.world > 1 else None
        fd = Gpt3Layer(**sizes, dtype=meshfuse.DataType.from_torch(dtype), mesh=mesh).define()
        inputs = [meshfuse.shard_tensor(t, tv, ctx.rank) for t, tv in
                  zip((x, dy, *params.values()), fd.fusion.inputs())]
        y, dx, *_ = fd.execute(inputs)
        ref_y, (ref_dx, *_) = _autograd_step(_module(sizes, params, ctx.device), x, dy)()
        check_close("meshfuse vs the one-GPU layer",
                    [y, dx], [ref_y.chunk(ctx.world, 1)[ctx.rank],
                              ref_dx.chunk(ctx.world, 1)[ctx.rank]], LAYER_TOL)
        return (lambda: fd.execute(inputs)), {"sharded": mesh is not None}

    return [
        Variant("torch_1gpu", one_gpu, "unsharded layer on each GPU, autograd", gpus=1),
        Variant("dtensor_tp_sp", dtensor_tp_sp, "Colwise/Rowwise + SequenceParallel, autograd"),
        Variant("meshfuse", mesh_fused, "one fusion, forward + backward, TP + SP"),
    ]


def run(ctx: Context) -> list[Record]:
    sizes = QUICK_SIZES if ctx.quick else SIZES
    if sizes["h"] % ctx.world or sizes["s"] % ctx.world:
        raise ValueError(f"heads {sizes['h']} and sequence {sizes['s']} must split over "
                         f"{ctx.world} ranks")
    # gloo has no bf16 reductions everywhere: fp32 on the CPU
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=3, iters=10)
    plan = Plan(plan.warmup, plan.iters, flops=layer_flops(sizes["b"], sizes["s"], sizes["e"]))
    gen = torch.Generator(ctx.device).manual_seed(1)
    shape = (sizes["b"], sizes["s"], sizes["e"])
    x = torch.randn(shape, generator=gen, device=ctx.device).to(dtype)
    dy = torch.randn(shape, generator=gen, device=ctx.device).to(dtype)
    params = make_params(sizes["e"], dtype, ctx.device)
    config = f"b{sizes['b']} s{sizes['s']} h{sizes['h']} e{sizes['e']}"
    return run_variants(ctx, "gpt3_layer", config, variants(ctx, sizes, dtype, x, dy, params),
                        plan, "torch_1gpu", dict(sizes, dtype=str(dtype).removeprefix("torch.")))
