"""Cases 1 and 2: causal bf16 attention forward+backward, heads split over the ranks.

Each rank holds heads ``[rank*h/d, (rank+1)*h/d)`` of q, k, v and the output gradient, in
BHSE or BSHE memory order, and runs, as variants:

- ``meshfuse``: the seed's fusion, plain ``execute`` (cached after the first call; on CUDA
  replayed from a CUDA graph by default, nothing copied: ``meshfuse.runtime.replay.automatic``; the
  record's ``graph`` says whether it was);
- ``meshfuse_interpreter``: ``execute(cuda_graph=False)``, the interpreter launching each
  kernel from Python (what a program that cannot replay costs), at the seed's sizes only;
- ``meshfuse_graph``: ``execute(cuda_graph=True)`` (captured once, replayed, inputs and
  outputs copied), at the seed's sizes only;
- ``direct`` (baseline, (a)): the same SDPA kernels on the local shards, through
  ``meshfuse.ops.attention.kernels`` with the backend meshfuse selects;
- ``direct_aten``: the same kernels as bare ``torch.ops.aten`` calls (no wrapper, no check);
  each meshfuse record's ``vs_direct_aten`` is its time over this one's (issue 13: a plain
  ``execute`` within 1.1x);
- ``dtensor`` ((b)): DTensor q/k/v placed ``Shard(1)``, ``F.scaled_dot_product_attention``
  and autograd (CUDA only: DTensor has no sharding rule for the CPU kernels);
- ``torch_flash`` ((c)): ``F.scaled_dot_product_attention`` with autograd on the local
  shards, flash backend forced with ``sdpa_kernel``;
- ``torch_sdpa``: the same with PyTorch's own kernel choice.

FLOPs: ``4*b*h*s^2*e`` for the forward (e the head dim), halved for causal; the backward is
2.5 times the forward, so forward+backward is 3.5 times.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import meshfuse
from benchmarks.context import Context
from benchmarks.fusions import QkvFormat, SeedAttention, as_format
from benchmarks.harness import (
    Plan,
    Record,
    Skip,
    Variant,
    check_close,
    interleave,
    kept,
    run_variants,
    waited,
)
from meshfuse.ops.attention import kernels
from meshfuse.ops.attention.backends import select_backend

SEED_SIZES = {"b": 2, "h": 12, "s": 1024, "head_dim": 64}  # the seed: e = 768, 12 heads
LARGE_SIZES = {"b": 4, "h": 32, "s": 4096, "head_dim": 128}
QUICK_SEED_SIZES = {"b": 2, "h": 4, "s": 128, "head_dim": 16}
QUICK_LARGE_SIZES = {"b": 1, "h": 4, "s": 256, "head_dim": 32}
DROPOUT_P, IS_CAUSAL = 0.0, True
ATTENTION_TOL = 1e-2  # the same kernels; only nondeterministic backward reductions may differ


def attention_flops(b: int, h: int, s: int, head_dim: int, causal: bool = True,
                    backward: bool = True) -> float:
    """FLOPs of one attention forward (+ backward when ``backward``), all heads."""
    forward = 4.0 * b * h * s * s * head_dim / (2 if causal else 1)
    return forward * (3.5 if backward else 1.0)


def local_inputs(ctx: Context, sizes: dict[str, int], qkv_format: QkvFormat):
    """This rank's head shard of q, k, v, out_grad (same global values on every rank)."""
    b, h, s, e = sizes["b"], sizes["h"], sizes["s"], sizes["head_dim"]
    if h % ctx.world:
        raise ValueError(f"{h} heads do not split over {ctx.world} ranks")
    per = h // ctx.world
    gen = torch.Generator(ctx.device).manual_seed(0)
    out = []
    for _ in range(4):
        full = torch.randn(b, h, s, e, generator=gen, device=ctx.device, dtype=torch.bfloat16)
        out.append(as_format(full[:, ctx.rank * per:(ctx.rank + 1) * per], qkv_format))
        del full
    return out


_GRAPH_VARIANTS = {
    None: ("meshfuse", "plain execute (replayed from a CUDA graph where safe)"),
    False: ("meshfuse_interpreter", "execute(cuda_graph=False): kernels launched from Python"),
    True: ("meshfuse_graph", "execute(cuda_graph=True): inputs and outputs copied"),
}


def meshfuse_variant(ctx: Context, sizes: dict[str, int], fmt: QkvFormat, inputs,
                     cuda_graph: bool | None = None) -> Variant:
    """The seed's fusion, ``execute`` on the local shards with ``cuda_graph`` (None: plain
    ``execute``, variant ``meshfuse``; False: ``meshfuse_interpreter``; True, captured once
    and replayed with copies: ``meshfuse_graph``); checked against the direct kernels (on its
    first call and on a cached one) before it is timed. Metrics: ``first_call_s`` (building
    the program: meshfuse compiles no kernel for attention), ``graph`` (explain's line on the
    automatic replay, for plain ``execute``)."""

    def setup():
        if cuda_graph and not ctx.cuda:
            raise Skip("CUDA graphs need CUDA")
        b, h, s, head_dim = (sizes[k] for k in ("b", "h", "s", "head_dim"))
        model = SeedAttention(fmt, meshfuse.DeviceMesh(range(ctx.world)), b, h, s, h * head_dim)
        start = time.perf_counter()
        got = model.execute(inputs, cuda_graph=cuda_graph)  # build and cache
        ctx.sync()
        seconds = time.perf_counter() - start
        step, metrics = direct_variant(inputs).setup()
        ref_attn, ref_grads = step()
        for _ in range(2):  # the first call, then a cached one (captured, where it replays)
            check_close("meshfuse vs direct kernels", got, [ref_attn, *ref_grads],
                        ATTENTION_TOL)
            got = model.execute(inputs, cuda_graph=cuda_graph)
        del got
        line = next((x for x in model.explain(inputs).splitlines()
                     if x.startswith("CUDA graph replay")), "no automatic replay")
        if cuda_graph is not None:  # explain states the default; this variant overrides it
            line = f"cuda_graph={cuda_graph}"
        runner = model._get_runner()

        def cached():  # what a cached call must leave alone: programs built, graphs captured
            return len(runner._programs), len(runner._replays), sum(
                replay.graphs for replay in runner._replays.values())

        metrics = dict(metrics, first_call_s=round(seconds, 4), graph=line,
                       _cached=(cached, cached()))
        return (lambda: model.execute(inputs, cuda_graph=cuda_graph)), metrics

    name, note = _GRAPH_VARIANTS[cuda_graph]
    return Variant(name, setup, note)


def direct_variant(inputs, requested=None, name="direct"):
    """The SDPA kernels meshfuse runs, called on the local shards without meshfuse."""
    q, k, v, g = inputs

    def setup():
        backend = select_backend(q, k, v, DROPOUT_P, IS_CAUSAL, requested)

        def step():
            attn, lse, seed, offset = kernels.sdpa_forward(q, k, v, DROPOUT_P, IS_CAUSAL, None,
                                                           backend)
            return attn, kernels.sdpa_backward(g, q, k, v, attn, lse, DROPOUT_P, IS_CAUSAL,
                                               seed, offset, None, backend)

        return step, {"backend": backend.value}

    return Variant(name, setup)


def raw_aten(backend, q, k, v, g, causal=IS_CAUSAL):
    """One forward and backward of ``backend`` as bare ``torch.ops.aten`` calls (no meshfuse
    wrapper, no check, no layout work): the issue's "same kernels called directly"."""
    aten, s = torch.ops.aten, q.shape[2]
    backend = getattr(backend, "value", backend)  # an AttentionBackend or its name
    if backend == "cudnn":
        out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
        return out[0], aten._scaled_dot_product_cudnn_attention_backward(
            g, q, k, v, out[0], out[1], out[6], out[7], None, None, None, s, s, 0.0, causal)
    if backend == "flash":
        out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
        return out[0], aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out[0], out[1], None, None, s, s, 0.0, causal, out[6], out[7])
    if backend == "efficient":
        out = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
        return out[0], aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, None, out[0], out[1], out[2], out[3], 0.0, [True, True, True, False],
            causal)
    out = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out[0], aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out[0], out[1], 0.0, causal)


def raw_variant(inputs) -> Variant:
    """``direct_aten``: the kernels meshfuse selects as bare aten calls (see raw_aten)."""
    q, k, v, g = inputs

    def setup():
        backend = select_backend(q, k, v, DROPOUT_P, IS_CAUSAL)
        if backend.value not in ("cudnn", "flash", "efficient", "cpu_flash"):
            raise Skip(f"no bare aten form for the {backend.value} kernel")
        return (lambda: raw_aten(backend, q, k, v, g)), {"backend": backend.value}

    return Variant("direct_aten", setup, "bare torch.ops.aten calls")


def _autograd_step(q, k, v, g, backends):
    def step():
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT_P,
                                                 is_causal=IS_CAUSAL)
        return out, torch.autograd.grad(out, (q, k, v), g)

    return step


_ALL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                 SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _torch(inputs, name, backends, note):
    def setup():
        q, k, v = (t.detach().requires_grad_() for t in inputs[:3])
        return _autograd_step(q, k, v, inputs[3], backends)

    return Variant(name, setup, note)


def _dtensor(ctx, inputs):
    from torch.distributed.tensor import DTensor, Shard

    def setup():
        if not ctx.cuda:
            raise Skip("DTensor has no sharding rule for the CPU flash SDPA kernel (and the "
                       "math kernel's causal mask mixes Tensor and DTensor); runs on CUDA")
        mesh = ctx.dtensor_mesh()
        q, k, v, g = (DTensor.from_local(t, mesh, [Shard(1)], run_check=False) for t in inputs)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        step = _autograd_step(q, k, v, g, _ALL_BACKENDS)
        try:
            waited(step())  # its collectives too: none left unwaited at exit
            return step, {"kernels": "PyTorch's choice"}
        except NotImplementedError:  # no DTensor sharding rule for the kernel PyTorch chose
            fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
            return _autograd_step(q, k, v, g, fused), {"kernels": "flash/efficient"}

    note = "Shard(1), autograd"
    return Variant("dtensor", setup, note)


def run_attention(ctx: Context, case: str, sizes: dict[str, int], plan: Plan,
                  cuda_graph: bool, interleaved: tuple[int, int] | None = None
                  ) -> list[Record]:
    """Every variant per layout; ``cuda_graph``: with ``meshfuse_interpreter`` and
    ``meshfuse_graph`` (for launch-bound sizes: at large sizes a graph saves nothing and its
    input/output copies cost time). ``interleaved`` (rounds, iterations): ``meshfuse`` is
    also timed alternating with ``direct_aten`` (the H200's clock moves between two levels
    over seconds, and medians taken one after the other can land on different ones)."""
    records = []
    for fmt in QkvFormat:
        inputs = local_inputs(ctx, sizes, fmt)
        graphed = [meshfuse_variant(ctx, sizes, fmt, inputs, cuda_graph=mode)
                   for mode in (False, True)] if cuda_graph else []
        steps: dict = {}
        variants = [
            kept(meshfuse_variant(ctx, sizes, fmt, inputs), steps),
            *graphed,
            direct_variant(inputs),
            kept(raw_variant(inputs), steps),
            _dtensor(ctx, inputs),
            _torch(inputs, "torch_flash", [SDPBackend.FLASH_ATTENTION], "sdpa_kernel(FLASH)"),
            _torch(inputs, "torch_sdpa", _ALL_BACKENDS, "PyTorch's kernel choice"),
        ]
        params = dict(sizes, causal=IS_CAUSAL, dtype="bf16", layout=fmt.value,
                      heads_per_rank=sizes["h"] // ctx.world)
        timed = run_variants(ctx, case, fmt.value, variants, plan, "direct", params)
        if interleaved is not None:
            interleave(ctx, timed, steps, "direct_aten", *interleaved, ["meshfuse"])
        records += _vs_raw(timed)
        del inputs, variants, steps
    return records


def _vs_raw(records: list[Record]) -> list[Record]:
    """``vs_direct_aten`` on the meshfuse records: the median over ``direct_aten``'s (issue
    13's target for a plain ``execute``: at most 1.1); a meshfuse variant whose timed calls
    built a program or captured a graph again is an error record (cached calls must not)."""
    raw = next((r for r in records if r.variant == "direct_aten" and r.median_ms), None)
    for record in records:
        cached, before = record.metrics.pop("_cached", (None, None))
        if raw is not None and record.variant.startswith("meshfuse") and record.median_ms:
            record.metrics["vs_direct_aten"] = round(record.median_ms / raw.median_ms, 3)
        if cached is not None and record.status == "ok" and cached() != before:
            record.status = "error"
            record.message = (f"cached calls built or captured again: (programs, replays, "
                              f"graphs) {before} after the setup, {cached()} after timing")
    return records


def seed_case(ctx: Context) -> list[Record]:
    """Case 1: the seed's sizes (b=2, h=12, s=1024, head dim 64)."""
    sizes = QUICK_SEED_SIZES if ctx.quick else SEED_SIZES
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=20, iters=100, host_calls=50)
    plan = Plan(plan.warmup, plan.iters, plan.host_calls, flops=attention_flops(**sizes))
    return run_attention(ctx, "attention_seed", sizes, plan, cuda_graph=True)


def large_case(ctx: Context) -> list[Record]:
    """Case 2: b=4, h=32, s=4096, head dim 128."""
    sizes = QUICK_LARGE_SIZES if ctx.quick else LARGE_SIZES
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=5, iters=30)
    plan = Plan(plan.warmup, plan.iters, flops=attention_flops(**sizes))
    return run_attention(ctx, "attention_large", sizes, plan, cuda_graph=False,
                         interleaved=(2, 2) if ctx.quick else (10, 5))
