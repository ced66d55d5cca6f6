"""Case 4 (issue 6): a Megatron tensor-parallel MLP, forward and backward.

``z = gelu(x @ w1.T) @ w2.T`` with hidden 8192, ffn 32768, 8192 tokens, bf16; the
gradients of x, w1 and w2 from a given ``dz``. Variants:

- ``torch_1gpu`` (baseline): the whole MLP on one GPU with autograd (every rank runs it);
- ``torch_manual``: the Megatron calls on the local shards (w1 split on F by rows, w2 by
  columns) with an NCCL allreduce of z and of dx, no autograd: what meshfuse should lower to;
- ``dtensor_tp``: ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``, autograd;
- ``meshfuse``: :class:`~benchmarks.fusions.MegatronMlp` (unsharded on one rank): the same
  calls, its two allreduces launched asynchronously as early as their inputs exist, as
  loops by the copy engines where the estimate says they pay (the default transport on
  CUDA);
- ``meshfuse_nccl``: the same with the process group asked for (the default before);
- ``meshfuse_loops_nccl``, ``meshfuse_copy_engine``, ``meshfuse_copy_engine_4``,
  ``meshfuse_copy_engine_8``: the same with both allreduces forced into GEMM -> allreduce
  loops (:data:`LOOP_VARIANTS`).

FLOPs: two matmuls of ``2*T*H*F`` forward, twice that backward: ``12*T*H*F`` in all.

Issue 13's bar (no worse than 0.97x DTensor and 1.96x over one GPU) is read from two metrics
of the sharded variants, both against records of the same run: ``speedup_over_1gpu``
(``torch_1gpu``'s time over the variant's) and, on ``meshfuse``, ``vs_dtensor_tp``
(``dtensor_tp``'s time over meshfuse's: above 1, meshfuse is faster).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist

import meshfuse
from benchmarks.context import Context
from benchmarks.fusions import MegatronMlp, megatron_mlp_torch
from benchmarks.harness import Plan, Record, Variant, autograd_step, check_close, run_variants

SIZES = {"tokens": 8192, "hidden": 8192, "ffn": 32768}
QUICK_SIZES = {"tokens": 64, "hidden": 32, "ffn": 128}
MLP_TOL = 3e-2  # bf16, relative: the allreduces sum bf16 partials


def mlp_flops(tokens: int, hidden: int, ffn: int) -> float:
    return 12.0 * tokens * hidden * ffn


def tensors(ctx: Context, sizes: dict[str, int], dtype: torch.dtype):
    """Global x, dz, w1, w2 (the same on every rank), then this rank's shards of w1 and w2."""
    t, h, f = sizes["tokens"], sizes["hidden"], sizes["ffn"]
    gen = torch.Generator(ctx.device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=ctx.device, dtype=dtype) * scale

    x, dz = randn(t, h), randn(t, h)
    w1, w2 = randn(f, h, scale=h ** -0.5), randn(h, f, scale=f ** -0.5)
    per = f // ctx.world
    part = slice(ctx.rank * per, (ctx.rank + 1) * per)
    return x, dz, w1, w2, w1[part].contiguous(), w2[:, part].contiguous()


def _model(w1: torch.Tensor, w2: torch.Tensor) -> torch.nn.Sequential:
    f, h = w1.shape
    model = torch.nn.Sequential(
        torch.nn.Linear(h, f, bias=False), torch.nn.GELU(), torch.nn.Linear(f, h, bias=False)
    ).to(device=w1.device, dtype=w1.dtype)
    with torch.no_grad():
        model[0].weight.copy_(w1)
        model[2].weight.copy_(w2)
    return model


def variants(ctx: Context, sizes, dtype: torch.dtype, inputs) -> list[Variant]:
    """The case's variants over :func:`tensors`' ``inputs``."""
    x, dz, w1, w2, w1_local, w2_local = inputs
    group = dist.group.WORLD if ctx.world > 1 else None

    def one_gpu():
        model = _model(w1, w2)
        return autograd_step(model, [x], dz, model.parameters())

    def manual():
        return lambda: megatron_mlp_torch(x, w1_local, w2_local, dz, group)

    def dtensor_tp():
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        model = parallelize_module(_model(w1, w2), ctx.dtensor_mesh(),
                                   {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return autograd_step(model, [x], dz, model.parameters())

    def mesh_fused(env: dict[str, str] | None = None, overlap: bool | None = None):
        """meshfuse's MegatronMlp, its program made (at the first call) under ``env``;
        ``overlap``: the set_overlap of its two partial sums."""
        mesh = meshfuse.DeviceMesh(range(ctx.world)) if ctx.world > 1 else None
        model = MegatronMlp(**sizes, mesh=mesh, dtype=meshfuse.DataType.from_torch(dtype),
                            overlap=overlap)
        inputs = [x, w1_local, w2_local, dz]
        with _environment(env or {}):
            outputs = model.execute(inputs)
        check_close("meshfuse vs torch_manual", outputs,
                    megatron_mlp_torch(x, w1_local, w2_local, dz, group), MLP_TOL)
        loops = [line.strip() for line in model.explain(inputs).splitlines()
                 if "allreduce decomposed" in line]
        return (lambda: model.execute(inputs)), {"sharded": mesh is not None, "loops": loops}

    return [
        Variant("torch_1gpu", one_gpu, "whole MLP on each GPU, autograd", gpus=1),
        Variant("torch_manual", manual, "local shards + all_reduce, gelu_backward kernel"),
        Variant("dtensor_tp", dtensor_tp, "ColwiseParallel/RowwiseParallel, autograd"),
        Variant("meshfuse", mesh_fused, "unsharded on 1 rank" if ctx.world == 1 else ""),
        *(Variant(name, functools.partial(mesh_fused, env, overlap), note)
          for name, (env, overlap, note) in LOOP_VARIANTS.items()),
    ]


# GEMM -> allreduce loops (docs/overlap.md) on both allreduces of the MLP: name -> (the
# environment its program is made in, set_overlap of the partial sums, note). Forced: over
# NCCL in 4 row chunks, by the copy engines whole or in 4 or 8 chunks; and the process group
# asked for with the loops left to the estimate.
_CE = {"MESHFUSE_OVERLAP_TRANSPORT": "copy_engine"}
LOOP_VARIANTS = {
    "meshfuse_loops_nccl": ({"MESHFUSE_OVERLAP_CHUNKS": "4",
                             "MESHFUSE_OVERLAP_TRANSPORT": "process_group"}, True,
                            "allreduce loops of 4 row chunks, NCCL"),
    "meshfuse_copy_engine": (dict(_CE, MESHFUSE_OVERLAP_CHUNKS="1"), True,
                             "allreduces by copy engines, whole"),
    "meshfuse_copy_engine_4": (dict(_CE, MESHFUSE_OVERLAP_CHUNKS="4"), True,
                               "allreduces by copy engines, 4 row chunks"),
    "meshfuse_copy_engine_8": (dict(_CE, MESHFUSE_OVERLAP_CHUNKS="8"), True,
                               "allreduces by copy engines, 8 row chunks"),
    "meshfuse_nccl": ({"MESHFUSE_OVERLAP_TRANSPORT": "process_group"}, None,
                      "the process group, loops as estimated"),
}


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``os.environ`` with ``env`` set inside the block, as it was after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(ctx: Context) -> list[Record]:
    sizes = QUICK_SIZES if ctx.quick else SIZES
    if sizes["ffn"] % ctx.world:
        raise ValueError(f"ffn={sizes['ffn']} does not split over {ctx.world} ranks")
    # gloo has no bf16 reductions everywhere: fp32 on the CPU
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=3, iters=15)
    plan = Plan(plan.warmup, plan.iters, flops=mlp_flops(**sizes))
    inputs = tensors(ctx, sizes, dtype)
    params = dict(sizes, dtype=str(dtype).removeprefix("torch."), bias=False, gelu="exact")
    return speedups(run_variants(
        ctx, "mlp", f"T{sizes['tokens']} H{sizes['hidden']} F{sizes['ffn']}",
        variants(ctx, sizes, dtype, inputs), plan, "torch_1gpu", params))


def speedups(records: list[Record]) -> list[Record]:
    """Each sharded variant's ``speedup_over_1gpu``, meshfuse's ``vs_dtensor_tp`` too (see
    the module doc), as numbers and as the record's one-line ``summary``."""
    ok = {r.variant: r for r in records if r.status == "ok" and r.median_ms}
    one, dtensor = ok.get("torch_1gpu"), ok.get("dtensor_tp")
    for name in ("torch_manual", "dtensor_tp", "meshfuse", *LOOP_VARIANTS):
        record = ok.get(name)
        if record is None or one is None or record.world < 2:
            continue
        record.metrics["speedup_over_1gpu"] = round(one.median_ms / record.median_ms, 3)
        summary = f"{record.metrics['speedup_over_1gpu']:.2f}x over one GPU"
        if name.startswith("meshfuse") and dtensor is not None:
            record.metrics["vs_dtensor_tp"] = round(dtensor.median_ms / record.median_ms, 3)
            summary += f", {record.metrics['vs_dtensor_tp']:.2f}x dtensor_tp's speed"
        record.metrics["summary"] = summary
    return records
