"""The end-of-run summary: a short table of what a run did and where its outputs are, printed on rank 0 by
`grpo-engine train` and `grpo-engine demo` (engine/cli.py, engine/demo/run.py).

    run summary
      held-out reward   0.250 -> 0.760   (before -> after training)
      optimizer steps   20
      wall time         41 s
      metrics           runs/tiny_cpu/metrics.jsonl
      curves            runs/tiny_cpu/metrics.png
      checkpoint        runs/tiny_cpu/checkpoint-20
      HF export         runs/tiny_cpu/hf

Owns: the table's rows and layout. Rows whose output is absent (no test split, no plot, no export) are left out.

Must not: compute metrics or write files.

Test: tests/unit/test_run_summary.py.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.train.checkpoint import checkpoint_dir
from engine.train.metric_sinks import METRICS_FILE, PLOT_FILE


def format_run_summary(cfg: EngineConfig, summary: dict, wall_s: float) -> str:
    """The table, one row per line.

    Args:
        cfg: the run's config (where its outputs went).
        summary: `engine.train.loop.train`'s return value (eval_reward_before / _after, start_step, steps).
        wall_s: seconds the command ran.
    Returns:
        the table as text, without a trailing newline.
    """
    out = Path(cfg.train.output_dir)
    rows = []
    before, after = summary.get("eval_reward_before"), summary.get("eval_reward_after")
    if before is not None and after is not None:
        rows.append(("held-out reward", f"{before:.3f} -> {after:.3f}   (before -> after training)"))
    elif before is not None:
        rows.append(("held-out reward", f"{before:.3f} before training"))
    start = summary.get("start_step") or 0
    rows.append(("optimizer steps", f"{summary['steps']}" + (f" (resumed at {start})" if start else "")))
    rows.append(("wall time", _format_seconds(wall_s)))
    exported = cfg.checkpoint.save_hf_at_end and not summary.get("stopped_by_signal")  # else `hf` may be stale
    for label, path in (("metrics", out / METRICS_FILE), ("curves", out / PLOT_FILE),
                        ("checkpoint", checkpoint_dir(out, summary["steps"])),
                        ("HF export", out / "hf" if exported else None)):
        if path is not None and path.exists():
            rows.append((label, str(path)))
    width = max(len(label) for label, _ in rows)
    return "\n".join(["run summary", *(f"  {label:<{width}}   {value}" for label, value in rows)])


def _format_seconds(seconds: float) -> str:
    """`41 s`, `3 min 05 s` or `2 h 03 min`."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds} s"
