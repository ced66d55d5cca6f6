"""Issue 17: forward and backward through derived backwards (``fd.as_autograd_function()``).

``mlp_autodiff``: the Megatron MLP of the ``mlp`` case (T8192 H8192 F32768, bf16), forward
and backward: ``hand_written`` (baseline: :class:`~benchmarks.fusions.MegatronMlp`, the
backward written out in the same fusion) against ``derived`` (the forward only, its backward
derived, run through torch autograd). Time and peak memory; ``derived`` is also timed
interleaved with ``hand_written`` (metric ``interleaved_ratio``). The GPT-3 layer through
autograd is a variant of the ``gpt3_layer`` case.
"""

from __future__ import annotations

import torch

import meshfuse
from benchmarks.cases.mlp import QUICK_SIZES, SIZES, mlp_flops, tensors
from benchmarks.context import Context
from benchmarks.fusions import MegatronMlp
from benchmarks.harness import (
    Plan,
    Record,
    Variant,
    autograd_step,
    check_close,
    interleave,
    kept,
    run_variants,
)
from meshfuse import DataType, FusionDefinition, ParallelType

TOL = 3e-2  # bf16, relative


def forward_only_mlp(sizes, mesh, dtype: DataType) -> tuple[FusionDefinition, list]:
    """``z = gelu(x @ w1.T) @ w2.T``, Megatron-sharded weights, z replicated."""
    t, h, f = sizes["tokens"], sizes["hidden"], sizes["ffn"]
    with FusionDefinition() as fd:
        x = fd.define_tensor([t, h], dtype=dtype)
        w1 = fd.define_tensor([f, h], dtype=dtype)
        w2 = fd.define_tensor([h, f], dtype=dtype)
        z = fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1)), w2)
        fd.add_output(z)
    if mesh is not None:
        for tv, axis in ((x, None), (w1, 0), (w2, 1), (z, None)):
            tv.set_device_mesh(mesh)
            if axis is not None:
                tv.outer_split(axis, mesh.size)
                tv.axis(axis).parallelize(ParallelType.mesh_x)
    return fd, [x, w1, w2]


def mlp_run(ctx: Context) -> list[Record]:
    sizes = QUICK_SIZES if ctx.quick else SIZES
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    x, dz, _, _, w1_local, w2_local = tensors(ctx, sizes, dtype)
    mesh = meshfuse.DeviceMesh(range(ctx.world)) if ctx.world > 1 else None
    mf_dtype = DataType.from_torch(dtype)

    def hand_written():
        model = MegatronMlp(**sizes, mesh=mesh, dtype=mf_dtype)
        inputs = [x, w1_local, w2_local, dz]
        return lambda: model.execute(inputs)

    def derived():
        fd, _ = forward_only_mlp(sizes, mesh, mf_dtype)
        function = fd.as_autograd_function()
        step = autograd_step(lambda *leaves: function(leaves)[0], [x, w1_local, w2_local], dz)
        z, (dx, dw1, dw2) = step()
        expected = MegatronMlp(**sizes, mesh=mesh, dtype=mf_dtype).execute(
            [x, w1_local, w2_local, dz])
        check_close("derived vs hand_written", [z, dx, dw1, dw2], expected, TOL)
        return step

    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=3, iters=15)
    plan = Plan(plan.warmup, plan.iters, flops=mlp_flops(**sizes))
    variants = [
        Variant("hand_written", hand_written, "forward and backward written as one fusion"),
        Variant("derived", derived, "forward only; backward derived, through torch autograd"),
    ]
    params = dict(sizes, dtype=str(dtype).removeprefix("torch."))
    steps: dict = {}
    records = run_variants(ctx, "mlp_autodiff",
                           f"T{sizes['tokens']} H{sizes['hidden']} F{sizes['ffn']}",
                           [kept(v, steps) for v in variants], plan, "hand_written", params)
    rounds, iters = (2, 2) if ctx.quick else (7, 10)
    interleave(ctx, records, steps, "hand_written", rounds, iters, ["derived"])
    return records
