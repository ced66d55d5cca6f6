#!/usr/bin/env bash
# Issue 14 on 2 GPUs, one command from the repository root (about 5 minutes, 10 at most):
#   bash benchmarks/cp_gpu.sh OUT
# 1. OUT/tests.txt: the CUDA tests of how the ring's blocks travel and merge
#    (tests/test_context_parallel_transport.py over NCCL: the copy engines against NCCL's
#    send/recv bit for bit, a slot made while the peer is busy, the compiled merge, both on
#    auto; against unsharded attention);
# 2. OUT/cp/*.md, *.json (log OUT/cp.log): the context_parallel case, every configuration
#    (causal s=32k and 128k, non-causal 32k): one GPU, the default ring (ring_zigzag), the
#    ring with NCCL, with the copy engines, with the eager merge, with the own block whole,
#    block split, all-gather, all-to-all, the estimate's choice, torch's context_parallel;
#    with OUT/profile/: a torch.profiler trace of two default ring calls at s=32k per rank
#    and its summary (ring_zigzag_s32768_rank<r>{.json,_summary.json}).
# A summary is printed last and written to OUT/summary.txt.
#
#   bash benchmarks/cp_gpu.sh OUT short     (about 3.5 minutes)
# runs instead: OUT/cp (log OUT/cp.log): causal s=32k, the one-GPU baselines as bare
# torch.ops.aten calls (one_gpu: cuDNN, one_gpu_flash), meshfuse's one-GPU kernel layer
# (one_gpu_meshfuse), the default ring, torch's context_parallel (all-to-all); then, last (a
# stuck barrier cannot cost the numbers), OUT/tests.txt: the CUDA context-parallel tests
# (tests/test_context_parallel_transport.py: the copy engines and the compiled merge, the
# default merge, explain's transport and merge; tests/test_context_parallel_errors.py: a
# transport set otherwise on one rank; the context-parallel programs of the fuzzer).
#
#   bash benchmarks/cp_gpu.sh OUT one       (1 GPU, about 1.5 minutes)
# when only one GPU is lent: OUT/cp: causal s=32k on one GPU, the bare aten baselines against
# meshfuse's one-GPU kernel layer; OUT/tests.txt: the same CUDA tests at world size 1 (no
# ring: the explain, error and fuzz tests that need one rank).
#
#   bash benchmarks/cp_gpu.sh OUT repro     (about 5 minutes)
# runs: OUT/cp: causal s=32k, one GPU, the default ring (the compiled merge on CUDA), the
# ring with the eager merge, with the own block whole (MESHFUSE_CP_OWN_PARTS=1), the
# estimate's choice, torch's context_parallel (all-to-all); OUT/cp_nccl_high: the default
# ring with NCCL's streams of high priority (TORCH_NCCL_HIGH_PRIORITY=1); OUT/repro:
# benchmarks/cp_copy_engine_repro.py, the signal-pad race with torch's API alone
# (raw_unsynced, raw_synced) and the copy-engine ring at s=32k against the NCCL ring
# (ring_rank<r>.json, .log); last, OUT/cp_copy: the case's copy-engine variant.
set -u
out=${1:-gpu-out}
mode=${2:-full}
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
launch=(torchrun --nproc-per-node 2 -m benchmarks.run --cases context_parallel)
summary=()
if [ "$mode" = short ]; then
  MESHFUSE_CP_BENCH_CONFIGS=causal_s32k \
    MESHFUSE_CP_BENCH_VARIANTS=one_gpu_meshfuse,ring_zigzag,torch_cp_alltoall \
    timeout 120 "${launch[@]}" --out "$out/cp" > "$out/cp.log" 2>&1
  summary+=("context_parallel: rc=$?" "$(grep -h '^| causal_s32k' "$out"/cp/*.md 2>/dev/null)")
  timeout 90 python -m pytest tests/test_context_parallel_transport.py \
    tests/test_context_parallel_errors.py tests/test_fuzz_context_parallel.py -q \
    -p no:cacheprovider > "$out/tests.txt" 2>&1
  summary+=("CUDA context-parallel tests: rc=$? $(tail -1 "$out/tests.txt")")
  printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
  exit 0
fi
if [ "$mode" = one ]; then
  MESHFUSE_CP_BENCH_CONFIGS=causal_s32k MESHFUSE_CP_BENCH_VARIANTS=one_gpu_meshfuse \
    timeout 90 torchrun --nproc-per-node 1 -m benchmarks.run --cases context_parallel \
    --out "$out/cp" > "$out/cp.log" 2>&1
  summary+=("context_parallel, 1 GPU: rc=$?" "$(grep -h '^| causal_s32k' "$out"/cp/*.md 2>/dev/null)")
  timeout 60 python -m pytest tests/test_context_parallel_transport.py \
    tests/test_context_parallel_errors.py tests/test_fuzz_context_parallel.py -q \
    -p no:cacheprovider --world-sizes 1 > "$out/tests.txt" 2>&1
  summary+=("CUDA context-parallel tests, 1 rank: rc=$? $(tail -1 "$out/tests.txt")")
  printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
  exit 0
fi
if [ "$mode" = repro ]; then
  MESHFUSE_CP_BENCH_CONFIGS=causal_s32k \
    MESHFUSE_CP_BENCH_VARIANTS=ring_zigzag,ring_zigzag_eager_merge,ring_zigzag_own_whole,auto,torch_cp_alltoall \
    timeout 150 "${launch[@]}" --out "$out/cp" > "$out/cp.log" 2>&1
  summary+=("context_parallel: rc=$?" "$(grep -h '^| causal_s32k' "$out"/cp/*.md 2>/dev/null)")
  TORCH_NCCL_HIGH_PRIORITY=1 MESHFUSE_CP_BENCH_CONFIGS=causal_s32k \
    MESHFUSE_CP_BENCH_VARIANTS=ring_zigzag timeout 90 "${launch[@]}" --out "$out/cp_nccl_high" \
    > "$out/cp_nccl_high.log" 2>&1
  summary+=("TORCH_NCCL_HIGH_PRIORITY=1: rc=$?" "$(grep -h '^| causal_s32k' "$out"/cp_nccl_high/*.md 2>/dev/null)")
  repro=(torchrun --nproc-per-node 2 -m benchmarks.cp_copy_engine_repro "$out/repro")
  for m in raw_unsynced raw_synced ring; do
    timeout "$([ "$m" = ring ] && echo 150 || echo 60)" "${repro[@]}" "$m" > "$out/repro_$m.log" 2>&1
    summary+=("repro $m: rc=$? $(cat "$out"/repro/"$m"_rank*.json 2>/dev/null | tr -d ' \n' | cut -c1-900)")
  done
  MESHFUSE_CP_BENCH_CONFIGS=causal_s32k MESHFUSE_CP_BENCH_VARIANTS=ring_zigzag_copy_engine \
    timeout 120 "${launch[@]}" --out "$out/cp_copy" > "$out/cp_copy.log" 2>&1
  summary+=("copy engines: rc=$?" "$(grep -h '^| causal_s32k' "$out"/cp_copy/*.md 2>/dev/null)")
  printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
  exit 0
fi
timeout 180 python -m pytest tests/test_context_parallel_transport.py -q -p no:cacheprovider \
  > "$out/tests.txt" 2>&1
summary+=("transport tests: rc=$? $(tail -1 "$out/tests.txt")")
variants=one_gpu_meshfuse,ring_zigzag,ring_zigzag_nccl,ring_zigzag_copy_engine,ring_zigzag_eager_merge
variants+=,ring_zigzag_own_whole,ring_block,allgather,alltoall,auto
variants+=,torch_cp_allgather,torch_cp_alltoall
MESHFUSE_CP_PROFILE=$out/profile MESHFUSE_CP_BENCH_VARIANTS=$variants \
  timeout 400 "${launch[@]}" --out "$out/cp" > "$out/cp.log" 2>&1
summary+=("context_parallel: rc=$?" "$(grep -h '^| causal_s32k\|^| full_s32k\|^| causal_s128k' "$out"/cp/*.md 2>/dev/null)")
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
