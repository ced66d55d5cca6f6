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

- ``meshfuse_<backend>_p0.1``: meshfuse with dropout on each other fused kernel
  (``MESHFUSE_SDPA_BACKEND`` at the first call, when the kernel is bound), to see which
  fused kernel is fastest with dropout here.

Every variant also records its host time per call (``host_us``, the GPU kept busy) and its
GPU time (``gpu_us``): a call is host-bound here, and a slow iteration is either host work or
a wait for the GPU (``host_note``). Timings of a host-bound program drift with the host's
load, so the dropout cost is also measured *interleaved*: ``meshfuse_p0`` and
``meshfuse_p0.1`` timed in alternating blocks, the median of the per-round ratios
(``interleaved_ratio`` on the ``meshfuse_p0.1`` record; the target is <= 1.3).

Before timing, the meshfuse dropout variants are checked to be reproducible and finite: two
calls with the same seed give the same attention output bits (the same masks) and gradients
that agree to rounding (a fused backward may add ``q_grad`` in another order: flash does,
with atomics); the record names the outputs that were not bitwise equal by default and
under ``torch.use_deterministic_algorithms(True)`` (``not_bitwise_default``,
``not_bitwise_deterministic``; ``benchmarks.dropout_check`` holds the full contract). See ``benchmarks/reproducibility.py``. Their correctness is the
test suite's (``tests/test_attention_dropout.py``, which runs on the GPUs too).
"""

from __future__ import annotations

import os

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
from benchmarks.reproducibility import check_same_seed
from benchmarks.timing import interleaved_ratio
from meshfuse.errors import InputError
from meshfuse.ops import attention_kernels as kernels
from meshfuse.ops.attention_backends import ENV_VAR as BACKEND_ENV
from meshfuse.ops.attention_backends import select_backend

P, IS_CAUSAL = 0.1, True
FUSED = ("cudnn", "flash", "efficient")
OUTPUTS = ("attn", "q_grad", "k_grad", "v_grad")


def meshfuse_variant(ctx: Context, sizes, inputs, p: float, mode: str | None = None,
                     backend: str | None = None, steps: dict | None = None) -> Variant:
    """The seed's fusion with ``dropout_p = p`` (and ``dropout_mode``), run on the shards;
    ``backend`` forces the attention kernel; ``steps`` collects the timed step by name."""
    name = f"meshfuse_p{p:g}" if mode is None else f"meshfuse_{mode}_p{p:g}"
    if backend is not None:
        name = f"meshfuse_{backend}_p{p:g}"

    def setup():
        b, h, s, head_dim = (sizes[k] for k in ("b", "h", "s", "head_dim"))
        model = SeedAttention(QkvFormat.BHSE, meshfuse.DeviceMesh(range(ctx.world)), b, h, s,
                              h * head_dim, dropout_p=p, dropout_mode=mode)
        if backend is not None:
            if not ctx.cuda:
                raise Skip("the fused dropout kernels are CUDA kernels")
            _bind_with(model, inputs, backend)
        metrics = {}
        if p > 0:
            metrics = reproducible(model, inputs, deterministic_check=mode != "global")
            if mode is None:
                metrics["backend"] = (backend or select_backend(*inputs[:3], p, IS_CAUSAL).value)
        model.execute(inputs)
        if steps is not None:
            steps[name] = lambda: model.execute(inputs)
        return lambda: model.execute(inputs), metrics

    return Variant(name, setup, f"dropout_mode={mode}" if mode else "")


def reproducible(model, inputs, deterministic_check: bool = True) -> dict:
    """Checks that the same seed gives the same masks (``check_same_seed``: the attention
    output bitwise; gradients bitwise under deterministic algorithms, else within a
    reordered sum's rounding: flash's backward adds ``q_grad`` with atomics) and finite
    outputs; returns the gradients that are not bitwise reproducible by default, as a
    metric."""
    found = check_same_seed(lambda: model.execute(inputs), OUTPUTS,
                            deterministic_check=deterministic_check, strict=False)
    if not all(t.isfinite().all() for t in model.execute(inputs)):
        raise ValueError("non-finite outputs")
    metrics = {}
    for mode, outputs in found.items():
        if isinstance(outputs, dict):
            loose = [n for n, r in outputs.items() if not r["bitwise"]]
            metrics[f"not_bitwise_{mode}"] = ", ".join(loose) or "none"
        elif outputs is not None:
            metrics[f"not_bitwise_{mode}"] = outputs
    return metrics


def _bind_with(model, inputs, backend: str) -> None:
    """The first call of ``model`` (where its kernels are chosen) with ``backend`` forced."""
    saved = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = backend
    try:
        model.execute(inputs)
    except InputError as err:
        raise Skip(str(err)) from None
    finally:
        if saved is None:
            del os.environ[BACKEND_ENV]
        else:
            os.environ[BACKEND_ENV] = saved


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
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=20, iters=100, host_calls=50)
    plan = Plan(plan.warmup, plan.iters, plan.host_calls, flops=attention_flops(**sizes))
    inputs = local_inputs(ctx, sizes, QkvFormat.BHSE)
    steps: dict = {}
    variants = [
        meshfuse_variant(ctx, sizes, inputs, 0.0, steps=steps),
        meshfuse_variant(ctx, sizes, inputs, P, steps=steps),
        direct_variant(ctx, inputs, None),
        *(direct_variant(ctx, inputs, name) for name in FUSED),
        *(meshfuse_variant(ctx, sizes, inputs, P, backend=name) for name in FUSED),
        torch_variant(inputs),
        meshfuse_variant(ctx, sizes, inputs, P, "global"),
    ]
    params = dict(sizes, causal=IS_CAUSAL, dtype="bf16", layout="BHSE", dropout_p=P,
                  heads_per_rank=sizes["h"] // ctx.world)
    records = run_variants(ctx, "attention_dropout", "BHSE", variants, plan, "meshfuse_p0",
                           params)
    base, dropped = steps.get("meshfuse_p0"), steps.get(f"meshfuse_p{P:g}")
    record = next((r for r in records if r.variant == f"meshfuse_p{P:g}"), None)
    if base is not None and dropped is not None and record is not None:
        rounds, iters = (2, 3) if ctx.quick else (7, 50)
        ratio = interleaved_ratio(ctx, base, dropped, rounds, iters)
        record.metrics["interleaved_ratio"] = round(ratio, 3)
        record.metrics["summary"] = f"interleaved with p0: {ratio:.2f}x"
    return records
