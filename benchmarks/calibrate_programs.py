"""The programs ``benchmarks/calibrate.py`` times: the microbenchmarks the calibration is fitted
to, and the 20 check variants it is then judged on, which share no shape with them (the
check is a hold-out). Programs are data (a kind and a shape), made runnable by
:func:`make_call` and predicted by :func:`predict`, so a recorded check can be re-predicted
offline without a device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from meshfuse.cost import CostModel
from meshfuse.cost.fit import attention_flops

# GEMMs fitted to, as (m, n, k) of [m, k] @ [k, n]: squares, short k, short n, short m,
# large and uneven ones; none is a check variant's shape.
GEMM_SHAPES = [
    (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
    (8192, 8192, 8192), (6144, 6144, 6144), (2560, 2560, 4096), (5120, 5120, 2048),
    (3584, 3584, 3584), (1536, 6144, 4096),
    (8192, 8192, 512), (8192, 8192, 2048), (4096, 8192, 1024), (16384, 2048, 2048),
    (2048, 16384, 1024), (8192, 2048, 8192), (16384, 512, 8192), (4096, 1024, 16384),
    (8192, 512, 4096), (1024, 8192, 8192), (512, 16384, 4096), (768, 8192, 8192),
    (4096, 16384, 8192), (8192, 28672, 4096), (16384, 8192, 4096), (10240, 2560, 5120),
    (2048, 4096, 14336), (12288, 12288, 2048)]
TINY_GEMMS = [(64, 64, 64), (128, 128, 128), (256, 256, 256)]  # the floor
# Causal attention fitted to, as (batch, heads, seq, head_dim): several sequence lengths per
# head dimension, none a check variant's.
# Few heads on a sequence (the schedule's idle slots) and a long one (sustained) included.
ATTENTION_SHAPES = [(16, 16, 1024, 128), (4, 32, 4096, 128), (4, 16, 3072, 128),
                    (1, 32, 12288, 128), (1, 16, 24576, 128), (2, 8, 6144, 128),
                    (16, 16, 1024, 64), (8, 16, 2048, 64), (2, 16, 8192, 64),
                    (2, 8, 6144, 64), (1, 16, 12288, 64)]
TINY_ATTENTION = (1, 1, 64, 64)
# Memory-bound kernels fitted to: each kind on rows of 2048 to 24576 elements, never 8192
# (the check's rows), 48 Mi elements each (the check's: 64 Mi). PyTorch picks a softmax's
# kernel by the row length (torch 2.11, bf16: the row in registers, ceil(row / 1024) a thread,
# below 10 a thread, so up to 9216; in shared memory up to about 24K; else read twice from
# memory), so a kind's cost per byte is measured on each side of those changes and close to
# the rows the model is asked about (7168 and 9216 run the kernel of 8192, more or fewer
# registers a thread).
KERNEL_ROWS = (2048, 3072, 4096, 6144, 7168, 9216, 12288, 16384, 24576)
KERNEL_ELEMENTS = 48 << 20
# kind: (call on x, y, weight, bias; the least bytes it moves in elements of x)
KERNELS: dict[str, tuple[Callable, int]] = {
    "pointwise": (lambda x, y, w: x + y, 3),
    "gelu": (lambda x, y, w: F.gelu(x, approximate="tanh"), 2),
    "silu": (lambda x, y, w: F.silu(x), 2),
    "layer_norm": (lambda x, y, w: F.layer_norm(x, (x.shape[-1],), w, w), 2),
    "rms_norm": (lambda x, y, w: F.rms_norm(x, (x.shape[-1],), w), 2),
    "softmax": (lambda x, y, w: torch.softmax(x, -1), 2),
    "sum": (lambda x, y, w: x.sum(-1), 1),
}

# The check: 8 GEMMs (m, k, n as named), 4 attentions, 8 memory-bound programs on an
# [8192, 8192] input, each a list of (kernel kind, least bytes in elements of x).
CHECK_GEMMS = [(3072, 3072, 3072), (6144, 4096, 4096), (8192, 1024, 8192),
               (12288, 4096, 12288), (2048, 2048, 512), (4096, 14336, 4096),
               (768, 768, 768), (16384, 1024, 4096)]  # (m, n, k)
CHECK_ATTENTION = [(2, 16, 8192, 128), (8, 32, 2048, 128), (1, 64, 16384, 128),
                   (4, 8, 4096, 64)]
CHECK_ROWS = 8192
CHECK_KERNELS = {
    "pointwise add": ((lambda x, y, w: x + y), [("pointwise", 3)]),
    "pointwise mul": ((lambda x, y, w: x * y), [("pointwise", 3)]),
    "pointwise gelu": ((lambda x, y, w: F.gelu(x, approximate="tanh")), [("gelu", 2)]),
    "pointwise silu*mul": ((lambda x, y, w: F.silu(x) * y), [("silu", 2), ("pointwise", 3)]),
    "layer_norm": ((lambda x, y, w: F.layer_norm(x, (x.shape[-1],), w, w)),
                   [("layer_norm", 2)]),
    "rms_norm": ((lambda x, y, w: F.rms_norm(x, (x.shape[-1],), w)), [("rms_norm", 2)]),
    "softmax": ((lambda x, y, w: torch.softmax(x, -1)), [("softmax", 2)]),
    "sum rows": ((lambda x, y, w: x.sum(-1)), [("sum", 1)]),
}


def check_programs(scale: int) -> list[tuple[str, str, tuple]]:
    """The 20 check variants as ``(name, family, shape)`` at ``scale`` (shapes divided by
    it on every GEMM side, on the sequence, on the rows of the memory-bound input)."""
    out = []
    for m, n, k in CHECK_GEMMS:
        m, n, k = m // scale, n // scale, k // scale
        out.append((f"gemm {m}x{k}x{n}", "gemm", (m, n, k)))
    for b, h, s, d in CHECK_ATTENTION:
        out.append((f"attention {b}x{h}x{s // scale}x{d}", "attention", (b, h, s // scale, d)))
    for name in CHECK_KERNELS:
        out.append((name, "kernels", (CHECK_ROWS // scale, CHECK_ROWS)))
    return out


def predict(name: str, family: str, shape: tuple, model: CostModel, itemsize: int) -> float:
    """Seconds the cost model predicts for one check program."""
    if family == "gemm":
        return model.gemm(*shape, itemsize)
    if family == "attention":
        b, h, s, d = shape
        return model.attention(attention_flops(b, h, s, d), s, d)
    rows, cols = shape
    return sum(model.memory_bound(elements * rows * cols * itemsize, kind, cols)
               for kind, elements in CHECK_KERNELS[name][1])


def make_call(name: str, family: str, shape: tuple, dtype, device: str) -> Callable:
    """One check program, runnable (its inputs made here, random)."""
    if family == "gemm":
        m, n, k = shape
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        return lambda: a @ b
    if family == "attention":
        q, k, v = (torch.randn(*shape, dtype=dtype, device=device) for _ in range(3))
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = torch.randn(*shape, dtype=dtype, device=device)
    y = torch.randn_like(x)
    w = torch.ones(shape[-1], dtype=dtype, device=device)
    call = CHECK_KERNELS[name][0]
    return lambda: call(x, y, w)
