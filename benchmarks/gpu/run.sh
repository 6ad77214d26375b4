#!/usr/bin/env bash
# Run the GPU suite (benchmarks/gpu/suite.py) on a GPU machine: install the carried wheels into a temporary prefix
# (pip --no-index --no-deps --target: nothing is downloaded, nothing in the machine's own environment changes), put
# it on PYTHONPATH, then run the suite with this script's arguments. Rows go to $OUT when set (the lent machine),
# else benchmarks/results/; the suite prints a short table last.
#
#   bash benchmarks/gpu/run.sh                  # every part (more than one 10-minute command: see PLAN.md)
#   bash benchmarks/gpu/run.sh --parts a,b      # some parts
#
# On a GPU machine of your own, `pip install -e ".[gpu,dev]" liger-kernel` and run the suite directly
# (`python -m benchmarks.gpu.suite`); with no wheels folder this script skips the install step.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELS=benchmarks/gpu/wheels
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  PREFIX=$(mktemp -d /tmp/gpu-suite-site.XXXXXX)
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$PREFIX" "$WHEELS"/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH="$PREFIX${PYTHONPATH:+:$PYTHONPATH}"
  echo "installed into $PREFIX: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')"
  "$PY" -m pip check 2>&1 | grep -v "^No broken requirements" | sed 's/^/pip check (informational): /'
fi
# The device's copy of the tree has no .git: the sha fetch_wheels.sh stamped stands in for it.
if ! git rev-parse HEAD > /dev/null 2>&1 && [ -s "$WHEELS/GIT_SHA" ]; then
  export BENCH_GIT_SHA="$(cat "$WHEELS/GIT_SHA")"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>/dev/null || true
exec "$PY" -m benchmarks.gpu.suite "$@"
