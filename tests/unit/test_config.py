"""The config tree: loading, dotted overrides, type errors with the full dotted path, TRL names and defaults."""

import dataclasses

import pytest
import yaml

from engine.config import (
    ConfigError,
    EngineConfig,
    build_config,
    config_to_dict,
    find_field,
    load_config,
    write_resolved_config,
)


def _yaml(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_config_defaults_follow_trl_names():
    cfg = EngineConfig()
    assert (cfg.grpo.loss_type, cfg.grpo.beta, cfg.grpo.epsilon, cfg.grpo.num_generations) == ("dapo", 0.0, 0.2, 8)
    assert cfg.grpo.vllm_importance_sampling_mode == "sequence_mask"
    assert cfg.optimizer.learning_rate == 1e-6
    assert cfg.generation.max_completion_length == 512


def test_config_unknown_nested_key_names_full_path_and_suggests(tmp_path):
    path = _yaml(tmp_path, "grpo:\n  epsilon_hgih: 0.28\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'grpo.epsilon_hgih'; did you mean 'epsilon_high'"):
        load_config(path)


def test_config_unknown_section_is_refused():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer'"):
        build_config({"trainer": {"max_steps": 3}})


@pytest.mark.parametrize(
    "data,message",
    [
        ({"grpo": {"beta": "lots"}}, r"grpo.beta: expected a number, got str 'lots'"),
        ({"train": {"per_device_train_batch_size": 2.5}}, r"train.per_device_train_batch_size: expected an integer"),
        ({"train": {"max_steps": True}}, r"train.max_steps: expected an integer, got bool"),
        ({"parallel": {"sequence_parallel": "yes"}}, r"parallel.sequence_parallel: expected true or false"),
        ({"grpo": {"loss_type": "ppo"}}, r"grpo.loss_type: 'ppo' is not one of 'grpo', 'bnpo'"),
        ({"reward": {"reward_weights": [1.0, "x"]}}, r"reward.reward_weights\[1\]: expected a number"),
        ({"logging": {"report_to": ["tensorboard", "mlflow"]}}, r"logging.report_to\[1\]: 'mlflow' is not one of"),
        ({"model": "Qwen/Qwen2.5-7B"}, r"model: expected a mapping of fields, got str"),
    ],
)
def test_config_wrong_type_names_full_path(data, message):
    with pytest.raises(ConfigError, match=message):
        build_config(data)


def test_config_float_written_without_dot_is_accepted(tmp_path):
    # YAML 1.1 reads `1e-6` as a string; a user writing it means the number.
    cfg = load_config(_yaml(tmp_path, "optimizer:\n  learning_rate: 1e-6\n"))
    assert cfg.optimizer.learning_rate == 1e-6


def test_config_scale_rewards_accepts_trl_booleans():
    assert build_config({"grpo": {"scale_rewards": True}}).grpo.scale_rewards == "group"
    assert build_config({"grpo": {"scale_rewards": False}}).grpo.scale_rewards == "none"


def test_config_overrides_apply_dotted_paths_with_yaml_values(tmp_path):
    path = _yaml(tmp_path, "grpo:\n  beta: 0.0\ntrain:\n  max_steps: 10\n")
    cfg = load_config(path, ["grpo.beta=0.04", "--train.max_steps=3", "reward.reward_funcs=[accuracy, length]"])
    assert cfg.grpo.beta == 0.04 and cfg.train.max_steps == 3
    assert cfg.reward.reward_funcs == ["accuracy", "length"]


@pytest.mark.parametrize(
    "override,message",
    [
        ("grpo.betta=0.1", r"unknown config key 'grpo.betta'; did you mean 'beta'"),
        ("grpo.beta", r"expected section.key=value"),
        ("grpo.beta.x=1", r"'grpo.beta' is a value, not a section"),
        ("parallel.tp_size=two", r"parallel.tp_size: expected an integer, got str 'two'"),
    ],
)
def test_config_bad_override_is_refused(tmp_path, override, message):
    path = _yaml(tmp_path, "grpo:\n  beta: 0.0\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path, [override])


def test_config_is_frozen():
    cfg = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.grpo.beta = 1.0  # type: ignore[misc]


def test_config_resolved_file_round_trips(tmp_path):
    cfg = load_config(None, ["grpo.beta=0.04", "parallel.tp_size=2", "generation.generation_kwargs={stop: [x]}"])
    path = write_resolved_config(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    assert load_config(path) == cfg
    assert yaml.safe_load(path.read_text())["grpo"]["beta"] == 0.04


def test_config_every_leaf_name_has_one_home():
    assert find_field("epsilon_high") == ("grpo", "epsilon_high")
    assert find_field("vllm_tensor_parallel_size") == ("rollout", "vllm_tensor_parallel_size")
    assert find_field("per_device_train_batch_size") == ("train", "per_device_train_batch_size")
    with pytest.raises(KeyError):
        find_field("not_a_field")


# Fields that share TRL's name but not its default, on purpose.
DELIBERATE_DIFFERENCES = {
    "output_dir": "TRL's None means 'trainer_output'; ours names the run directory explicitly",
    "pad_to_multiple_of": "TRL's 'auto' pads only on AWS Neuron; None is the same elsewhere",
    "optim": "Megatron's optimizer names ('adam' is AdamW), not HF's 'adamw_torch_fused'",
    "report_to": "a list of extra sinks; JSONL is always written",
}


def test_config_trl_named_fields_have_trl_defaults():
    trl = pytest.importorskip("trl")
    trl_fields = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    shared = 0
    for section in dataclasses.fields(EngineConfig):
        defaults = config_to_dict(section.default_factory())
        for name, ours in defaults.items():
            if name not in trl_fields or name in DELIBERATE_DIFFERENCES:
                continue
            f = trl_fields[name]
            theirs = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert str(ours) == str(theirs), f"{section.name}.{name}: ours {ours!r}, TRL {theirs!r}"
            shared += 1
    assert shared >= 60, f"only {shared} fields share TRL's names"
