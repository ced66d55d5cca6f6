"""What a copy-engine stream loop costs beyond its GEMM, measured on one GPU (issue 18; a
diagnostic with direct calls, not a benchmark case).

``python -m benchmarks.chunked_gemm_probe --out DIR``: at nvFuser's overlap sizes (t = h =
8192, bf16, the shapes of a rank of 2), the median of 30 rounds (CUDA events; every
variant once per round) of:

- the column layer's GEMM ``[t, h] x [h, 4h/2]`` whole, as 2 row halves and as 4 quarters
  (each written into its block of the output): what chunking itself costs;
- the staging copy of one rank's shard (``[t/2, h]``, 64 MB) on the same device: what the
  pull transport pays before its first barrier;
- the whole GEMM beside a 64 MB host-to-device copy (a copy engine on the GEMM's memory);
- the row layer's GEMM ``[t, 4h/2] x [4h/2, h]`` whole and as 2 row halves, and the add of a
  pulled half (the reduce-scatter loop's last step).

Writes ``DIR/chunked_gemm_probe.txt``; each line gives its ratio to the whole GEMM.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from benchmarks import context
from benchmarks.timing import timed_samples

ITERS, WARMUP = 30, 5


def _medians_ms(ctx, variants: dict) -> dict[str, float]:
    """The median time of each of ``variants`` (name -> callable), timed round-robin (one
    call of each per round, :func:`~benchmarks.timing.timed_samples`), so that a drift of
    the clocks as the GPU warms up weighs on every variant alike."""
    for fn in variants.values():
        timed_samples(ctx, fn, WARMUP)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(ITERS):
        for name, fn in variants.items():
            times[name] += timed_samples(ctx, fn, 1)
    return {name: statistics.median(t) for name, t in times.items()}


def _in_blocks(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, blocks: int):
    rows = a.shape[0] // blocks

    def run():
        for i in range(blocks):
            torch.matmul(a[i * rows:(i + 1) * rows], b, out=out[i * rows:(i + 1) * rows])
    return run


def probe(ctx, t: int, h: int) -> list[str]:
    bf16, device = torch.bfloat16, ctx.device
    x = torch.randn(t, h, device=device, dtype=bf16)
    w = torch.randn(h, 2 * h, device=device, dtype=bf16)
    out = torch.empty(t, 2 * h, device=device, dtype=bf16)
    shard, staged = x[: t // 2].clone(), torch.empty(t // 2, h, device=device, dtype=bf16)
    pinned = torch.empty(t // 2, h, dtype=bf16, pin_memory=True)
    side = torch.cuda.Stream(device)

    def beside_a_copy():
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            staged.copy_(pinned, non_blocking=True)
        torch.matmul(x, w, out=out)
        torch.cuda.current_stream(device).wait_stream(side)

    xr = torch.randn(t, 2 * h, device=device, dtype=bf16)
    wr = torch.randn(2 * h, h, device=device, dtype=bf16)
    outr = torch.empty(t, h, device=device, dtype=bf16)
    pulled = torch.empty(t // 2, h, device=device, dtype=bf16)
    # name -> (call, the whole GEMM it is compared with, or None)
    variants = {
        "column GEMM whole": (lambda: torch.matmul(x, w, out=out), None),
        "column GEMM in 2 row halves": (_in_blocks(x, w, out, 2), "column GEMM whole"),
        "column GEMM in 4 row quarters": (_in_blocks(x, w, out, 4), "column GEMM whole"),
        "staging copy of a shard (64 MB, same device)": (lambda: staged.copy_(shard), None),
        "column GEMM whole beside a 64 MB host-to-device copy": (beside_a_copy,
                                                                 "column GEMM whole"),
        "row GEMM whole": (lambda: torch.matmul(xr, wr, out=outr), None),
        "row GEMM in 2 row halves": (_in_blocks(xr, wr, outr, 2), "row GEMM whole"),
        "add of a pulled half (64 MB + 64 MB)": (lambda: outr[: t // 2] + pulled, None),
    }
    ms = _medians_ms(ctx, {name: call for name, (call, _) in variants.items()})
    lines = [(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"t={t} h={h} bf16, median of {ITERS} rounds (every variant once per round)")]
    for name, (_, whole) in variants.items():
        ratio = f" ({ms[name] / ms[whole]:.3f}x the whole GEMM)" if whole else ""
        lines.append(f"{name}: {ms[name]:.3f} ms{ratio}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=8192)
    args = parser.parse_args()
    ctx = context.setup(quick=False)
    if not ctx.cuda:
        raise SystemExit("the chunked GEMM probe times CUDA kernels: run it on a GPU")
    lines = probe(ctx, args.tokens, args.hidden)
    context.teardown()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chunked_gemm_probe.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
