"""The metric logger: collects TRL's metrics between log steps and hands one record per log step to its sinks, with
a progress display, the completions table, GPU readings and phase timings.

Owns: `MetricLogger` (one per run, on the main process only: the logging window, the progress display,
`log_completions` and how each differs from TRL: there), `GpuMonitor` (GPU memory and utilisation through
nvidia-ml-py; nothing when there is no GPU or no NVML), and `PhaseTimer` (time/rollout_s, time/logprob_s,
time/train_s, time/sync_s, tokens_per_s).

Must not: write files or talk to backends itself (engine/train/metric_sinks.py owns metrics.jsonl, TensorBoard, W&B,
the parquet tables and the PNG), compute metric values from tensors (engine/grpo/metrics.py does, under TRL's
names), talk to process groups (the caller reduces first and builds the logger on the main process only), or read
the root config.

Test: `pytest tests/unit/test_metrics.py`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from engine.train.metric_sinks import MetricSinks

if TYPE_CHECKING:
    from engine.config import LoggingConfig

LAST_VALUE_METRICS = frozenset({"num_tokens", "learning_rate", "grad_norm", "epoch", "entropy_coef"})
"""Metrics whose logged value is the newest one in the window, not the mean (cumulative counts, schedules)."""
PROGRESS_METRICS = (("reward", "reward"), ("kl", "kl"), ("completions/mean_length", "len"), ("step_time", "s/step"))
"""(metric, short label) shown on the progress display when present."""
PLAIN_LINES = 10
"""Without a terminal (CI logs, `make demo > file`): about this many progress lines per run, on log steps."""


class MetricLogger:
    """Collects metrics between log steps and writes them out every `logging_steps` optimizer steps.

    The logging window: values added between two log steps are averaged, NaNs dropped, as TRL's `GRPOTrainer.log`;
    `LAST_VALUE_METRICS` keep their newest value, as HF's Trainer does for the learning rate and TRL for
    `num_tokens`; NaN and None are written as null. The progress display: a tqdm bar with ETA, reward, KL, length and
    step time on a terminal; otherwise plain lines on log steps, about `PLAIN_LINES` per run. `log_completions` is
    TRL's table: step, prompt, completion, one column per reward function, the `log_extra` columns in sorted order,
    advantage; printed here, written by the sinks.

    Differences from TRL: the completions table holds every row added since the previous log step (TRL keeps the last
    generation batch's rows in a bounded deque; `max_completion_rows` gives the same bound); completions are printed
    as plain text rather than with rich.

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
        self._last_printed_step: int | None = None
        self.last_record: dict[str, Any] | None = None
        """The last record written (the loop's hooks hear it: `on_log`), and its step."""
        self.last_record_step: int | None = None
        self._closed = False
        self.sinks = MetricSinks(output_dir, logging_cfg.report_to, run_name=logging_cfg.run_name,
                                 run_config=run_config, resume_step=resume_step)
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

    def log_now(self, step: int) -> dict[str, Any] | None:
        """Write the window now (a callback's `should_log` on a step logging_steps skips); None when empty."""
        if not any(self._window.values()):
            return None
        return self._flush(step)

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
        self.sinks.write(step, record)
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
        table = None
        if self.cfg.log_completions and self._rows:
            rows, self._rows = self._rows, []
            table = self.sinks.write_completions(step, rows)  # the DataFrame, also sent to W&B
            self._print_completions(table)
        self.sinks.write(step, {k: _nan_to_none(v) for k, v in record.items()}, table)
        self._last_logged_step = step
        self.last_record, self.last_record_step = record, step  # what the loop's hooks hear (on_log)
        return record

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
        """Advance the bar every step (closed after the last, so that what follows starts on its own line); without
        a bar, print a plain line on the log steps `_is_line_due` picks."""
        if self._progress is not None:
            self._progress.n = step
            if record is not None:
                self._progress.set_postfix_str(self._summary(record, for_bar=True), refresh=False)
            self._progress.refresh()
            if self.max_steps is not None and step >= self.max_steps:
                self._progress.close()
                self._progress = None
        elif record is not None and self._is_line_due(step):
            self._last_printed_step = step
            self._print(self._summary(record, for_bar=False))

    def _is_line_due(self, step: int) -> bool:
        """The first and the last log step, else once max_steps / PLAIN_LINES steps have passed (every log step
        when max_steps is unknown)."""
        if self._last_printed_step is None or self.max_steps is None or step >= self.max_steps:
            return True
        return step - self._last_printed_step >= math.ceil(self.max_steps / PLAIN_LINES)

    def _summary(self, record: Mapping[str, Any], for_bar: bool) -> str:
        """`step 5/20 | eta 1m02s | reward 0.250 | kl 0.0012 | len 14.0 | s/step 3.10`; the bar shows the step and
        the ETA itself, so its text starts at the reward."""
        step = record["step"]
        parts = [] if for_bar else [f"step {step}" + (f"/{self.max_steps}" if self.max_steps else "")]
        done = step - (self._first_step or 0)
        if not for_bar and self.max_steps and done > 0:
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
        return self.sinks.close()

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
