"""Cross-field checks: each bad config fails with a message a user can act on (the arithmetic shown);
every file in configs/ is valid at the world size its layout states."""

from pathlib import Path

import pytest

from engine.config import ConfigError, build_config, load_config
from engine.validation import derive, validate

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def _cfg(**sections):
    return build_config(sections)


@pytest.mark.parametrize(
    "sections,world_size,message",
    [
        (
            {"parallel": {"tp_size": 2, "pp_size": 2, "dp_size": 3}}, 8,
            r"tp_size\*pp_size\*dp_size = 2\*2\*3 = 12 != world size 8",
        ),
        ({"parallel": {"tp_size": 4, "pp_size": 2}}, 12, r"world size 12 is not divisible by tp_size\*pp_size = 4\*2 = 8"),
        ({"grpo": {"num_generations": 1}}, 1, r"GRPO requires at least 2 generations per prompt to calculate the "
                                              r"advantages. You provided 1, which is less than the minimum required"),
        (
            {"train": {"per_device_train_batch_size": 6}, "grpo": {"num_generations": 4}}, 1,
            r"generation_batch_size \(6\) must be divisible by num_generations \(4\). Given the current generation "
            r"batch size, the valid values for the number of generations are: \[2, 3, 6\]. \(generation batch = "
            r"per_device_train_batch_size\*dp_size\*steps_per_generation = 6\*1\*1 = 6 completions",
        ),
        (
            {"train": {"per_device_train_batch_size": 4, "generation_batch_size": 24}, "grpo": {"num_generations": 4}},
            4, r"generation_batch_size \(24\) must be divisible by the global batch size \(16\). "
               r"\(train.generation_batch_size=24 must be a multiple of "
               r"per_device_train_batch_size\*dp_size = 4\*4 = 16",
        ),
        (
            {"train": {"generation_batch_size": 16, "steps_per_generation": 2}}, 1,
            r"'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time",
        ),
        (
            {"train": {"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "parallel": {"pp_size": 2}}, 2,
            r"steps_per_generation\*num_iterations = 3\*1 micro-steps per round is not a multiple of "
            r"train.gradient_accumulation_steps=2, so optimizer steps span generation rounds, which needs "
            r"parallel.pp_size=1",
        ),
        (
            {"train": {"steps_per_generation": 3, "gradient_accumulation_steps": 2},
             "rollout": {"vllm_mode": "server", "max_staleness": 1}}, 1,
            r"which needs rollout.max_staleness=0",
        ),
        ({"parallel": {"sequence_parallel": True}}, 1, r"sequence_parallel needs parallel.tp_size > 1"),
        ({"parallel": {"virtual_pipeline_size": 2}}, 1, r"virtual_pipeline_size=2 needs parallel.pp_size > 1"),
        (
            {"reward": {"reward_funcs": ["accuracy", "length"], "reward_weights": [1.0]}}, 1,
            r"reward.reward_weights has 1 entries for 2 reward.reward_funcs",
        ),
        (
            {"grpo": {"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 2.0}}, 1,
            r"clip_min=2.0 must be < grpo.vllm_importance_sampling_clip_max=2.0",
        ),
        (
            {"grpo": {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None}},
            1, r"'token_truncate' needs clip_min or clip_max",
        ),
        ({"grpo": {"num_remains_in_group": 8}}, 1, r"num_remains_in_group=8 must satisfy 2 <= k < num_generations=8"),
        ({"grpo": {"delta": 1.1}}, 1, r"grpo.delta=1.1 must exceed 1 \+ epsilon = 1 \+ 0.2"),
        ({"grpo": {"sync_ref_model": True}}, 1, r"sync_ref_model needs a reference model, i.e. grpo.beta > 0"),
        ({"grpo": {"sync_ref_model": True, "beta": 0.1, "ref_model_sync_steps": 0}}, 1,
         r"grpo.ref_model_sync_steps must be >= 1"),
        ({"data": {"eval_max_prompts": 0}}, 1, r"data.eval_max_prompts must be >= 1 or null \(all\), got 0"),
        ({"grpo": {"loss_type": "vespo"}}, 1, r"loss_type='vespo' folds the IS ratio"),
        ({"rollout": {"vllm_tensor_parallel_size": 3}}, 4, r"vllm_tensor_parallel_size=3 must divide the world size 4"),
        ({"generation": {"temperature": 0.0}}, 1, r"generation.temperature must be > 0"),
        ({"rollout": {"vllm_max_model_length": 256}}, 1, r"vllm_max_model_length=256 leaves no room for a prompt"),
        ({"train": {"max_steps": 0}}, 1, r"train.max_steps must be -1 \(use num_train_epochs\) or >= 1, got 0"),
        ({"reward": {"reward_funcs": []}}, 1, r"reward.reward_funcs is empty"),
        (
            {"rollout": {"vllm_mode": "server", "vllm_server_base_url": "http://a:8000",
                         "vllm_server_base_urls": ["http://b:8000"]}}, 1,
            r"vllm_server_base_url and rollout.vllm_server_base_urls are both set",
        ),
        ({"rollout": {"vllm_server_base_urls": []}}, 1, r"vllm_server_base_urls is an empty list"),
        ({"rollout": {"max_staleness": 1}}, 1, r"max_staleness=1 needs rollout.vllm_mode=server: a colocated engine"),
        ({"rollout": {"vllm_mode": "server", "max_staleness": -1}}, 1, r"max_staleness must be >= 0"),
        ({"rollout": {"vllm_nodes_per_server": 2, "vllm_tensor_parallel_size": 2}}, 2,
         r"vllm_nodes_per_server=2 needs rollout.vllm_mode=server"),
        ({"rollout": {"vllm_mode": "server", "vllm_nodes_per_server": 2, "vllm_tensor_parallel_size": 3}}, 1,
         r"vllm_nodes_per_server=2 must divide rollout.vllm_tensor_parallel_size=3 \(3 % 2 = 1\)"),
        ({"rollout": {"vllm_mode": "server", "vllm_nodes_per_server": 0}}, 1, r"vllm_nodes_per_server must be >= 1"),
        (
            {"rollout": {"vllm_server_base_urls": ["http://a:8000", "http://a:8000/"]}}, 1,
            r"vllm_server_base_urls lists a server twice",
        ),
        ({"rollout": {"vllm_server_base_urls": ["a:8000"]}}, 1, r"must be http\(s\):// URLs, got \['a:8000'\]"),
        ({"rollout": {"vllm_request_timeout": 0}}, 1, r"vllm_request_timeout and rollout.vllm_server_timeout must be > 0"),
        ({"train": {"max_tokens_per_microbatch": 0}}, 1, r"train.max_tokens_per_microbatch must be >= 1 token or null"),
        ({"kernels": {"loss_pass": "one"}, "grpo": {"importance_sampling_level": "sequence"}}, 1,
         r"kernels.loss_pass = 'one' needs a token-local loss: sequence-level importance sampling"),
        ({"optimizer": {"optim": "sgd", "optimizer_state_dtype": "bfloat16"}}, 1,
         r"optimizer.optimizer_state_dtype=bfloat16 stores Adam's moments; optimizer.optim=sgd has none"),
    ],
)
def test_validate_refuses_with_actionable_message(sections, world_size, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(**sections), world_size)


def test_validate_reports_every_problem_at_once():
    cfg = _cfg(grpo={"num_generations": 1, "beta": -1.0}, generation={"temperature": 0.0})
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1)
    text = str(info.value)
    assert "num_generations=1" in text and "grpo.beta must be >= 0" in text and "temperature must be > 0" in text


def test_derive_batch_geometry_follows_trl():
    # TRL: generation batch = per_device * world * steps_per_generation; here world -> data-parallel ranks.
    cfg = _cfg(
        parallel={"tp_size": 2},
        train={"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_generation": 4},
        grpo={"num_generations": 8, "num_iterations": 2},
    )
    d = validate(cfg, 8)
    assert (d.dp_size, d.global_batch_size, d.generation_batch_size) == (4, 4 * 4 * 2, 4 * 4 * 4)
    assert d.num_prompts_per_generation == 64 // 8
    assert d.optimizer_steps_per_generation == 4 * 2 // 2


def test_derive_generation_batch_size_sets_steps_per_generation():
    cfg = _cfg(train={"per_device_train_batch_size": 4, "generation_batch_size": 32}, grpo={"num_generations": 4})
    assert derive(cfg, 2).steps_per_generation == 32 // (4 * 2)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_is_valid(path):
    cfg = load_config(path)
    par = cfg.parallel
    world_size = par.tp_size * par.pp_size * (par.dp_size or 1)
    derived = validate(cfg, world_size)
    assert derived.generation_batch_size % cfg.grpo.num_generations == 0
    assert path.read_text().startswith("#"), "every config opens with a header comment (hardware, layout, memory)"


def test_configs_directory_has_the_promised_files():
    names = {p.stem for p in CONFIGS}
    assert {"tiny_cpu", "qwen2.5-0.5b_tp1_1gpu", "qwen2.5-7b_tp2_dp4_1node", "qwen2.5-72b_tp8_pp4_split_4x1"} <= names
