#!/usr/bin/env bash
# Issue 16 on 1-2 GPUs, one command from the repository root:
#   bash benchmarks/dropout_gpu.sh OUT
# 1. the CUDA tests of dropout replayed from a CUDA graph (bitwise the interpreter at every
#    call index, at 1 and 2 ranks) and of the generator swap;
# 2. the other CUDA tests that dropout touches (automatic replay, CUDA graphs, dropout);
# 3. the attention_dropout case on 2 GPUs (1 without a second): dropout 0.1 vs 0.0 replayed and
#    interpreted, the cuDNN aten kernel's own ratio, the fastest kernel with dropout;
# 4. the same case on 1 GPU.
# Each step writes its own log under OUT and a failing step does not stop the others; a
# summary is printed last (and kept in OUT/summary.txt). About 6 minutes.
set -u
out=${1:-gpu-out}
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
sizes=1
(( ngpu >= 2 )) && sizes=1,2
summary=()
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfs --world-sizes "$sizes" \
  tests/test_generator_swap.py tests/test_dropout_replay.py > "$out/tests_replay.log" 2>&1
summary+=("tests replay: rc=$? $(tail -1 "$out/tests_replay.log")")
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfs --world-sizes "$sizes" \
  tests/test_auto_replay.py tests/test_cuda_graph.py tests/test_attention_dropout.py \
  tests/test_dropout_reproducible.py > "$out/tests_other.log" 2>&1
summary+=("tests other: rc=$? $(tail -1 "$out/tests_other.log")")
launcher=(python3)
(( ngpu >= 2 )) && launcher=(torchrun --nproc-per-node 2)
timeout 300 "${launcher[@]}" -m benchmarks.run --cases attention_dropout --out "$out/bench2" \
  > "$out/bench2.log" 2>&1
summary+=("bench attention_dropout (${ngpu} GPUs): rc=$?")
timeout 200 python3 -m benchmarks.run --cases attention_dropout --out "$out/bench1" \
  > "$out/bench1.log" 2>&1
summary+=("bench attention_dropout (1 GPU): rc=$?")
for md in "$out"/bench2/*.md "$out"/bench1/*.md; do
  [[ -f $md ]] && grep -h "meshfuse_p0.1 |" "$md" >> "$out/summary.txt"
done
printf '%s\n' "${summary[@]}" | tee -a "$out/summary.txt"
