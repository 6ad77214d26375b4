"""The metric logger: TRL's metric names to a JSONL file, a progress display, TensorBoard and W&B, the completions
table, GPU readings, phase timings, and the end-of-run plot.

Owns: `MetricLogger` (one per run, on the main process only), the logging window (values added between two log
steps are averaged, NaNs dropped, as TRL's `GRPOTrainer.log`; `LAST_VALUE_METRICS` keep their newest value, as HF's
Trainer does for the learning rate and TRL for `num_tokens`), `<output_dir>/metrics.jsonl` (one JSON object per
logged step, each written with a single `os.write` on an O_APPEND descriptor so a line is never interleaved or
torn; NaN and None are written as null), the progress display (tqdm with ETA on a terminal, one plain line per log
step otherwise), `report_to` backends (`tensorboard` through torch.utils.tensorboard into <output_dir>/tensorboard,
`wandb`; set WANDB_MODE=offline to run without a network), `log_completions` (TRL's table: step, prompt,
completion, one column per reward function, the `log_extra` columns in sorted order, advantage, written to
<output_dir>/completions/completions_{step:05d}.parquet), GPU memory and utilisation through nvidia-ml-py (nothing
when there is no GPU or no NVML), `PhaseTimer` (time/rollout_s, time/logprob_s, time/train_s, time/sync_s,
tokens_per_s), and `plot_metrics` (reward, KL and completion-length curves from metrics.jsonl to a PNG).

Must not: compute metric values from tensors (engine/grpo_metrics.py does, under TRL's names), talk to process groups
(the caller reduces first and builds the logger on the main process only), or read the root config.

Differences from TRL: the completions table holds every row added since the previous log step (TRL keeps the last
generation batch's rows in a bounded deque; `max_completion_rows` gives the same bound); completions are printed
as plain text rather than with rich.

Test: `pytest tests/unit/test_metrics.py`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from engine.config import LoggingConfig

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
COMPLETIONS_DIR = "completions"
TENSORBOARD_DIR = "tensorboard"
WANDB_STEP_METRIC = "train/global_step"
"""The x-axis of every W&B chart (as HF's WandbCallback), so train and eval records may share a step."""
LAST_VALUE_METRICS = frozenset({"num_tokens", "learning_rate", "grad_norm", "epoch", "entropy_coef"})
"""Metrics whose logged value is the newest one in the window, not the mean (cumulative counts, schedules)."""
PROGRESS_METRICS = (("reward", "reward"), ("kl", "kl"), ("completions/mean_length", "len"), ("step_time", "s/step"))
"""(metric, short label) shown on the progress display when present."""


class MetricLogger:
    """Collects metrics between log steps and writes them out every `logging_steps` optimizer steps.

    Typical use (main process only):
        logger = MetricLogger(cfg.logging, cfg.train.output_dir, max_steps=total_steps)
        ... rewards = reward_funcs(..., log_extra=logger.log_extra, log_metric=logger.log_metric)
        logger.add(compute_reward_metrics(...)); logger.add_completions(...)
        logger.step(step, {"loss": loss, "learning_rate": lr})     # once per optimizer step
        logger.close()                                             # flushes and draws metrics.png
    """

    def __init__(
        self,
        logging_cfg: LoggingConfig,
        output_dir: str | Path,
        *,
        max_steps: int | None = None,
        run_config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
        max_completion_rows: int | None = None,
        stream: TextIO | None = None,
    ):
        """Args:
            logging_cfg: the `logging` section (logging_steps, report_to, run_name, log_completions,
                num_completions_to_print).
            output_dir: the run directory (created if missing).
            max_steps: total optimizer steps, for the ETA and the final log step; None = unknown.
            run_config: the resolved config as plain data, stored with the W&B run.
            resume_step: when resuming, lines of metrics.jsonl after this step are removed (they belong to the
                abandoned continuation).
            max_completion_rows: keep only the newest rows of the completions table; None = every row since the
                last log step.
            stream: where the progress goes (default stderr); tqdm is used only when it is a terminal.
        """
        self.cfg = logging_cfg
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / METRICS_FILE
        self.max_steps = max_steps
        self.max_completion_rows = max_completion_rows
        self.stream = stream if stream is not None else sys.stderr
        self._lock = threading.Lock()  # log_extra / log_metric may come from the reward event-loop thread
        self._window: dict[str, list[float]] = defaultdict(list)
        self._pending_extra: dict[str, list] = defaultdict(list)
        self._rows: list[dict[str, Any]] = []
        self._start_time = time.perf_counter()
        self._last_step_time = self._start_time
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._last_logged_step: int | None = None
        self._closed = False
        if resume_step is not None:
            _truncate_after(self.metrics_path, resume_step)
        self._tensorboard = self._open_tensorboard() if "tensorboard" in logging_cfg.report_to else None
        self._wandb = self._open_wandb(run_config) if "wandb" in logging_cfg.report_to else None
        self._progress = self._open_progress()
        self._gpu = GpuMonitor()

    # -- collecting -----------------------------------------------------------------------------------------------

    def add(self, metrics: Mapping[str, float | None]) -> None:
        """Add one value per metric to the current window (e.g. one generation batch's reward metrics).

        Args:
            metrics: name -> float (tensors of one element and None accepted; None and NaN are left out of means).
        """
        with self._lock:
            for name, value in metrics.items():
                self._window[name].append(_to_float(value))

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric` hook for reward functions: a scalar averaged over the window."""
        self.add({name: value})

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """TRL's `log_extra` hook for reward functions: a column for the completions table, one value per row
        of the batch being scored; attached to the rows of the next `add_completions` call."""
        with self._lock:
            self._pending_extra[column].extend(list(values))

    def add_completions(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        rewards: Mapping[str, Sequence[float]],
        advantages: Sequence[float],
    ) -> None:
        """Add B rows to the completions table (kept only when `logging.log_completions` is on).

        Args:
            prompts: B prompts (str or message lists).
            completions: B completions (str or message lists).
            rewards: reward-function name -> B rewards (NaN = None), e.g. from the (B, K) tensor's columns.
            advantages: B advantages.
        """
        with self._lock:
            extra, self._pending_extra = self._pending_extra, defaultdict(list)
        if not self.cfg.log_completions:
            return
        num_rows = len(prompts)
        columns = {name: _to_list(values) for name, values in rewards.items()}
        advantages = _to_list(advantages)
        for name, values in list(columns.items()) + [("advantage", advantages)]:
            if len(values) != num_rows:
                raise ValueError(f"completions table: {name!r} has {len(values)} values for {num_rows} rows")
        for i in range(num_rows):
            row = {"prompt": prompts[i], "completion": completions[i]}
            row.update({name: _nan_to_none(values[i]) for name, values in columns.items()})
            row.update({name: values[i] if i < len(values) else None for name, values in sorted(extra.items())})
            row["advantage"] = _nan_to_none(advantages[i])
            self._rows.append(row)
        if self.max_completion_rows is not None:
            del self._rows[: max(0, len(self._rows) - self.max_completion_rows)]

    # -- writing --------------------------------------------------------------------------------------------------

    def should_log(self, step: int) -> bool:
        """Whether `step` is a log step: a multiple of logging_steps, or the last step."""
        return step % self.cfg.logging_steps == 0 or (self.max_steps is not None and step >= self.max_steps)

    def step(self, step: int, metrics: Mapping[str, float | None] | None = None) -> dict[str, Any] | None:
        """End of optimizer step `step` (1-based): add `metrics`, and on a log step write everything out.

        `step_time` (seconds since the previous call) is added unless `metrics` has it.

        Args:
            step: the optimizer step just finished.
            metrics: this step's values (loss, learning_rate, grad_norm, timings, ...).
        Returns:
            The logged record (`step`, `elapsed_s`, the window's metrics) on a log step, else None.
        """
        now = time.perf_counter()
        metrics = dict(metrics or {})
        metrics.setdefault("step_time", now - self._last_step_time)
        self._last_step_time = now
        if self._first_step is None:
            self._first_step = step - 1
        self.add(metrics)
        self._last_step = step
        record = None
        if self.should_log(step):
            record = self._flush(step)
        self._update_progress(step, record)
        return record

    def log_eval(self, step: int, metrics: Mapping[str, float | None]) -> dict[str, Any]:
        """Write evaluation metrics at once, under TRL's `eval_` prefix.

        Args:
            step: the optimizer step the evaluation ran after.
            metrics: name -> value (without the prefix).
        Returns:
            The logged record.
        """
        record = {"step": step, "elapsed_s": time.perf_counter() - self._start_time}
        record.update({f"eval_{name}": _nan_to_none(_to_float(v)) for name, v in metrics.items()})
        self._write(step, record)
        return record

    def _flush(self, step: int) -> dict[str, Any]:
        """Average the window, add GPU readings, write every sink, and start a new window."""
        with self._lock:
            window, self._window = self._window, defaultdict(list)
        record: dict[str, Any] = {"step": step, "elapsed_s": time.perf_counter() - self._start_time}
        for name, values in window.items():
            valid = [v for v in values if not math.isnan(v)]
            if not valid:
                record[name] = None
            elif name in LAST_VALUE_METRICS:
                record[name] = valid[-1]
            else:
                record[name] = sum(valid) / len(valid)
        record.update(self._gpu.read())
        table = self._write_completions(step) if self.cfg.log_completions and self._rows else None
        self._write(step, record, table)
        self._last_logged_step = step
        return record

    def _write(self, step: int, record: dict[str, Any], table: Any = None) -> None:
        """One JSONL line plus the report_to backends (`table`: the completions DataFrame, for W&B)."""
        clean = {k: _nan_to_none(v) for k, v in record.items()}
        append_jsonl(self.metrics_path, clean)
        scalars = {k: v for k, v in clean.items() if k != "step" and isinstance(v, (int, float))}
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, value, global_step=step)
            self._tensorboard.flush()
        if self._wandb is not None:
            payload: dict[str, Any] = {WANDB_STEP_METRIC: step, **scalars}
            if table is not None:
                import wandb

                payload["completions"] = wandb.Table(dataframe=table.astype(str))
            self._wandb.log(payload)  # NOTE: no step=: eval records may share a train step (HF's WandbCallback)

    def _write_completions(self, step: int) -> Any:
        """The table as <output_dir>/completions/completions_{step:05d}.parquet (atomic), printed; returns the
        DataFrame."""
        import pandas as pd

        rows, self._rows = self._rows, []
        frame = pd.DataFrame([{"step": step, **row} for row in rows])
        fixed = ("step", "prompt", "completion")
        frame = frame[[*fixed, *(c for c in frame.columns if c not in (*fixed, "advantage")), "advantage"]]
        directory = self.output_dir / COMPLETIONS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"completions_{step:05d}.parquet"
        tmp = target.with_suffix(".parquet.tmp")
        frame.to_parquet(tmp)
        os.replace(tmp, target)
        self._print_completions(frame)
        return frame

    def _print_completions(self, frame: Any) -> None:
        """The first `num_completions_to_print` rows (None = all) as plain text."""
        count = len(frame) if self.cfg.num_completions_to_print is None else self.cfg.num_completions_to_print
        for _, row in frame.head(count).iterrows():
            values = ", ".join(f"{k}={row[k]}" for k in frame.columns if k not in ("step", "prompt", "completion"))
            self._print(f"[step {row['step']}] prompt={_short(row['prompt'])} completion={_short(row['completion'])} "
                        f"{values}")

    # -- progress -------------------------------------------------------------------------------------------------

    def _open_progress(self) -> Any:
        """A tqdm bar when the stream is a terminal, else None (plain lines)."""
        if not (hasattr(self.stream, "isatty") and self.stream.isatty()):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.max_steps, file=self.stream, desc="GRPO", unit="step", dynamic_ncols=True)

    def _update_progress(self, step: int, record: dict[str, Any] | None) -> None:
        """Advance the bar every step; print a plain line on log steps when there is no bar."""
        if self._progress is not None:
            self._progress.n = step
            if record is not None:
                self._progress.set_postfix_str(self._summary(record, with_eta=False), refresh=False)
            self._progress.refresh()
        elif record is not None:
            self._print(self._summary(record, with_eta=True))

    def _summary(self, record: Mapping[str, Any], with_eta: bool) -> str:
        """`step 5/20 | eta 1m02s | reward 0.250 | kl 0.0012 | len 14.0 | s/step 3.10`."""
        step = record["step"]
        parts = [f"step {step}" + (f"/{self.max_steps}" if self.max_steps else "")]
        done = step - (self._first_step or 0)
        if with_eta and self.max_steps and done > 0:
            seconds_per_step = (time.perf_counter() - self._start_time) / done
            parts.append(f"eta {_format_duration(seconds_per_step * max(0, self.max_steps - step))}")
        for name, label in PROGRESS_METRICS:
            value = record.get(name)
            if isinstance(value, float):
                parts.append(f"{label} {value:.4g}")
        return " | ".join(parts)

    def _print(self, text: str) -> None:
        """One line to the stream (through tqdm when a bar is showing, so it is not garbled)."""
        if self._progress is not None:
            self._progress.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    # -- backends -------------------------------------------------------------------------------------------------

    def _open_tensorboard(self) -> Any:
        """A SummaryWriter into <output_dir>/tensorboard."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "logging.report_to includes 'tensorboard' but the tensorboard package is missing: "
                "pip install tensorboard"
            ) from exc
        return SummaryWriter(log_dir=str(self.output_dir / TENSORBOARD_DIR))

    def _open_wandb(self, run_config: Mapping[str, Any] | None) -> Any:
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
            name=self.cfg.run_name,
            dir=str(self.output_dir),
            config=dict(run_config) if run_config is not None else None,
        )
        run.define_metric(WANDB_STEP_METRIC)
        run.define_metric("*", step_metric=WANDB_STEP_METRIC, step_sync=True)
        return run

    def close(self) -> Path | None:
        """Write what is left in the window (as the last step's record if nothing was logged for it), close the
        backends and draw <output_dir>/metrics.png. Idempotent.

        Returns:
            The PNG's path, or None when there was nothing to plot or matplotlib is missing.
        """
        if self._closed:
            return None
        self._closed = True
        if self._last_step is not None and self._last_step != self._last_logged_step:
            with self._lock:
                has_values = any(self._window.values())
            if has_values:
                self._flush(self._last_step)
        if self._progress is not None:
            self._progress.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        try:
            return plot_metrics(self.metrics_path, self.output_dir / PLOT_FILE)
        except ImportError:
            return None

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------------
# files


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


def _truncate_after(path: Path, step: int) -> None:
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


# ---------------------------------------------------------------------------------------------------------------
# GPU readings and phase timings


class GpuMonitor:
    """Memory and utilisation of the visible GPUs through NVML (nvidia-ml-py); reads nothing without a GPU."""

    def __init__(self):
        self._handles: list[tuple[int, Any]] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            indices = list(range(count))
            if visible and all(part.strip().isdigit() for part in visible.split(",")):
                indices = [int(part) for part in visible.split(",") if int(part) < count]
            self._handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no library, no driver, no GPU: nothing to read
            self._handles = []

    @property
    def available(self) -> bool:
        """Whether any GPU is being read."""
        return bool(self._handles)

    def read(self) -> dict[str, float]:
        """`gpu/{i}/memory_used_gb`, `gpu/{i}/memory_total_gb`, `gpu/{i}/utilization_pct` per visible GPU (NVML
        index), plus `gpu/max_memory_allocated_gb` of this process from torch's allocator; {} without a GPU."""
        metrics: dict[str, float] = {}
        for index, handle in self._handles:
            try:
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                utilization = self._nvml.nvmlDeviceGetUtilizationRates(handle)
            except Exception:  # noqa: BLE001 - a GPU that stopped answering is skipped, not fatal
                continue
            metrics[f"gpu/{index}/memory_used_gb"] = memory.used / 2**30
            metrics[f"gpu/{index}/memory_total_gb"] = memory.total / 2**30
            metrics[f"gpu/{index}/utilization_pct"] = float(utilization.gpu)
        if self._handles:
            import torch

            if torch.cuda.is_available():
                metrics["gpu/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return metrics


class PhaseTimer:
    """Wall time per phase of a step: `with timer.phase("rollout"): ...`, then `timer.metrics(num_tokens)`.

    Phase names used by the trainer: rollout, reward, logprob, train, sync (any name is accepted). The caller
    synchronises CUDA before leaving a phase when it wants device time.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        """Args:
            clock: seconds, monotonic (tests pass a fake).
        """
        self._clock = clock
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall time of the block to phase `name`."""
        start = self._clock()
        try:
            yield
        finally:
            self._seconds[name] += self._clock() - start

    def metrics(self, num_tokens: int | None = None, reset: bool = True) -> dict[str, float]:
        """`time/{phase}_s` per phase, plus `tokens_per_s` = num_tokens / total time when num_tokens is given.

        Args:
            num_tokens: tokens processed in the timed phases (prompt + completion), or None.
            reset: start from zero afterwards.
        Returns:
            name -> value.
        """
        metrics = {f"time/{name}_s": seconds for name, seconds in self._seconds.items()}
        total = sum(self._seconds.values())
        if num_tokens is not None and total > 0:
            metrics["tokens_per_s"] = num_tokens / total
        if reset:
            self._seconds.clear()
        return metrics


# ---------------------------------------------------------------------------------------------------------------
# small conversions


def _to_float(value: Any) -> float:
    """float(value); None -> NaN; one-element tensors accepted."""
    if value is None:
        return float("nan")
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


def _to_list(values: Any) -> list:
    """A list from a list, tuple, tensor or array."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _nan_to_none(value: Any) -> Any:
    """None for NaN / inf floats (strict JSON, parquet nulls), the value otherwise."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _short(value: Any, limit: int = 100) -> str:
    """str(value) on one line, shortened to `limit` characters."""
    text = str(value).replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _format_duration(seconds: float) -> str:
    """`1h02m`, `3m05s` or `12s`."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"
