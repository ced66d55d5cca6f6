"""Fused segments (issue 13): each program as the interpreter, compiled, torch eager,
``torch.compile`` of the same torch code, and the memory floor.

Programs, rows split over the ranks (timings per rank):

- the 10-op pointwise chain (:class:`~benchmarks.fusions.Pointwise10`), fp32, global
  4096x4096 and 8192x8192;
- softmax over rows written with ops (``fd.ops.softmax``), bf16 in and out, 16384x4096;
- layer norm and RMS norm forward and backward written with ops (:class:`NormFwdBwd`),
  bf16, 16384x4096: outputs ``y`` and ``dx`` (the weight's gradient, a sum over the split
  rows, is left out: it would add an allreduce).

Variants: ``meshfuse`` (plain ``execute``: the interpreter's program, replayed from a CUDA
graph from the second call on, where safe: see ``meshfuse.runtime.replay.automatic``),
``meshfuse_compiled`` (``execute(compile=True)``: the compiled segments, replayed alike), ``meshfuse_compiled_no_graph`` (the same launched from Python,
``cuda_graph=False``), ``torch_eager`` and ``torch_compile`` (the same torch calls),
``memory_floor`` (a copy of as many bytes as the program reads and writes, so its time is
those bytes at the copy bandwidth of this run); ratios are against ``memory_floor``, and
``vs_torch_compile`` on the meshfuse records is the ratio to ``torch_compile``. ``graph``
says whether the program is replayed (explain's line). A compiled variant whose timed calls
compiled again is an error record (cached calls never recompile). Each variant's host time per call
(``host_us``, the GPU kept busy) and GPU time (``gpu_us``) say whether it is host- or
GPU-bound. The compiled variants record their
first-call compile time (``compile_s``) and, for meshfuse, the number of compilations
(``compiles``; a later call that recompiled would change it). Without CUDA (``--quick``) the
compiled variants use torch.compile's ``aot_eager`` backend: Inductor's C++ build on a CPU
would dominate a smoke test.
"""

from __future__ import annotations

import time

import torch

import meshfuse
from benchmarks.context import Context
from benchmarks.fusions import Pointwise10, _Sharded, pointwise10_torch
from benchmarks.harness import Plan, Record, Variant, check_close, run_variants
from meshfuse import DataType

EPS = 1e-5


class SoftmaxRows(_Sharded):
    """``softmax(x, dim=1)`` with ``fd.ops.softmax``; ``x [n, m]`` rows split."""

    def __init__(self, n: int, m: int, mesh, dtype=DataType.BFloat16):
        super().__init__(mesh)
        self._shape, self._dtype = [n, m], dtype

    def definition(self) -> None:
        x = self._on(self.define_tensor(self._shape, dtype=self._dtype), 0)
        self.add_output(self._on(self.ops.softmax(x, 1), 0))


def softmax_torch(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=1)


class NormFwdBwd(_Sharded):
    """Layer norm (``rms=False``) or RMS norm over rows, forward and input gradient, written
    with ops in float32 from bf16 ``x [n, m]``, ``w [m]`` (replicated) and ``dy [n, m]``."""

    def __init__(self, n: int, m: int, mesh, rms: bool):
        super().__init__(mesh)
        self._shape, self._rms = [n, m], rms

    def definition(self) -> None:
        o, bf16 = self.ops, DataType.BFloat16
        x = self._on(self.define_tensor(self._shape, dtype=bf16), 0)
        w = self._on(self.define_tensor(self._shape[1:], dtype=bf16), None)
        dy = self._on(self.define_tensor(self._shape, dtype=bf16), 0)
        xf, wf, g = o.cast(x, DataType.Float), o.cast(w, DataType.Float), o.cast(dy, DataType.Float)
        if self._rms:
            rstd = o.rsqrt(o.add(o.mean(o.mul(xf, xf), [1], keepdim=True), EPS))
            xhat = o.mul(xf, rstd)
        else:
            var, mean = o.var_mean(xf, [1], correction=0, keepdim=True)
            rstd = o.rsqrt(o.add(var, EPS))
            xhat = o.mul(o.sub(xf, mean), rstd)
        gw = o.mul(g, wf)
        inner = o.mul(xhat, o.mean(o.mul(gw, xhat), [1], keepdim=True))
        if not self._rms:
            inner = o.add(inner, o.mean(gw, [1], keepdim=True))
        dx = o.mul(o.sub(gw, inner), rstd)
        self.add_output(self._on(o.cast(o.mul(xhat, wf), bf16), 0))
        self.add_output(self._on(o.cast(dx, bf16), 0))


def norm_torch(rms: bool):
    """The torch calls of :class:`NormFwdBwd`."""

    def run(x, w, dy):
        xf, wf, g = x.float(), w.float(), dy.float()
        if rms:
            rstd = torch.rsqrt((xf * xf).mean(1, keepdim=True) + EPS)
            xhat = xf * rstd
        else:
            var, mean = torch.var_mean(xf, 1, correction=0, keepdim=True)
            rstd = torch.rsqrt(var + EPS)
            xhat = (xf - mean) * rstd
        gw = g * wf
        inner = xhat * (gw * xhat).mean(1, keepdim=True)
        if not rms:
            inner = inner + gw.mean(1, keepdim=True)
        return (xhat * wf).to(torch.bfloat16), ((gw - inner) * rstd).to(torch.bfloat16)

    return run


def _first_call(fn, inputs) -> tuple[list, float]:
    start = time.perf_counter()
    out = fn(*inputs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _variants(ctx: Context, model, torch_fn, inputs: list, tol: float) -> list[Variant]:
    backend = "inductor" if ctx.cuda else "aot_eager"
    expected = torch_fn(*inputs)
    expected = list(expected) if isinstance(expected, tuple) else [expected]
    moved = sum(x.numel() * x.element_size() for x in [*inputs, *expected])
    src = torch.empty(moved // 2, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)

    def mf(compile, cuda_graph=None):
        def run(*args):
            return model.execute(list(args), compile=compile, cuda_graph=cuda_graph)

        def setup():
            out, seconds = _first_call(run, inputs)  # compiles, and picks kernels
            check_close("meshfuse vs torch", out, expected, tol)
            check_close("meshfuse replayed vs torch", run(*inputs), expected, tol)
            if not compile:
                return (lambda: run(*inputs)), {"graph": _replay_line(model, inputs)}
            (_, stats), = model._get_runner()._fused.values()
            return (lambda: run(*inputs),
                    {"compile_s": round(seconds, 3), "compiles": stats.compiles,
                     "graph": _replay_line(model, inputs) if cuda_graph is None else
                     f"cuda_graph={cuda_graph}", "_stats": stats})
        return setup

    def compiled_torch():
        fn = torch.compile(torch_fn, backend=backend, dynamic=False)
        out, seconds = _first_call(fn, inputs)
        check_close("torch.compile vs torch", out if isinstance(out, tuple) else [out],
                    expected, tol)
        return (lambda: fn(*inputs)), {"compile_s": round(seconds, 3)}

    return [Variant("meshfuse", mf(False)),
            Variant("meshfuse_compiled", mf(backend),
                    "execute(compile=True): segments compiled, replayed from a CUDA graph "
                    "where safe"),
            Variant("meshfuse_compiled_no_graph", mf(backend, False),
                    "execute(compile=True, cuda_graph=False): the compiled segments launched "
                    "from Python"),
            Variant("torch_eager", lambda: (lambda: torch_fn(*inputs))),
            Variant("torch_compile", compiled_torch),
            Variant("memory_floor", lambda: (lambda: dst.copy_(src)),
                    note=f"copy of {moved} bytes: the program's reads and writes")]


def _replay_line(model, inputs) -> str:
    """explain's line on the automatic CUDA-graph replay of ``inputs``' signature."""
    lines = model.explain(inputs).splitlines()
    return next((line for line in lines if line.startswith("CUDA graph replay")), "none")


def _finish(records: list[Record]) -> list[Record]:
    """Adds ``vs_torch_compile`` (median over ``torch_compile``'s) to the meshfuse records,
    and marks a compiled variant whose timed calls recompiled as an error (cached calls must
    never recompile)."""
    by_name = {r.variant: r for r in records}
    reference = by_name.get("torch_compile")
    for record in records:
        stats = record.metrics.pop("_stats", None)
        if not record.variant.startswith("meshfuse") or record.median_ms is None:
            continue
        if reference is not None and reference.median_ms:
            record.metrics["vs_torch_compile"] = round(record.median_ms / reference.median_ms, 3)
        if stats is not None and stats.compiles != record.metrics.get("compiles"):
            record.status = "error"
            record.message = (f"cached calls recompiled: {record.metrics.get('compiles')} "
                              f"compilations after the first call, {stats.compiles} after timing")
    return records


def _rows(ctx: Context, n: int) -> int:
    if n % ctx.world:
        raise ValueError(f"{n} rows do not split over {ctx.world} ranks")
    return n // ctx.world


def _randn(ctx: Context, *shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    gen = torch.Generator(ctx.device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=ctx.device).to(dtype)


def run(ctx: Context) -> list[Record]:
    """Every program of the module doc, at quick sizes with ``--quick``."""
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=10, iters=50, host_calls=50)
    mesh = meshfuse.DeviceMesh(range(ctx.world))
    records = []
    for n in ((64,) if ctx.quick else (4096, 8192)):
        x, y = (_randn(ctx, _rows(ctx, n), n, seed=s) for s in (0, 1))
        variants = _variants(ctx, Pointwise10(n, mesh), pointwise10_torch, [x, y],
                             1e-5)
        records += _finish(run_variants(ctx, "fusion", f"pointwise10 {n}x{n}", variants, plan,
                                        "memory_floor", {"n": n, "dtype": "fp32"}))
    n, m = (64, 32) if ctx.quick else (16384, 4096)
    x = _randn(ctx, _rows(ctx, n), m, dtype=torch.bfloat16)
    variants = _variants(ctx, SoftmaxRows(n, m, mesh), softmax_torch, [x], 1e-2)
    records += _finish(run_variants(ctx, "fusion", f"softmax {n}x{m}", variants, plan,
                                    "memory_floor", {"n": n, "m": m, "dtype": "bf16"}))
    w, dy = _randn(ctx, m, dtype=torch.bfloat16, seed=1), \
        _randn(ctx, _rows(ctx, n), m, dtype=torch.bfloat16, seed=2)
    for rms, name in ((False, "layer_norm"), (True, "rms_norm")):
        variants = _variants(ctx, NormFwdBwd(n, m, mesh, rms), norm_torch(rms),
                             [x, w, dy], 1e-2)
        records += _finish(run_variants(ctx, "fusion", f"{name} fwd+bwd {n}x{m}", variants,
                                        plan, "memory_floor", {"n": n, "m": m, "dtype": "bf16"}))
    return records
