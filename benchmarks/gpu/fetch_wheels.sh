#!/usr/bin/env bash
# Download, on this (CPU) machine, the wheels the GPU suite needs on the lent GPU machine, which has Python 3.12,
# torch 2.11, triton 3.6, transformers 5.17, pandas and pyarrow but no megatron-core, TRL, Liger or datasets, and no
# network. They go to benchmarks/gpu/wheels/ (git-ignored), travel with the device call (carry
# ["benchmarks/gpu/wheels"]) and are installed there by benchmarks/gpu/run.sh. Also stamps the current git sha into
# wheels/GIT_SHA (the device's copy of the tree has no .git), and checks that the tree plus the wheels fit the
# device's 64 MiB limit, printing the total. Exit 1 when over.
#
#   bash benchmarks/gpu/fetch_wheels.sh            # re-run right before each device call (cheap: files are kept)
#
# Versions, one of each (two versions of one package stop the whole install):
# - megatron-core 0.16.1: the version CI tests the engine against (setup.py pins <0.17 because the CPU machines run
#   Python 3.11; 0.17+ needs 3.12, which the GPU machine has). The engine overrides Megatron internals verified on
#   0.16.1 (RowParallelLinear._forward_impl, the schedules' pg_collection), so a GPU run on another version would mix
#   version drift into GPU findings. Set MCORE_VERSION to try another.
# - trl 1.16.0 (setup.py's pin; the maths is checked against it) and its requirements the machine lacks: datasets,
#   dill, multiprocess, at the versions CI installs (accelerate, pandas, pyarrow, huggingface-hub are there).
# - liger-kernel 0.8.5: the newest release; needs only torch and triton.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DEST=benchmarks/gpu/wheels
LIMIT_MIB=64
WHEELS=(
  "megatron-core==${MCORE_VERSION:-0.16.1}"
  "trl==1.16.0"
  "liger-kernel==0.8.5"
  "datasets==5.2.0"
  "dill==0.4.1"
  "multiprocess==0.70.19"
)
mkdir -p "$DEST"
# Drop wheels not in the list (an old version left behind would make two versions of one package).
keep=$(for spec in "${WHEELS[@]}"; do name=${spec%%==*}; echo "${name//-/_}-${spec##*==}-"; done)
for file in "$DEST"/*.whl; do
  [ -e "$file" ] || continue
  base=$(basename "$file")
  matched=0
  for prefix in $keep; do [[ "$base" == "$prefix"* ]] && matched=1; done
  [ "$matched" = 1 ] || { echo "removing $base (not in the list)"; rm -f "$file"; }
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$DEST" "${WHEELS[@]}"

sha=$(git rev-parse --short HEAD 2>/dev/null || echo "")
if [ -n "$sha" ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then sha="$sha-dirty"; fi
echo "$sha" > "$DEST/GIT_SHA"

tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
wheel_bytes=$(find "$DEST" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
ls -l "$DEST"
awk -v t="$tree_bytes" -v w="$wheel_bytes" -v l="$LIMIT_MIB" -v sha="$sha" 'BEGIN {
  total = (t + w) / 1048576
  printf "tree %.2f MiB + wheels %.2f MiB = %.2f MiB of the device limit %d MiB (git sha %s)\n", t / 1048576, w / 1048576, total, l, sha
  exit (total > l) }' || { echo "over the ${LIMIT_MIB} MiB limit: carry fewer wheels or ignore large files" >&2; exit 1; }
