"""TRL 1.16's `GRPOConfig` fields (its own and `transformers.TrainingArguments`'), with TRL's types and defaults.

Owns: `TRL_FIELDS` (name -> (type, default), in TRL's order), the names TRL's script dataclasses own
(`SCRIPT_OWNED`), and `declare_fields`, which turns a class into a dataclass over these fields and the engine's own
so that `transformers.HfArgumentParser` builds TRL's flags from it (types, choices, `--no_*` booleans, lists, help).
The types are the ones TRL's parser sees: enums as their values (`Literal`), `ParallelismConfig` as a dict or JSON
string (no accelerate import).

Must not: import trl (a test-only dependency), torch or transformers (importing `engine` stays light).

Test: tests/unit/test_trl_script.py compares the table with the installed trl's fields.
"""

import dataclasses
import typing
from typing import Any, Literal

_SCHEDULERS = Literal[
    'linear', 'cosine', 'cosine_with_restarts', 'polynomial', 'constant', 'constant_with_warmup', 'inverse_sqrt',
    'reduce_lr_on_plateau', 'cosine_with_min_lr', 'cosine_warmup_with_min_lr', 'warmup_stable_decay', 'greedy',
]
_OPTIMIZERS = Literal[
    'adamw_torch', 'adamw_torch_fused', 'adamw_torch_xla', 'adamw_torch_npu_fused', 'adafactor',
    'adamw_anyprecision', 'adamw_torch_4bit', 'adamw_torch_8bit', 'ademamix', 'sgd', 'adagrad', 'adamw_bnb_8bit',
    'adamw_8bit', 'ademamix_8bit', 'lion_8bit', 'lion_32bit', 'paged_adamw_32bit', 'paged_adamw_8bit',
    'paged_ademamix_32bit', 'paged_ademamix_8bit', 'paged_lion_32bit', 'paged_lion_8bit', 'rmsprop', 'rmsprop_bnb',
    'rmsprop_bnb_8bit', 'rmsprop_bnb_32bit', 'galore_adamw', 'galore_adamw_8bit', 'galore_adafactor',
    'galore_adamw_layerwise', 'galore_adamw_8bit_layerwise', 'galore_adafactor_layerwise', 'lomo', 'adalomo',
    'grokadamw', 'schedule_free_radam', 'schedule_free_adamw', 'schedule_free_sgd', 'apollo_adamw',
    'apollo_adamw_layerwise', 'stable_adamw',
]

TRL_FIELDS: dict[str, tuple[Any, Any]] = {
    'output_dir': (str | None, None),
    'per_device_train_batch_size': (int, 8),
    'num_train_epochs': (float, 3.0),
    'max_steps': (int, -1),
    'learning_rate': (float, 1e-06),
    'lr_scheduler_type': (_SCHEDULERS | str, 'linear'),
    'lr_scheduler_kwargs': (dict | str | None, None),
    'warmup_steps': (float, 0),
    'optim': (_OPTIMIZERS | str, 'adamw_torch_fused'),
    'optim_args': (str | None, None),
    'weight_decay': (float, 0.0),
    'adam_beta1': (float, 0.9),
    'adam_beta2': (float, 0.999),
    'adam_epsilon': (float, 1e-08),
    'optim_target_modules': (None | str | list[str], None),
    'gradient_accumulation_steps': (int, 1),
    'average_tokens_across_devices': (bool, True),
    'max_grad_norm': (float, 1.0),
    'label_smoothing_factor': (float, 0.0),
    'bf16': (bool | None, None),
    'fp16': (bool, False),
    'bf16_full_eval': (bool, False),
    'fp16_full_eval': (bool, False),
    'tf32': (bool | None, None),
    'gradient_checkpointing': (bool, True),
    'gradient_checkpointing_kwargs': (dict[str, Any] | str | None, None),
    'torch_compile': (bool, False),
    'torch_compile_backend': (str | None, None),
    'torch_compile_mode': (str | None, None),
    'use_liger_kernel': (bool, False),
    'liger_kernel_config': (dict[str, bool] | None, None),
    'use_cache': (bool, False),
    'neftune_noise_alpha': (float | None, None),
    'torch_empty_cache_steps': (int | None, None),
    'auto_find_batch_size': (bool, False),
    'logging_strategy': (Literal['no', 'steps', 'epoch'] | str, 'steps'),
    'logging_steps': (float, 10),
    'logging_first_step': (bool, False),
    'log_on_each_node': (bool, True),
    'logging_nan_inf_filter': (bool, True),
    'include_num_input_tokens_seen': (str | bool, 'no'),
    'log_level': (str, 'passive'),
    'log_level_replica': (str, 'warning'),
    'disable_tqdm': (bool | None, None),
    'report_to': (None | str | list[str], 'none'),
    'run_name': (str | None, None),
    'project': (str, 'huggingface'),
    'trackio_space_id': (str | None, None),
    'trackio_bucket_id': (str | None, None),
    'trackio_static_space_id': (str | None | Literal[False], None),
    'eval_strategy': (Literal['no', 'steps', 'epoch'] | str, 'no'),
    'eval_steps': (float | None, None),
    'eval_delay': (float, 0),
    'per_device_eval_batch_size': (int, 8),
    'prediction_loss_only': (bool, False),
    'eval_on_start': (bool, False),
    'eval_do_concat_batches': (bool, True),
    'eval_use_gather_object': (bool, False),
    'eval_accumulation_steps': (int | None, None),
    'include_for_metrics': (list[str], []),
    'batch_eval_metrics': (bool, False),
    'save_only_model': (bool, False),
    'save_strategy': (Literal['no', 'steps', 'epoch', 'best'] | str, 'steps'),
    'save_steps': (float, 500),
    'save_on_each_node': (bool, False),
    'save_total_limit': (int | None, None),
    'enable_jit_checkpoint': (bool, False),
    'push_to_hub': (bool, False),
    'hub_token': (str | None, None),
    'hub_private_repo': (bool | None, None),
    'hub_model_id': (str | None, None),
    'hub_strategy': (Literal['end', 'every_save', 'checkpoint', 'all_checkpoints'] | str, 'every_save'),
    'hub_always_push': (bool, False),
    'hub_revision': (str | None, None),
    'load_best_model_at_end': (bool, False),
    'metric_for_best_model': (str | None, None),
    'greater_is_better': (bool | None, None),
    'ignore_data_skip': (bool, False),
    'restore_callback_states_from_checkpoint': (bool, False),
    'full_determinism': (bool, False),
    'seed': (int, 42),
    'data_seed': (int | None, None),
    'use_cpu': (bool, False),
    'accelerator_config': (dict | str | None, None),
    'parallelism_config': (dict | str | None, None),
    'dataloader_drop_last': (bool, False),
    'dataloader_num_workers': (int, 0),
    'dataloader_pin_memory': (bool, True),
    'dataloader_persistent_workers': (bool, False),
    'dataloader_prefetch_factor': (int | None, None),
    'dataloader_multiprocessing_context': (str | None, None),
    'dataloader_in_order': (bool, True),
    'remove_unused_columns': (bool | None, False),
    'label_names': (list[str] | None, None),
    'train_sampling_strategy': (str, 'random'),
    'length_column_name': (str, 'length'),
    'ddp_find_unused_parameters': (bool | None, None),
    'ddp_bucket_cap_mb': (int | None, None),
    'ddp_broadcast_buffers': (bool | None, None),
    'ddp_static_graph': (bool | None, None),
    'ddp_backend': (str | None, None),
    'ddp_timeout': (int, 1800),
    'fsdp': (str | None, None),
    'fsdp_config': (dict[str, Any] | str | None, None),
    'deepspeed': (dict | str | None, None),
    'debug': (str | list[Literal['underflow_overflow', 'tpu_metrics_debug']], ''),
    'skip_memory_metrics': (bool, True),
    'do_train': (bool, False),
    'do_eval': (bool, False),
    'do_predict': (bool, False),
    'resume_from_checkpoint': (str | None, None),
    'local_rank': (int, -1),
    'model_init_kwargs': (dict[str, Any] | str | None, None),
    'trust_remote_code': (bool, False),
    'router_aux_loss_coef': (float | None, None),
    'disable_dropout': (bool, False),
    'cast_lm_head_to_fp32': (bool, False),
    'num_generations': (int | None, 8),
    'num_generations_eval': (int | None, None),
    'max_completion_length': (int | None, 512),
    'ds3_gather_for_generation': (bool, True),
    'shuffle_dataset': (bool | None, True),
    'pad_to_multiple_of': (int | str | None, 'auto'),
    'generation_batch_size': (int | None, None),
    'steps_per_generation': (int | None, None),
    'temperature': (float, 1.0),
    'top_p': (float, 1.0),
    'top_k': (int, 0),
    'min_p': (float | None, None),
    'generation_kwargs': (dict | str | None, None),
    'chat_template_kwargs': (dict | str | None, None),
    'repetition_penalty': (float, 1.0),
    'cache_implementation': (str | None, None),
    'use_vllm': (bool, False),
    'vllm_mode': (str, 'colocate'),
    'vllm_model_impl': (str, 'vllm'),
    'vllm_enable_sleep_mode': (bool, False),
    'vllm_structured_outputs_regex': (str | None, None),
    'vllm_server_base_url': (str | None, None),
    'vllm_server_host': (str, '0.0.0.0'),
    'vllm_server_port': (int, 8000),
    'vllm_server_timeout': (float, 240.0),
    'vllm_group_port': (int, 51216),
    'vllm_gpu_memory_utilization': (float, 0.3),
    'vllm_max_model_length': (int | None, None),
    'vllm_tensor_parallel_size': (int, 1),
    'beta': (float, 0.0),
    'num_iterations': (int, 1),
    'epsilon': (float, 0.2),
    'delta': (float | None, None),
    'epsilon_high': (float | None, None),
    'sapo_temperature_neg': (float, 1.05),
    'sapo_temperature_pos': (float, 1.0),
    'vespo_k_pos': (float, 2.0),
    'vespo_lambda_pos': (float, 3.0),
    'vespo_k_neg': (float, 3.0),
    'vespo_lambda_neg': (float, 2.0),
    'importance_sampling_level': (str, 'token'),
    'reward_weights': (list[float] | None, None),
    'multi_objective_aggregation': (str, 'sum_then_normalize'),
    'scale_rewards': (str, 'group'),
    'loss_type': (str, 'dapo'),
    'mask_truncated_completions': (bool, False),
    'sync_ref_model': (bool, False),
    'ref_model_mixup_alpha': (float, 0.6),
    'ref_model_sync_steps': (int, 512),
    'top_entropy_quantile': (float, 1.0),
    'entropy_coef': (float, 0.0),
    'use_adaptive_entropy': (bool, False),
    'entropy_coef_min': (float, 0.0),
    'entropy_coef_max': (float, 1.0),
    'entropy_coef_delta': (float, 0.005),
    'entropy_target': (float, 0.2),
    'max_tool_calling_iterations': (int | None, None),
    'vllm_importance_sampling_correction': (bool, True),
    'vllm_importance_sampling_mode': (str, 'sequence_mask'),
    'vllm_importance_sampling_clip_max': (float | None, 3.0),
    'vllm_importance_sampling_clip_min': (float | None, None),
    'off_policy_mask_threshold': (float | None, None),
    'use_bias_correction_kl': (bool, True),
    'log_completions': (bool, False),
    'log_multimodal': (bool, True),
    'num_completions_to_print': (int | None, None),
    'log_unique_prompts': (bool, False),
    'log_completions_hub_repo': (str | None, None),
    'use_transformers_continuous_batching': (bool, False),
    'transformers_continuous_batching_config': (dict | str | None, None),
    'use_transformers_paged': (bool, False),
    'vllm_importance_sampling_cap': (float | None, None),
}
"""TRL 1.16 GRPOConfig's fields: name -> (type as TRL's parser reads it, TRL's default)."""

SCRIPT_OWNED = frozenset({
    "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split",  # TRL's ScriptArguments
    "dtype", "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",  # TRL's ModelConfig
    "lora_target_parameters", "lora_modules_to_save", "use_rslora",
    "reward_funcs",  # trl/scripts/grpo.py's script arguments
})
"""Engine keywords whose names TRL's ScriptArguments / ModelConfig / grpo script arguments own: `GRPOConfig` takes
them as keywords but does not declare them as fields, so a parser over (ScriptArguments, GRPOConfig, ModelConfig)
has one flag per name (the command line maps the script's values onto them: engine/api/trl_script.py)."""


def trl_default(name: str) -> Any:
    """TRL's default of a TRL field (a fresh copy of a list)."""
    default = TRL_FIELDS[name][1]
    return list(default) if isinstance(default, list) else default


def engine_fields() -> dict[str, tuple[Any, Any]]:
    """The engine's flat fields that TRL's GRPOConfig lacks (tp_size, max_staleness, ...): name -> (type,
    engine default), without the script-owned names."""
    from engine.config import EngineConfig

    fields: dict[str, tuple[Any, Any]] = {}
    for section in dataclasses.fields(EngineConfig):
        cls = section.default_factory  # type: ignore[misc]
        hints, instance = typing.get_type_hints(cls), cls()
        for leaf in dataclasses.fields(cls):
            if leaf.name not in TRL_FIELDS and leaf.name not in SCRIPT_OWNED:
                fields[leaf.name] = (hints[leaf.name], getattr(instance, leaf.name))
    return fields


def declare_fields(cls: type, helps: dict[str, str]) -> type:
    """Make `cls` a dataclass over TRL's fields and the engine's (`helps`: name -> help text), keeping its own
    `__init__`, `__repr__` and attribute access: the class attributes dataclass would leave behind are removed, so
    reads still go through `cls.__getattr__`."""
    declared = {**TRL_FIELDS, **engine_fields()}
    cls.__annotations__ = {name: tp for name, (tp, _) in declared.items()}
    for name, (_, default) in declared.items():
        metadata = {"help": helps.get(name, "")}
        if isinstance(default, (list, dict)):
            value = dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=metadata)
        else:
            value = dataclasses.field(default=default, metadata=metadata)
        setattr(cls, name, value)
    dataclasses.dataclass(init=False, repr=False, eq=False)(cls)
    for name in declared:
        if name in cls.__dict__:
            delattr(cls, name)
    return cls


def defaults_of(cls: type) -> dict[str, Any]:
    """Every declared field's default: what a parser passes for a flag it was not given."""
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            for f in dataclasses.fields(cls)}
