"""engine/train/metric_logger.py and its sinks (engine/train/metric_sinks.py): the logging window, metrics.jsonl,
progress, completions parquet, TensorBoard, W&B (offline), GPU readings, phase timings and the end-of-run plot."""

from __future__ import annotations

import io
import json
import math
import threading

import pytest
import torch

from engine.config import LoggingConfig
from engine.train.metric_logger import GpuMonitor, MetricLogger, PhaseTimer
from engine.train.metric_sinks import append_jsonl, plot_metrics, read_metrics

NAN = float("nan")


def _logger(tmp_path, stream=None, **logging_kwargs) -> MetricLogger:
    return MetricLogger(LoggingConfig(**logging_kwargs), tmp_path, max_steps=5, stream=stream or io.StringIO())


def test_the_window_averages_without_nans_and_keeps_the_newest_value_of_cumulative_metrics(tmp_path):
    logger = _logger(tmp_path, logging_steps=2)
    logger.add({"reward": 1.0, "kl": NAN, "num_tokens": 10, "rewards/judge/mean": None})
    assert logger.step(1, {"loss": 0.5}) is None  # not a log step
    logger.add({"reward": torch.tensor(3.0), "kl": NAN, "num_tokens": 25})
    logger.log_metric("judge/calls", 4.0)
    record = logger.step(2, {"loss": 0.1, "step_time": 2.0})
    assert record["reward"] == 2.0 and record["num_tokens"] == 25 and record["loss"] == pytest.approx(0.3)
    assert record["kl"] is None and record["rewards/judge/mean"] is None and record["judge/calls"] == 4.0
    assert record["step"] == 2 and "step_time" in record
    assert read_metrics(tmp_path / "metrics.jsonl") == [record]  # NaN / None written as null


def test_metrics_jsonl_gets_one_line_per_log_step_and_the_last_step(tmp_path):
    logger = _logger(tmp_path, logging_steps=2)
    for step in range(1, 6):
        logger.step(step, {"reward": float(step)})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4, 5]
    assert [json.loads(line)["reward"] for line in lines] == [1.5, 3.5, 5.0]


def test_concurrent_appends_never_tear_or_interleave_a_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    payload = "x" * 5000  # longer than a pipe buffer: a torn write would show

    def writer(worker):
        for i in range(50):
            append_jsonl(path, {"worker": worker, "i": i, "payload": payload})

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 200 and all(r["payload"] == payload for r in records)


def test_a_resumed_run_drops_the_records_of_the_abandoned_continuation(tmp_path):
    for step in (1, 2, 3, 4):
        append_jsonl(tmp_path / "metrics.jsonl", {"step": step})
    logger = MetricLogger(LoggingConfig(logging_steps=1), tmp_path, resume_step=2, stream=io.StringIO())
    logger.step(3, {"reward": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_without_a_terminal_each_log_step_prints_one_line_with_eta_reward_and_kl(tmp_path):
    stream = io.StringIO()
    logger = _logger(tmp_path, stream=stream, logging_steps=1)
    logger.step(1, {"reward": 0.25, "kl": 0.0012, "completions/mean_length": 14.0, "step_time": 3.0})
    line = stream.getvalue().strip()
    assert line.startswith("step 1/5 | eta ")
    assert "reward 0.25" in line and "kl 0.0012" in line and "len 14" in line and "s/step 3" in line


def test_without_a_terminal_a_long_run_prints_about_ten_lines_first_and_last_included(tmp_path):
    stream = io.StringIO()
    logger = MetricLogger(LoggingConfig(logging_steps=1), tmp_path, max_steps=100, stream=stream)
    for step in range(1, 101):
        logger.step(step, {"reward": 0.5})
    steps = [int(line.split()[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert steps == [1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 100]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 100, "every log step is still written"


def test_log_completions_writes_trls_table_with_extra_columns_to_parquet(tmp_path):
    import pandas as pd

    logger = _logger(tmp_path, logging_steps=2, log_completions=True, num_completions_to_print=1)
    logger.log_extra("gold_parsed", ["[3]", "[3]"])
    logger.log_extra("answer_parsed", ["[3]", "[4]"])
    logger.add_completions(["p", "p"], ["<answer>3</answer>", "<answer>4</answer>"],
                           {"accuracy_reward": torch.tensor([1.0, 0.0]), "judge": [NAN, 0.5]},
                           torch.tensor([0.7, -0.7]))
    logger.step(1)
    assert not (tmp_path / "completions").exists()  # written on log steps only
    logger.step(2)
    frame = pd.read_parquet(tmp_path / "completions" / "completions_00002.parquet")
    assert list(frame.columns) == ["step", "prompt", "completion", "accuracy_reward", "judge", "answer_parsed",
                                   "gold_parsed", "advantage"]
    assert frame["step"].tolist() == [2, 2] and frame["answer_parsed"].tolist() == ["[3]", "[4]"]
    assert frame["accuracy_reward"].tolist() == [1.0, 0.0] and math.isnan(frame["judge"][0])
    assert frame["advantage"].tolist() == pytest.approx([0.7, -0.7])
    printed = logger.stream.getvalue()
    assert printed.count("completion=") == 1 and "accuracy_reward=1.0" in printed


def test_completions_are_not_kept_when_log_completions_is_off(tmp_path):
    logger = _logger(tmp_path, logging_steps=1)
    logger.add_completions(["p"], ["c"], {"r": [1.0]}, [0.0])
    logger.step(1)
    assert not (tmp_path / "completions").exists()


def test_tensorboard_receives_every_logged_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = _logger(tmp_path, logging_steps=1, report_to=["tensorboard"])
    logger.step(1, {"reward": 0.5, "kl": NAN})
    logger.step(2, {"reward": 0.75})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.5), (2, 0.75)]
    assert "kl" not in events.Tags()["scalars"]  # a NaN is not a point


@pytest.mark.slow  # wandb.init starts its service process: ~1.6 s idle, ~5 s on 2 busy cores
def test_wandb_logs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = _logger(tmp_path, logging_steps=1, report_to=["wandb"], run_name="unit")
    logger.step(1, {"reward": 0.5})
    logger.step(2, {"reward": 0.75})
    assert logger.sinks.wandb.summary["reward"] == 0.75 and logger.sinks.wandb.name == "unit"
    logger.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_close_draws_reward_kl_and_length_curves_to_a_png(tmp_path):
    logger = _logger(tmp_path, logging_steps=1)
    for step in range(1, 4):
        logger.step(step, {"reward": 0.1 * step, "reward_std": 0.05, "kl": 0.01 * step,
                           "completions/mean_length": 10.0 + step, "completions/min_length": 5.0,
                           "completions/max_length": 20.0})
    png = logger.close()
    assert png == tmp_path / "metrics.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_metrics(tmp_path / "missing.jsonl", tmp_path / "none.png") is None


def test_close_logs_a_window_left_after_the_last_log_step(tmp_path):
    logger = MetricLogger(LoggingConfig(logging_steps=10), tmp_path, stream=io.StringIO())
    logger.step(3, {"reward": 1.0})
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [3]


def test_eval_metrics_get_trls_eval_prefix(tmp_path):
    logger = _logger(tmp_path)
    logger.log_eval(4, {"reward": 0.5, "kl": NAN})
    assert read_metrics(tmp_path / "metrics.jsonl")[0] | {"elapsed_s": 0} == {
        "step": 4, "elapsed_s": 0, "eval_reward": 0.5, "eval_kl": None}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_readings_are_empty_without_a_gpu():
    monitor = GpuMonitor()
    assert not monitor.available and monitor.read() == {}


def test_phase_timer_reports_seconds_per_phase_and_tokens_per_second():
    clock = iter([0.0, 2.0, 2.0, 3.0, 10.0, 11.0])
    timer = PhaseTimer(clock=lambda: next(clock))
    for name in ("rollout", "train", "rollout"):
        with timer.phase(name):
            pass
    assert timer.metrics(num_tokens=400) == {"time/rollout_s": 3.0, "time/train_s": 1.0, "tokens_per_s": 100.0}
    assert timer.metrics() == {}  # reset
