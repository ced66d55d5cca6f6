#!/usr/bin/env bash
# Runs nvFuser's multi-device Python tests against meshfuse, with only the module names
# aliased (nvfuser, nvfuser_direct -> meshfuse). nvFuser's files are copied into a scratch
# folder, never into this repository.
#
#   scripts/nvfuser_tests.sh NVFUSER_TESTS OUT [pytest args...]
#
# NVFUSER_TESTS: a folder with nvFuser's multidevice/ tests and, optionally, legacy/ (the
# January 2025 tests of the legacy frontend): what scripts/nvfuser_fetch.sh writes to
# build/nvfuser (nvFuser's own tests/python folder works too, for multidevice/).
# OUT: a folder for the log. Run from the meshfuse repository root. The pytest arguments
# name the tests (paths under the scratch folder, e.g. multidevice/test_transformer.py;
# default: multidevice/ and legacy/ without test_overlap.py, which needs stream parallelism).
# On GPUs (one process per GPU, NCCL) the tests run as written; with MESHFUSE_NVFUSER_CPU=1
# they run on CPU ranks (gloo): CUDA calls become no-ops, "cuda" devices become "cpu", and
# the GPT-3 layer (e=12288, s=2048, h=96) shrinks to e=64, s=64, h=4 and test_overlap.py's
# benchmark items to t = h = 64 unless MESHFUSE_NVFUSER_FULL_SIZE=1. Files whose optional dependency (transformers,
# transformer_engine) is missing are not collected.
# World sizes: --world-sizes (default 1,2,4; sizes above the GPU count are skipped).
#
# Examples:
#   scripts/nvfuser_fetch.sh ~/Fuser/.git build/nvfuser       # once, where nvFuser is at hand
#   MESHFUSE_NVFUSER_CPU=1 scripts/nvfuser_tests.sh build/nvfuser results/nvfuser -q
#   PYTHONPATH=. scripts/nvfuser_tests.sh build/nvfuser results/nvfuser \
#       multidevice/test_transformer.py --world-sizes 2 -v     # GPT-3 layer, 2 GPUs, NCCL
set -euo pipefail
src=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); shift 2
repo=$(pwd)
work=$(mktemp -d)
cpu=${MESHFUSE_NVFUSER_CPU:-0}
small=0
[ "$cpu" = 1 ] && [ "${MESHFUSE_NVFUSER_FULL_SIZE:-0}" != 1 ] && small=1

# copy SRC_DIR DEST_DIR: nvFuser's files, with "cuda" made "cpu" and the GPT-3 layer shrunk
# where asked.
copy() {
  mkdir -p "$2"
  for f in "$1"/*.py; do
    local to="$2/$(basename "$f")"
    cp "$f" "$to"
    if [ "$cpu" = 1 ]; then sed -i -e 's/"cuda"/"cpu"/g' -e "s/'cuda'/'cpu'/g" "$to"; fi
    if [ "$small" = 1 ]; then
      # the GPT-3 layer, and test_overlap.py's benchmark sizes (t = h = 8192: minutes per
      # GEMM on a CPU core)
      sed -i -e 's/b, s, h, e = 1, 2048, 96, 12288/b, s, h, e = 1, 64, 4, 64/' \
        -e 's/h, t = 8192, 8192/h, t = 64, 64/' -e 's/h, s, t = 8192, 2, 8192/h, s, t = 64, 2, 64/' \
        "$to"
    fi
  done
}
copy "$src/multidevice" "$work/multidevice"
# nvFuser's conftest sets up the process group itself; meshfuse's plugin has done it already.
sed -i 's/^    dist.init_process_group(/    dist.is_initialized() or dist.init_process_group(/' \
  "$work/multidevice/conftest.py"
mkdir -p "$work/python"
touch "$work/python/__init__.py"
cp "$repo/scripts/nvfuser_shim/direct_utils.py" "$work/python/direct_utils.py"
if [ -d "$src/legacy" ]; then
  copy "$src/legacy" "$work/legacy"
  # The legacy tests predate PyTorch 2.7, since which flash attention's RNG state is a [2]
  # uint64 seed and a 0-d uint64 offset (0-d int64s before); nvFuser's later tests pick the
  # form by torch version, as this does for the legacy forward's two checks.
  sed -i -e 's/(sdpa_seed, \[\], torch.int64)/(sdpa_seed, [2], torch.uint64)/' \
    -e 's/(sdpa_offset, \[\], torch.int64)/(sdpa_offset, [], torch.uint64)/' \
    "$work/legacy/test_multidevice.py"
  cp "$repo/scripts/nvfuser_shim/legacy_utils.py" "$work/legacy/utils.py"
fi
cp "$repo/scripts/nvfuser_shim/conftest.py" "$work/conftest.py"
cd "$work"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# pytest's output reaches the log as it is written: block-buffered into the pipe, a run cut
# short by a time limit left an empty log.
export PYTHONUNBUFFERED=1
# meshfuse's pytest plugin: loaded by its entry point when meshfuse is installed, else here.
plugin=(-p meshfuse.testing.plugin)
python -c "import importlib.metadata as m, sys; sys.exit(not any(
  e.value == 'meshfuse.testing.plugin' for e in m.entry_points(group='pytest11')))" && plugin=()
has_tests=0
for a in "$@"; do case $a in multidevice*|legacy*) has_tests=1;; esac; done
if [ $has_tests = 0 ]; then
  set -- multidevice $([ -d legacy ] && echo legacy) --ignore=multidevice/test_overlap.py "$@"
fi
python -m pytest "${plugin[@]}" -p no:cacheprovider "$@" 2>&1 | tee "$out/nvfuser_tests.log"
