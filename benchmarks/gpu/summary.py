"""The short table the GPU suite prints last: each part's status, then the headline numbers of this run's rows.

Owns: reading back the rows a suite run wrote (those stamped at or after its start) and condensing them into a few
lines a reader of the command's last output can quote: the GEMM floor, the fused log-prob sweep (full mode: p50 ms,
fraction of the floor, peak extra MiB per variant), the Megatron and TRL steps (tokens/s, peak MiB, longest
completion that fits). Every number printed is a row in the CSVs named at the end.

Must not: measure, or write any file.

Used by benchmarks/gpu/suite.py; exercised by tests/integration/test_gpu_suite.py.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from benchmarks.harness import read_rows


def _rows_since(results_dir: Path, name: str, since: float) -> list[dict]:
    path = results_dir / name
    if not path.exists():
        return []
    return [r for r in read_rows(path) if datetime.fromisoformat(r["timestamp"]).timestamp() >= int(since)]


def _value(rows: list[dict], metric: str) -> float | None:
    """p50 of the last row of `metric` (the last measurement of a key wins, as in benchmarks/plot.py)."""
    found = [float(r["p50"]) for r in rows if r["metric"] == metric]
    return found[-1] if found else None


def _fused_lines(rows: list[dict]) -> list[str]:
    """Full-mode (fwd+bwd) p50 ms (fraction of floor) / peak MiB per variant, one line per (N, H); for triton the
    sweep's row (best tiles, written after the tile choices) is the last one at its point."""
    sweep = [r for r in rows if r["mode"] == "full"]
    variants = ["reference", "torch_chunked", "triton", "onepass_torch_chunked", "onepass_cublas_triton",
                "onepass_triton_fused", "liger_grpo_loss"]
    points = sorted({(int(r["x_value"]), json.loads(r["config_json"])["H"]) for r in sweep})
    if not points:
        return []
    lines = ["  fused log-prob fwd+bwd (full), p50 ms (fraction of floor) / peak extra MiB:",
             f"    {'N':>6} {'H':>5}  " + "  ".join(f"{v:>24}" for v in variants)]
    for n, h in points:
        cells = []
        for variant in variants:
            at = [r for r in sweep if r["variant"] == variant and int(r["x_value"]) == n
                  and json.loads(r["config_json"])["H"] == h]
            ms, frac, mib = (_value(at, m) for m in ("time", "fraction_of_floor", "peak_memory"))
            cells.append("-" if ms is None else f"{ms:.2f} ({frac or 0:.2f}) / {mib or 0:.0f}")
        lines.append(f"    {n:>6} {h:>5}  " + "  ".join(f"{c:>24}" for c in cells))
    return lines


def _step_lines(rows: list[dict], label: str, group_by_variant: bool) -> list[str]:
    """tokens/s, peak MiB and longest fit per (shape, implementation) or (shape, variant)."""

    def group(row: dict) -> tuple[str, str]:
        config = json.loads(row["config_json"])
        return config.get("shape", "?"), row["variant"] if group_by_variant else config.get("implementation", "?")

    lines = []
    for shape, name in sorted({group(r) for r in rows}):
        mine = [r for r in rows if group(r) == (shape, name)]
        nominal = [r for r in mine if r["mode"] == "train_step"]
        fit = [r for r in mine if r["mode"] == "longest_fit" and r["metric"] == "max_completion_len"]
        tps, peak = _value(nominal, "tokens_per_s"), _value(nominal, "peak_memory")
        share = _value([r for r in mine if r["mode"] == "lm_head_share"], "lm_head_share")
        longest = f"{float(fit[-1]['p50']):.0f} ({json.loads(fit[-1]['config_json'])['stopped']})" if fit else "-"
        nominal_text = "nominal step -" if tps is None else f"{tps:.0f} completion tokens/s, peak {peak:.0f} MiB"
        nominal_text += "" if share is None else f", LM head {share:.2f} of the step"
        lines.append(f"  {label} {shape} {name}: {nominal_text}; longest completion that fits: {longest}")
    return lines


def print_summary(results_dir: Path, env, versions: dict, outcomes: dict, parts, since: float) -> None:
    """Print the part table and the headline numbers of the rows written since `since` (a time.time())."""
    print(f"\n==== GPU suite summary: {env.device}, git {env.git_sha or '?'}, torch {env.torch_version}, triton "
          f"{env.triton_version}, mcore {env.mcore_version or '-'}, transformers {versions['transformers'] or '-'}, "
          f"trl {versions['trl'] or '-'}, liger {versions['liger_kernel'] or '-'}")
    print(f"{'part':<20} {'status':<8} {'wall s':>7} {'rows':>5}  reason / notes")
    for part in parts:
        if part.key in outcomes:
            o = outcomes[part.key]
            text = "; ".join(([o.reason] if o.reason else []) + o.notes)
            print(f"{part.key + ' ' + part.name:<20} {o.status:<8} {o.wall_s:>7.1f} {o.rows:>5}  {text[:160]}")
    gemm = [r for r in _rows_since(results_dir, "gemm.csv", since) if r["metric"] == "throughput"]
    if gemm:
        best = max(gemm, key=lambda r: float(r["p50"]))
        print(f"  GEMM floor: {float(best['p50']):.2f} TFLOP/s (torch.matmul, n={best['x_value']}, "
              f"{json.loads(best['config_json'])['dtype']})")
    for line in _fused_lines(_rows_since(results_dir, "fused_logprob.csv", since)):
        print(line)
    for line in _step_lines(_rows_since(results_dir, "grpo_step.csv", since), "megatron", False):
        print(line)
    for line in _step_lines(_rows_since(results_dir, "trl_grpo_step.csv", since), "trl", True):
        print(line)
    for line in _step_lines(_rows_since(results_dir, "long_tail.csv", since), "long-tailed batch", True):
        print(line)
    print(f"rows: {results_dir}/*.csv (suite.csv: one row per part), output: {results_dir}/suite.log")
