"""Case: the seed's attention forward+backward with dropout 0.1 against dropout 0.0.

The seed's sizes (b=2, h=12, s=1024, head dim 64, causal, bf16, heads split over the ranks),
BHSE, as variants:

- ``meshfuse_p0`` (baseline): the seed's fusion with ``dropout_p = 0.0``, plain ``execute``
  (replayed from a CUDA graph: ``replay`` in the record says whether it was);
- ``meshfuse_p0.1``: the same with ``dropout_p = 0.1`` in the default ``"shard"`` mode: the
  fastest fused kernel that supports dropout, each head shard drawing from its own stream,
  replayed too (each replay seeds the streams: ``meshfuse.runtime.replay.streams``; target:
  within 1.3x of the baseline);
- ``meshfuse_interpreter_p0``, ``meshfuse_interpreter_p0.1``: both with
  ``execute(cuda_graph=False)`` (kernels launched from Python, host-bound);
- ``aten_cudnn_p0``, ``aten_cudnn_p0.1``: cuDNN's forward and backward aten ops called
  directly (bound once, no checks), with dropout 0.0 and 0.1: their GPU times (``gpu_us``) are
  the kernel's own cost of dropout, the floor of any ratio above;
- ``aten_cudnn_graph_p0``, ``aten_cudnn_graph_p0.1``: the same aten calls replayed from a CUDA
  graph of their own (PyTorch's graph-safe RNG: a new mask at each replay): the floor in
  wall time, without host time;
- ``direct_p0.1``: the kernel meshfuse selects for dropout, called directly on the local
  shards (no per-shard stream): what meshfuse adds to it;
- ``direct_<backend>_p0.1``, ``direct_<backend>_p0``: each fused CUDA kernel with and
  without dropout, called directly (which is fastest with dropout here, and what dropout
  costs each kernel itself);
- ``torch_sdpa_p0.1``: ``F.scaled_dot_product_attention(dropout_p=0.1)`` with autograd;
- ``meshfuse_global_p0.1``: ``dropout_mode="global"`` (the math kernel with the global
  mask: the validation mode, for its cost).

- ``meshfuse_<backend>_p0.1``, ``meshfuse_<backend>_p0``: meshfuse on each fused kernel
  with and without dropout (``MESHFUSE_SDPA_BACKEND`` at the first call, when the kernel is
  bound): which fused kernel is fastest with dropout here, and dropout's cost when both
  runs use the same kernel.

Every variant also records its host time per call (``host_us``, the GPU kept busy) and its
GPU time (``gpu_us``): a call is host-bound here, and a slow iteration is either host work or
a wait for the GPU (``host_note``). Timings of a host-bound program drift with the host's
load, so the dropout cost is also measured *interleaved*: ``meshfuse_p0`` and
``meshfuse_p0.1`` timed in alternating blocks, the median of the per-round ratios
(``interleaved_ratio`` on the ``meshfuse_p0.1`` record; the target is <= 1.3).

The ``meshfuse_p0.1`` record ends with ``dropout_cost`` (and its one-line ``summary``): the
ratios of meshfuse (replayed, interleaved, interpreted; GPU time), of the cuDNN aten kernel
alone (GPU time, and graphed wall time), the fastest fused kernel with dropout here (by GPU
time of ``direct_<backend>_p0.1``), each kernel's p0.1/p0 ratio against itself (GPU time
of the direct calls, ``same_kernel_gpu``; meshfuse's wall time, ``same_kernel_meshfuse``),
and whether the 1.3x target is met, or, when the kernel alone costs more than 1.3x, that it
cannot be.

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
from meshfuse.ops.attention import kernels
from meshfuse.ops.attention.backends import ENV_VAR as BACKEND_ENV
from meshfuse.ops.attention.backends import select_backend
from meshfuse.ops.attention.dropout import kernel_state

P, IS_CAUSAL = 0.1, True
FUSED = ("cudnn", "flash", "efficient")
OUTPUTS = ("attn", "q_grad", "k_grad", "v_grad")


def meshfuse_variant(ctx: Context, sizes, inputs, p: float, mode: str | None = None,
                     backend: str | None = None, steps: dict | None = None,
                     cuda_graph: bool | None = None) -> Variant:
    """The seed's fusion with ``dropout_p = p`` (and ``dropout_mode``), run on the shards
    with ``execute(cuda_graph=cuda_graph)``; ``backend`` forces the attention kernel;
    ``steps`` collects the timed step by name. Metric ``replay``: explain's line on the
    automatic replay, after the setup's calls."""
    name = f"meshfuse_p{p:g}" if mode is None else f"meshfuse_{mode}_p{p:g}"
    if backend is not None:
        name = f"meshfuse_{backend}_p{p:g}"
    if cuda_graph is False:
        name = name.replace("meshfuse_", "meshfuse_interpreter_", 1)

    def setup():
        b, h, s, head_dim = (sizes[k] for k in ("b", "h", "s", "head_dim"))
        model = SeedAttention(QkvFormat.BHSE, meshfuse.DeviceMesh(range(ctx.world)), b, h, s,
                              h * head_dim, dropout_p=p, dropout_mode=mode)
        if backend is not None:
            if not ctx.cuda:
                raise Skip("the fused dropout kernels are CUDA kernels")
            _bind_with(model, inputs, backend)
        def step():
            return model.execute(inputs, cuda_graph=cuda_graph)

        metrics = {}
        if p > 0:
            metrics = reproducible(step, deterministic_check=mode != "global",
                                   one_thread=not ctx.cuda)
            if mode is None:
                metrics["backend"] = (backend or select_backend(*inputs[:3], p, IS_CAUSAL).value)
        for _ in range(3):  # captured at the second call with these inputs, where it replays
            step()
        metrics["replay"] = replay_state(model, inputs, cuda_graph)
        if steps is not None:
            steps[name] = step
        return step, metrics

    note = f"dropout_mode={mode}" if mode else ""
    if cuda_graph is False:
        note = "execute(cuda_graph=False)"
    return Variant(name, setup, note)


def replay_state(model, inputs, cuda_graph: bool | None) -> str:
    """explain's line on the automatic replay ("CUDA graph replay: ..."), shortened."""
    if cuda_graph is False:
        return "off (cuda_graph=False)"
    line = next((x for x in model.explain(inputs).splitlines()
                 if x.startswith("CUDA graph replay")), "no automatic replay")
    return line.removeprefix("CUDA graph replay: ")


def reproducible(step, deterministic_check: bool = True, one_thread: bool = False) -> dict:
    """Checks that the same seed gives the same masks (``check_same_seed``: the attention
    output bitwise; gradients bitwise under deterministic algorithms, else within a
    reordered sum's rounding: flash's backward adds ``q_grad`` with atomics) and finite
    outputs; returns the gradients that are not bitwise reproducible by default, as a
    metric. ``one_thread``: check with one intra-op thread (on CPU, the bf16 matmuls of the
    math kernel are not bitwise reproducible across threads under load: docs/dropout.md)."""
    threads = torch.get_num_threads()
    if one_thread:
        torch.set_num_threads(1)
    try:
        found = check_same_seed(step, OUTPUTS, deterministic_check=deterministic_check,
                                strict=False)
    finally:
        torch.set_num_threads(threads)
    if not all(t.isfinite().all() for t in step()):
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


def direct_variant(ctx: Context, inputs, requested: str | None, p: float = P) -> Variant:
    """A fused kernel called directly on the local shards with dropout ``p`` (CUDA only)."""
    q, k, v, g = inputs

    def setup():
        if not ctx.cuda:
            raise Skip("the fused dropout kernels are CUDA kernels")
        try:
            backend = select_backend(q, k, v, p, IS_CAUSAL, requested)
        except InputError as err:
            raise Skip(str(err)) from None

        def step():
            attn, lse, seed, offset = kernels.sdpa_forward(q, k, v, p, IS_CAUSAL, None, backend)
            return attn, kernels.sdpa_backward(g, q, k, v, attn, lse, p, IS_CAUSAL, seed,
                                               offset, None, backend)

        return step, {"backend": backend.value}

    name = f"direct_{requested}_p{p:g}" if requested else f"direct_p{p:g}"
    return Variant(name, setup)


def aten_variant(ctx: Context, inputs, p: float, graphed: bool = False) -> Variant:
    """cuDNN's aten forward and backward called directly on the local shards with dropout
    ``p`` (the raw ops, bound once; the RNG state passed as meshfuse passes it), or, with
    ``graphed``, the same calls replayed from a CUDA graph (CUDA only)."""
    q, k, v, g = inputs

    def setup():
        if not ctx.cuda:
            raise Skip("cuDNN attention is a CUDA kernel")
        try:
            backend, forward, backward = kernels.bind_kernels(q, k, v, p, IS_CAUSAL, "cudnn")
        except InputError as err:
            raise Skip(str(err)) from None

        def step():
            attn, lse, seed, offset = forward(q, k, v, p, IS_CAUSAL, None)
            seed, offset = kernel_state(backend, seed, offset, p, q.device, kernel_form=True)
            return attn, backward(g, q, k, v, attn, lse, p, IS_CAUSAL, seed, offset, None)

        return (graphed_step(step) if graphed else step), {"backend": backend.value}

    return Variant(f"aten_cudnn{'_graph' if graphed else ''}_p{p:g}", setup,
                   "CUDA graph of the aten calls" if graphed else "aten calls, bound once")


def graphed_step(step):
    """``step`` captured into a CUDA graph (after a warm-up on a side stream, as CUDA asks);
    returns a step that replays it. PyTorch registers its default CUDA generator with every
    graph, so a kernel with dropout draws a new mask at each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    def replay():
        graph.replay()
        return out

    return replay


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
        meshfuse_variant(ctx, sizes, inputs, 0.0, cuda_graph=False),
        meshfuse_variant(ctx, sizes, inputs, P, cuda_graph=False),
        *(aten_variant(ctx, inputs, p, graphed) for graphed in (False, True)
          for p in (0.0, P)),
        direct_variant(ctx, inputs, None),
        *(direct_variant(ctx, inputs, name, p) for name in FUSED for p in (0.0, P)),
        *(meshfuse_variant(ctx, sizes, inputs, p, backend=name) for name in FUSED
          for p in (0.0, P)),
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
    if record is not None:
        cost = dropout_cost(records)
        record.metrics["dropout_cost"] = cost
        record.metrics["summary"] = cost_summary(cost)
    return records


def _ratio(by: dict[str, Record], variant: str, base: str, gpu: bool = False) -> float | None:
    """``variant``'s time over ``base``'s: median wall time, or GPU time (``gpu``)."""
    a, b = by.get(variant), by.get(base)
    if a is None or b is None:
        return None
    if gpu:
        x, y = a.metrics.get("gpu_us"), b.metrics.get("gpu_us")
    else:
        x, y = a.median_ms, b.median_ms
    return None if not x or not y else round(x / y, 3)


def dropout_cost(records: list[Record]) -> dict:
    """What dropout 0.1 costs over 0.0, same run: meshfuse's ratios, the cuDNN kernel's own
    (the floor), the fastest fused kernel with dropout here, and the 1.3x target's verdict."""
    by = {r.variant: r for r in records if r.status == "ok"}
    p = f"p{P:g}"
    mf = by.get(f"meshfuse_{p}")
    cost = {
        "meshfuse_replayed": _ratio(by, f"meshfuse_{p}", "meshfuse_p0"),
        "meshfuse_interleaved": mf.metrics.get("interleaved_ratio") if mf else None,
        "meshfuse_gpu": _ratio(by, f"meshfuse_{p}", "meshfuse_p0", gpu=True),
        "meshfuse_interpreted": _ratio(by, f"meshfuse_interpreter_{p}",
                                       "meshfuse_interpreter_p0"),
        "kernel_gpu": _ratio(by, f"aten_cudnn_{p}", "aten_cudnn_p0", gpu=True),
        "kernel_graphed": _ratio(by, f"aten_cudnn_graph_{p}", "aten_cudnn_graph_p0"),
    }
    fused = {name: by[f"direct_{name}_{p}"].metrics.get("gpu_us") for name in FUSED
             if f"direct_{name}_{p}" in by}
    fused = {name: us for name, us in fused.items() if us}
    if fused:
        cost["dropout_kernels_gpu_us"] = {n: round(us, 1) for n, us in fused.items()}
        cost["fastest_dropout_kernel"] = min(fused, key=fused.get)
    # Each kernel against itself without dropout: the kernel's own cost of dropout, and
    # meshfuse's p0.1 over p0 when both run that kernel.
    cost["same_kernel_gpu"] = _per_kernel(by, "direct_{}_" + p, "direct_{}_p0", gpu=True)
    cost["same_kernel_meshfuse"] = _per_kernel(by, "meshfuse_{}_" + p, "meshfuse_{}_p0")
    cost["target_1.3x"] = _verdict(cost)
    return cost


def _per_kernel(by: dict[str, Record], variant: str, base: str, gpu: bool = False) -> dict:
    """``_ratio`` of ``variant`` over ``base`` for each fused kernel (names formatted with
    the kernel's), for the kernels measured both ways."""
    ratios = {name: _ratio(by, variant.format(name), base.format(name), gpu) for name in FUSED}
    return {name: r for name, r in ratios.items() if r is not None}


def _verdict(cost: dict) -> str:
    measured = cost["meshfuse_interleaved"] or cost["meshfuse_replayed"]
    floor = cost["kernel_graphed"] or cost["kernel_gpu"]
    if measured is None:
        return "not measured"
    if measured <= 1.3:
        return f"met ({measured:.2f}x)"
    if floor is not None and floor > 1.3:
        return (f"not reachable: the cuDNN kernel alone costs {floor:.2f}x with dropout; "
                f"meshfuse {measured:.2f}x")
    alone = "not measured" if floor is None else f"{floor:.2f}x"
    return f"not met ({measured:.2f}x; the kernel alone {alone})"


def cost_summary(cost: dict) -> str:
    """The dropout cost in one line (the report's notes)."""
    def x(value):
        return "-" if value is None else f"{value:.2f}x"

    fastest = cost.get("fastest_dropout_kernel")
    kernels_us = cost.get("dropout_kernels_gpu_us", {})
    fastest = f"{fastest} {kernels_us[fastest]} us" if fastest else "-"
    return (f"p0.1/p0: replayed {x(cost['meshfuse_replayed'])}, interleaved "
            f"{x(cost['meshfuse_interleaved'])}, GPU {x(cost['meshfuse_gpu'])}, interpreted "
            f"{x(cost['meshfuse_interpreted'])}; cuDNN kernel alone: GPU "
            f"{x(cost['kernel_gpu'])}, graphed {x(cost['kernel_graphed'])}; fastest with "
            f"dropout: {fastest}; each kernel against itself: GPU "
            f"{_listed(cost['same_kernel_gpu'])}, meshfuse {_listed(cost['same_kernel_meshfuse'])}"
            f"; 1.3x target: {cost['target_1.3x']}")


def _listed(ratios: dict) -> str:
    return ", ".join(f"{name} {r:.2f}x" for name, r in ratios.items()) or "-"
