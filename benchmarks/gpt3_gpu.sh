#!/usr/bin/env bash
# Issues 17 and 19 on 2 GPUs (or 1), one command from the repository root (about 6 minutes,
# 9.5 at most):
#   bash benchmarks/gpt3_gpu.sh OUT
# 1. the gpt3_layer case (one GPU, DTensor TP+SP, meshfuse hand-written and derived backward,
#    interpreted and compiled, the derived one also with remat='save' and with the overlap
#    estimate's earlier figures; each meshfuse variant also timed interleaved with DTensor)
#    and mlp_autodiff (the Megatron MLP, derived vs hand-written backward): times, TFLOP/s,
#    peak memory (benchmarks.run): OUT/*.md, OUT/*.json, log OUT/bench.log;
# 2. the 2-block GPT stack trained 20 AdamW steps in bf16, TP+SP, against single-device
#    PyTorch and a DTensor twin (meshfuse.examples.train_gpt): OUT/train/train_gpt.json,
#    log OUT/train.log;
# 3. a profile of 3 steps of DTensor (one GPU: the unsharded torch layer) and of the compiled
#    derived and hand-written variants: kernels by name with counts and times per step, GPU
#    busy/idle/exposed-NCCL time, clocks (benchmarks.gpt3_profile): OUT/profile/*.txt;
# 4. nvFuser's test_transformer.py at full size (e=12288, s=2048) with NCCL, if build/nvfuser
#    is there (scripts/nvfuser_fetch.sh): stops at the first failure; each test's start and
#    outcome are written as it ends, to OUT/nvfuser/rank*.jsonl (kept when the run is cut
#    short), its summary to OUT/nvfuser/nvfuser_tests.log.
# Each step has its own time limit; one that fails or times out does not stop the others.
# With one GPU everything runs at world size 1 (meshfuse unsharded against torch's layer).
# A summary is printed last and written to OUT/summary.txt.
set -u
out=${1:-gpu-out}
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
ngpu=$(python3 -c 'import torch; print(min(torch.cuda.device_count(), 2))')
# The commit: $MESHFUSE_COMMIT where the caller sets it (a copied tree without .git would
# read the enclosing repository's), else this tree's own .git, else unknown.
commit=${MESHFUSE_COMMIT:-$([ -e .git ] && git rev-parse --short HEAD 2>/dev/null || echo unknown)}
summary=("GPUs used: $ngpu" "commit: $commit")
if (( ngpu >= 2 )); then
  launch=(torchrun --nproc-per-node 2) baseline=dtensor_tp_sp
else
  launch=(python3) baseline=torch_1gpu
fi
timeout 270 "${launch[@]}" -m benchmarks.run --cases gpt3_layer,mlp_autodiff --out "$out" \
  > "$out/bench.log" 2>&1
summary+=("gpt3_layer, mlp_autodiff: rc=$?" "$(grep -h -A11 '^| config' "$out"/*.md 2>/dev/null)")
timeout 100 "${launch[@]}" -m meshfuse.examples.train_gpt --dtype bfloat16 --batch 2 --seq 256 \
  --embed 512 --heads 8 --out "$out/train" > "$out/train.log" 2>&1
summary+=("train_gpt bf16 (20 AdamW steps): rc=$?" "$(tail -1 "$out/train.log")")
timeout 110 "${launch[@]}" -m benchmarks.gpt3_profile --out "$out/profile" \
  --variants $baseline,meshfuse_autograd_compiled,meshfuse_compiled,meshfuse_autograd_compiled_overlap \
  > "$out/profile.log" 2>&1
summary+=("profile: rc=$?" "$(cat "$out/profile/gpt3_profile.txt" 2>/dev/null)")
if [ -d build/nvfuser/multidevice ]; then
  scratch=$(mktemp -d)
  mkdir -p "$out/nvfuser"
  # Each rank's per-test records and pytest log, copied every few seconds while it runs
  # (the harness deletes them at the end; nvFuser's own files stay in the scratch folder).
  (while sleep 3; do cp "$scratch"/meshfuse-ws*/rank* "$out/nvfuser/" 2>/dev/null; done) &
  copier=$!
  TMPDIR=$scratch MESHFUSE_TEST_TIMEOUT=100 timeout 115 scripts/nvfuser_tests.sh build/nvfuser \
    "$out/nvfuser" multidevice/test_transformer.py --world-sizes "$ngpu" -v -x -rA \
    > "$out/nvfuser/stdout.log" 2>&1
  rc=$?
  kill $copier
  rm -rf "$scratch"
  summary+=("nvFuser test_transformer.py ($ngpu GPUs, full size): rc=$rc" \
    "$(grep -h '"event": "end"' "$out"/nvfuser/rank0.jsonl 2>/dev/null \
      | python3 -c 'import json, sys; [print(" ", r["outcome"], r["nodeid"]) for r in map(json.loads, sys.stdin)]')" \
    "$(tail -3 "$out/nvfuser/nvfuser_tests.log" 2>/dev/null)")
else
  summary+=("nvFuser tests: build/nvfuser missing (scripts/nvfuser_fetch.sh), not run")
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
