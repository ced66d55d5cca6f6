"""Triton kernels of the fused cross entropy on class indices (CUDA).

The forward reads each row of logits once when it fits on chip (``one_block``: the whole row
in registers) and otherwise twice (an online max and sum of exponentials over blocks, then
the gradient), and writes per row the loss and the *gradient of the reduced loss*:
``(softmax(x) - w) * scale``, ``w`` the target distribution (one-hot, mixed with the uniform
one by label smoothing), ``scale`` ``1 / count`` for a mean (zero on an ignored row). The
backward then only scales that gradient by the incoming cotangent: :func:`scale_in_place`
reads the cotangent on the device and returns at once when it equals the scale already
applied (1.0 after a forward), with no host synchronization, so it is safe in CUDA graphs.

A target out of ``[0, classes)`` that is not ``ignore_index`` gives a NaN loss and NaN
gradient row (never a silent value; ``MESHFUSE_CHECK_INDICES=1`` raises on the host).
"""

from __future__ import annotations

import dataclasses
import os

import torch

# Triton decides when a kernel is decorated whether it is interpreted.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

triton = None
if torch.cuda.is_available() or INTERPRETED:  # a CPU-only process never imports Triton
    try:
        import triton
        import triton.language as tl
    except ImportError:  # the torch implementation is used instead
        triton = None

# Rows of at most this many classes are held whole in registers (one read of the logits).
# Measured on one H200 (8192 rows, bf16; benchmarks/results/2026-12-03-1530-h200-1gpu-
# cross-entropy-sweep-*): at 32k classes one block of 32 warps took 1.63x a copy of the
# logits, two passes over blocks 1.50x or less (the second read hits L2), so longer rows take
# two passes.
ONE_BLOCK_MAX = 8192
# Longer rows, read in two passes over blocks of CHUNK classes (see :func:`_two_pass_config`).
CHUNK = 8192
LONG_ROW = 65536


def available(x: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``x``: on CUDA, or on the CPU where this module
    was imported with the Triton interpreter on (``TRITON_INTERPRET=1``, for tests)."""
    return triton is not None and (x.is_cuda or (INTERPRETED and x.device.type == "cpu"))



if triton is not None:
    # exp(x) as exp2(x * LOG2E): the subtraction of a row's maximum then folds into one
    # multiply-add per element
    LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def _online_stats(x_row, n_classes, BLOCK: tl.constexpr, SMOOTHED: tl.constexpr):
        """The log-sum-exp and (``SMOOTHED``) the sum of a row read block by block: an
        online maximum and rescaled sum per block, the blocks kept in L2 for the second
        read. The loop is not software-pipelined: on an H200 three stages took 1.2-1.4x
        one. (Per-thread sums shifted by the first block's maximum, reduced once a row,
        took 1.05x this at 128k once the exponentials were one multiply-add each:
        benchmarks/results/2026-12-04-0845-h200-1gpu-cross-entropy-sweep-7bd769d.txt.)"""
        cols = tl.arange(0, BLOCK)
        total = tl.zeros((), tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in tl.range(0, n_classes, BLOCK, num_stages=1):
            mask = start + cols < n_classes
            x = tl.load(x_row + start + cols, mask=mask, other=float("-inf"),
                        eviction_policy="evict_last").to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2(x * LOG2E - m_new * LOG2E), 0)
            m = m_new
            if SMOOTHED:
                total += tl.sum(tl.where(mask, x, 0.0), 0)
        return m + tl.log(s), total

    @triton.jit
    def _forward_kernel(x_ptr, x_stride, target_ptr, grad_ptr, grad_stride, loss_ptr,
                        count_ptr, n_classes, ignore_index, smoothing,
                        HAS_COUNT: tl.constexpr, ONE_BLOCK: tl.constexpr,
                        BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr,
                        SMOOTHED: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        g_row = grad_ptr + row * grad_stride
        cols = tl.arange(0, BLOCK)
        if ONE_BLOCK:  # the whole row in registers: read once
            mask = cols < n_classes
            x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            m = tl.max(x, 0)
            e = tl.exp2(x * LOG2E - m * LOG2E)
            s = tl.sum(e, 0)
            lse = m + tl.log(s)
            total = tl.zeros((), tl.float32)
            if SMOOTHED:
                total = tl.sum(tl.where(mask, x, 0.0), 0)
        else:  # statistics first (the second read then finds the row in L2)
            lse, total = _online_stats(x_row, n_classes, BLOCK, SMOOTHED)
        # What depends on the target comes after the first read: nothing delays it.
        target = tl.load(target_ptr + row).to(tl.int64)
        ignored = target == ignore_index
        valid = (target >= 0) & (target < n_classes)
        scale = 1.0
        if HAS_COUNT:
            scale = 1.0 / tl.load(count_ptr).to(tl.float32)
        scale = tl.where(ignored, 0.0, tl.where(valid, scale, float("nan")))
        uniform = 0.0
        if SMOOTHED:
            uniform = smoothing / n_classes
        # the target's logit read on its own: a further reduction over the row costs more
        x_t = tl.load(x_row + tl.where(valid, target, 0)).to(tl.float32)
        # the gradient (softmax(x) - w) * scale as p * scale - w * scale, w's two values
        # scaled once
        hit = (1.0 - smoothing + uniform) * scale
        miss = uniform * scale
        if WRITE_GRAD:
            if ONE_BLOCK:
                grad = e * (scale / s) - tl.where(cols == target, hit, miss)
                tl.store(g_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)
            else:
                shift = lse * LOG2E
                for start in tl.range(0, n_classes, BLOCK, num_stages=1):
                    mask = start + cols < n_classes
                    x = tl.load(x_row + start + cols, mask=mask, other=0.0,
                                eviction_policy="evict_first").to(tl.float32)
                    p = tl.exp2(x * LOG2E - shift)
                    grad = p * scale - tl.where(cols == target - start, hit, miss)
                    # streamed: the gradient does not push the rows still to read out of L2
                    tl.store(g_row + start + cols, grad.to(grad_ptr.dtype.element_ty),
                             mask=mask, cache_modifier=".cs")
        loss = lse - (1.0 - smoothing) * x_t - uniform * total
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss * scale))

    @triton.jit
    def _scale_kernel(grad_ptr, n, cotangent_ptr, applied_ptr, BLOCK: tl.constexpr):
        g = tl.load(cotangent_ptr).to(tl.float32)
        applied = tl.load(applied_ptr)
        if g != applied:
            factor = g / applied
            cols = tl.arange(0, BLOCK).to(tl.int64)
            step = tl.num_programs(0).to(tl.int64) * BLOCK
            for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
                mask = start + cols < n
                x = tl.load(grad_ptr + start + cols, mask=mask).to(tl.float32)
                tl.store(grad_ptr + start + cols, (x * factor).to(grad_ptr.dtype.element_ty),
                         mask=mask)

    @triton.jit
    def _record_kernel(cotangent_ptr, applied_ptr):
        tl.store(applied_ptr, tl.load(cotangent_ptr).to(tl.float32))


def forward(x: torch.Tensor, target: torch.Tensor, count, ignore_index: int,
            smoothing: float, one_block_max: int = ONE_BLOCK_MAX, chunk: int = CHUNK,
            write_grad: bool = True, long_row: int = LONG_ROW,
            config: KernelConfig | None = None):
    """``(loss, grad, applied)``: the summed loss (float32, 0-d; a mean when ``count``, a
    0-d tensor, is given), the gradient of that loss in ``x``'s dtype (None without
    ``write_grad``: the loss alone reads each row once), and the scale applied to it
    (1.0). ``one_block_max``, ``chunk`` and ``long_row`` choose the kernel's variant (rows
    held whole up to ``one_block_max`` classes, else read in blocks of ``chunk``, with more
    warps beyond ``long_row``): tests use them to reach every variant; ``config`` replaces
    the chosen configuration of a row read in blocks (benchmarks sweep it)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, classes = x.shape
    grad = torch.empty((rows, classes) if write_grad else (1, 1), dtype=x.dtype,
                       device=x.device)
    loss = torch.empty(rows, dtype=torch.float32, device=x.device)
    target = target.contiguous()
    has_count = isinstance(count, torch.Tensor)
    count_arg = count.to(torch.float32).reshape(1) if has_count else loss
    block = triton.next_power_of_2(classes)
    one_block = block <= one_block_max
    if one_block:
        config = _one_block_config(block)
    elif config is None:
        config = _two_pass_config(classes, min(chunk, block), long_row)
    if rows:
        _forward_kernel[(rows,)](x, x.stride(0), target, grad, grad.stride(0), loss, count_arg,
                                 classes, ignore_index, float(smoothing),
                                 HAS_COUNT=has_count, ONE_BLOCK=one_block, BLOCK=config.block,
                                 WRITE_GRAD=write_grad, SMOOTHED=smoothing != 0.0,
                                 num_warps=config.warps,
                                 **config.launch_options())
    applied = torch.ones((), dtype=torch.float32, device=x.device)
    return loss.sum(), grad if write_grad else None, applied


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """How the forward kernel reads a row too long to hold whole: blocks of ``block``
    classes, ``warps`` warps a program, and at most ``max_registers`` registers a thread
    (None: the compiler's choice), which sets how many programs share a multiprocessor."""

    block: int
    warps: int
    max_registers: int | None = None

    def launch_options(self) -> dict:
        if self.max_registers is None or INTERPRETED:
            return {}
        return {"maxnreg": self.max_registers}


def _one_block_config(block: int) -> KernelConfig:
    return KernelConfig(block, 4 if block <= 2048 else 8 if block <= 4096 else 16)


def _two_pass_config(classes: int, block: int, long_row: int) -> KernelConfig:
    """The configuration of a row read in two passes: the fastest of the swept ones on one
    H200 (8192 rows, bf16; benchmarks/cross_entropy_sweep.py, results in
    benchmarks/results/2026-12-04-0845-h200-1gpu-cross-entropy-sweep-7bd769d.txt): up to
    ``long_row`` classes blocks of 8192, 8 warps and at most 64 registers a thread, so that
    four programs share a multiprocessor (the compiler's 80 let three: 1.17x a copy of the
    logits against 1.24x at 32k classes); longer rows blocks of 8192 and 16 warps (1.53x at
    128k, 1.56x with 8 warps)."""
    if classes <= long_row:
        return KernelConfig(block, 8 if block >= 4096 else 4, max_registers=64)
    return KernelConfig(block, 16 if block >= 8192 else 8)


def scale_in_place(grad: torch.Tensor, applied: torch.Tensor,
                   cotangent: torch.Tensor) -> torch.Tensor:
    """``grad`` scaled in place from the scale ``applied`` holds to ``cotangent`` (0-d
    tensors on ``grad``'s device), and ``applied`` set to it; nothing moves when they are
    equal (a loss whose gradient arrives as 1.0). Returns ``grad``."""
    n = grad.numel()
    block = 4096
    programs = max(1, min(triton.cdiv(n, block), 4 * _multiprocessors(grad.device)))
    cotangent = cotangent.reshape(1)
    _scale_kernel[(programs,)](grad, n, cotangent, applied, BLOCK=block, num_warps=8)
    _record_kernel[(1,)](cotangent, applied)
    return grad


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
