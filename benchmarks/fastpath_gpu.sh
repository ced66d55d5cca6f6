#!/usr/bin/env bash
# Issue 13 (and the CUDA tests of issue 16) on 1-2 GPUs, one command from the repository root:
#   bash benchmarks/fastpath_gpu.sh OUT
# 1. the CUDA tests of the automatic replay, CUDA graphs, fused segments and dropout;
# 2. the issue-13 benchmarks on 2 GPUs (1 without a second): `--cases issue13` (fusion,
#    attention_seed, attention_large, overhead, mlp), ratios to baselines of the same run.
# Everything goes to OUT (logs, JSON, reports); a summary is printed last. About 4 minutes.
set -u
out=${1:-gpu-out}
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
summary=()
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_auto_replay.py \
  tests/test_cuda_graph.py tests/test_fused.py tests/test_dropout_reproducible.py \
  tests/test_attention_dropout.py > "$out/tests.log" 2>&1
summary+=("tests: rc=$? $(tail -1 "$out/tests.log")")
launcher=(python3)
(( ngpu >= 2 )) && launcher=(torchrun --nproc-per-node 2)
timeout 330 "${launcher[@]}" -m benchmarks.run --cases issue13 --out "$out" \
  > "$out/bench.log" 2>&1
summary+=("bench issue13 (${ngpu} GPUs): rc=$?")
grep -h -A12 "meshfuse vs the same torch calls" "$out"/*.md >> "$out/summary.txt" 2>/dev/null
printf '%s\n' "${summary[@]}" | tee -a "$out/summary.txt"
