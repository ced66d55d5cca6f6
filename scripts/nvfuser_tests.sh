#!/usr/bin/env bash
# Runs nvFuser's multi-device Python tests against meshfuse, with only the module names
# aliased (nvfuser, nvfuser_direct -> meshfuse). nvFuser's files are copied into a scratch
# folder, never into this repository.
#
#   scripts/nvfuser_tests.sh FUSER_TESTS OUT [pytest args...]
#
# FUSER_TESTS: nvFuser's tests/python folder (its multidevice/ subfolder is copied);
# OUT: a folder for the log. Run from the meshfuse repository root. The pytest arguments
# name the tests (paths under the scratch folder, e.g. multidevice/test_transformer.py;
# default: all of multidevice/).
# On GPUs (one process per GPU, NCCL) the tests run as written; with MESHFUSE_NVFUSER_CPU=1
# they run on CPU ranks (gloo): CUDA calls become no-ops and "cuda" devices become "cpu".
# World sizes: --world-sizes (default 1,2,4; sizes above the GPU count are skipped).
#
# Example (GPT-3 layer of test_transformer.py at full size on 2 GPUs):
#   PYTHONPATH=. scripts/nvfuser_tests.sh ~/Fuser/tests/python results/nvfuser \
#       multidevice/test_transformer.py --world-sizes 2 -v
set -euo pipefail
src=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); shift 2
repo=$(pwd)
work=$(mktemp -d)
mkdir -p "$work/multidevice" "$work/python"
for f in "$src"/multidevice/*.py; do
  if [ "${MESHFUSE_NVFUSER_CPU:-0}" = 1 ]; then
    sed -e 's/"cuda"/"cpu"/g' -e "s/'cuda'/'cpu'/g" "$f" > "$work/multidevice/$(basename "$f")"
  else
    cp "$f" "$work/multidevice/"
  fi
done
# nvFuser's conftest sets up the process group itself; meshfuse's plugin has done it already.
sed -i 's/^    dist.init_process_group(/    dist.is_initialized() or dist.init_process_group(/' \
  "$work/multidevice/conftest.py"
cp "$repo/scripts/nvfuser_shim/conftest.py" "$work/conftest.py"
cp "$repo/scripts/nvfuser_shim/direct_utils.py" "$work/python/direct_utils.py"
touch "$work/python/__init__.py"
cd "$work"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# meshfuse's pytest plugin: loaded by its entry point when meshfuse is installed, else here.
plugin=(-p meshfuse.testing.plugin)
python -c "import importlib.metadata as m, sys; sys.exit(not any(
  e.value == 'meshfuse.testing.plugin' for e in m.entry_points(group='pytest11')))" && plugin=()
[ $# -gt 0 ] || set -- multidevice
python -m pytest "${plugin[@]}" -p no:cacheprovider "$@" 2>&1 | tee "$out/nvfuser_tests.log"
