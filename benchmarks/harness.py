"""Measuring a list of variants of one benchmark into :class:`Record`\\ s.

A case builds :class:`Variant`\\ s (a name and a ``setup`` that returns the step to time) and
calls :func:`run_variants`. Each variant runs the same phases on every rank: reset the peak
memory, set up and warm up, time, optionally measure host time. The peak memory counts the
case's inputs and what the variant allocates, not what earlier variants left allocated.
After each phase the ranks exchange their outcome, so a variant that fails (or is skipped)
on one rank is recorded as such on all of them and no rank is left waiting in a later
barrier. A failure never stops the run: it becomes a record with ``status="error"`` and the
message.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from benchmarks.context import Context
from benchmarks.timing import (
    combine,
    host_us_per_call,
    interleaved_ratio,
    summarize,
    timed_samples,
)


class Skip(Exception):
    """Raised by a variant's setup when it cannot run here (yet); the message says why."""


@dataclasses.dataclass
class Record:
    """One measured (or skipped, or failed) variant of one benchmark configuration."""

    case: str
    config: str
    variant: str
    world: int
    status: str = "ok"  # "ok", "skipped" or "error"
    message: str = ""
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    iters: int | None = None
    rank_medians_ms: list[float] = dataclasses.field(default_factory=list)
    baseline: str | None = None
    ratio: float | None = None
    tflops_per_gpu: float | None = None
    peak_mib: float | None = None
    host_us: float | None = None
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    params: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Variant:
    """A way to run one benchmark configuration.

    ``setup()`` allocates what the variant needs and returns the step to time, or a pair
    ``(step, metrics)`` whose metrics (e.g. the kernel chosen) go into the record. It may
    raise :class:`Skip`.
    """

    name: str
    setup: Callable[[], Any]
    note: str = ""
    gpus: int | None = None  # GPUs its work is spread over, for TFLOP/s (default: all ranks)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to measure: iterations, and the optional extras of a case."""

    warmup: int
    iters: int
    host_calls: int = 0  # > 0: also measure host microseconds per call
    flops: float | None = None  # per iteration, over all ranks; gives TFLOP/s per GPU


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _where(e: BaseException) -> str:
    """`` [path:line]`` of the innermost frame in this repository (else the innermost)."""
    frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ else []
    ours = [f for f in frames if f.filename.startswith(_REPO + os.sep)]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return ""
    path = os.path.relpath(frame.filename, _REPO) if ours else os.path.basename(frame.filename)
    return f" [{path}:{frame.lineno}]"


def _outcome(e: BaseException) -> tuple[str, str]:
    if isinstance(e, Skip):
        return "skipped", str(e)
    return "error", f"{type(e).__name__}: {e}{_where(e)}"


def _agree(ctx: Context, local: tuple[str, str] | None) -> tuple[str, str] | None:
    """Every rank's outcome of a phase; the first error (else the first skip), or None."""
    outcomes = ctx.gather(local)
    for kind in ("error", "skipped"):
        for rank, o in enumerate(outcomes):
            if o is not None and o[0] == kind:
                message = o[1] if ctx.world == 1 or kind == "skipped" else f"rank {rank}: {o[1]}"
                return kind, message[:2000]
    return None


def _attempt(fn: Callable[[], Any]) -> tuple[Any, tuple[str, str] | None]:
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        return None, _outcome(e)


def waited(result: Any) -> Any:
    """``result`` once every functional collective in it (DTensor's outputs and gradients
    are AsyncCollectiveTensors) is waited for: a step's time includes its communication,
    and nothing is left for torch to count as unwaited at exit."""
    for leaf in tree_leaves(result):
        if isinstance(leaf, DTensor):
            leaf = leaf._local_tensor
        if isinstance(leaf, AsyncCollectiveTensor):
            leaf.wait()
    return result


def _prepare(ctx: Context, variant: Variant, warmup: int):
    prepared = variant.setup()
    step, metrics = prepared if isinstance(prepared, tuple) else (prepared, {})
    step = functools.partial(_waited_step, step)
    # The peak counts the inputs and what the steps allocate, not the setup's correctness
    # check (which holds two sets of outputs at once).
    ctx.reset_memory()
    for _ in range(warmup):
        step()
    return step, metrics


def _waited_step(step: Callable[[], Any]) -> Any:
    return waited(step())


def _run_one(ctx: Context, record: Record, variant: Variant, plan: Plan,
             leftover_mib: float) -> Record:
    unwaited = _unwaited()
    try:
        return _measure(ctx, record, variant, plan, leftover_mib)
    finally:
        # Collectives whose result nobody waited for (DTensor's functional collectives, when
        # a step drops its output): what torch's exit warning would count, by variant.
        left = _unwaited() - unwaited
        if left:
            record.metrics["unwaited_collectives"] = left


def _unwaited() -> int:
    return torch._C._distributed_c10d._get_work_registry_size()


def _measure(ctx: Context, record: Record, variant: Variant, plan: Plan,
             leftover_mib: float) -> Record:
    prepared, failed = _attempt(lambda: _prepare(ctx, variant, plan.warmup))
    failed = _agree(ctx, failed)
    if failed is None:
        step, metrics = prepared
        record.metrics.update(metrics)
        samples, failed = _attempt(lambda: timed_samples(ctx, step, plan.iters))
        failed = _agree(ctx, failed)
    if failed is None and plan.host_calls:
        host, failed = _attempt(lambda: host_us_per_call(ctx, step, plan.host_calls))
        failed = _agree(ctx, failed)
    if failed is not None:
        record.status, record.message = failed
        return record
    peak = ctx.peak_memory_mib()
    if peak is not None:
        peak -= leftover_mib
    per_rank = ctx.gather((summarize(samples), peak, host if plan.host_calls else None))
    stats = combine([p[0] for p in per_rank])
    record.median_ms, record.p10_ms, record.p90_ms = stats.median_ms, stats.p10_ms, stats.p90_ms
    record.iters, record.rank_medians_ms = stats.iters, list(stats.rank_medians_ms)
    peaks = [p[1] for p in per_rank if p[1] is not None]
    record.peak_mib = max(peaks) if peaks else None
    if plan.host_calls:
        record.host_us = max(p[2]["host_us"] for p in per_rank)
        gpu = [p[2]["gpu_us"] for p in per_rank if p[2]["gpu_us"] is not None]
        if gpu:
            record.metrics["gpu_us"] = max(gpu)
        busy = [p[2]["gpu_busy"] for p in per_rank]
        if False in busy:
            record.metrics["host_note"] = "a call waited for the GPU: host time includes it"
    if plan.flops and stats.median_ms > 0:
        gpus = variant.gpus or ctx.world
        record.tflops_per_gpu = plan.flops / gpus / (stats.median_ms * 1e-3) / 1e12
    return record


def _release(ctx: Context) -> None:
    """Frees what the last variant left (reference cycles too) before the next one's peak
    memory is measured. Only on CUDA: the CPU has no peak to measure, and each full
    collection of torch's heap costs about 0.1 s (a quarter of a ``--quick`` run's time)."""
    if ctx.cuda:
        gc.collect()
        torch.cuda.empty_cache()


def run_variants(ctx: Context, case: str, config: str, variants: list[Variant], plan: Plan,
                 baseline: str | None, params: dict[str, Any] | None = None) -> list[Record]:
    """Measures each variant in turn; ratios are median time over the baseline's.

    Args:
        case, config: the benchmark family and this configuration's label (e.g. "BSHE").
        variants: in the order to run and print them.
        plan: iterations and extras.
        baseline: the variant name the ratios are against (None: no ratios).
        params: sizes and options, copied into every record.
    """
    records = []
    _release(ctx)
    inputs_mib = ctx.allocated_mib()  # the case's inputs
    for variant in variants:
        ctx.log(f"  {case} {config} {variant.name} ...")
        record = Record(case, config, variant.name, ctx.world, params=dict(params or {}))
        if variant.note:
            record.metrics["note"] = variant.note
        # What earlier variants leave allocated (DTensor keeps some tensors alive) is not
        # this variant's: its peak counts the inputs and its own allocations only.
        leftover = max(0.0, ctx.allocated_mib() - inputs_mib) if ctx.cuda else 0.0
        if leftover:
            record.metrics["leftover_mib"] = round(leftover)
        records.append(_run_one(ctx, record, variant, plan, leftover))
        _release(ctx)
    set_ratios(records, baseline)
    return records


def kept(variant: Variant, steps: dict) -> Variant:
    """``variant`` whose step is also kept in ``steps`` by name (for :func:`interleave`,
    after every variant ran alone)."""
    def setup():
        made = variant.setup()
        steps[variant.name] = made[0] if isinstance(made, tuple) else made
        return made

    return dataclasses.replace(variant, setup=setup)


def interleave(ctx: Context, records: list[Record], steps: dict, baseline: str,
               rounds: int, iters: int, names: list[str]) -> None:
    """The time of each variant of ``names`` over ``baseline``'s, timed interleaved with it
    (:func:`~benchmarks.timing.interleaved_ratio`: alternating blocks, so that a drift of the
    devices' clocks hits both alike), into its record's metrics (``interleaved_ratio``)."""
    base = steps.get(baseline)
    for record in records:
        step = steps.get(record.variant)
        if base is None or step is None or record.variant not in names:
            continue
        ratio = interleaved_ratio(ctx, functools.partial(_waited_step, base),
                                  functools.partial(_waited_step, step), rounds, iters)
        record.metrics["interleaved_ratio"] = round(ratio, 3)
        record.metrics["summary"] = f"interleaved with {baseline}: {ratio:.3f}x"


def autograd_step(run: Callable[..., torch.Tensor], inputs, cotangent: torch.Tensor,
                  params=()) -> Callable[[], tuple]:
    """The step of a variant timed forward and backward through torch autograd.

    ``inputs`` are made leaves that require grad (detached copies); ``params`` are leaves
    already (a module's parameters). The step runs ``run(*inputs)`` and returns its output
    and the gradients of the inputs, then of the params, for ``cotangent``.
    """
    leaves = [t.detach().requires_grad_() for t in inputs]
    wrt = [*leaves, *params]

    def step():
        out = run(*leaves)
        return out, torch.autograd.grad(out, wrt, cotangent)

    return step


def check_close(what: str, got, expected, tol: float) -> None:
    """Raises ``ValueError`` unless each tensor of ``got`` is within ``tol`` of ``expected``,
    as relative error ``||got - expected|| / ||expected||`` (a benchmark of wrong results
    would mislead)."""
    got, expected = list(got), list(expected)
    if len(got) != len(expected):
        raise ValueError(f"{what}: {len(got)} outputs, the reference has {len(expected)}")
    for i, (g, e) in enumerate(zip(got, expected)):
        if tuple(g.shape) != tuple(e.shape):
            raise ValueError(f"{what}: output {i} has shape {list(g.shape)}, the reference "
                             f"{list(e.shape)}")
        e = e.float()
        err = ((g.float() - e).norm() / e.norm().clamp_min(1e-30)).item()
        if not err <= tol:
            raise ValueError(f"{what}: output {i} differs from the reference by {err:.2e} "
                             f"(relative), more than {tol:g}")


def set_ratios(records: list[Record], baseline: str | None) -> None:
    base = next((r for r in records if r.variant == baseline and r.status == "ok"), None)
    for r in records:
        r.baseline = baseline
        if base is not None and r.status == "ok" and base.median_ms:
            r.ratio = r.median_ms / base.median_ms


def skipped(ctx: Context, case: str, config: str, variant: str, message: str,
            params: dict[str, Any] | None = None) -> Record:
    """A record for a variant that is not run at all (the same decision on every rank)."""
    return Record(case, config, variant, ctx.world, status="skipped", message=message,
                  params=dict(params or {}))
