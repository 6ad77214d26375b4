"""TRL's command line without starting the engine: TRL-style flag lists and YAML recipes parse into the engine's
GRPOConfig with TRL's semantics (types, booleans, lists, choices, JSON dicts, engine flags), only the flags a user set
can be named in the no-effect warning, `--help` documents every field, TRL's own TrlParser takes the class, every TRL
field reads back, datasets and rewards resolve as `trl grpo` resolves them, and TRL's AsyncGRPOConfig arguments map
onto server mode with bounded staleness."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from engine import GRPOConfig
from engine.api.trl_fields import TRL_FIELDS
from engine.api.trl_script import (
    ModelConfig,
    ScriptArguments,
    apply_model_arguments,
    build_parser,
    load_split,
    parse_arguments,
    resolve_rewards,
)


def _parse(argv: list[str]):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here has "no effect": no warning allowed
        return parse_arguments(argv)


def test_flags_parse_with_trl_types_booleans_lists_and_json():
    parsed = _parse(["--model_name_or_path", "builtin:tiny-qwen2", "--dataset_name", "data.jsonl",
                     "--reward_funcs", "accuracy_reward", "think_format_reward", "--output_dir", "out",
                     "--learning_rate", "3e-6", "--max_steps", "7", "--num_generations", "4",
                     "--gradient_checkpointing", "False", "--fp16", "--reward_weights", "1.0", "0.5",
                     "--report_to", "tensorboard", "--scale_rewards", "batch", "--lr_scheduler_type", "cosine",
                     "--chat_template_kwargs", '{"enable_thinking": false}', "--tp_size", "2", "--max_staleness", "1"])
    args, cfg = parsed.training, parsed.training.to_engine_config()
    assert parsed.script.reward_funcs == ["accuracy_reward", "think_format_reward"]
    assert parsed.model.model_name_or_path == "builtin:tiny-qwen2"
    assert (args.learning_rate, args.max_steps, args.num_generations, args.output_dir) == (3e-6, 7, 4, "out")
    assert cfg.train.gradient_checkpointing is False and cfg.model.dtype == "float16" and args.fp16 is True
    assert cfg.reward.reward_weights == [1.0, 0.5] and cfg.logging.report_to == ["tensorboard"]
    assert cfg.grpo.scale_rewards == "batch" and cfg.optimizer.lr_scheduler_type == "cosine"
    assert cfg.generation.chat_template_kwargs == {"enable_thinking": False}
    assert (cfg.parallel.tp_size, cfg.rollout.max_staleness) == (2, 1)


def test_flags_at_defaults_are_the_engine_defaults_and_no_flag_means_no_warning():
    parsed = _parse([])
    reference = GRPOConfig()
    assert parsed.training.to_dict() == reference.to_dict()
    assert parsed.training.explicit_names == {"output_dir"}  # TRL's default output_dir only


def test_a_no_effect_flag_is_named_in_the_one_warning_and_only_it():
    with pytest.warns(UserWarning, match="no effect") as record:
        parse_arguments(["--use_cpu", "--max_steps", "3"])
    messages = [str(r.message) for r in record if "no effect" in str(r.message)]
    assert len(messages) == 1 and "use_cpu=True" in messages[0] and "ddp_timeout" not in messages[0]


def test_bad_values_are_refused_as_trl_refuses_them(capsys):
    with pytest.raises(SystemExit):
        parse_arguments(["--lr_scheduler_type", "bogus"])  # a choice list, from TRL's enum
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_arguments(["--max_steps", "many"])
    with pytest.raises(SystemExit):
        parse_arguments(["--not_an_argument", "1"])
    with pytest.raises(NotImplementedError, match="neftune_noise_alpha"):
        parse_arguments(["--neftune_noise_alpha", "5"])


def test_a_yaml_recipe_sets_the_arguments_flags_win_and_env_is_exported(tmp_path, monkeypatch):
    monkeypatch.delenv("GRPO_RECIPE_TEST", raising=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: builtin:tiny-qwen2\ndataset_name: data.jsonl\n"
                      "reward_funcs: [accuracy_reward]\nlearning_rate: 1e-5\nmax_steps: 4\nbf16: false\n"
                      "gradient_checkpointing: false\nreport_to: [tensorboard]\nbeta: 0.04\n"
                      "model_init_kwargs: {trust_remote_code: true}\nenv: {GRPO_RECIPE_TEST: 'on'}\n")
    parsed = _parse(["--config", str(recipe), "--max_steps", "2"])
    cfg = parsed.training.to_engine_config()
    assert (cfg.optimizer.learning_rate, cfg.train.max_steps, cfg.grpo.beta) == (1e-5, 2, 0.04)  # the flag wins
    assert cfg.model.dtype == "float32" and cfg.train.gradient_checkpointing is False and cfg.model.trust_remote_code
    assert cfg.logging.report_to == ["tensorboard"] and parsed.script.reward_funcs == ["accuracy_reward"]
    import os

    assert os.environ["GRPO_RECIPE_TEST"] == "on"
    recipe.write_text("max_steps: 2\nlearnin_rate: 1e-5\n")
    with pytest.raises(ValueError, match="unknown argument.*learnin_rate"):
        parse_arguments(["--config", str(recipe)])


def test_help_lists_every_argument_with_its_doc():
    text = " ".join(build_parser().format_help().split())
    for cls in (ScriptArguments, GRPOConfig, ModelConfig):
        for f in dataclasses.fields(cls):
            assert f"--{f.name} " in text or f"--{f.name}," in text, f.name
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
    assert "Optimizer steps to run; -1 = use num_train_epochs." in text  # an engine field's docstring
    assert "No effect in this engine: Megatron owns the layout" in text  # a TRL field without effect says so


def test_trl_parser_and_hf_argument_parser_take_the_engine_grpo_config(tmp_path):
    trl = pytest.importorskip("trl")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("dataset_name: d\nlearning_rate: 2.0e-5\nnum_generations: 4\nuse_peft: true\n")
    script, args, model = trl.TrlParser((trl.ScriptArguments, GRPOConfig, trl.ModelConfig)).parse_args_and_config(
        ["--config", str(recipe), "--max_steps", "3"])
    assert (args.learning_rate, args.num_generations, args.max_steps, model.use_peft) == (2e-5, 4, 3, True)
    assert isinstance(args, GRPOConfig) and script.dataset_name == "d"


def test_every_trl_field_is_declared_and_reads_back_with_trls_default():
    trl = pytest.importorskip("trl")
    theirs = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    assert list(TRL_FIELDS) == list(theirs)  # the table is TRL 1.16's, in TRL's order
    ours = GRPOConfig(output_dir="x")
    from engine.config import _FLAT_INDEX

    for name, f in theirs.items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        default = getattr(default, "value", default)  # transformers' enums
        assert TRL_FIELDS[name][1] == default, name
        value = getattr(ours, name)  # every TRL field reads
        if name not in _FLAT_INDEX and name not in ("bf16", "fp16", "accelerator_config"):
            assert value == default, name
    assert (ours.push_to_hub, ours.hub_model_id, ours.model_init_kwargs) == (False, None, None)
    assert ours.transformers_continuous_batching_config is None


def test_model_arguments_apply_as_trls_script_applies_them():
    base = GRPOConfig(output_dir="o")
    args = apply_model_arguments(base, ModelConfig(dtype="bfloat16", attn_implementation="eager", use_peft=True,
                                                   lora_r=8, lora_target_modules=["q_proj", "v_proj"]))
    cfg = args.to_engine_config()
    assert cfg.model.dtype == "bfloat16" and cfg.model.attention_implementation == "eager"
    assert (cfg.lora.use_peft, cfg.lora.lora_r, cfg.lora.lora_target_modules) == (True, 8, ["q_proj", "v_proj"])
    assert apply_model_arguments(base, ModelConfig()).to_engine_config().model.dtype == "bfloat16"  # TRL default
    for name in ("load_in_4bit", "load_in_8bit", "use_dora"):
        with pytest.raises(NotImplementedError, match=name):
            apply_model_arguments(base, ModelConfig(**{name: True}))
    with pytest.raises(NotImplementedError, match="model_revision"):
        apply_model_arguments(base, ModelConfig(model_revision="v2"))


def test_datasets_load_from_a_local_file_or_a_saved_copy(tmp_path):
    import datasets

    rows = [{"prompt": f"what is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    train = load_split(ScriptArguments(dataset_name=str(data)), "train")
    assert train["answer"] == ["1", "2", "3", "4"]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}
                         ).save_to_disk(str(tmp_path / "saved"))
    assert len(load_split(ScriptArguments(dataset_name=str(tmp_path / "saved")), "test")) == 1
    with pytest.raises(ValueError, match="dataset_name is required"):
        load_split(ScriptArguments(), "train")


def test_rewards_resolve_by_trls_names_and_dotted_paths(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def short(completions, **kw):\n    return [0.0 for _ in completions]\n")
    monkeypatch.chdir(tmp_path)
    funcs = resolve_rewards(ScriptArguments(reward_model_name_or_path="rm_dir", reward_funcs=[
        "accuracy_reward", "think_format_reward", "reasoning_accuracy_reward", "get_soft_overlong_punishment",
        "my_rewards.short", "pkg.mod:func", "exact_match"]))
    accuracy, think, reasoning, overlong, short = funcs[1:6]
    assert funcs[0] == "rm_dir" and funcs[6:] == ["pkg.mod:func", "exact_match"]  # GRPOTrainer resolves these
    assert accuracy(["\\boxed{5}"], answer=["5"]) == [1.0] and think(["<think>x</think>y"]) == [1.0]
    assert reasoning(["<think>x</think> \\boxed{5}"], answer=["5"]) == [1.0]
    assert overlong([[0] * 1024]) == [0.0] and overlong([[0] * 1281]) == [-1.0]  # TRL's 1280 / 256
    assert short.__name__ == "short" and short(["a"]) == [0.0]
    with pytest.raises(ValueError, match="cannot import"):
        resolve_rewards(ScriptArguments(reward_funcs=["no_such_module.func"]))
    with pytest.raises(ValueError, match="no reward"):
        resolve_rewards(ScriptArguments())


def test_reasoning_accuracy_scores_the_answer_after_the_reasoning():
    from engine.train.builtin_rewards import reasoning_accuracy_reward

    completions = ["<think>so 4</think> The answer is \\boxed{5}", "<think>maybe \\boxed{5}", "<think></think> 6"]
    assert reasoning_accuracy_reward(completions, solution=["5", "5", "5"]) == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------------------
# AsyncGRPO


def test_async_grpo_config_maps_trls_arguments_onto_server_mode_with_bounded_staleness():
    from engine.experimental.async_grpo import AsyncGRPOConfig

    args = AsyncGRPOConfig(output_dir="o", max_staleness=2, request_timeout=30, num_generations=4,
                           vllm_server_base_url="http://rollout:8000", epsilon_high=0.28, dtype="bfloat16")
    cfg = args.to_engine_config()
    assert (cfg.rollout.vllm_mode, cfg.rollout.max_staleness, cfg.rollout.vllm_server_base_url) == (
        "server", 2, "http://rollout:8000")
    assert (cfg.rollout.vllm_request_timeout, cfg.grpo.num_generations, cfg.grpo.epsilon_high) == (30.0, 4, 0.28)
    assert cfg.model.dtype == "bfloat16" and args.request_timeout == 30.0 and args.weight_sync_steps == 1
    defaults = AsyncGRPOConfig(output_dir="o")
    assert (defaults.max_staleness, defaults.max_completion_length, defaults.lr_scheduler_type) == (4, 2048, "constant")
    for name, value in (("queue_maxsize", 8), ("weight_sync_steps", 2), ("token_budget", 4096)):
        with pytest.raises(NotImplementedError, match=name):
            AsyncGRPOConfig(**{name: value})
    with pytest.raises(ValueError, match="vllm_mode='server'"):
        AsyncGRPOConfig(vllm_mode="colocate")


def test_async_grpo_config_takes_every_trl_async_argument():
    trl_async = pytest.importorskip("trl.experimental.async_grpo")
    from engine.experimental.async_grpo import AsyncGRPOConfig

    defaults = {}
    for f in dataclasses.fields(trl_async.AsyncGRPOConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        defaults[f.name] = getattr(default, "value", default)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TrainingArguments' no-effect names, given explicitly
        args = AsyncGRPOConfig(**defaults)
    assert args.to_engine_config().rollout.max_staleness == 4 and args.fork_threshold_tokens == 1024


def test_async_grpo_trainer_refuses_trls_worker_objects_by_name():
    from engine.experimental.async_grpo import AsyncGRPOTrainer

    with pytest.raises(NotImplementedError, match="rollout_worker"):
        AsyncGRPOTrainer(model="m", reward_funcs=[], rollout_worker=object())


def test_hf_argument_parser_dicts_and_dataclasses_replace_keep_the_values_given():
    from transformers import HfArgumentParser

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # values read back at their defaults are not "given"
        (parsed,) = HfArgumentParser(GRPOConfig).parse_dict({"max_steps": 4, "learning_rate": 2e-6})
        original = GRPOConfig(output_dir="o", max_steps=3, beta=0.1, report_to="none")
        changed = dataclasses.replace(original, max_steps=5)
    assert (parsed.max_steps, parsed.learning_rate) == (4, 2e-6)
    assert changed.to_dict() == original.replace(max_steps=5).to_dict() and changed.beta == 0.1
