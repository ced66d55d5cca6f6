#!/usr/bin/env bash
# The open GPU bars of issues 31, 33 and 34 on one GPU, from the repository root, in two
# commands of under ten minutes each (logs and results under OUT):
#   bash benchmarks/open_bars_gpu.sh OUT memory  # CUDA replay tests; FSDP 1.1B step against
#                                                # FSDP2 + compile; Llama-3.2-1B HF step
#                                                # against compile (peaks, tokens/s)
#   bash benchmarks/open_bars_gpu.sh OUT speed   # the GPT layer's step (small, medium); the
#                                                # cross entropy at 32k and 128k classes
set -u
out=${1:-gpu-out}
part=${2:-memory}
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
case $part in
  memory)
    timeout 90 python3 -m pytest -q -p no:cacheprovider --world-sizes 1 \
      tests/test_auto_replay.py tests/test_autograd_replay.py tests/test_cross_entropy_kernel.py \
      > "$out/tests.txt" 2>&1
    echo "replay tests: rc=$? $(tail -1 "$out/tests.txt")"
    mkdir -p "$out/fsdp" "$out/llama"
    timeout 200 python3 -m benchmarks.fsdp_vs_torchtitan --steps 8 --out "$out/fsdp" \
      > "$out/fsdp/fsdp.log" 2>&1
    echo "fsdp: rc=$?"; tail -1 "$out/fsdp/fsdp_vs_torchtitan.md"
    timeout 250 python3 -m benchmarks.capture_llama --variants compile,meshfuse --trace \
      --out "$out/llama" > "$out/llama/capture_llama.log" 2>&1
    echo "llama: rc=$?"
    grep -E "^(meshfuse|compile) \{" "$out/llama/capture_llama.log" | cut -c1-300 ;;
  speed)
    mkdir -p "$out/layers" "$out/ce"
    timeout 330 python3 -m benchmarks.training_step --sizes small,medium --budget-s 300 \
      --out "$out/layers" > "$out/layers/training_step.log" 2>&1
    echo "training_step: rc=$?"
    grep -h -E '^## |^- meshfuse' "$out/layers/training_step.md"
    timeout 200 python3 -m benchmarks.cross_entropy --out "$out/ce" \
      > "$out/ce/cross_entropy.log" 2>&1
    echo "cross entropy: rc=$?" ;;
  *)
    echo "unknown part $part: memory or speed" >&2
    exit 2 ;;
esac
