#!/usr/bin/env bash
# One GPU session on a device machine (1 or 2 GPUs): versions, the demo, the GPU-relevant
# tests (multi-rank ones with NCCL, one process per GPU), and the benchmarks at 1 and 2 GPUs.
# Logs and results go to $OUT (default ./gpu-out); a short summary is printed last.
#   bash benchmarks/gpu_session.sh [tests|bench|all] [pytest args...]
set -u
what=${1:-all}
shift || true
out=${OUT:-gpu-out}
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
summary=("$(python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch",
  torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
  "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count(),
  torch.cuda.get_device_name(0))')")
if [[ $what == tests || $what == all ]]; then
  log=$out/tests.log
  timeout 150 python3 -m meshfuse.demo > "$log" 2>&1
  summary+=("demo (${ngpu} GPUs): rc=$? $(grep RESULT "$log")")
  MESHFUSE_CHECK_RANKS=1 timeout 400 python3 -m pytest -q -p no:cacheprovider --timeout=300 -rf \
    tests "$@" >> "$log" 2>&1
  summary+=("tests: rc=$? $(tail -1 "$log")")
fi
if [[ $what == bench || $what == all ]]; then
  log=$out/bench.log
  timeout 200 python3 -m benchmarks.run --out "$out" > "$log" 2>&1
  summary+=("bench 1 GPU: rc=$?")
  if (( ngpu >= 2 )); then
    timeout 240 torchrun --nproc-per-node 2 -m benchmarks.run --out "$out" >> "$log" 2>&1
    summary+=("bench 2 GPUs: rc=$?")
  fi
fi
printf '%s\n' "${summary[@]}"
