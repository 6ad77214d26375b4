"""The examples of four guides, each run as its user runs it: TRL's GRPO Trainer guide (quick start, custom reward
functions, colocate and server mode, the 70B multi-node config), TRL's experimental GFPO guide, the curriculum hook
`dynamic_prompts_fn`, and the Hugging Face LLM course's GRPO page (chapter 12.4). The scripts live in
examples/guides/ (and examples/001_* for the guide's conversational format reward), each changed from its guide
only in the import line, the model, the dataset and sizes, and each at TRL's defaults: bf16, colocated vLLM at
TRL's memory settings, no CPU-specific argument in any script.

Each script runs in a subprocess, unchanged, through tests/integration/trl_script_runner.py (`python script.py` as
`__main__`, then the `GRPOTrainer` it built is read: `trainer.state.log_history`, and `trainer.save_model(dir)`).
Every run must: finish; log TRL's metric names for every step record and end `log_history` with HF's final record
(`train_loss` ...); save a model that `transformers` loads, in bf16 (config.json `dtype`); and move the weights
exactly when some group's rewards varied (the quick start's never vary with the tiny model: there the saved weights
must equal the initial ones cast to bf16). GFPO: the filter instance of the script's `__main__` was called once
per generation; curriculum: the prompts the hook returned are the next generation's. The 70B config is validated
and planned on its cluster shape, not run.

Measured on the 2-core dev VM (2026-11-23): 18-25 s per run (start-up most of it), the server test ~30 s with the
server's start; about 2.5 minutes for the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import warm_python
from tests.integration.test_trl_examples import _run_until_trainer

REPO = Path(__file__).resolve().parents[2]
GUIDES = REPO / "examples" / "guides"
RUNNER = Path(__file__).with_name("trl_script_runner.py")
MODEL = "builtin:tiny-qwen2-arith"

TRL_STEP_METRICS = {
    "num_tokens", "step_time", "completions/mean_length", "completions/min_length", "completions/max_length",
    "completions/clipped_ratio", "completions/mean_terminated_length", "completions/min_terminated_length",
    "completions/max_terminated_length", "reward", "reward_std", "frac_reward_zero_std", "entropy",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
    "clip_ratio/high_max", "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max", "loss", "grad_norm", "learning_rate", "epoch", "step",
}
"""What TRL 1.16 logs per step with vLLM, β = 0 and the default dapo loss (TRL 1.16 `GRPOTrainer._metrics`), plus HF's own."""
FINAL_RECORD = ["train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss",
                "epoch", "step"]
"""HF Trainer's last `log_history` record, in its order."""


def run_guide(script: Path, cwd: Path, *args: str, env: dict | None = None) -> dict:
    """`python script [args]` in `cwd` through the runner; returns what it reports, plus `saved` (save_model's dir)
    and `cwd`."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", **(env or {})}
    result_file, saved = cwd / "result.json", cwd / "saved_model"
    proc = warm_python.run([sys.executable, str(RUNNER), str(script), str(result_file), str(saved), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"{script.name} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-6000:]}"
    return {**json.loads(result_file.read_text()), "saved": saved, "cwd": cwd}


def check_trl_history(result: dict, reward_names: list[str], steps: int) -> list[dict]:
    """TRL's metric names in every step record and HF's final record last; when the last step is not a logging
    step (TRL's default logging_steps is 10), TRL merges its metrics into the final record instead of a record of
    its own. Returns the records holding step metrics (the final one included when it holds them)."""
    *records, final = result["log_history"]
    expected = TRL_STEP_METRICS | {f"rewards/{n}/{s}" for n in reward_names for s in ("mean", "std")}
    assert final["step"] == steps == result["global_step"] and math.isfinite(final["train_loss"])
    for record in records:
        assert expected <= set(record), f"missing TRL metrics: {sorted(expected - set(record))}"
    if records and records[-1]["step"] == steps:  # a logging step: HF's final record alone
        assert list(final) == FINAL_RECORD
        return records
    # TRL's metrics of the unlogged steps; HF's loss / grad_norm / learning_rate are logged on logging steps only
    merged = expected - {"loss", "grad_norm", "learning_rate"}
    assert merged <= set(final), f"missing TRL metrics in the final record: {sorted(merged - set(final))}"
    assert set(FINAL_RECORD) <= set(final) and list(final)[-2:] == FINAL_RECORD[-2:], list(final)
    return [*records, final]


def count_moved_weights(saved: Path) -> int:
    """Elements of the saved model that differ from the initial model cast to bf16; checks save_model's output
    loads with transformers, in bf16."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from engine.models.tiny_model import resolve_builtin_model

    assert json.loads((saved / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert model.dtype == torch.bfloat16
    trained = model.state_dict()
    initial = load_file(resolve_builtin_model(MODEL, saved.parent / "cache") / "model.safetensors")  # float32
    return sum(int((trained[name] != tensor.to(torch.bfloat16)).sum()) for name, tensor in initial.items())


def check_learned_from_varied_rewards(result: dict, records: list[dict]) -> None:
    """Some group's rewards varied, so the bf16 weights moved."""
    assert any(r["frac_reward_zero_std"] < 1.0 for r in records), "no group's rewards varied: nothing to learn from"
    assert count_moved_weights(result["saved"]) > 0, "varied rewards, yet the saved weights equal the initial ones"


@pytest.mark.slow
def test_trl_quickstart_at_trl_defaults_all_equal_rewards_leave_weights_unchanged(tmp_path):
    """The guide's quick start has no `args`: TRL's defaults throughout (bf16, G = 8, 512 completion tokens, 3
    epochs, colocated vLLM at 0.3). The tiny model never writes LaTeX, so accuracy_reward is 0 everywhere: zero
    advantages, and Adam with zero gradients (and TRL's weight_decay 0) leaves every weight where it was."""
    import yaml

    result = run_guide(GUIDES / "trl_quickstart.py", tmp_path)
    records = check_trl_history(result, ["accuracy_reward"], steps=6)  # 3 epochs x 2 rows / 1 prompt per step
    assert result["output_dir"] == "builtin-tiny-qwen2-arith-GRPO"  # TRL: f"{model name}-GRPO"
    config = yaml.safe_load((tmp_path / result["output_dir"] / "config.yaml").read_text())
    assert config["model"]["dtype"] == "bfloat16" and config["grpo"]["num_generations"] == 8
    assert config["generation"]["max_completion_length"] == 512
    rollout = config["rollout"]
    assert rollout["vllm_gpu_memory_utilization"] == 0.3 and rollout["vllm_max_model_length"] is None
    assert all(r["rewards/accuracy_reward/mean"] == 0.0 and r["frac_reward_zero_std"] == 1.0 for r in records)
    assert count_moved_weights(result["saved"]) == 0


@pytest.mark.slow
def test_trl_custom_reward_functions_standard_format_with_weights_none_and_async(tmp_path):
    """Examples 1, 1.1, 3, 4 (None for the other task's rows) and 5 (async) in one weighted list, colocate mode."""
    names = ["reward_num_tokens", "reward_num_chars", "reward_ground_truth", "math_reward_func", "coding_reward_func",
             "async_reward_func"]
    result = run_guide(GUIDES / "trl_reward_functions.py", tmp_path)
    records = check_trl_history(result, names, steps=3)
    for record in records:
        assert record["rewards/reward_num_tokens/mean"] >= 1  # at least the end-of-sequence token
        assert 0 <= record["rewards/async_reward_func/mean"] <= 1
        for task_reward in ("math_reward_func", "coding_reward_func"):  # +-1 on its rows; NaN if none in the batch
            value = record[f"rewards/{task_reward}/mean"]
            assert math.isnan(value) or -1 <= value <= 1
    check_learned_from_varied_rewards(result, records)


@pytest.mark.slow
def test_gfpo_guide_calls_the_filter_instance_of_main(tmp_path):
    result = run_guide(GUIDES / "gfpo.py", tmp_path)
    records = check_trl_history(result, ["correct_answer"], steps=3)
    assert result["hooks"] == {"group_filter_func": "__main__:GroupFilter"}
    assert result["group_filter_state"] == {"num_calls": 3}  # one generation per step, the instance itself called
    config = (tmp_path / "Qwen3-0.6B-GFPO" / "config.yaml").read_text()
    assert "group_filter_func: __main__:GroupFilter()" in config and "num_remains_in_group: 2" in config
    check_learned_from_varied_rewards(result, records)


@pytest.mark.slow
def test_curriculum_hook_prompts_are_generated_next(tmp_path):
    result = run_guide(GUIDES / "curriculum.py", tmp_path)
    records = check_trl_history(result, ["accuracy"], steps=3)
    assert result["hooks"] == {"dynamic_prompts_fn": "__main__:curriculum_fn"}
    calls = result["globals"]["curriculum_log"]
    assert len(calls) == 3 and all(len(c["prompts"]) == len(c["returned"]) == 2 for c in calls)
    for before, after in zip(calls, calls[1:]):
        assert after["prompts"] == before["returned"], "the next generation must sample what the hook returned"
    assert all(math.isfinite(r["rewards/accuracy/mean"]) for r in records)  # the hook's rows carry `answer`
    check_learned_from_varied_rewards(result, records)


@pytest.mark.slow
def test_course_grpo_page_rewards_and_training_configuration(tmp_path):
    """3 epochs of 2 prompts at 2 prompts per step (4 completions x 2 accumulation steps / 4 generations)."""
    names = ["reward_func", "reward_length", "reward_format", "reward_len", "problem_reward", "format_reward"]
    result = run_guide(GUIDES / "course_grpo.py", tmp_path)
    records = check_trl_history(result, names, steps=3)
    for record in records:
        assert record["rewards/reward_len/mean"] <= 0 and record["rewards/reward_func/mean"] >= 0
        assert record["rewards/reward_func/mean"] == record["rewards/reward_length/mean"]  # the same function
        assert all(0 <= record[f"rewards/{n}/mean"] <= 1 for n in ("reward_format", "problem_reward", "format_reward"))
    check_learned_from_varied_rewards(result, records)


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_trl_server_mode_against_grpo_engine_vllm_serve(tmp_path):
    """Step 1 of the guide with `grpo-engine vllm-serve --model ...` (TRL's flags; no config file: the checkpoint's
    float32 in vLLM, bf16 in the trainer), step 2 the script at TRL's default server address 0.0.0.0:8000."""
    if not _port_is_free(8000):
        pytest.skip("port 8000 (TRL's default vllm_server_port, which the guide's config relies on) is taken")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "GRPO_ENGINE_TOKEN": secrets.token_hex(16)}
    log = (tmp_path / "server.log").open("w")
    server = warm_python.Popen([sys.executable, "-m", "engine", "vllm-serve", "--model", MODEL,
                               "--gpu_memory_utilization", "0.1"],  # on CPU: a fraction of host memory
                              cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:  # listening (the trainer itself waits until the engine is loaded)
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not listen within 120 s"
                time.sleep(0.5)
        result = run_guide(GUIDES / "trl_vllm_server.py", tmp_path, env={"GRPO_ENGINE_TOKEN": env["GRPO_ENGINE_TOKEN"]})
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    records = check_trl_history(result, ["reward_len"], steps=3)
    assert all(r["weight_sync/servers"] == 1 and r["weight_sync/server_restarts"] == 0 for r in records)
    assert "POST /weights/update" in (tmp_path / "server.log").read_text()
    check_learned_from_varied_rewards(result, records)


# ---------------------------------------------------------------------------------------------------------------
# the 70B multi-node config: validated and planned, not run


def _build_70b_guide_config(monkeypatch) -> dict:
    """Run the guide's script as its SLURM line would (the host as `ip-X-X-X-X`) up to `GRPOTrainer(...)`; the
    dataset is a stand-in with DeepMath's columns (the test is offline)."""
    import datasets

    import engine

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "1+1?"}], "solution": "2"}]))
    path = GUIDES / "trl_70b_multinode.py"
    monkeypatch.setattr(sys, "argv", [str(path), "--vllm_server_host", "ip-10-0-0-5"])
    return _run_until_trainer(path.read_text(), path, monkeypatch, engine)


def test_trl_70b_multinode_config_validates_and_plans_with_megatron_layout(monkeypatch):
    """The guide's GRPOConfig at its world size (4 nodes x 8 GPUs) has TRL's batch geometry; planned as written
    (no sharding in the script: ZeRO-3 sits on TRL's launch line) it cannot fit a 72B model on a GPU, and the plan
    says what to raise; with the engine's layout in ZeRO-3's place (TP 8 x PP 4, the same 128 completions per
    step, the server on the fifth node at `vllm-serve`'s default 0.9) it fits every GPU kind."""
    from engine.planning.planner import ClusterShape, build_plan
    from engine.validation import validate

    captured = _build_70b_guide_config(monkeypatch)
    args = captured["args"]
    assert captured["model"] == "Qwen/Qwen2.5-72B" and args.vllm_server_host == "10.0.0.5"
    assert args.to_engine_config().model.dtype == "bfloat16"

    def tree(grpo_args):
        cfg = grpo_args.to_engine_config()
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=captured["model"]),
                                   data=dataclasses.replace(cfg.data, max_prompt_length=512))  # the plan's bound

    derived = validate(tree(args), 32)
    assert (derived.dp_size, derived.generation_batch_size, derived.num_prompts_per_generation) == (32, 128, 16)
    as_written = build_plan(tree(args), ClusterShape(train_nodes=4, infer_nodes=0, gpus_per_node=8))
    assert any("raise parallel.pp_size or tp_size" in p for p in as_written.problems), as_written.problems

    megatron = args.replace(tp_size=8, pp_size=4, gradient_accumulation_steps=32, vllm_mode="server",
                            vllm_tensor_parallel_size=8, vllm_gpu_memory_utilization=0.9)
    plan = build_plan(tree(megatron), ClusterShape(train_nodes=4, infer_nodes=1, gpus_per_node=8))
    assert plan.problems == [] and plan.derived.global_batch_size == 128


# ---------------------------------------------------------------------------------------------------------------
# the same scripts under TRL


TRL_RUNNABLE = ["trl_quickstart", "trl_reward_functions", "course_grpo", "trl_vllm_server"]
"""The guide scripts TRL 1.16 itself runs (GFPO left TRL in 1.8; `dynamic_prompts_fn` is a fork's; the 70B one
needs the hub)."""
IMPORT_SWAPS = {"from engine import ": "from trl import ", "from engine.rewards import ": "from trl.rewards import "}


@pytest.mark.parametrize("name", TRL_RUNNABLE)
def test_guide_script_is_the_trl_script_with_the_imports_swapped(name, tmp_path, monkeypatch):
    """Swapping the import lines back to trl gives a script TRL 1.16 accepts: the same trainer arguments, and every
    GRPOConfig argument read the same way (TRL's trainer is stopped at construction: no `builtin:` model there)."""
    trl = pytest.importorskip("trl")
    import engine

    path = GUIDES / f"{name}.py"
    source = path.read_text()
    trl_source = source
    for ours, theirs in IMPORT_SWAPS.items():
        trl_source = trl_source.replace(ours, theirs)
    assert "\nfrom trl import " in trl_source and "\nfrom engine" not in trl_source
    monkeypatch.chdir(tmp_path)
    ours = _run_until_trainer(source, path, monkeypatch, engine)
    # NOTE: TRL's default bf16=True makes transformers refuse a machine without a bf16 GPU ("Your setup doesn't
    # support bf16/gpu"), i.e. TRL's defaults do not run on this CPU-only machine at all; stand in for the GPU.
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    theirs = _run_until_trainer(trl_source, path, monkeypatch, trl)
    assert sorted(ours) == sorted(theirs) and ours["model"] == theirs["model"] == MODEL
    if "args" in ours:
        assert not ours["args"].ignored_arguments, "the guides use only arguments that mean something here"
        for arg in ours["args"].explicit_names:
            ours_value, theirs_value = getattr(ours["args"], arg), getattr(theirs["args"], arg)
            assert getattr(ours_value, "value", ours_value) == getattr(theirs_value, "value", theirs_value), arg
        assert ours["args"].bf16 is theirs["args"].bf16 is True
