#!/usr/bin/env bash
# Issue 18 on 2 GPUs, one command from the repository root (about 4.5 minutes for every step):
#   bash benchmarks/overlap_gpu.sh OUT [STEPS]
# STEPS: a comma-separated subset of probe,tests,nvfuser,case,gpt3 (default: all), run in
# that order:
# - probe: OUT/probe/{api.txt,probe.txt,overlap_profile.txt} (log OUT/probe.log): what torch
#   offers for async TP, then direct calls at nvFuser's overlap sizes (t = h = 8192, bf16): the
#   GEMM alone, NCCL whole, torch's fused async-TP ops and torch.compile's _micro_pipeline_tp,
#   meshfuse's copy-engine transport
#   driving one GEMM per block (the column layer also with the pulls issued before the own
#   block's GEMM, with torch's two streams, and with pushes instead of pulls); how much of the transfers ran under GEMMs,
#   with a timeline (benchmarks.overlap_transport_probe);
# - tests: OUT/tests.txt: the CUDA tests of the copy-engine transport
#   (tests/test_overlap_transport.py: values against the unsharded layer and the NCCL loops,
#   transfers recorded);
# - nvfuser: nvFuser's tests/python/multidevice/test_overlap.py on 2 GPUs (needs build/nvfuser,
#   from scripts/nvfuser_fetch.sh): OUT/nvfuser/nvfuser_tests.log, each test's start and
#   outcome as it ends in OUT/nvfuser/rank*.jsonl (kept when the run is cut short); its
#   limit is NVFUSER_BATCH_S (240 s by default) for the 20 items of a world size;
# - case: OUT/case/*.md, *.json (log OUT/case.log): the overlap case (row, row_sp and column
#   linear; meshfuse without loops, with NCCL loops, with copy-engine loops, the estimate's
#   choice; torch's fused ops called directly; torch.compile with _micro_pipeline_tp);
# - gpt3: OUT/gpt3/gpt3_profile*.txt (log OUT/gpt3.log): the GPT-3 layer (e=12288, s=2048),
#   forward and backward: DTensor, and meshfuse's compiled derived backward with the copy
#   engines asked for: without loops, where the estimate chooses them, and with every
#   candidate collective in a loop: step times and a profile (busy/idle GPU time, NCCL time
#   not hidden, peer copies beside kernels, barriers).
# With one GPU only the tests and nvfuser steps run (at world size 1).
# Each step has its own time limit; one that fails or times out does not stop the others.
# A summary (with each step's seconds) is printed last and written to OUT/summary.txt.
set -u
out=${1:-gpu-out}
steps=,${2:-probe,tests,nvfuser,case,gpt3},
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
launch=(torchrun --nproc-per-node 2)
ngpu=$(python3 -c 'import torch; print(min(torch.cuda.device_count(), 2))')
summary=("commit: ${MESHFUSE_COMMIT:-$([ -e .git ] && git rev-parse --short HEAD 2>/dev/null || echo unknown)}" "GPUs used: $ngpu")
if (( ngpu < 2 )); then  # one GPU: the tests at world size 1; the timings need two
  summary+=("one GPU: probe, case and gpt3 need 2 GPUs, not run")
  steps=${steps//,probe,/,}; steps=${steps//,case,/,}; steps=${steps//,gpt3,/,}
fi
sizes=$( (( ngpu >= 2 )) && echo 1,2 || echo 1)
want() { [[ $steps == *",$1,"* ]]; }
if want probe; then
  SECONDS=0
  timeout 110 "${launch[@]}" -m benchmarks.overlap_transport_probe --out "$out/probe" \
    --layers column,row_sp \
    --variants gemm_only,nccl,torch_fused,async_tp_compiled,copy_engine_loop,copy_engine_loop_early,copy_engine_two_streams,copy_engine_barrier_aside,copy_engine_push,copy_engine_push_early \
    > "$out/probe.log" 2>&1
  summary+=("probe: rc=$? (${SECONDS}s)" "$(cat "$out/probe/probe.txt" 2>/dev/null)")
fi
if want tests; then
  SECONDS=0
  timeout 45 python -m pytest tests/test_overlap_transport.py -q -x -p no:cacheprovider \
    --world-sizes "$sizes" > "$out/tests.txt" 2>&1
  summary+=("copy-engine tests: rc=$? (${SECONDS}s) $(tail -1 "$out/tests.txt")")
fi
if want nvfuser; then
  SECONDS=0
  if [ -d build/nvfuser/multidevice ]; then
    scratch=$(mktemp -d)
    mkdir -p "$out/nvfuser"
    # each rank's per-test records, copied while it runs (the harness deletes them at the end)
    (while sleep 3; do cp "$scratch"/meshfuse-ws*/rank* "$out/nvfuser/" 2>/dev/null; done) &
    copier=$!
    # One batch holds all 20 items of a world size; the benchmark items draw 8192x32768
    # inputs on the host (torch.randn on the CPU): 65 s stopped the sixth item on an H200
    # machine at 05:06 on 2026-12-01.
    batch_s=${NVFUSER_BATCH_S:-240}
    TMPDIR=$scratch MESHFUSE_TEST_TIMEOUT=$batch_s timeout $((batch_s + 10)) \
      scripts/nvfuser_tests.sh build/nvfuser \
      "$out/nvfuser" multidevice/test_overlap.py --world-sizes "${sizes##*,}" -v -rA \
      > "$out/nvfuser/stdout.log" 2>&1
    rc=$?
    kill $copier
    cp "$scratch"/meshfuse-ws*/rank* "$out/nvfuser/" 2>/dev/null
    rm -rf "$scratch"
    summary+=("nvFuser test_overlap.py (world size ${sizes##*,}): rc=$rc (${SECONDS}s)" \
      "$(grep -h '"event": "end"' "$out"/nvfuser/rank0.jsonl 2>/dev/null | python3 -c '
import collections, json, sys
ends = [json.loads(line) for line in sys.stdin]
print("  rank 0:", dict(collections.Counter(r["outcome"] for r in ends)))
for r in ends:
    if r["outcome"] != "passed":
        print("  ", r["outcome"], r["nodeid"])')" \
      "$(tail -1 "$out/nvfuser/nvfuser_tests.log" 2>/dev/null)")
  else
    summary+=("nvFuser tests: build/nvfuser missing (scripts/nvfuser_fetch.sh), not run")
  fi
fi
if want case; then
  SECONDS=0
  timeout 110 "${launch[@]}" -m benchmarks.run --cases overlap --out "$out/case" \
    > "$out/case.log" 2>&1
  summary+=("overlap case: rc=$? (${SECONDS}s)" \
    "$(grep -h '^| row\|^| column' "$out"/case/*.md 2>/dev/null)")
fi
if want gpt3; then
  SECONDS=0
  # the copy engines asked for: meshfuse_autograd_compiled loops where the estimate says
  # they pay, _whole never, _overlap always
  MESHFUSE_OVERLAP_TRANSPORT=copy_engine timeout 120 "${launch[@]}" -m benchmarks.gpt3_profile \
    --out "$out/gpt3" --interleave --variants \
    dtensor_tp_sp,meshfuse_autograd_compiled_whole,meshfuse_autograd_compiled,meshfuse_autograd_compiled_overlap \
    > "$out/gpt3.log" 2>&1
  summary+=("gpt3 profile: rc=$? (${SECONDS}s)" "$(cat "$out/gpt3/gpt3_profile.txt" 2>/dev/null)")
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
