"""Memory a fusion's cross entropy keeps from step to step (CUDA): ``python -m
benchmarks.cross_entropy_memory [--vocab V]``.

Runs the ``meshfuse`` step of :mod:`benchmarks.cross_entropy` (the fused op through
``fd.as_autograd_function()``) repeatedly and prints the memory allocated after each step,
what the autograd function's calls did (CUDA-graph replay, host time) and what is alive at one
step's peak (:mod:`benchmarks.memory_peak`).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import memory_peak
from benchmarks.cross_entropy import _inputs, _meshfuse_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    device = torch.device("cuda")
    x, t = _inputs(args.tokens, args.vocab, device)
    step = _meshfuse_step(args.tokens, args.vocab, compile=False)
    for i in range(args.steps):
        step(x, t)
        torch.cuda.synchronize()
        print(f"step {i}: allocated {torch.cuda.memory_allocated() / 2**20:.0f} MiB",
              flush=True)
    print("\n".join(step.function.call_lines()))
    print("\n".join(memory_peak.live_at_peak(lambda: step(x, t))))


if __name__ == "__main__":
    main()
