"""Issue 32's capture-time target: capture + build of a 32-layer ``transformers`` Llama
(hidden 512) within 3x that of a 2-layer one, at one rank.

    python -m benchmarks.capture_depth                  # CPU, layers 2 and 32
    python -m benchmarks.capture_depth --layers 2,16 --device cuda

Per depth: the capture (the first ``explain(**inputs)`` of the parallelized module: the
trace, folding and partition, and the printed program) and the first forward + backward (the builds of each distinct block's fusion and
its derived backward, then the run), less the median of three later steps (the run alone;
the gradients are allocated before the first step, so that it differs from the others only
by the builds).
Random weights. Times are the process's CPU time (``time.process_time``, one intra-op
thread) on the CPU, so that other work on a shared machine does not count; wall time on CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist


def _time(device, fn) -> float:
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = clock()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - start


def measure(layers: int, device: torch.device) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import meshfuse

    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=4, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    ids = torch.randint(0, 1024, (1, 16), device=device)
    inputs = {"input_ids": ids, "labels": ids}
    result = {"layers": layers}
    # Laying out the parameters (DTensors: a copy of each, as parallelize_module makes) is
    # neither capture nor build: timed apart.
    result["place_s"] = _time(device, lambda: meshfuse.parallelize(
        model, meshfuse.DeviceMesh([0]), {}))
    result["capture_s"] = _time(device, lambda: model.explain(**inputs))
    with torch.no_grad():  # the gradients' first allocation is no build: every step has them
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    result["first_step_s"] = _time(device, lambda: model(**inputs).loss.backward())
    result["step_s"] = statistics.median(
        _time(device, lambda: model(**inputs).loss.backward()) for _ in range(3))
    result["capture_and_build_s"] = result["capture_s"] + result["first_step_s"] - \
        result["step_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    warnings.simplefilter("ignore")
    measure(1, device)  # warm-up: imports, first export
    results = [measure(int(n), device) for n in args.layers.split(",")]
    for r in results:
        print(json.dumps(r))
    base = results[0]["capture_and_build_s"]
    for r in results[1:]:
        print(f"{r['layers']} layers / {results[0]['layers']}: "
              f"{r['capture_and_build_s'] / base:.2f}x capture + build")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
