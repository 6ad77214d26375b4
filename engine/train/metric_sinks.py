"""Where the metric logger's records go: `<output_dir>/metrics.jsonl`, the `report_to` backends (TensorBoard, W&B),
the completions table's parquet files, and the end-of-run PNG drawn from metrics.jsonl.

Owns: `MetricSinks` (one per run: the JSONL file and the open backends of one run directory), `append_jsonl` (one
JSON object per line, each written with a single `os.write` on an O_APPEND descriptor so a line is never interleaved
or torn; NaN / inf must already be None), `read_metrics` (a torn last line, from a crash, is skipped),
`truncate_metrics` (a resumed run drops the abandoned continuation's lines), TensorBoard through
torch.utils.tensorboard into <output_dir>/tensorboard, W&B (project from WANDB_PROJECT; WANDB_MODE=offline runs
without a network; every chart's x-axis is `train/global_step`, as HF's WandbCallback), the completions table as
<output_dir>/completions/completions_{step:05d}.parquet (atomic), and `plot_metrics` (reward, KL and
completion-length curves to a PNG).

Must not: keep the logging window, average values or print (engine/train/metric_logger.py does), compute metric
values from tensors (engine/grpo/metrics.py), or talk to process groups.

Test: `pytest tests/unit/test_metrics.py` (through the logger, and the JSONL / plot functions directly).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
COMPLETIONS_DIR = "completions"
TENSORBOARD_DIR = "tensorboard"
WANDB_STEP_METRIC = "train/global_step"
"""The x-axis of every W&B chart (as HF's WandbCallback), so train and eval records may share a step."""


class MetricSinks:
    """metrics.jsonl and the `report_to` backends of one run directory (main process only)."""

    def __init__(
        self,
        output_dir: str | Path,
        report_to: Sequence[str],
        *,
        run_name: str | None = None,
        run_config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ):
        """Args:
            output_dir: the run directory (created if missing).
            report_to: backends besides the JSONL file: "tensorboard", "wandb".
            run_name: the W&B run's name.
            run_config: the resolved config as plain data, stored with the W&B run.
            resume_step: when resuming, lines of metrics.jsonl after this step are removed.
        """
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / METRICS_FILE
        if resume_step is not None:
            truncate_metrics(self.metrics_path, resume_step)
        self.tensorboard = open_tensorboard(self.output_dir) if "tensorboard" in report_to else None
        self.wandb = open_wandb(self.output_dir, run_name, run_config) if "wandb" in report_to else None

    def write(self, step: int, record: Mapping[str, Any], table: Any = None) -> None:
        """One JSONL line plus the backends' scalars (`record`: NaN / inf already None; `table`: the completions
        DataFrame, for W&B)."""
        append_jsonl(self.metrics_path, record)
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, global_step=step)
            self.tensorboard.flush()
        if self.wandb is not None:
            payload: dict[str, Any] = {WANDB_STEP_METRIC: step, **scalars}
            if table is not None:
                import wandb

                payload["completions"] = wandb.Table(dataframe=table.astype(str))
            self.wandb.log(payload)  # NOTE: no step=: eval records may share a train step (HF's WandbCallback)

    def write_completions(self, step: int, rows: Sequence[Mapping[str, Any]]) -> Any:
        """The completions table (columns step, prompt, completion, ..., advantage) as
        <output_dir>/completions/completions_{step:05d}.parquet (atomic); returns the DataFrame."""
        import pandas as pd

        frame = pd.DataFrame([{"step": step, **row} for row in rows])
        fixed = ("step", "prompt", "completion")
        frame = frame[[*fixed, *(c for c in frame.columns if c not in (*fixed, "advantage")), "advantage"]]
        directory = self.output_dir / COMPLETIONS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"completions_{step:05d}.parquet"
        tmp = target.with_suffix(".parquet.tmp")
        frame.to_parquet(tmp)
        os.replace(tmp, target)
        return frame

    def close(self) -> Path | None:
        """Close the backends and draw <output_dir>/metrics.png; returns its path, or None when there was nothing
        to plot or matplotlib is missing."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        try:
            return plot_metrics(self.metrics_path, self.output_dir / PLOT_FILE)
        except ImportError:
            return None


def open_tensorboard(output_dir: Path) -> Any:
    """A SummaryWriter into <output_dir>/tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "logging.report_to includes 'tensorboard' but the tensorboard package is missing: "
            "pip install tensorboard"
        ) from exc
    return SummaryWriter(log_dir=str(output_dir / TENSORBOARD_DIR))


def open_wandb(output_dir: Path, run_name: str | None, run_config: Mapping[str, Any] | None) -> Any:
    """A W&B run under <output_dir>/wandb (project from WANDB_PROJECT, default grpo-engine)."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            "logging.report_to includes 'wandb' but wandb is not installed: pip install wandb "
            "(WANDB_MODE=offline logs without a network)"
        ) from exc
    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT", "grpo-engine"),
        name=run_name,
        dir=str(output_dir),
        config=dict(run_config) if run_config is not None else None,
    )
    run.define_metric(WANDB_STEP_METRIC)
    run.define_metric("*", step_metric=WANDB_STEP_METRIC, step_sync=True)
    return run


def append_jsonl(path: str | Path, record: Mapping[str, Any]) -> None:
    """Append one JSON object as one line with a single write on an O_APPEND descriptor (never torn).

    Args:
        path: the JSONL file (created if missing).
        record: JSON-serialisable values; NaN / inf must already be None (the JSON is strict).
    """
    data = (json.dumps(record, allow_nan=False) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        if written != len(data):  # NOTE: regular files do not return short writes short of a full disk
            raise OSError(f"short write to {path}: {written} of {len(data)} bytes")
    finally:
        os.close(fd)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, in file order (a torn last line, from a crash, is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records with a step after `step` (atomic rewrite)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)


def plot_metrics(metrics_path: str | Path, output_path: str | Path) -> Path | None:
    """Draw reward (± reward_std), KL and completion length (mean, min-max band) against the step.

    Args:
        metrics_path: a metrics.jsonl.
        output_path: the PNG to write.
    Returns:
        `output_path`, or None when no record has a step (nothing to draw).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [r for r in read_metrics(metrics_path) if isinstance(r.get("step"), int)]
    if not records:
        return None
    figure = Figure(figsize=(12, 3.6), dpi=100)
    FigureCanvasAgg(figure)
    panels = (
        ("reward", "reward_std", None, "reward"),
        ("kl", None, None, "KL"),
        ("completions/mean_length", "completions/min_length", "completions/max_length", "completion length (tokens)"),
    )
    for index, (name, low, high, title) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), index + 1)
        points = [(r["step"], r) for r in records if isinstance(r.get(name), (int, float))]
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        if not points:
            note = f"no '{name}' logged" + (" (beta = 0)" if name == "kl" else "")
            axes.text(0.5, 0.5, note, ha="center", va="center", transform=axes.transAxes)
            continue
        steps = [s for s, _ in points]
        values = [r[name] for _, r in points]
        axes.plot(steps, values, marker="o", markersize=3)
        if low is not None and all(isinstance(r.get(low), (int, float)) for _, r in points):
            if high is None:  # a ± std band
                lows = [r[name] - r[low] for _, r in points]
                highs = [r[name] + r[low] for _, r in points]
            elif all(isinstance(r.get(high), (int, float)) for _, r in points):
                lows, highs = [r[low] for _, r in points], [r[high] for _, r in points]
            else:
                continue
            axes.fill_between(steps, lows, highs, alpha=0.2)
    figure.tight_layout()
    output_path = Path(output_path)
    figure.savefig(output_path)
    return output_path
