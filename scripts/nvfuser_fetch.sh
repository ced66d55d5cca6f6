#!/usr/bin/env bash
# Copies the nvFuser multi-device tests that meshfuse is measured against out of a git
# repository of NVIDIA/Fuser into DEST (default build/nvfuser, ignored by git), so that
# scripts/nvfuser_tests.sh can run them on a machine without network or nvFuser checkout
# (carry DEST along). Nothing is copied into the repository's tracked files.
#
#   scripts/nvfuser_fetch.sh FUSER_GIT_DIR [DEST]
#
# FUSER_GIT_DIR: a clone of https://github.com/NVIDIA/Fuser (its .git folder or a bare repo).
# DEST gets:
#   multidevice/  tests/python/multidevice/ at 81c4b22fd (2026-04-03), nvfuser_direct frontend
#   legacy/       tests/python/{test_multidevice,test_communication,multidevice_fixtures}.py
#                 at 93b68e003 (2025-01-31), the legacy nvfuser frontend (fd.sched.*)
set -euo pipefail
git_dir=$1; dest=${2:-build/nvfuser}
current=81c4b22fd750d377d69e24928c32233162f6b2bd
legacy=93b68e00340578534e54fd813e2168f522bf2b8f
for c in $current $legacy; do
  git --git-dir "$git_dir" cat-file -e "$c^{commit}" 2>/dev/null || {
    echo "nvfuser_fetch: commit $c is not in $git_dir; fetch NVIDIA/Fuser's main branch" >&2
    exit 2
  }
done
rm -rf "$dest/multidevice" "$dest/legacy"
mkdir -p "$dest/multidevice" "$dest/legacy"
git --git-dir "$git_dir" archive "$current" tests/python/multidevice \
  | tar -x -C "$dest/multidevice" --strip-components=3
git --git-dir "$git_dir" archive "$legacy" tests/python/test_multidevice.py \
  tests/python/test_communication.py tests/python/multidevice_fixtures.py \
  | tar -x -C "$dest/legacy" --strip-components=2
echo "nvFuser tests in $dest: $(ls "$dest/multidevice" | wc -l) current, $(ls "$dest/legacy" | wc -l) legacy files"
