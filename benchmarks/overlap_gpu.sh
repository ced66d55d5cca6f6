#!/usr/bin/env bash
# Issue 18 on 2 GPUs, one command from the repository root (about 5 minutes, 7 at most):
#   bash benchmarks/overlap_gpu.sh OUT
# 1. OUT/probe/{api.txt,probe.txt,overlap_profile.txt} (log OUT/probe.log): what torch offers
#    for async TP, then direct calls at nvFuser's overlap sizes (t = h = 8192, bf16): the GEMM
#    alone, NCCL whole, torch's fused async-TP ops, meshfuse's copy-engine transport driving
#    one GEMM per block; with how much of the transfers ran under GEMMs
#    (benchmarks.overlap_transport_probe);
# 2. OUT/tests.txt: the CUDA tests of the copy-engine transport (tests/test_overlap_transport.py:
#    values against the unsharded layer and the NCCL loops, transfers recorded);
# 3. OUT/case/*.md, *.json (log OUT/case.log): the overlap case (row, row_sp and column
#    linear; meshfuse without loops, with NCCL loops, with copy-engine loops, the estimate's
#    choice; torch's fused ops called directly; torch.compile with _micro_pipeline_tp);
# 4. OUT/gpt3/gpt3_profile*.txt (log OUT/gpt3.log): the GPT-3 layer (e=12288, s=2048), forward
#    and backward: DTensor, meshfuse's compiled derived backward as the estimate chooses, with
#    no loop, with every candidate collective in a copy-engine loop, and with NCCL loops: step
#    times and a profile (busy/idle GPU time, NCCL time not hidden, copies beside kernels).
# Each step has its own time limit; one that fails or times out does not stop the others.
# A summary is printed last and written to OUT/summary.txt.
set -u
out=${1:-gpu-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_NCCL_ENABLE_MONITORING=0
launch=(torchrun --nproc-per-node 2)
summary=("commit: ${MESHFUSE_COMMIT:-$([ -e .git ] && git rev-parse --short HEAD 2>/dev/null || echo unknown)}")
timeout 120 "${launch[@]}" -m benchmarks.overlap_transport_probe --out "$out/probe" \
  --variants gemm_only,nccl,torch_fused,copy_engine_loop,fused_rs_then_ag \
  > "$out/probe.log" 2>&1
summary+=("probe: rc=$?" "$(cat "$out/probe/probe.txt" 2>/dev/null)")
timeout 60 python -m pytest tests/test_overlap_transport.py -q -x -p no:cacheprovider \
  --world-sizes 1,2 > "$out/tests.txt" 2>&1
summary+=("copy-engine tests: rc=$? $(tail -1 "$out/tests.txt")")
timeout 130 "${launch[@]}" -m benchmarks.run --cases overlap --out "$out/case" \
  > "$out/case.log" 2>&1
summary+=("overlap case: rc=$?" "$(grep -h '^| row\|^| column' "$out"/case/*.md 2>/dev/null)")
timeout 120 "${launch[@]}" -m benchmarks.gpt3_profile --out "$out/gpt3" \
  --variants dtensor_tp_sp,meshfuse_autograd_compiled,meshfuse_autograd_compiled_whole,meshfuse_autograd_compiled_overlap,meshfuse_autograd_compiled_overlap_nccl \
  > "$out/gpt3.log" 2>&1
summary+=("gpt3 profile: rc=$?" "$(cat "$out/gpt3/gpt3_profile.txt" 2>/dev/null)")
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
