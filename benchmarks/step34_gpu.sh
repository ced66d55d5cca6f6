#!/usr/bin/env bash
# Issue 34 on one GPU, from the repository root, one part per command (each < 10 minutes):
#   bash benchmarks/step34_gpu.sh OUT tests    # CUDA tests of the replayed/captured paths
#   bash benchmarks/step34_gpu.sh OUT models   # CUDA tests of Hugging Face and torchtitan models
#                                              # through parallelize, one rank
#   bash benchmarks/step34_gpu.sh OUT layers   # the GPT layer's step, small and medium (~1-2 min
#                                              # on 2026-12-03, 50-65 s of timing)
#   bash benchmarks/step34_gpu.sh OUT perstep  # the small layer per step of a block of 10:
#                                              # autograd, capture_step, hand-written (~1 min)
#   bash benchmarks/step34_gpu.sh OUT first    # one step from an idle GPU, host time part by
#                                              # part (benchmarks.first_step, ~1 min)
#   bash benchmarks/step34_gpu.sh OUT big      # the 12288-wide layer (not timed before)
#   bash benchmarks/step34_gpu.sh OUT llama    # Llama-3.2-1B-shaped step: eager, compile,
#                                              # meshfuse (~3-4 min on 2026-12-03)
#   bash benchmarks/step34_gpu.sh OUT steps    # the small layer's GPU time per program step:
#                                              # autograd against the hand-written fusion, each
#                                              # also at Inductor's realize threshold 30
#                                              # (meshfuse's: 40), replay off
#   bash benchmarks/step34_gpu.sh OUT timeline # the small layer's replayed steps on the GPU's
#                                              # timeline: autograd, capture_step, hand-written
#   bash benchmarks/step34_gpu.sh OUT opcount  # the small and medium layers, autograd and
#                                              # hand-written, with Inductor's realize threshold
#                                              # at meshfuse's 40 and Inductor's 30, one run
# tests: the automatic replay (autograd path included), capture_step, fusion by default, host
# time, explicit CUDA graphs, the backward on the calling thread, recomputation across
# segments, with real graphs: OUT/tests.txt; then benchmarks.replay_phases (the graphs a
# layer keeps through host_profile's call patterns and a self-fed loop): OUT/replay_phases.log.
# layers/big: benchmarks.training_step (torch eager, torch.compile, reduce-overhead, the
# derived backward through autograd with default settings, without replay, under
# capture_step, the hand-written fusion; ratios in the same run): OUT/layers/ or OUT/big/
# training_step.{json,md}, log beside.
# llama: benchmarks.capture_llama (tokens/s, first step, peak memory, and what each shared
# fusion's calls did: whether every layer replays): OUT/llama/*.json, log beside.
# steps: benchmarks.host_profile --by-step: OUT/steps/host_profile-gpt-*-by-step.txt (which
# step's kernels the derived programs spend more GPU time in than the hand-written one).
# timeline: benchmarks.step_timeline: OUT/step_timeline.txt and one analysis per variant.
set -u
out=${1:-gpu-out}
part=${2:-layers}
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
case $part in
  tests)
    timeout 420 python3 -m pytest -q -p no:cacheprovider -rfs --world-sizes 1 \
      tests/test_autograd_replay.py tests/test_auto_replay.py tests/test_capture_step.py \
      tests/test_compile_default.py tests/test_host_time.py tests/test_cuda_graph.py \
      tests/test_engine_thread.py tests/test_recompute_segments.py tests/test_persistent_rows.py \
      > "$out/tests.txt" 2>&1
    echo "tests: rc=$? $(tail -1 "$out/tests.txt")"
    timeout 130 python3 -m benchmarks.replay_phases > "$out/replay_phases.log" 2>&1
    echo "replay_phases: rc=$? $(tail -1 "$out/replay_phases.log")" ;;
  models)
    timeout 560 python3 -m pytest -q -p no:cacheprovider -rfs --world-sizes 1 \
      tests/test_capture_models.py tests/test_capture_bf16.py tests/test_capture_lm_ops.py \
      tests/test_capture_repeats.py tests/test_capture_grouped_heads.py \
      tests/test_capture_model_zoo.py tests/test_capture_in_place.py tests/test_pipeline_hf.py \
      tests/test_capture_torchtitan.py tests/test_moe_torchtitan.py > "$out/models.txt" 2>&1
    echo "models: rc=$? $(tail -1 "$out/models.txt")" ;;
  perstep)
    mkdir -p "$out/perstep"
    timeout 300 python3 -m benchmarks.training_step --sizes small --per-step --rounds 9 \
      --variants meshfuse_autograd,meshfuse_hand_written,meshfuse_captured \
      --out "$out/perstep" > "$out/perstep/training_step.log" 2>&1
    echo "training_step --per-step: rc=$?"
    grep -h "per step of a block" "$out/perstep/training_step.md" ;;
  first)
    mkdir -p "$out/first"
    timeout 200 python3 -m benchmarks.first_step --rounds 20 --out "$out/first" \
      > "$out/first/first_step.log" 2>&1
    echo "first_step: rc=$?"
    cat "$out/first/first_step.txt" ;;
  layers|big)
    sizes=small,medium
    [ "$part" = big ] && sizes=big
    mkdir -p "$out/$part"
    timeout 570 python3 -m benchmarks.training_step --sizes "$sizes" --budget-s 500 \
      --out "$out/$part" > "$out/$part/training_step.log" 2>&1
    echo "training_step $sizes: rc=$?"
    grep -h -E '^## |^- meshfuse' "$out/$part/training_step.md" ;;
  llama)
    mkdir -p "$out/llama"
    timeout 570 python3 -m benchmarks.capture_llama --out "$out/llama" \
      > "$out/llama/capture_llama.log" 2>&1
    echo "capture_llama: rc=$?"
    grep -E '^(meshfuse|eager|compile) \{|^\{' "$out/llama/capture_llama.log" ;;
  steps)
    mkdir -p "$out/steps"
    timeout 400 python3 -m benchmarks.host_profile --case gpt --by-step --out "$out/steps" \
      --gpt-variants meshfuse_autograd,meshfuse_autograd_opcount30,meshfuse_hand_written,meshfuse_hand_written_opcount30 \
      > "$out/steps/host_profile.log" 2>&1
    echo "host_profile --by-step: rc=$?"
    grep -h "^program of" "$out"/steps/*-by-step.txt ;;
  timeline)
    # traces stay out of OUT (one per variant, large); their analyses come back
    timeout 300 python3 -m benchmarks.step_timeline --out /tmp/step_timeline \
      --variants meshfuse_autograd,meshfuse_autograd_recompute,meshfuse_captured,meshfuse_hand_written \
      > "$out/step_timeline.log" 2>&1
    echo "step_timeline: rc=$?"
    cp /tmp/step_timeline/step_timeline* "$out/"
    cat "$out/step_timeline.txt" ;;
  opcount)
    mkdir -p "$out/opcount"
    timeout 570 python3 -m benchmarks.training_step --sizes small,medium --budget-s 420 \
      --variants meshfuse_autograd,meshfuse_autograd_opcount30,meshfuse_hand_written,meshfuse_hand_written_opcount30,torch_compile \
      --out "$out/opcount" > "$out/opcount/training_step.log" 2>&1
    echo "training_step opcount: rc=$?"
    grep -h -E '^## |^\| meshfuse|^\| torch' "$out/opcount/training_step.md" ;;
  *)
    echo "unknown part $part: tests, models, perstep, first, layers, big, llama, steps, timeline or opcount" >&2
    exit 2 ;;
esac
