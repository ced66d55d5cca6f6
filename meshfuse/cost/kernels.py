"""Times of compute kernels from a calibration's fitted parameters (:mod:`.calibration`).

- A **GEMM** ``[m, k] @ [k, n]`` runs as tiles of ``tile`` output elements, ``units`` at a
  time: ``w = ceil(ceil(m / tm) ceil(n / tn) / units)`` waves, each ``2 tm tn k`` FLOPs on a
  unit (at ``tflops / units``) plus a tile's fixed cost ``tile_us``. The last wave's idle
  units make a GEMM of few tiles slow (``3072^3`` on 132 units is 2.2 waves run as 3), and
  the fixed cost a short ``k`` one; a dimension smaller than the tile's cuts the tile (to a
  multiple of 64). With ``alternatives`` (other tiles the library has kernels of), the
  time is the least over the tiles, as the library's heuristic picks the kernel whose waves
  fit the shape best (``3072^3``: 576 tiles of 128 x 128 are 4.4 waves run as 5, 256 of
  192 x 192 are 1.9 run as 2, 10% less work on the busiest unit). A call takes at least
  ``floor_us`` (issuing it) and at
  least its operands' bytes at the memory bandwidth (a skinny GEMM is memory-bound).
- **Attention** (fused, causal) of ``F`` forward FLOPs on sequences of ``s`` with head
  dimension ``d`` (``F / (2 s^2 d)`` heads, batch included): the kernel runs each head's
  ``s / block`` query blocks as one work item, the ``i``-th doing ``i + 1`` key blocks
  (causal) plus a fixed cost ``block_cost`` (its softmax statistics, loads and store),
  ``slots`` at a time handed out in launch order; the time is the busiest slot's work
  (:func:`attention_makespan`) at ``rate(d) / slots``, ``rate(d)`` interpolated between the
  calibrated head dimensions (a smaller head does less matrix work per softmax element).
  Few heads on a short sequence leave slots idle at the end (the 4 x 8 heads of 4096 at
  ``d = 64`` run 18% slower than a per-FLOP rate says). At least ``floor_us``. (The older
  form: ``F / rate(d) (1 + s0 / s)``, ``s0`` a per-row overhead as a sequence length.)
- A **memory-bound kernel** of kind ``kind`` whose inputs and outputs total ``B`` bytes:
  ``B f(kind, row) / bandwidth``, ``f`` the bytes it really moves over ``B`` (a norm or a
  softmax reads its rows more than once; a reduction over rows is slower per byte),
  interpolated in the row length between the calibrated ones (a softmax's and a row sum's,
  whose kernel changes with the row length, not smoothly: the worse of the two around it;
  on an H200 a softmax's ``f`` was 3.3 at rows of 4096, 4.0 at 8192, 2.1 at 16384); at least
  ``floor_us``.

Times are in seconds.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from collections.abc import Mapping

from meshfuse.cost.calibration import KERNELS, AttentionFit, GemmFit, MemoryFit
from meshfuse.errors import InputError

TILE_STEP = 64  # a tile cut to a small dimension keeps a multiple of this
# kernel kinds whose kernel PyTorch picks by the row length (a softmax's row in registers,
# in shared memory or read from memory again; a row sum by one block or split): between two
# calibrated row lengths the kernel may be either's, or a third, so the worse is taken
ROW_STEPPED = frozenset({"softmax", "sum"})


def gemm_tile(fit: GemmFit, m: int, n: int, tile: tuple[int, int] | None = None
              ) -> tuple[int, int]:
    """The tile of an ``m x n`` output: ``tile`` (the calibrated one by default), cut to a
    smaller dimension (rounded up to a multiple of 64), as a library picks a narrower kernel
    for it."""
    tm, tn = tile or fit.tile
    return (min(tm, math.ceil(m / TILE_STEP) * TILE_STEP),
            min(tn, math.ceil(n / TILE_STEP) * TILE_STEP))


def gemm_waves(fit: GemmFit, m: int, n: int, tile: tuple[int, int] | None = None) -> int:
    """Waves of tiles of an ``m x n`` output."""
    tm, tn = gemm_tile(fit, m, n, tile)
    return math.ceil(math.ceil(m / tm) * math.ceil(n / tn) / fit.units)


def gemm_tile_seconds(fit: GemmFit, m: int, n: int, k: int,
                      tile: tuple[int, int] | None = None) -> float:
    """Compute seconds of a GEMM run as tiles of ``tile`` (the calibrated one by default)."""
    tm, tn = gemm_tile(fit, m, n, tile)
    per_wave = 2.0 * tm * tn * k / (fit.tflops * 1e12 / fit.units) + fit.tile_us * 1e-6
    return gemm_waves(fit, m, n, tile) * per_wave


def gemm_best_tile(fit: GemmFit, m: int, n: int, k: int) -> tuple[int, int]:
    """The tile, of the calibrated one and its alternatives, that runs the GEMM fastest."""
    return min((fit.tile, *fit.alternatives), key=lambda t: gemm_tile_seconds(fit, m, n, k, t))


def gemm_seconds(fit: GemmFit, memory: MemoryFit, m: int, n: int, k: int,
                 itemsize: int) -> float:
    """Seconds of one GEMM ``[m, k] @ [k, n]`` (see the module doc)."""
    if min(m, n, k) <= 0:
        return 0.0
    compute = gemm_tile_seconds(fit, m, n, k, gemm_best_tile(fit, m, n, k))
    moved = (m * k + k * n + m * n) * itemsize / (memory.gb_per_s * 1e9)
    return max(fit.floor_us * 1e-6, compute, moved)


def attention_seconds(fit: AttentionFit, flops: float, seq: int | None = None,
                      head_dim: int | None = None) -> float:
    """Seconds of a fused causal attention call of ``flops`` (see the module doc); without
    ``seq`` no per-row overhead nor schedule, without ``head_dim`` the largest calibrated
    one's rate."""
    if flops <= 0:
        return 0.0
    d = head_dim if head_dim else max(fit.tflops)
    rate = interpolate(fit.tflops, d, log=False) * 1e12
    if not seq:
        return max(fit.floor_us * 1e-6, flops / rate)
    if fit.block <= 0:  # the older form: a per-row overhead
        return max(fit.floor_us * 1e-6, flops / rate * (1.0 + fit.seq_overhead / seq))
    heads = max(1, round(flops / (2.0 * seq * seq * d)))  # batch x heads
    blocks = attention_makespan(heads, math.ceil(seq / fit.block), fit.slots, fit.block_cost)
    return max(fit.floor_us * 1e-6, blocks * 4.0 * fit.block ** 2 * d * fit.slots / rate)


@functools.lru_cache(maxsize=4096)
def attention_makespan(heads: int, query_blocks: int, slots: int, cost: float) -> float:
    """Key blocks' work on the busiest of ``slots`` when ``heads`` x ``query_blocks``
    query blocks (the ``i``-th of a head: ``i + 1`` key blocks and ``cost``, causal) are
    handed out in launch order to the first free slot, as the GPU's block scheduler does.
    Past 64 blocks a slot, the work over the slots plus half a head's last block."""
    lengths = [i + 1 + cost for i in range(query_blocks)]
    if heads * query_blocks > 64 * slots:
        return heads * sum(lengths) / slots + lengths[-1] / 2
    free = [0.0] * slots
    for _ in range(heads):
        for length in lengths:
            heapq.heappush(free, heapq.heappop(free) + length)
    return max(free)


def memory_seconds(fit: MemoryFit, nbytes: float, kind: str = "pointwise",
                   row: int | None = None) -> float:
    """Seconds of a memory-bound kernel of ``kind`` whose inputs and outputs total
    ``nbytes``, on rows of ``row`` elements (None: the kind's first calibrated row)."""
    if kind not in fit.kernels:
        raise InputError(f"memory-bound kernel kind {kind!r}: the cost model knows "
                         f"{list(KERNELS)}; use 'pointwise' for an elementwise op")
    if nbytes <= 0:
        return 0.0
    factors = fit.kernels[kind]
    x = row if row else min(factors)
    factor = worse_neighbour(factors, x) if kind in ROW_STEPPED else \
        interpolate(factors, x, log=True)
    return max(fit.floor_us * 1e-6, nbytes * factor / (fit.gb_per_s * 1e9))


def worse_neighbour(points: Mapping[int, float], x: float) -> float:
    """The larger of ``points``' values at the calibrated ``x``s around ``x`` (the nearest's
    beyond them)."""
    xs = sorted(points)
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return points[x]
    return max(points[xs[j]] for j in (i - 1, i) if 0 <= j < len(xs))


def interpolate(points: Mapping[int, float], x: float, log: bool) -> float:
    """``points``' value at ``x``: linear between the two around it (in ``log x`` when
    ``log``), the nearest's beyond them."""
    xs = sorted(points)
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return points[x]
    if i == 0 or i == len(xs):
        return points[xs[min(i, len(xs) - 1)]]
    x0, x1 = xs[i - 1], xs[i]
    f = (math.log(x / x0) / math.log(x1 / x0)) if log else (x - x0) / (x1 - x0)
    return points[x0] + f * (points[x1] - points[x0])
