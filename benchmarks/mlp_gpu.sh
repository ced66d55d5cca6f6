#!/usr/bin/env bash
# Issue 13's Megatron MLP on 2 GPUs, one command from the repository root (about 2 minutes,
# 4 at most):
#   bash benchmarks/mlp_gpu.sh OUT
# 1. OUT/tests.txt: the GEMM -> allreduce loop tests on CUDA ranks at world sizes 1 and 2
#    (tests/test_allreduce_loop.py: NCCL loops and copy-engine loops against the unsharded
#    GEMM and the Megatron calls, transfers recorded);
# 2. OUT/case/*.md, *.json (log OUT/case.log): the mlp case (T=H=8192, F=32768, bf16, forward
#    and backward): one GPU, torch_manual, DTensor, meshfuse as estimated, and with both
#    allreduces forced into loops: NCCL in 4 row chunks, copy engines whole, in 4 and 8 chunks,
#    and the copy engines asked for with the loops left to the estimate;
#    each with its speed over one GPU and over DTensor;
# 3. OUT/profile/mlp_profile*.txt (log OUT/profile.log): a profile of 3 steps of each variant
#    (kernels by name with counts and times per step; GPU busy/idle time, NCCL or copy-engine
#    time no compute kernel hid; clocks; traces mlp_trace_*.json.gz).
# Each step has its own time limit; one that fails or times out does not stop the others.
# A summary is printed last and written to OUT/summary.txt.
set -u
out=${1:-gpu-out}
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
launch=(torchrun --nproc-per-node 2)
summary=("commit: ${MESHFUSE_COMMIT:-$([ -e .git ] && git rev-parse --short HEAD 2>/dev/null || echo unknown)}")
timeout 70 python -m pytest tests/test_allreduce_loop.py -q -p no:cacheprovider \
  --world-sizes 1,2 > "$out/tests.txt" 2>&1
summary+=("allreduce loop tests: rc=$? $(tail -1 "$out/tests.txt")")
timeout 90 "${launch[@]}" -m benchmarks.run --cases mlp --out "$out/case" > "$out/case.log" 2>&1
summary+=("mlp case: rc=$?" "$(grep -h '^| T8192' "$out"/case/*.md 2>/dev/null)")
timeout 70 "${launch[@]}" -m benchmarks.mlp_profile --out "$out/profile" > "$out/profile.log" 2>&1
summary+=("mlp profile: rc=$?" "$(cat "$out/profile/mlp_profile.txt" 2>/dev/null)")
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
