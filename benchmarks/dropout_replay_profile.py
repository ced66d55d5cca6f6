"""Where the host time of a replayed call goes, with dropout 0.1 and without (one GPU).

The seed program (b=2, 6 heads, s=1024, head dim 64, causal, bf16: one GPU's part of the
2-GPU seed run), plain ``execute``, replayed from a CUDA graph from its second call: for each
of dropout 0.0 and 0.1, the host microseconds per call, a cProfile of the calls (Python
functions and the built-ins they call, such as ``CUDAGraph.replay``, whose time includes
PyTorch's replay prologue) and the GPU work each call launches (torch.profiler: kernels and
memsets per call, e.g. the prologue's writes of a generator's seed and offset).

    python -m benchmarks.dropout_replay_profile OUT

Writes ``OUT/dropout_replay_profile.txt``.
"""

from __future__ import annotations

import collections
import cProfile
import io
import os
import pstats
import sys
import time

import torch

import meshfuse
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention, random_inputs

B, H, S, HEAD_DIM = 2, 6, 1024, 64
CALLS = 200


def _host_us(step, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _gpu_work(step, calls: int = 20) -> list[str]:
    """The GPU activities (kernels, memsets, copies) per call, by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    counts = collections.Counter({e.key: e.count for e in prof.key_averages()
                                  if e.device_type == torch.autograd.DeviceType.CUDA})
    return [f"  {n / calls:5.1f} per call  {name[:110]}" for name, n in counts.most_common()]


def profile(p: float) -> list[str]:
    model = SeedAttention(QkvFormat.BHSE, meshfuse.DeviceMesh([0]), B, H, S, H * HEAD_DIM,
                          dropout_p=p)
    inputs = model.inputs_for(*random_inputs(B, H, S, H * HEAD_DIM, device="cuda"), 0)

    def step():
        model.execute(inputs)

    for _ in range(10):
        step()
    line = next((x for x in model.explain(inputs).splitlines() if "CUDA graph replay" in x),
                "no automatic replay")
    host = min(_host_us(step, CALLS) for _ in range(5))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CALLS):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return [f"== dropout_p = {p}: host {host:.1f} us/call (best of 5 x {CALLS} calls)", line,
            "GPU work per call:", *_gpu_work(step), "cProfile (tottime):", text.getvalue()]


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    lines = [f"torch {torch.__version__}, {torch.cuda.get_device_name()}"]
    for p in (0.0, 0.1):
        lines += profile(p)
    path = os.path.join(out, "dropout_replay_profile.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:3]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
