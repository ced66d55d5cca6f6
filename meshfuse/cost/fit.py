"""Fitting the compute models' parameters (:mod:`.kernels`) to measured microbenchmarks
(``benchmarks/calibrate.py`` times them; tests fit synthetic ones).

Each fit minimizes the squared *relative* error of the model's times over the samples, so
that a 30 us GEMM counts as much as a 3 ms one:

- :func:`fit_gemm`: for each candidate tile, the rate and the tile's fixed cost by linear
  least squares (the model's compute time is linear in ``1 / rate`` and ``tile_us`` for a
  given tile), over the samples the floor and the memory bandwidth do not decide; the tile
  whose whole model (floor and memory included) fits all samples best is kept, or, when
  that fits better, all the candidates as the library's set (each GEMM at its fastest
  tile, as cuBLAS's heuristic picks one: the rate and cost refitted with each sample's
  tile until the picks settle);
- :func:`fit_attention`: one per-row overhead ``s0`` for all head dimensions (searched on a
  grid) and, for each head dimension, the rate that fits its samples best given ``s0``;
- :func:`fit_attention_blocks`: the scheduled model's slots and a query block's fixed cost
  (searched) and, for each head dimension, its rate given them;
- :func:`kernel_factors`: each kernel kind's bytes moved over the least it must, per row
  length, the median over its samples.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence

from meshfuse.cost.calibration import AttentionFit, GemmFit, MemoryFit
from meshfuse.cost.kernels import (
    attention_makespan,
    attention_seconds,
    gemm_best_tile,
    gemm_seconds,
    gemm_tile,
    gemm_waves,
)

GemmSample = tuple[int, int, int, float]  # m, n, k, seconds
AttentionSample = tuple[int, int, int, int, float]  # batch, heads, seq, head_dim, seconds


def _relative_error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def fit_gemm(samples: Sequence[GemmSample], tiles: Iterable[tuple[int, int]], units: int,
             floor_us: float, memory: MemoryFit, itemsize: int) -> GemmFit:
    """The GEMM parameters that fit ``samples`` best (see the module doc)."""
    best: tuple[float, GemmFit] | None = None
    tiles = list(tiles)
    sets = [(tile, ()) for tile in tiles] + ([(tiles[0], tuple(tiles[1:]))] * (len(tiles) > 1))
    for tile, alternatives in sets:
        fit = _fit_tile(samples, tile, units, floor_us, memory, itemsize, alternatives)
        if fit is None:
            continue
        error = sum(_relative_error(gemm_seconds(fit, memory, m, n, k, itemsize), t) ** 2
                    for m, n, k, t in samples)
        if best is None or error < best[0]:
            best = (error, fit)
    if best is None:
        raise ValueError("no GEMM sample above the floor and the memory bandwidth to fit")
    return best[1]


def _fit_tile(samples, tile, units, floor_us, memory, itemsize, alternatives=(),
              rounds: int = 6) -> GemmFit | None:
    """Rate and tile cost for one ``tile``: ``t = w (2 tm tn k units) / R + w tile_us`` by
    least squares on ``t``'s relative error, over the compute-bound samples (well above the
    floor and their bytes' time, a wave of tiles at least: a library may split the ``k``
    of fewer tiles over the idle units, which the model does not; all samples when fewer
    than two are). With ``alternatives``, each sample's tile is its fastest under the last
    round's fit (``tile`` for all in the first), ``rounds`` at most."""
    shape = GemmFit(1.0, tile, units, 0.0, 0.0)
    fit, picks = None, None
    for _ in range(rounds if alternatives else 1):
        new = _fit_picked(samples, shape, floor_us, memory, itemsize, fit or shape)
        if new is None:
            return fit
        fit = dataclasses.replace(new, alternatives=tuple(alternatives))
        now = [gemm_best_tile(fit, m, n, k) for m, n, k, _ in samples]
        if now == picks:
            break
        picks = now
    return fit


def _fit_picked(samples, shape, floor_us, memory, itemsize, previous) -> GemmFit | None:
    """:func:`_fit_tile`'s least squares, each sample ``(m, n, k, t)`` run as tiles of
    its fastest under ``previous`` (a fit or ``shape``)."""
    units = shape.units

    def compute_bound(m, n, k, t):
        moved = (m * k + k * n + m * n) * itemsize / (memory.gb_per_s * 1e9)
        tm, tn = gemm_tile(shape, m, n)
        return (t >= 2 * floor_us * 1e-6 and moved <= 0.5 * t
                and math.ceil(m / tm) * math.ceil(n / tn) >= units)

    chosen = [s for s in samples if compute_bound(*s)]
    rows = []
    for m, n, k, t in chosen if len(chosen) >= 2 else samples:
        picked = gemm_best_tile(previous, m, n, k)
        w, (tm, tn) = gemm_waves(shape, m, n, picked), gemm_tile(shape, m, n, picked)
        rows.append((w * 2.0 * tm * tn * k * units / t, w / t))  # each row should sum to 1
    if not rows:
        return None
    inverse_rate, tile_s = _least_squares(rows)
    if tile_s < 0:  # no fixed cost: the rate alone
        inverse_rate = sum(a for a, _ in rows) / sum(a * a for a, _ in rows)
        tile_s = 0.0
    if inverse_rate <= 0:
        return None
    return GemmFit(1.0 / inverse_rate / 1e12, shape.tile, units, tile_s * 1e6, floor_us)


def _least_squares(rows: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(x, y)`` minimizing ``sum (a x + b y - 1)^2`` over ``rows`` of ``(a, b)``."""
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    if abs(det) < 1e-12 * max(saa * sbb, 1e-300):
        return sa / saa, 0.0
    return (sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention: half of two ``2 b h s s d`` products."""
    return 2.0 * batch * heads * seq * seq * head_dim


def fit_attention(samples: Sequence[AttentionSample], floor_us: float,
                  overheads: Iterable[float] = range(0, 4097, 16)) -> AttentionFit:
    """The attention parameters that fit ``samples`` best (see the module doc)."""
    dims = sorted({d for *_, d, _ in samples})
    best: tuple[float, AttentionFit] | None = None
    for s0 in overheads:
        rates = {}
        for d in dims:
            # t = F (1 + s0 / s) / R: fit 1 / R on the relative error
            u = [attention_flops(b, h, s, d) * (1 + s0 / s) / t
                 for b, h, s, dd, t in samples if dd == d]
            rates[d] = sum(x * x for x in u) / sum(u) / 1e12
        fit = AttentionFit(rates, float(s0), floor_us)
        error = sum(_relative_error(attention_seconds(fit, attention_flops(b, h, s, d), s, d),
                                    t) ** 2 for b, h, s, d, t in samples)
        if best is None or error < best[0]:
            best = (error, fit)
    if best is None:
        raise ValueError("no attention sample to fit")
    return best[1]


def fit_attention_blocks(samples: Sequence[AttentionSample], floor_us: float,
                         slot_choices: Iterable[int], block: int = 128,
                         costs: Iterable[float] = tuple(x / 4 for x in range(17))
                         ) -> AttentionFit:
    """The scheduled attention model (:func:`.kernels.attention_seconds`) that fits
    ``samples`` best: the slots (among ``slot_choices``) and a query block's fixed cost
    (among ``costs``, in key blocks) searched, each head dimension's rate fitted given
    them."""
    dims = sorted({d for *_, d, _ in samples})
    best: tuple[float, AttentionFit] | None = None
    for slots in slot_choices:
        for cost in costs:
            rates = {}
            for d in dims:  # t = work(slots, cost) / R: fit 1 / R on the relative error
                u = [attention_makespan(b * h, math.ceil(s / block), slots, cost)
                     * 4.0 * block ** 2 * d * slots / t
                     for b, h, s, dd, t in samples if dd == d]
                rates[d] = sum(x * x for x in u) / sum(u) / 1e12
            fit = AttentionFit(rates, 0.0, floor_us, block, slots, cost)
            error = sum(_relative_error(attention_seconds(
                fit, attention_flops(b, h, s, d), s, d), t) ** 2 for b, h, s, d, t in samples)
            if best is None or error < best[0]:
                best = (error, fit)
    if best is None:
        raise ValueError("no attention sample to fit")
    return best[1]


def kernel_factors(samples: Iterable[tuple[str, int, float, float]], gb_per_s: float
                   ) -> dict[str, dict[int, float]]:
    """Per kind and row length, the median of ``seconds * bandwidth / least bytes`` over
    ``samples`` of ``(kind, row, least bytes, seconds)``."""
    by: dict[str, dict[int, list[float]]] = {}
    for kind, row, nbytes, seconds in samples:
        by.setdefault(kind, {}).setdefault(row, []).append(seconds * gb_per_s * 1e9 / nbytes)
    return {kind: {row: statistics.median(f) for row, f in rows.items()}
            for kind, rows in by.items()}


def median_error(pairs: Iterable[tuple[float, float]]) -> float:
    """The median absolute relative error of ``(predicted, measured)`` pairs."""
    return statistics.median(abs(_relative_error(p, m)) for p, m in pairs if m > 0)

