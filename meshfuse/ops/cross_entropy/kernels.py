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
    @triton.jit
    def _row_stats(x_row, n_classes, BLOCK: tl.constexpr, SMOOTHED: tl.constexpr,
                   SHIFTED: tl.constexpr):
        """The log-sum-exp and (``SMOOTHED``) the sum of a row read block by block, the
        blocks kept in L2 for the second read (the loops are not software-pipelined: on an
        H200 three stages took 1.2-1.4x one): :func:`_shifted_stats` or
        :func:`_online_stats`."""
        if SHIFTED:
            return _shifted_stats(x_row, n_classes, BLOCK, SMOOTHED)
        return _online_stats(x_row, n_classes, BLOCK, SMOOTHED)

    @triton.jit
    def _online_stats(x_row, n_classes, BLOCK: tl.constexpr, SMOOTHED: tl.constexpr):
        """An online maximum and rescaled sum per block (two reductions over the threads
        per block)."""
        cols = tl.arange(0, BLOCK)
        total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
        s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        for start in tl.range(0, n_classes, BLOCK, num_stages=1):
            mask = start + cols < n_classes
            x = tl.load(x_row + start + cols, mask=mask, other=float("-inf"),
                        eviction_policy="evict_last").to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
            if SMOOTHED:
                total += tl.sum(tl.where(mask, x, 0.0), 0)
        return m + tl.log(s), total

    @triton.jit
    def _shifted_stats(x_row, n_classes, BLOCK: tl.constexpr, SMOOTHED: tl.constexpr):
        """Each thread sums ``exp(x - c)``, ``c`` the first block's maximum, and keeps its own
        maximum, reduced once at the end (no reduction over the threads per block)."""
        cols = tl.arange(0, BLOCK)
        total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        x = tl.load(x_row + cols, mask=cols < n_classes, other=float("-inf"),
                    eviction_policy="evict_last").to(tl.float32)
        c = tl.max(x, 0)
        sums = tl.exp(x - c)
        peaks = x
        if SMOOTHED:
            total += tl.sum(tl.where(cols < n_classes, x, 0.0), 0)
        for start in tl.range(BLOCK, n_classes, BLOCK, num_stages=1):
            mask = start + cols < n_classes
            x = tl.load(x_row + start + cols, mask=mask, other=float("-inf"),
                        eviction_policy="evict_last").to(tl.float32)
            peaks = tl.maximum(peaks, x)
            sums += tl.exp(x - c)
            if SMOOTHED:
                total += tl.sum(tl.where(mask, x, 0.0), 0)
        lse = c + tl.log(tl.sum(sums, 0))
        # Rare: a later block far above the first is summed again from the true maximum
        # (exp(60) times a million classes stays far below float32's largest value).
        if tl.max(peaks, 0) - c > 60.0:
            lse, _ = _online_stats(x_row, n_classes, BLOCK, False)
        return lse, total

    @triton.jit
    def _forward_kernel(x_ptr, x_stride, target_ptr, grad_ptr, grad_stride, loss_ptr,
                        count_ptr, rows, n_classes, ignore_index, smoothing,
                        HAS_COUNT: tl.constexpr, ONE_BLOCK: tl.constexpr,
                        BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr,
                        SMOOTHED: tl.constexpr, SHIFTED: tl.constexpr,
                        PERSISTENT: tl.constexpr):
        """One program per row, or (``PERSISTENT``) a fixed number of programs, each over
        every ``num_programs``-th row: that bounds the rows in flight, whose first read the
        second pass must still find in L2."""
        if PERSISTENT:
            for row in range(tl.program_id(0), rows, tl.num_programs(0)):
                _forward_row(tl.cast(row, tl.int64), x_ptr, x_stride, target_ptr, grad_ptr,
                             grad_stride, loss_ptr, count_ptr, n_classes, ignore_index,
                             smoothing, HAS_COUNT, ONE_BLOCK, BLOCK, WRITE_GRAD, SMOOTHED,
                             SHIFTED)
        else:
            _forward_row(tl.program_id(0).to(tl.int64), x_ptr, x_stride, target_ptr,
                         grad_ptr, grad_stride, loss_ptr, count_ptr, n_classes, ignore_index,
                         smoothing, HAS_COUNT, ONE_BLOCK, BLOCK, WRITE_GRAD, SMOOTHED, SHIFTED)

    @triton.jit
    def _forward_row(row, x_ptr, x_stride, target_ptr, grad_ptr, grad_stride, loss_ptr,
                     count_ptr, n_classes, ignore_index, smoothing, HAS_COUNT: tl.constexpr,
                     ONE_BLOCK: tl.constexpr, BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr,
                     SMOOTHED: tl.constexpr, SHIFTED: tl.constexpr):
        x_row = x_ptr + row * x_stride
        g_row = grad_ptr + row * grad_stride
        target = tl.load(target_ptr + row).to(tl.int64)
        ignored = target == ignore_index
        valid = (target >= 0) & (target < n_classes)
        scale = 1.0
        if HAS_COUNT:
            scale = 1.0 / tl.load(count_ptr).to(tl.float32)
        scale = tl.where(ignored, 0.0, tl.where(valid, scale, float("nan")))
        uniform = smoothing / n_classes
        cols = tl.arange(0, BLOCK)
        if ONE_BLOCK:  # the whole row in registers: read once
            mask = cols < n_classes
            x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            m = tl.max(x, 0)
            e = tl.exp(x - m)
            s = tl.sum(e, 0)
            lse = m + tl.log(s)
            total = 0.0
            if SMOOTHED:
                total = tl.sum(tl.where(mask, x, 0.0), 0)
            # the target's logit read on its own: a fourth reduction over the row costs more
            x_t = tl.load(x_row + tl.where(valid, target, 0)).to(tl.float32)
            w = tl.where(cols == target, 1.0 - smoothing + uniform, uniform)
            if WRITE_GRAD:
                grad = (e * (1.0 / s) - w) * scale
                tl.store(g_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)
        else:  # statistics first, then the gradient: read twice (the second from L2)
            lse, total = _row_stats(x_row, n_classes, BLOCK, SMOOTHED, SHIFTED)
            x_t = tl.load(x_row + tl.where(valid, target, 0)).to(tl.float32)
            if WRITE_GRAD:
                for start in tl.range(0, n_classes, BLOCK, num_stages=1):
                    mask = start + cols < n_classes
                    x = tl.load(x_row + start + cols, mask=mask, other=0.0,
                                eviction_policy="evict_first").to(tl.float32)
                    w = tl.where(start + cols == target, 1.0 - smoothing + uniform, uniform)
                    grad = (tl.exp(x - lse) - w) * scale
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
            programs_per_sm: int | None = None):
    """``(loss, grad, applied)``: the summed loss (float32, 0-d; a mean when ``count``, a
    0-d tensor, is given), the gradient of that loss in ``x``'s dtype (None without
    ``write_grad``: the loss alone reads each row once), and the scale applied to it
    (1.0). ``one_block_max``, ``chunk`` and ``long_row`` choose the kernel's variant (rows
    held whole up to ``one_block_max`` classes, else read in blocks of ``chunk``, with
    shifted sums beyond ``long_row``): tests use them to reach every variant.
    ``programs_per_sm``: 0 for a program per row, else that many programs per
    multiprocessor, each over many rows (None: the configured choice)."""
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
    shifted, per_sm = False, 0
    if one_block:
        warps = 4 if block <= 2048 else 8 if block <= 4096 else 16
    else:
        block, warps, shifted, per_sm = _two_pass_config(classes, min(chunk, block), long_row)
    if programs_per_sm is not None:
        per_sm = programs_per_sm
    programs = rows if not per_sm else min(rows, per_sm * _multiprocessors(x.device))
    if rows:
        _forward_kernel[(programs,)](x, x.stride(0), target, grad, grad.stride(0), loss,
                                     count_arg, rows, classes, ignore_index, float(smoothing),
                                     HAS_COUNT=has_count, ONE_BLOCK=one_block, BLOCK=block,
                                     WRITE_GRAD=write_grad, SMOOTHED=smoothing != 0.0,
                                     SHIFTED=shifted, PERSISTENT=programs < rows,
                                     num_warps=warps)
    applied = torch.ones((), dtype=torch.float32, device=x.device)
    return loss.sum(), grad if write_grad else None, applied


def _two_pass_config(classes: int, block: int, long_row: int) -> tuple[int, int, bool, int]:
    """(block, warps, shifted, programs per multiprocessor) of a row read in two passes: the
    fastest of the swept configurations on one H200 (8192 rows, bf16;
    benchmarks/cross_entropy_sweep.py, results benchmarks/results/2026-12-04-02*-cross-
    entropy-sweep*): up to 64k classes blocks of 8192 with 8 warps and an online maximum,
    beyond blocks of 8192 with 16 warps and shifted sums; a program per row."""
    if classes <= long_row:
        return block, (8 if block >= 4096 else 4), False, 0
    return block, (16 if block >= 8192 else 8), True, 0


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
