"""Issue 32's capture-time target: capture + build of a 32-layer ``transformers`` Llama
(hidden 512) within 3x that of a 2-layer one, at one rank.

    python -m benchmarks.capture_depth                  # CPU, layers 2 and 32
    python -m benchmarks.capture_depth --layers 2,16 --device cuda

Per depth: the capture (``parallelize`` with ``example_inputs``: the trace, folding and
partition) and the first forward + backward (the builds of each distinct block's fusion and
its derived backward, then the run), against a second step (the run alone). Random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch
import torch.distributed as dist


def _time(device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


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
    result["capture_s"] = _time(device, lambda: meshfuse.parallelize(
        model, meshfuse.DeviceMesh([0]), {}, example_inputs=inputs))
    result["first_step_s"] = _time(device, lambda: model(**inputs).loss.backward())
    result["second_step_s"] = _time(device, lambda: model(**inputs).loss.backward())
    result["capture_and_build_s"] = result["capture_s"] + result["first_step_s"] - \
        result["second_step_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    device = torch.device(args.device)
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
