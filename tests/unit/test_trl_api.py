"""The TRL-compatible API without starting the engine: TRL keyword arguments land in the right config fields, TRL
arguments with no effect are named in one warning, unknown names raise TypeError with a suggestion, unsupported
features are refused with a message, and GRPOTrainer resolves its inputs (model, rewards, datasets) up front."""

from __future__ import annotations

import dataclasses
import warnings

import datasets
import pytest
import torch

from engine import GRPOConfig, GRPOTrainer
from engine.api.trl_config import known_argument_names
from engine.api.trl_trainer import FINAL_MODEL_DIR, INITIAL_MODEL_DIR
from engine.config import ConfigError, EngineConfig, config_to_dict

TINY = "builtin:tiny-qwen2-arith"


def _config(**kwargs) -> GRPOConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these arguments all have a home: no warning allowed
        return GRPOConfig(**kwargs)


def _prompts(n: int = 8, **extra) -> datasets.Dataset:
    rows = {"prompt": [f"Question: what is {i} + 1? Answer:" for i in range(n)]}
    rows |= {name: [value] * n for name, value in extra.items()}
    return datasets.Dataset.from_dict(rows)


def _small_args(tmp_path, **kwargs) -> GRPOConfig:
    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4, max_steps=2)
    return _config(**(base | kwargs))


def reward_len(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]


# ---------------------------------------------------------------------------------------------------------------
# GRPOConfig


def test_grpo_config_puts_trl_arguments_in_their_sections():
    args = _config(output_dir="out", learning_rate=3e-6, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                   num_train_epochs=2.0, max_steps=7, logging_steps=3, save_steps=5, save_total_limit=2, seed=1,
                   run_name="r", beta=0.04, loss_type="grpo", num_generations=4, max_completion_length=64,
                   temperature=0.7, reward_weights=[1.0, 0.5], vllm_mode="colocate", weight_decay=0.1)
    cfg = args.to_engine_config()
    assert (cfg.optimizer.learning_rate, cfg.optimizer.weight_decay) == (3e-6, 0.1)
    assert (cfg.train.output_dir, cfg.train.per_device_train_batch_size, cfg.train.gradient_accumulation_steps,
            cfg.train.num_train_epochs, cfg.train.max_steps, cfg.train.seed) == ("out", 4, 2, 2.0, 7, 1)
    assert (cfg.logging.logging_steps, cfg.logging.run_name) == (3, "r")
    assert (cfg.checkpoint.save_steps, cfg.checkpoint.save_total_limit) == (5, 2)
    assert (cfg.grpo.beta, cfg.grpo.loss_type, cfg.grpo.num_generations) == (0.04, "grpo", 4)
    assert (cfg.generation.max_completion_length, cfg.generation.temperature) == (64, 0.7)
    assert cfg.reward.reward_weights == [1.0, 0.5]
    assert args.learning_rate == 3e-6 and args.beta == 0.04  # attributes read the tree, as on TRL's config


def test_grpo_config_accepts_engine_only_knobs():
    cfg = _config(tp_size=2, pp_size=2, vllm_tensor_parallel_size=2, loss_implementation="reference",
                  use_dynamic_sampling=True).to_engine_config()
    assert (cfg.parallel.tp_size, cfg.parallel.pp_size, cfg.rollout.vllm_tensor_parallel_size) == (2, 2, 2)
    assert cfg.kernels.loss_implementation == "reference" and cfg.grpo.use_dynamic_sampling


def test_grpo_config_without_output_dir_writes_where_trl_does():
    assert _config().output_dir == "trainer_output"
    assert _config(output_dir=None).output_dir == "trainer_output"
    assert GRPOConfig("positional").output_dir == "positional"


def test_grpo_config_unknown_argument_is_a_type_error_with_a_suggestion():
    with pytest.raises(TypeError, match=r"'learnig_rate' \(did you mean 'learning_rate'\?\)"):
        GRPOConfig(learnig_rate=1e-6)
    with pytest.raises(TypeError, match="'no_such_option'"):
        GRPOConfig(no_such_option=1)


def test_grpo_config_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match=r"grpo\.num_generations: expected an integer"):
        GRPOConfig(num_generations="eight")
    with pytest.raises(ConfigError, match=r"loss_type.*not one of"):
        GRPOConfig(loss_type="ppo")


def test_grpo_config_arguments_without_effect_warn_once_naming_each():
    with pytest.warns(UserWarning) as record:
        args = GRPOConfig(dataloader_num_workers=4, eval_delay=2, torch_compile=True, learning_rate=1e-6)
    assert len(record) == 1
    message = str(record[0].message)
    for name in ("dataloader_num_workers=4", "eval_delay=2", "torch_compile=True"):
        assert name in message
    assert "learning_rate" not in message
    assert args.dataloader_num_workers == 4  # kept, readable like on TRL's config
    assert args.ignored_arguments == {"dataloader_num_workers": 4, "eval_delay": 2, "torch_compile": True}


def test_grpo_config_cast_lm_head_to_fp32_is_named_with_why_logits_are_float32_already():
    with pytest.warns(UserWarning, match=r"cast_lm_head_to_fp32=True \(the LM head's logits are always computed in "
                                         r"float32.*it acts on trainer.model only"):
        GRPOConfig(cast_lm_head_to_fp32=True)


@pytest.mark.parametrize("tied", [False, True])
def test_cast_lm_head_to_fp32_gives_trainer_model_a_float32_head_as_trl(tmp_path, tied):
    """TRL's `cast_lm_head_to_fp32`: `trainer.model.lm_head.weight` is float32 and so are its logits; a tied input
    embedding still outputs the model's dtype (the decoder runs in bf16); without the setting the head is bf16."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from engine.models.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ids = torch.tensor([[1, 2, 3]])
    for cast in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = GRPOConfig(output_dir=str(tmp_path / f"run{cast}"), per_device_train_batch_size=8,
                              num_generations=4, max_steps=1, cast_lm_head_to_fp32=cast)
        trainer = GRPOTrainer(model=model if cast else AutoModelForCausalLM.from_config(config).to(torch.bfloat16),
                              reward_funcs=reward_len, args=args, train_dataset=_prompts(), processing_class=tokenizer)
        policy = trainer.model
        expected = torch.float32 if cast else torch.bfloat16
        assert policy.lm_head.weight.dtype == expected
        assert policy(ids).logits.dtype == expected
        assert policy.get_input_embeddings()(ids).dtype == torch.bfloat16
        assert (policy.lm_head.weight is policy.get_input_embeddings().weight) == tied


def test_grpo_config_never_prints_a_hub_token():
    with pytest.warns(UserWarning) as record:
        args = GRPOConfig(hub_token="hf_secret123")
    assert "hf_secret123" not in str(record[0].message) and "hf_secret123" not in repr(args)


def test_grpo_config_use_vllm_true_is_what_runs_and_does_not_warn():
    _config(use_vllm=True, vllm_mode="colocate")
    with pytest.warns(UserWarning, match="use_vllm=False.*always uses vLLM"):
        GRPOConfig(use_vllm=False)


@pytest.mark.parametrize("name, value", [("push_to_hub", True), ("load_best_model_at_end", True),
                                         ("neftune_noise_alpha", 5.0)])
def test_grpo_config_refuses_features_it_does_not_have(name, value):
    with pytest.raises(NotImplementedError, match=name):
        GRPOConfig(**{name: value})
    _config(**{name: None if name == "neftune_noise_alpha" else False})  # TRL's default is fine


@pytest.mark.parametrize("kwargs, dtype", [({"bf16": True}, "bfloat16"), ({"fp16": True}, "float16"),
                                           ({"bf16": False}, "float32"), ({"bf16": False, "fp16": False}, "float32"),
                                           ({}, "bfloat16"), ({"model_init_kwargs": {"dtype": "float32"}}, "float32"),
                                           ({"model_init_kwargs": {"torch_dtype": "auto"}}, "bfloat16")])
def test_grpo_config_precision_flags_choose_the_model_dtype(kwargs, dtype):
    args = _config(**kwargs)
    assert args.to_engine_config().model.dtype == dtype
    assert args.bf16 == (dtype == "bfloat16")


def test_grpo_config_conflicting_precisions_are_an_error():
    with pytest.raises(ValueError, match="exclusive"):
        GRPOConfig(bf16=True, fp16=True)
    with pytest.raises(ValueError, match="conflicting precisions"):
        GRPOConfig(bf16=True, model_init_kwargs={"dtype": "float32"})


@pytest.mark.parametrize("attn, implementation", [(None, "auto"), ("eager", "eager"), ("sdpa", "auto"),
                                                  ("flash_attention_2", "auto")])
def test_grpo_config_attn_implementation_chooses_the_core_attention(attn, implementation):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # translated, not in the no-effect warning
        args = _config(model_init_kwargs={"attn_implementation": attn} if attn else None)
    assert args.to_engine_config().model.attention_implementation == implementation


def test_grpo_config_router_aux_loss_coef_is_the_moe_aux_loss_coefficient():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # translated, not in the no-effect warning
        assert GRPOConfig(router_aux_loss_coef=0.01).to_engine_config().model.moe_aux_loss_coeff == 0.01
        assert GRPOConfig(router_aux_loss_coef=None).to_engine_config().model.moe_aux_loss_coeff is None
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01 means moe_aux_loss_coeff=0.01"):
        GRPOConfig(router_aux_loss_coef=0.01, moe_aux_loss_coeff=0.02)


def test_grpo_config_translates_trl_value_forms():
    args = _config(max_steps=20, warmup_steps=0.1, logging_steps=0.25, save_steps=10.0, report_to="none",
                   lr_scheduler_type="constant_with_warmup", chat_template_kwargs='{"enable_thinking": false}',
                   vllm_importance_sampling_cap=2.0, scale_rewards=False, optim="adamw_torch_fused",
                   pad_to_multiple_of="auto", model_init_kwargs={"trust_remote_code": True})
    cfg = args.to_engine_config()
    assert (cfg.optimizer.warmup_ratio, cfg.optimizer.warmup_steps) == (0.1, 0)
    assert (cfg.logging.logging_steps, cfg.checkpoint.save_steps) == (5, 10)
    assert cfg.logging.report_to == [] and cfg.optimizer.lr_scheduler_type == "constant"
    assert cfg.generation.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.grpo.vllm_importance_sampling_clip_max == 2.0 and cfg.grpo.scale_rewards == "none"
    assert cfg.optimizer.optim == "adam" and cfg.train.pad_to_multiple_of is None and cfg.model.trust_remote_code
    assert _config(report_to=["tensorboard"]).report_to == ["tensorboard"]
    assert _config(report_to="all").report_to == ["tensorboard", "wandb"]


@pytest.mark.parametrize("kwargs, match", [({"logging_steps": 0.5}, "needs max_steps"),
                                           ({"warmup_steps": 0.1, "warmup_ratio": 0.2}, "was given too"),
                                           ({"vllm_importance_sampling_cap": 2.0,
                                             "vllm_importance_sampling_clip_max": 4.0}, "was given too"),
                                           ({"report_to": "mlflow"}, "not supported"),
                                           ({"lr_scheduler_type": "polynomial"}, "available here"),
                                           ({"optim": "adafactor"}, "AdamW"),
                                           ({"optim": "adamw_torch_4bit"}, "4- / 8-bit Adam states are not built"),
                                           ({"optim": "adamw_torch_8bit"}, "optimizer_state_dtype='bfloat16'")])
def test_grpo_config_refuses_values_it_cannot_honour(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kwargs)


def test_grpo_config_attribute_assignment_updates_and_checks():
    args = _config(max_steps=3)
    args.max_steps = 5
    args.beta = 0.1
    assert args.to_engine_config().train.max_steps == 5 and args.to_engine_config().grpo.beta == 0.1
    with pytest.raises(ConfigError):
        args.num_generations = "many"
    assert args.num_generations == 8  # a rejected assignment leaves the config as it was
    with pytest.raises(TypeError, match="did you mean 'max_steps'"):
        args.max_step = 4


def test_trl_log_level_info_or_debug_turns_verbose_logging_on_and_passive_leaves_it():
    assert GRPOConfig(log_level="info").to_engine_config().logging.verbose is True
    assert GRPOConfig(log_level="debug").verbose is True
    assert GRPOConfig(log_level="passive", verbose=True).verbose is True
    assert GRPOConfig(log_level="warning").verbose is False and GRPOConfig().verbose is False
    with pytest.raises(ValueError, match="log_level='loud'"):
        GRPOConfig(log_level="loud")
    with pytest.raises(ValueError, match="log_level"):
        GRPOConfig(log_level="error", verbose=True)


def test_grpo_config_takes_every_trl_argument_and_trl_defaults_mean_engine_defaults():
    trl = pytest.importorskip("trl")
    trl_fields = dataclasses.fields(trl.GRPOConfig)
    missing = [f.name for f in trl_fields if f.name not in known_argument_names()]
    assert not missing, f"TRL arguments GRPOConfig does not accept: {missing}"
    defaults = {}
    for f in trl_fields:
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    with pytest.warns(UserWarning):
        args = GRPOConfig(**defaults)
    ours, engine = config_to_dict(args.to_engine_config()), config_to_dict(EngineConfig())
    different = {f"{s}.{k}": v for s in ours for k, v in ours[s].items() if v != engine[s][k]}
    assert different == {"train.output_dir": "trainer_output"}


# ---------------------------------------------------------------------------------------------------------------
# GRPOTrainer: resolving inputs and refusals (no engine start)


def test_trainer_builds_the_engine_config_from_its_inputs(tmp_path):
    trainer = GRPOTrainer(model=TINY, reward_funcs=[reward_len, "think_format"], args=_small_args(tmp_path),
                          train_dataset=_prompts(answer="1"))
    cfg = trainer.engine_config
    assert cfg.model.name_or_path == TINY
    assert cfg.reward.reward_funcs == [f"{__name__}:reward_len", "engine.train.builtin_rewards:think_format_reward"]
    assert trainer.reward_func_names == ["reward_len", "think_format_reward"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0] and trainer.reward_weights.dtype == torch.float32  # TRL's
    weighted = GRPOTrainer(model=TINY, reward_funcs=[reward_len, "think_format"], train_dataset=_prompts(answer="1"),
                           args=_small_args(tmp_path, reward_weights=[0.5, 2.0]))
    assert weighted.reward_weights.tolist() == [0.5, 2.0]
    assert cfg.data.dataset_test_split is None  # no eval_dataset: no held-out evaluation
    with_eval = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path),
                            train_dataset=_prompts(), eval_dataset=_prompts(4))
    assert with_eval.engine_config.data.dataset_test_split is not None


def test_trainer_default_args_are_trls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, train_dataset=_prompts(16))
    assert trainer.args.output_dir == "builtin-tiny-qwen2-arith-GRPO"


def test_trainer_checks_the_batch_geometry_before_starting_with_trls_message(tmp_path):
    with pytest.raises(ValueError, match=r"generation_batch_size \(6\) must be divisible by num_generations \(4\)\. "
                                         r"Given the current generation batch size, the valid values for the number "
                                         r"of generations are: \[2, 3, 6\]"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path, per_device_train_batch_size=6),
                    train_dataset=_prompts())
    with pytest.raises(ValueError, match=r"generation_batch_size \(12\) must be divisible by the global batch size "
                                         r"\(8\)"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path, generation_batch_size=12),
                    train_dataset=_prompts())
    with pytest.raises(ValueError, match="'generation_batch_size' and 'steps_per_generation' can not be both "
                                         "configured at the same time"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, train_dataset=_prompts(),
                    args=_small_args(tmp_path, generation_batch_size=16, steps_per_generation=2))
    with pytest.raises(ValueError, match="GRPO requires at least 2 generations per prompt to calculate the "
                                         "advantages. You provided 1, which is less than the minimum required"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path, num_generations=1),
                    train_dataset=_prompts())


def test_trainer_reward_weights_must_match_the_functions(tmp_path):
    with pytest.raises(ValueError, match=r"reward weights \(3\) must match number of reward functions \(1\)"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path, reward_weights=[1.0, 1.0, 1.0]),
                    train_dataset=_prompts())


def test_trainer_unknown_reward_name_fails_before_training(tmp_path):
    from engine.train.rewards import RewardFunctionError

    with pytest.raises(RewardFunctionError, match="accurcy.*Did you mean 'accuracy'"):
        GRPOTrainer(model=TINY, reward_funcs="accurcy", args=_small_args(tmp_path), train_dataset=_prompts())


@pytest.mark.parametrize("kwargs, error, match", [
    ({"peft_config": object()}, ValueError, "only peft.LoraConfig"),
    ({"optimizers": (object(), None)}, NotImplementedError, "distributed optimizer"),
    ({"quantization_config": object()}, NotImplementedError, "quantization"),
    ({"processing_class": object()}, NotImplementedError, "tokenizer"),
])
def test_trainer_refuses_what_this_engine_does_not_do(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path), train_dataset=_prompts(), **kwargs)


def test_trainer_refuses_bad_agentic_inputs_at_construction_naming_the_culprit(tmp_path):
    from engine.models.tiny_model import TOOL_CHAT_TEMPLATE, build_tiny_tokenizer

    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: the key
        """
        return key

    def undocumented(key: str) -> str:
        return key

    class NoReset:
        pass

    make = lambda **kw: GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path),  # noqa: E731
                                    train_dataset=_prompts(), **kw)
    with pytest.raises(ValueError, match="tool 'undocumented'.*no docstring"):
        make(tools=[lookup, undocumented])
    with pytest.raises(TypeError, match="NoReset has no reset"):
        make(environment_factory=NoReset)
    plain = build_tiny_tokenizer()  # the builtin template: no tools, no tool role
    with pytest.raises(ValueError, match="chat template of builtin:tiny-qwen2-arith.*cannot render tool calls"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path), train_dataset=_prompts(),
                    processing_class=plain, tools=[lookup])
    with pytest.raises(ValueError, match="rollout_func builds whole rollouts"):
        make(tools=[lookup], rollout_func=lambda prompts, trainer: {})
    with pytest.raises(ValueError, match="environment_factory without train_dataset.*max_steps"):
        GRPOTrainer(model=TINY, args=_small_args(tmp_path, max_steps=-1), environment_factory=dict)
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        GRPOTrainer(model=TINY, args=_small_args(tmp_path), environment_factory={"a": dict, "b": dict})
    tool_ready = build_tiny_tokenizer()
    tool_ready.chat_template = TOOL_CHAT_TEMPLATE
    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path), train_dataset=_prompts(),
                          processing_class=tool_ready, tools=[lookup])
    assert trainer._agentic.loop_inputs["tools"] == [lookup] and trainer.tools == [lookup]  # TRL's trainer.tools

    class Shelf:
        def reset(self, **row) -> None:
            return None

        def fetch(self, key: str) -> str:
            """Fetch a key.

            Args:
                key: the key
            """
            return key

        def get_reward(self) -> float:
            return 1.0

    with_env = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path, reward_weights=[0.5]),
                           train_dataset=_prompts(), processing_class=tool_ready, tools=[lookup],
                           environment_factory=Shelf)
    assert [t.__name__ for t in with_env.tools] == ["lookup", "fetch"]  # get_reward / reset are not tools
    assert with_env.reward_func_names == ["reward_len", "Shelf"] and with_env.reward_weights.tolist() == [0.5, 1.0]


def test_trainer_refuses_split_dicts_for_training_and_streams_without_max_steps(tmp_path):
    iterable = _prompts().to_iterable_dataset()
    with pytest.raises(ValueError, match=r"IterableDataset.*max_steps has to be set"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path, max_steps=-1),
                    train_dataset=iterable)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"Iterable datasets require `dispatch_batches"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, train_dataset=iterable,
                    args=GRPOConfig(output_dir=str(tmp_path), accelerator_config={"dispatch_batches": True}))
    with pytest.raises(TypeError, match=r"dataset\['train'\]"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path),
                    train_dataset=datasets.DatasetDict({"train": _prompts()}))
    with pytest.raises(ValueError, match="no 'prompt' column.*rename_column"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path),
                    train_dataset=datasets.Dataset.from_dict({"question": ["a"]}))
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path))


def test_trainer_refuses_trls_own_config_with_the_fix(tmp_path):
    from types import SimpleNamespace

    with pytest.raises(TypeError, match="from engine import GRPOConfig"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=SimpleNamespace(output_dir="x"), train_dataset=_prompts())


def test_trainer_hub_model_offline_and_not_cached_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(ValueError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        GRPOTrainer(model="no-such-org/no-such-model", reward_funcs=reward_len, args=_small_args(tmp_path),
                    train_dataset=_prompts())
    with pytest.raises(ValueError, match="no such local directory"):
        GRPOTrainer(model=str(tmp_path / "missing"), reward_funcs=reward_len, args=_small_args(tmp_path),
                    train_dataset=_prompts())


def test_trainer_saves_a_model_object_and_loads_it_from_output_dir(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.tiny_model import resolve_builtin_model

    source = resolve_builtin_model(TINY, tmp_path / "cache")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(source), AutoTokenizer.from_pretrained(source)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=_small_args(tmp_path), train_dataset=_prompts(),
                          processing_class=tokenizer)
    saved = tmp_path / "run" / INITIAL_MODEL_DIR
    assert trainer.engine_config.model.name_or_path == str(saved)
    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert (a == b).all(), name
    assert AutoTokenizer.from_pretrained(saved).chat_template == tokenizer.chat_template
    # before train(), save_model writes the model as given (TRL saves the current weights)
    trainer.save_model(str(tmp_path / "export"))
    assert (tmp_path / "export" / "config.json").is_file() and not (tmp_path / "run" / FINAL_MODEL_DIR).exists()


def test_assigning_trainer_model_replaces_the_policy_or_says_why_it_cannot(tmp_path):
    """TRL's (HF Trainer's) `trainer.model = m` before train(): m's weights are what the engine loads; a stand-in
    object (TRL's rollout_func tests assign a SimpleNamespace) is refused, naming the type."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    from engine.models.tiny_model import resolve_builtin_model

    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path), train_dataset=_prompts())
    with pytest.raises(TypeError, match="trainer.model must be a transformers PreTrainedModel, got SimpleNamespace"):
        trainer.model = SimpleNamespace(training=True)
    assert trainer.engine_config.model.name_or_path == TINY  # a refused assignment changed nothing
    replacement = AutoModelForCausalLM.from_pretrained(resolve_builtin_model(TINY, tmp_path / "cache"))
    with torch.no_grad():
        replacement.lm_head.weight.mul_(0.5)
    trainer.model = replacement
    saved = tmp_path / "run" / INITIAL_MODEL_DIR
    assert trainer.engine_config.model.name_or_path == str(saved) and trainer.model is replacement
    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    assert torch.equal(reloaded.lm_head.weight, replacement.lm_head.weight)
    trainer._trained = True
    with pytest.raises(RuntimeError, match="cannot be replaced after train"):
        trainer.model = replacement


def test_trainer_gives_a_reward_model_its_processing_class(tmp_path):
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from engine.models.tiny_model import resolve_builtin_model
    from engine.train.rewards import RewardModelReward

    tokenizer = AutoTokenizer.from_pretrained(resolve_builtin_model(TINY, tmp_path / "cache"))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    reward_model = Qwen2ForSequenceClassification(config).eval()
    trainer = GRPOTrainer(model=TINY, reward_funcs=[reward_len, reward_model], args=_small_args(tmp_path),
                          train_dataset=_prompts(), reward_processing_classes=[None, tokenizer])
    scorer = trainer.reward_funcs[1]
    assert isinstance(scorer, RewardModelReward) and scorer.tokenizer is tokenizer
    values = scorer(prompts=["Question: what is 1 + 1? Answer:"], completions=[" 2"])
    with torch.inference_mode():
        ids = tokenizer("Question: what is 1 + 1? Answer: 2", return_tensors="pt", add_special_tokens=False)
        expected = reward_model(**ids).logits[0, 0].item()
    assert values[0] == pytest.approx(expected, abs=1e-5)


def test_load_prompts_takes_an_in_memory_dataset_with_its_columns(tmp_path):
    from transformers import AutoTokenizer

    from engine.config import DataConfig, GenerationConfig
    from engine.models.tiny_model import resolve_builtin_model
    from engine.train.data import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(resolve_builtin_model(TINY, tmp_path / "cache"))
    dataset = _prompts(3, answer="1", task="arithmetic")
    data_cfg = DataConfig(dataset_name="builtin:arithmetic", dataset_test_split=None)
    prompts = load_prompts(data_cfg, tokenizer, GenerationConfig(), split="test", dataset=dataset)
    assert len(prompts) == 3  # the dataset wins over the config (and its null test split)
    batch = prompts.select([2, 0])
    assert batch.prompts == [dataset[2]["prompt"], dataset[0]["prompt"]]
    assert batch.columns == {"answer": ["1", "1"], "task": ["arithmetic", "arithmetic"]}
    assert load_prompts(data_cfg, tokenizer, GenerationConfig(), split="test") is None


def test_training_loss_is_the_mean_over_this_runs_steps():
    from engine.api.trl_trainer import _mean_loss, _new_records

    old = [{"step": 1, "loss": 9.0}, {"step": 2, "loss": 9.0}]
    assert _new_records(old, old + [{"step": 1, "loss": 1.0}]) == [{"step": 1, "loss": 1.0}]
    resumed = [old[0], {"step": 2, "loss": 2.0}, {"step": 3, "loss": 3.0}]  # resumed after step 1: step 2 redone
    assert _new_records(old, resumed) == resumed[1:]
    # records logged every 2 steps weigh the 2 steps they cover
    assert _mean_loss([{"step": 2, "loss": 1.0}, {"step": 3, "loss": 4.0}, {"step": 4}]) == pytest.approx(2.0)
    assert _mean_loss([{"step": 12, "loss": 1.0}, {"step": 13, "loss": 4.0}], start_step=10) == pytest.approx(2.0)


def test_final_record_is_hfs_last_log_history_entry():
    """HF's Trainer ends log_history with train_runtime, train_samples_per_second, train_steps_per_second,
    total_flos, train_loss, epoch, step (in that order); a resumed run counts only its own steps."""
    from engine.api.trl_trainer import final_record

    history = [{"loss": 1.0, "epoch": 0.25, "step": 11}, {"loss": 3.0, "epoch": 0.5, "step": 12}]
    record = final_record(history, steps=12, start_step=10, runtime_s=4.0, samples_per_step=16, total_flos=7.0)
    assert list(record) == ["train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
                            "train_loss", "epoch", "step"]
    assert record == {"train_runtime": 4.0, "train_samples_per_second": 8.0, "train_steps_per_second": 0.5,
                      "total_flos": 7.0, "train_loss": 2.0, "epoch": 0.5, "step": 12}
    empty = final_record([], steps=12, start_step=12, runtime_s=0.0, samples_per_step=16, total_flos=0.0)
    assert empty == {"train_runtime": 0.0, "total_flos": 0.0, "train_loss": 0.0, "step": 12}  # as HF: no rates at 0 s


SPAWNING_SCRIPT = '''
import contextlib, multiprocessing, pathlib, sys, time
from engine.api.spawn_guard import spawn_children_skip_main_script
with pathlib.Path(sys.argv[1]).open("a") as f:
    f.write("script ran\\n")
guard = spawn_children_skip_main_script() if sys.argv[2] == "guarded" else contextlib.nullcontext()
with guard:
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
'''


@pytest.mark.parametrize("mode, runs", [("guarded", 1), ("unguarded", 2)])
def test_spawn_children_do_not_rerun_a_flat_training_script(tmp_path, mode, runs):
    """A library may spawn a process while training runs; a flat TRL script (no __main__ guard) must not run twice. The
    script imports the guard's own module (standard library only), so each run of it starts in well under a second;
    `GRPOTrainer.train` holds this same guard."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script, marker = tmp_path / "flat_script.py", tmp_path / "runs.txt"
    script.write_text(SPAWNING_SCRIPT)
    repo = str(Path(__file__).resolve().parents[2])
    subprocess.run([sys.executable, str(script), str(marker), mode], cwd=tmp_path, capture_output=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": repo})
    assert marker.read_text().count("script ran") == runs
    from engine.api import spawn_guard, trl_trainer

    assert trl_trainer.spawn_children_skip_main_script is spawn_guard.spawn_children_skip_main_script


def shortest_first(group_completions, group_rewards, **kwargs):
    return [[-len(c) for c in group] for group in group_completions]


class GroupFilter:
    """TRL's GFPO guide's filter: a class defined in the user's script, passed as an instance (scores by index)."""

    def __call__(self, group_completions, group_rewards, **kwargs):
        return [[float(j) for j in range(len(g))] for g in group_completions]


def test_hook_fields_keep_any_callable_in_memory_and_record_a_description():
    import json

    group_filter, curriculum = GroupFilter(), lambda prompts, completions, rewards, metas: prompts
    args = _config(num_remains_in_group=2, group_filter_func=group_filter, dynamic_prompts_fn=curriculum)
    assert args.group_filter_func is group_filter and args.dynamic_prompts_fn is curriculum  # as on TRL's config
    assert args.in_memory_callables == {"group_filter_func": group_filter, "dynamic_prompts_fn": curriculum}
    cfg = args.to_engine_config()
    assert cfg.grpo.group_filter_func == f"{__name__}:GroupFilter()"
    assert cfg.data.dynamic_prompts_fn == (f"{__name__}:test_hook_fields_keep_any_callable_in_memory_and_record_a_"
                                           "description.<locals>.<lambda>")
    json.dumps(args.to_dict())  # the resolved config (and checkpoints) stay plain data
    assert args.replace(seed=3).in_memory_callables == args.in_memory_callables
    # a module-level function is recorded by its import path; the config-file string form stays a string
    assert _config(group_filter_func=shortest_first).to_engine_config().grpo.group_filter_func == (
        f"{__name__}:shortest_first")
    by_name = _config(dynamic_prompts_fn="my_curricula:harder_first")
    assert by_name.dynamic_prompts_fn == "my_curricula:harder_first" and by_name.in_memory_callables == {}


def test_trainer_hands_the_hook_objects_to_the_engine_also_on_resume(tmp_path, monkeypatch):
    import engine.train.loop

    calls = []

    def fake_train(cfg, **kwargs):
        calls.append((cfg, kwargs))
        return {"steps": 0}

    monkeypatch.setattr(engine.train.loop, "train", fake_train)
    curriculum = lambda prompts, completions, rewards, metas: prompts  # noqa: E731 - a lambda on purpose
    for resume in (None, True):
        trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, train_dataset=_prompts(),
                              args=_small_args(tmp_path, num_remains_in_group=2, dynamic_prompts_fn=curriculum),
                              group_filter_func=shortest_first)
        trainer.train(resume_from_checkpoint=resume)
    for cfg, kwargs in calls:
        assert kwargs["group_filter_func"] is shortest_first and kwargs["dynamic_prompts_fn"] is curriculum
        assert cfg.grpo.group_filter_func == f"{__name__}:shortest_first"
    assert calls[1][0].checkpoint.resume_from_checkpoint == "latest"


def test_gfpo_names_import_from_engine_and_from_trls_experimental_path(tmp_path):
    from engine import GFPOConfig, GFPOTrainer
    from engine.experimental import gfpo

    assert (gfpo.GFPOConfig, gfpo.GFPOTrainer) == (GFPOConfig, GFPOTrainer)
    assert issubclass(GFPOConfig, GRPOConfig) and issubclass(GFPOTrainer, GRPOTrainer)
    args = GFPOConfig(output_dir=str(tmp_path / "run"), num_remains_in_group=2, num_generations=4,
                      per_device_train_batch_size=8, max_steps=2)
    assert args.num_remains_in_group == 2 and args.to_engine_config().grpo.num_remains_in_group == 2
    assert isinstance(args.replace(seed=1), GFPOConfig) and repr(args).startswith("GFPOConfig(")
    group_filter = GroupFilter()  # TRL's guide: the filter is a trainer argument
    trainer = GFPOTrainer(model=TINY, reward_funcs=reward_len, args=args, train_dataset=_prompts(),
                          group_filter_func=group_filter)
    assert trainer.args.group_filter_func is group_filter
    assert trainer.engine_config.grpo.group_filter_func == f"{__name__}:GroupFilter()"


@pytest.mark.parametrize("trainer_name", ["GRPOTrainer", "GFPOTrainer"])
def test_gfpo_needs_a_filter_and_warns_about_an_unused_one(tmp_path, trainer_name):
    import engine

    trainer_class = getattr(engine, trainer_name)
    with pytest.raises(ConfigError, match=r"num_remains_in_group=2 needs grpo.group_filter_func"):
        trainer_class(model=TINY, reward_funcs=reward_len, train_dataset=_prompts(),
                      args=_small_args(tmp_path, num_remains_in_group=2))
    with pytest.warns(UserWarning, match="group_filter_func is not used: num_remains_in_group is not set"):
        trainer_class(model=TINY, reward_funcs=reward_len, train_dataset=_prompts(), args=_small_args(tmp_path),
                      group_filter_func=GroupFilter())


# ---------------------------------------------------------------------------------------------------------------
# TRL's trainer surface without training: attributes, callbacks, the evaluation schedule, streams


def _recorder_class():
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_init_end(self, args, state, control, **kwargs):
            self.events.append(("on_init_end", type(state).__name__, type(control).__name__, args.output_dir))

    return Recorder


def test_trainer_attributes_and_callback_list_as_trl(tmp_path):
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PrinterCallback, TrainerState

    recorder_cls = _recorder_class()
    recorder = recorder_cls()
    args = _small_args(tmp_path)
    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=args, train_dataset=_prompts(),
                          callbacks=[recorder, PrinterCallback])
    assert recorder.events == [("on_init_end", "TrainerState", "TrainerControl", str(tmp_path / "run"))]
    assert isinstance(trainer.state, TrainerState) and trainer.state.global_step == 0
    assert trainer.state.max_steps == 2
    assert trainer.args is args and trainer.reward_funcs == [reward_len]
    assert trainer.reward_processing_classes == [None]
    assert trainer.ref_model is None  # beta = 0: no reference, as TRL
    assert isinstance(trainer.processing_class, PreTrainedTokenizerBase)
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names == ["FlowCallback", "Recorder", "PrinterCallback"]  # a class is instantiated, as HF
    assert trainer.pop_callback(PrinterCallback).__class__ is PrinterCallback
    trainer.remove_callback(recorder)
    trainer.add_callback(recorder_cls)
    assert [type(c).__name__ for c in trainer.callback_handler.callbacks] == ["FlowCallback", "Recorder"]
    model = trainer.model  # the initial weights, as a transformers model
    assert isinstance(model, PreTrainedModel) and trainer.model is model
    from safetensors.torch import load_file

    from engine.models.tiny_model import resolve_builtin_model

    saved = load_file(str(next(resolve_builtin_model(TINY, tmp_path / "run" / "models").glob("*.safetensors"))))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(model.get_parameter(name), saved[name])


def test_trainer_model_object_is_the_given_object(tmp_path):
    from transformers import AutoModelForCausalLM

    from engine.models.tiny_model import resolve_builtin_model

    source = resolve_builtin_model(TINY, tmp_path / "cache")
    model = AutoModelForCausalLM.from_pretrained(source)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=_small_args(tmp_path), train_dataset=_prompts())
    assert trainer.model is model


def test_trainer_evaluation_schedule_checks(tmp_path):
    with pytest.raises(ValueError, match=r"eval_strategy='steps'.*no eval_dataset"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path, eval_strategy="steps"),
                    train_dataset=_prompts())
    with pytest.raises(ValueError, match=r"eval_strategy='sometimes'"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path, eval_strategy="sometimes"),
                    train_dataset=_prompts(), eval_dataset=_prompts())
    with pytest.raises(ValueError, match=r"per_device_eval_batch_size=3.*num_generations_eval=2"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, train_dataset=_prompts(), eval_dataset=_prompts(),
                    args=_small_args(tmp_path, eval_strategy="steps", per_device_eval_batch_size=3,
                                     num_generations_eval=2))
    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, train_dataset=_prompts(),
                          eval_dataset={"a": _prompts(2), "b": _prompts(3).to_iterable_dataset()},
                          args=_small_args(tmp_path, eval_strategy="steps", eval_steps=0.5, eval_on_start=True))
    schedule = trainer._hooks.schedule
    assert (schedule.strategy, schedule.steps, schedule.on_start) == ("steps", 1, True)  # 0.5 of max_steps=2
    assert {k: len(v) for k, v in trainer._eval_sets.items()} == {"a": 2, "b": 3}
    assert trainer.engine_config.data.dataset_test_split is None  # a dict is evaluated on the schedule only


def test_trainer_reads_a_stream_for_max_steps_in_its_order(tmp_path):
    rows = _prompts(40, answer="1")
    consumed = []

    def stream():
        for row in rows:
            consumed.append(row["prompt"])
            yield row

    iterable = datasets.IterableDataset.from_generator(stream)
    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path, max_steps=3),
                          train_dataset=iterable)
    assert consumed == []  # nothing read before train()
    assert trainer.engine_config.train.shuffle_dataset is False  # the stream's order, as TRL
    taken = trainer._train_rows()
    assert taken["prompt"] == rows["prompt"][:6]  # 3 rounds x 2 prompts (8 completions, 4 per prompt)
    assert len(consumed) <= 7 and trainer._train_rows() is taken


def test_final_record_takes_the_unlogged_last_steps_metrics_as_trl():
    """TRL merges the metrics of steps after the last logging step into the final record (log_history[-1]["reward"]);
    at a logging step the record stays where it is."""
    from engine.api.trl_trainer import merge_unlogged_step

    history = [{"loss": 1.0, "reward": 0.5, "epoch": 0.5, "step": 10, "elapsed_s": 3.0},
               {"loss": 2.0, "reward": 0.7, "rewards/f/mean": 0.7, "grad_norm": 1.0, "epoch": 0.6, "step": 12}]
    final = {"train_runtime": 4.0, "total_flos": 7.0, "train_loss": 1.5, "epoch": 0.6, "step": 12}
    kept, merged = merge_unlogged_step(history, final, logging_steps=10)
    assert kept == history[:1]
    assert list(merged) == ["train_runtime", "total_flos", "train_loss", "reward", "rewards/f/mean", "epoch", "step"]
    assert merged["reward"] == 0.7
    assert merge_unlogged_step(history, final, logging_steps=2) == (history, final)  # step 12: a logging step


def test_trainer_hooks_follow_the_eval_schedule_and_a_callbacks_should_log():
    """The hooks the loop calls (engine/train/hooks.py), driven by hand: eval_strategy='epoch' asks for an evaluation
    at a finished pass, 'steps' every eval_steps; a callback's should_log on a skipped step writes the window now."""
    from transformers import TrainerCallback

    from engine.api.trl_callbacks import EvalSchedule, TrainerHooks

    class AskLog(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_log = state.global_step == 3

    def hooks(**kw):
        args = _config(output_dir="x", max_steps=6, logging_steps=5, **kw)
        return TrainerHooks(args, [AskLog], None, {None: _prompts()}, EvalSchedule.from_args(args), world_size=1)

    by_epoch = hooks(eval_strategy="epoch")
    by_epoch.train_begin(0, 6)
    by_epoch.step_end(1)
    assert not by_epoch.round_end(1, None, 0.5).evaluate
    by_epoch.step_end(2)
    by_epoch.epoch_end(1.0)
    assert by_epoch.round_end(2, None, 1.0).evaluate
    by_steps = hooks(eval_strategy="steps", eval_steps=2)
    by_steps.train_begin(0, 6)
    asked, written = [], {"reward": 1.0, "step": 3}
    for step in (1, 2, 3):
        by_steps.step_end(step)
        decision = by_steps.round_end(step, None, step / 6, log_now=lambda: asked.append(1) or written)
        assert decision.evaluate == (step == 2)
    assert asked == [1] and by_steps.state.log_history == [{"reward": 1.0, "step": 3}]
    by_steps.step_end(6)
    assert by_steps.round_end(6, None, 1.0).stop  # max_steps: HF's should_training_stop


def test_trainer_flags_loaders_and_stream_settings_as_trl(tmp_path):
    """TRL's `entropy_coef` / `_entropy_bonus_enabled` / `aux_loss_enabled`, `args.accelerator_config`, the
    settings a streamed train set forces (dispatch_batches False, 0 workers) and the inspection loaders."""
    stream = _prompts().to_iterable_dataset()
    args = _small_args(tmp_path)
    with pytest.warns(UserWarning, match="dataloader_num_workers=4"):
        args.dataloader_num_workers = 4
    assert args.accelerator_config.dispatch_batches is None  # transformers' default
    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=args, train_dataset=stream)
    assert args.dataloader_num_workers == 0 and args.accelerator_config.dispatch_batches is False
    assert trainer.get_train_dataloader().num_workers == 0
    assert (trainer.entropy_coef, trainer._entropy_bonus_enabled, trainer.aux_loss_enabled) == (0.0, False, False)
    trainer.entropy_coef = 0.5  # TRL's attribute: before train() it is the run's coefficient
    assert (trainer.engine_config.grpo.entropy_coef, trainer.args.entropy_coef, trainer._entropy_bonus_enabled) == (
        0.5, 0.5, True)
    args = _small_args(tmp_path, entropy_coef=0.1, per_device_eval_batch_size=4)
    with pytest.warns(UserWarning):
        args.dataloader_num_workers = 2
    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=args, train_dataset=_prompts(),
                          eval_dataset=stream)
    assert (trainer.entropy_coef, trainer._entropy_bonus_enabled) == (0.1, True)
    loader = trainer.get_train_dataloader()
    assert loader.num_workers == 2 and args.dataloader_num_workers == 2  # a map-style train set keeps them
    assert trainer.get_eval_dataloader().num_workers == 0  # an iterable eval set: 0, not persisted
    loader.num_workers = 0
    assert [len(b) for b in loader] == [8] and next(iter(loader))[0] == _prompts()[0]
    with pytest.raises(TypeError, match="AcceleratorConfig has"):
        GRPOConfig(accelerator_config={"dispatch_batch": False})


def test_trainer_names_a_reward_pad_token_outside_the_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    from engine.models.tiny_model import resolve_builtin_model

    directory = resolve_builtin_model(TINY, tmp_path / "cache")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.pad_token = "<|not_a_token|>"
    with pytest.raises(ValueError, match=r"reward_processing_classes\[0\].pad_token = '<\|not_a_token\|>' is not in"):
        GRPOTrainer(model=TINY, reward_funcs=directory, args=_small_args(tmp_path), train_dataset=_prompts(),
                    reward_processing_classes=[tokenizer])


def test_trainer_model_refuses_a_checkpoint_larger_than_the_memory(tmp_path):
    from engine.api.trl_surface import check_fits_in_memory
    from engine.models.tiny_model import resolve_builtin_model

    directory = resolve_builtin_model(TINY, tmp_path / "cache")
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    check_fits_in_memory(directory, available_bytes=2 * size)
    with pytest.raises(MemoryError, match=r"trainer.model would load .* GiB .*from_pretrained\(.*device_map='auto'"):
        check_fits_in_memory(directory, available_bytes=size)


def test_save_model_before_train_with_peft_writes_the_initial_adapter(tmp_path):
    """TRL's `save_model()` of a PEFT model before `train()` writes the (initial) adapter, not the base: the adapter
    loads with peft onto the base, holds A as the run draws it (seeded by name, the run's seed) and B = 0, and the
    LM head of modules_to_save as loaded (PEFT's key); the output directory's other files stay."""
    from peft import LoraConfig, PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from engine.models.tiny_model import resolve_builtin_model
    from engine.policy.lora import initial_lora_a

    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_small_args(tmp_path), train_dataset=_prompts(),
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                 modules_to_save=["lm_head"]))
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / "keep.txt").write_text("x")
    trainer.save_model()
    out = tmp_path / "run"
    assert (out / "keep.txt").exists() and not (out / "model.safetensors").exists()
    tensors = load_file(out / "adapter_model.safetensors")
    assert len(tensors) == 4 * 2 * 2 + 1
    key = "base_model.model.model.layers.2.mlp.down_proj"
    torch.testing.assert_close(tensors[f"{key}.lora_A.weight"],
                               initial_lora_a(2, "down_proj", 4, 352, trainer.engine_config.train.seed), rtol=0, atol=0)
    assert all(not t.any() for k, t in tensors.items() if "lora_B" in k)
    base = AutoModelForCausalLM.from_pretrained(resolve_builtin_model(TINY, tmp_path / "cache"))
    torch.testing.assert_close(tensors["base_model.model.lm_head.weight"], base.lm_head.weight, rtol=0, atol=0)
    model = PeftModel.from_pretrained(base, out)
    assert model.peft_config["default"].r == 4 and sorted(model.peft_config["default"].target_modules) == [
        "down_proj", "q_proj"]
