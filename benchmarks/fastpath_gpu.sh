#!/usr/bin/env bash
# Issues 16 and 13 on 1-2 GPUs, one command from the repository root:
#   bash benchmarks/fastpath_gpu.sh OUT
# 1. dropout check per kernel (math, cuDNN, flash, memory-efficient, global mode): same seed,
#    same forward bits; gradients bitwise under deterministic algorithms; masks read off the
#    output; the user's generator untouched (benchmarks/dropout_check.py), on 1 GPU and on 2;
# 2. the dropout, replay and fusion tests on the GPUs;
# 3. benchmarks on 2 GPUs (1 without a second): attention_dropout, fusion, attention_seed.
# Everything goes to OUT (logs, JSON, reports); a summary is printed last.
set -u
out=${1:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_NCCL_ENABLE_MONITORING=0
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
summary=()
timeout 300 python3 -m benchmarks.dropout_check "$out/dropout-1gpu" > "$out/dropout-1gpu.log" 2>&1
summary+=("dropout_check 1 GPU: rc=$? $(grep RESULT "$out/dropout-1gpu.log")")
if (( ngpu >= 2 )); then
  timeout 300 torchrun --nproc-per-node 2 -m benchmarks.dropout_check "$out/dropout-2gpu" \
    > "$out/dropout-2gpu.log" 2>&1
  summary+=("dropout_check 2 GPUs: rc=$? $(grep RESULT "$out/dropout-2gpu.log")")
fi
timeout 500 python3 -m pytest -q -p no:cacheprovider -rf tests/test_dropout_reproducible.py \
  tests/test_attention_dropout.py tests/test_auto_replay.py tests/test_cuda_graph.py \
  tests/test_fused.py tests/test_reproducibility_check.py > "$out/tests.log" 2>&1
summary+=("tests: rc=$? $(tail -1 "$out/tests.log")")
launcher=(python3)
(( ngpu >= 2 )) && launcher=(torchrun --nproc-per-node 2)
timeout 420 "${launcher[@]}" -m benchmarks.run --cases attention_dropout,fusion,attention_seed \
  --out "$out" > "$out/bench.log" 2>&1
summary+=("bench (${ngpu} GPUs): rc=$?")
printf '%s\n' "${summary[@]}"
