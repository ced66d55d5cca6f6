"""Case: the seed's attention forward+backward with dropout 0.1 against dropout 0.0.

The seed's sizes (b=2, h=12, s=1024, head dim 64, causal, bf16, heads split over the ranks),
BHSE, as variants:

- ``meshfuse_p0`` (baseline): the seed's fusion with ``dropout_p = 0.0``;
- ``meshfuse_p0.1``: the same with ``dropout_p = 0.1`` in the default ``"shard"`` mode: the
  fastest fused kernel that supports dropout, each head shard drawing from its own stream
  (target: within 1.3x of the baseline);
- ``direct_p0.1``: the kernel meshfuse selects for dropout, called directly on the local
  shards (no per-shard stream): what meshfuse adds to it;
- ``direct_<backend>_p0.1``: each fused CUDA kernel with dropout, called directly (which
  is fastest here);
- ``torch_sdpa_p0.1``: ``F.scaled_dot_product_attention(dropout_p=0.1)`` with autograd;
- ``meshfuse_global_p0.1``: ``dropout_mode="global"`` (the math kernel with the global
  mask: the validation mode, for its cost).

Before timing, the meshfuse dropout variants are checked to be reproducible (two calls with
the same seed give the same bits) and finite; their correctness is the test suite's
(``tests/test_attention_dropout.py``, which runs on the GPUs too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import meshfuse
from benchmarks.cases.attention import (
    QUICK_SEED_SIZES,
    SEED_SIZES,
    attention_flops,
    local_inputs,
)
from benchmarks.context import Context
from benchmarks.fusions import QkvFormat, SeedAttention
from benchmarks.harness import Plan, Record, Skip, Variant, run_variants
from meshfuse.errors import InputError
from meshfuse.ops import attention_kernels as kernels
from meshfuse.ops.attention_backends import select_backend

P, IS_CAUSAL = 0.1, True
FUSED = ("cudnn", "flash", "efficient")


def meshfuse_variant(ctx: Context, sizes, inputs, p: float, mode: str | None = None) -> Variant:
    """The seed's fusion with ``dropout_p = p`` (and ``dropout_mode``), run on the shards."""

    def setup():
        b, h, s, head_dim = (sizes[k] for k in ("b", "h", "s", "head_dim"))
        model = SeedAttention(QkvFormat.BHSE, meshfuse.DeviceMesh(range(ctx.world)), b, h, s,
                              h * head_dim, dropout_p=p, dropout_mode=mode)
        if p > 0:
            runs = []
            for _ in range(2):
                torch.manual_seed(0)
                runs.append(model.execute(inputs))
            if not all(torch.equal(a, b) for a, b in zip(*runs)):
                raise ValueError("two runs with the same seed differ")
            if not all(t.isfinite().all() for t in runs[0]):
                raise ValueError("non-finite outputs")
        model.execute(inputs)
        return lambda: model.execute(inputs)

    name = f"meshfuse_p{p:g}" if mode is None else f"meshfuse_{mode}_p{p:g}"
    return Variant(name, setup, f"dropout_mode={mode}" if mode else "")


def direct_variant(ctx: Context, inputs, requested: str | None) -> Variant:
    """A fused dropout kernel called directly on the local shards (CUDA only)."""
    q, k, v, g = inputs

    def setup():
        if not ctx.cuda:
            raise Skip("the fused dropout kernels are CUDA kernels")
        try:
            backend = select_backend(q, k, v, P, IS_CAUSAL, requested)
        except InputError as err:
            raise Skip(str(err)) from None

        def step():
            attn, lse, seed, offset = kernels.sdpa_forward(q, k, v, P, IS_CAUSAL, None, backend)
            return attn, kernels.sdpa_backward(g, q, k, v, attn, lse, P, IS_CAUSAL, seed,
                                               offset, None, backend)

        return step, {"backend": backend.value}

    name = f"direct_{requested}_p{P:g}" if requested else f"direct_p{P:g}"
    return Variant(name, setup)


def torch_variant(inputs) -> Variant:
    def setup():
        q, k, v = (t.detach().requires_grad_() for t in inputs[:3])

        def step():
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=IS_CAUSAL)
            return out, torch.autograd.grad(out, (q, k, v), inputs[3])

        return step

    return Variant(f"torch_sdpa_p{P:g}", setup, "autograd, PyTorch's kernel choice")


def run(ctx: Context) -> list[Record]:
    """The seed's attention with and without dropout, in one run."""
    sizes = QUICK_SEED_SIZES if ctx.quick else SEED_SIZES
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=20, iters=100)
    plan = Plan(plan.warmup, plan.iters, flops=attention_flops(**sizes))
    inputs = local_inputs(ctx, sizes, QkvFormat.BHSE)
    variants = [
        meshfuse_variant(ctx, sizes, inputs, 0.0),
        meshfuse_variant(ctx, sizes, inputs, P),
        direct_variant(ctx, inputs, None),
        *(direct_variant(ctx, inputs, name) for name in FUSED),
        torch_variant(inputs),
        meshfuse_variant(ctx, sizes, inputs, P, "global"),
    ]
    params = dict(sizes, causal=IS_CAUSAL, dtype="bf16", layout="BHSE", dropout_p=P,
                  heads_per_rank=sizes["h"] // ctx.world)
    return run_variants(ctx, "attention_dropout", "BHSE", variants, plan, "meshfuse_p0",
                        params)
