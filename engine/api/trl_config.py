"""TRL's `GRPOConfig` over the engine's config tree: TRL 1.16's GRPOConfig / TrainingArguments keyword arguments
mapped onto the typed tree of engine/config.py.

Owns: turning TRL's flat keyword arguments into the tree (`config.find_field`: every leaf carries TRL's name, and the
engine's own knobs such as tp_size are accepted the same way), the table of TRL arguments that mean nothing here
(accepted, then named in one warning with the reason), the arguments refused with a message (push_to_hub, ...), the
TRL values that need translating, and the user hooks kept as objects (both listed in `GRPOConfig`'s docstring). A TRL
config at TRL's defaults is the engine's defaults (tested), except `output_dir`: `trainer_output`, as TRL.
`GFPOConfig` is TRL's experimental GFPO config (trl.experimental.gfpo, TRL <= 1.7.1): this one, `num_remains_in_group`
included.

Must not: import torch, Megatron, vLLM or trl (importing `engine` stays light; trl is a test-only dependency), or
change a value silently: every TRL argument either lands in a field, is named in the warning, or raises.

It is a dataclass (TRL's fields and the engine's, engine/api/trl_fields.py), so HfArgumentParser / TrlParser parse it
from flags and YAML recipes (engine/api/trl_script.py is the `grpo-engine grpo` command line).

Test: `pytest tests/unit/test_trl_api.py`, `pytest tests/unit/test_trl_script.py` (parsing).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import warnings
from typing import Any

from engine.api.trl_compat import vespo_importance_sampling_mode
from engine.api.trl_fields import TRL_FIELDS, declare_fields, defaults_of, trl_default
from engine.config import ConfigError, EngineConfig, build_config, config_to_dict, describe_callable, find_field

TRL_DEFAULT_OUTPUT_DIR = "trainer_output"
"""TRL's output directory when `GRPOConfig(output_dir=None)` (TrainingArguments' default)."""

# ---------------------------------------------------------------------------------------------------------------
# TRL 1.16 GRPOConfig / TrainingArguments names without a home in the engine's tree, by why


def _group(reason: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, reason)


NO_EFFECT: dict[str, str] = {
    **_group("Megatron owns precision, compilation and kernels here (model.dtype, kernels.loss_implementation)",
             "tf32", "torch_compile", "torch_compile_backend", "torch_compile_mode", "bf16_full_eval", "fp16_full_eval",
             "use_liger_kernel", "liger_kernel_config", "use_cache",
             "torch_empty_cache_steps", "auto_find_batch_size", "average_tokens_across_devices",
             "label_smoothing_factor", "optim_args", "optim_target_modules", "lr_scheduler_kwargs"),
    **_group("Megatron owns the layout and the devices here (tp_size, pp_size, dp_size; CUDA when present)",
             "fsdp", "fsdp_config", "deepspeed", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
             "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend", "ddp_timeout", "accelerator_config",
             "parallelism_config", "local_rank", "use_cpu", "log_on_each_node", "save_on_each_node",
             "ds3_gather_for_generation", "full_determinism"),
    **_group("prompts are tokenized up front and batches sampled by the engine (seeded by seed)",
             "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory",
             "dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
             "dataloader_in_order", "remove_unused_columns", "label_names", "train_sampling_strategy",
             "length_column_name", "data_seed", "ignore_data_skip", "include_num_input_tokens_seen"),
    **_group("metrics always go to output_dir/metrics.jsonl and the progress display (plus report_to)",
             "logging_strategy", "logging_first_step", "logging_nan_inf_filter", "log_level_replica",
             "disable_tqdm", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
             "log_multimodal", "log_unique_prompts", "log_completions_hub_repo", "skip_memory_metrics", "debug"),
    **_group("evaluation reports TRL's metrics (reward, completions, eval_loss); no best-model tracking",
             "eval_delay", "prediction_loss_only", "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps",
             "include_for_metrics", "batch_eval_metrics", "metric_for_best_model", "greater_is_better"),
    **_group("checkpoints are written every save_steps (0: only at the end)",
             "save_strategy", "save_only_model", "enable_jit_checkpoint", "restore_callback_states_from_checkpoint"),
    **_group("nothing is pushed during training; trainer.push_to_hub() reads hub_model_id / hub_token / "
             "hub_private_repo / hub_revision when called", "hub_token", "hub_private_repo", "hub_model_id",
             "hub_strategy", "hub_always_push", "hub_revision"),
    **_group("generation always uses vLLM here", "use_vllm", "cache_implementation",
             "use_transformers_continuous_batching", "transformers_continuous_batching_config",
             "use_transformers_paged"),
    **_group("script flags for HF's example scripts", "do_train", "do_eval", "do_predict"),
    **_group("the LM head's logits are always computed in float32 here (the fused kernel upcasts the hidden states "
             "and the model.dtype weight, whose float32 master copy the optimizer updates), so training is the same; "
             "it acts on trainer.model only: its lm_head float32 with float32 logits, as TRL's",
             "cast_lm_head_to_fp32"),
}
"""Accepted and named in one warning (the engine behaves as the reason says, whatever the value)."""

REFUSED: dict[str, str] = {
    "push_to_hub": "pushing during training is not supported; call trainer.push_to_hub() after train() (it uploads "
                   "the exported model with huggingface_hub)",
    "load_best_model_at_end": "there is no scheduled evaluation to pick a best model from",
    "neftune_noise_alpha": "NEFTune embedding noise is not implemented in the Megatron policy",
}
"""Accepted at TRL's default (a falsy value); anything else raises NotImplementedError with the reason."""

TRANSLATED: dict[str, str] = {
    "bf16": "model.dtype = bfloat16 (False: float32)",
    "fp16": "model.dtype = float16",
    "model_init_kwargs": "its dtype / torch_dtype -> model.dtype, trust_remote_code -> model.trust_remote_code, "
                         "attn_implementation -> model.attention_implementation (eager; any other: auto, SDPA where the layer allows it); other "
                         "keys are named in the no-effect warning",
    "vllm_importance_sampling_cap": "grpo.vllm_importance_sampling_clip_max (TRL's deprecated name)",
    "log_level": "'info' / 'debug' -> logging.verbose = true; 'warning' and quieter -> false; 'passive' leaves it",
    "gradient_checkpointing_kwargs": "torch.utils.checkpoint's use_reentrant / preserve_rng_state are named in the "
                                     "no-effect warning (Megatron's recompute always restores the RNG state and "
                                     "re-enters); other keys are refused",
    "router_aux_loss_coef": "model.moe_aux_loss_coeff (MoE load-balancing loss weight); None (TRL's default) is "
                            "the model config's router_aux_loss_coef, as TRL",
}
"""TRL names that map onto engine fields of another name (see `GRPOConfig._translate`), with what they become."""

TRAINER_ARGUMENTS: dict[str, tuple[Any, str]] = {
    "eval_strategy": ("no", "'steps' / 'epoch': GRPOTrainer evaluates its eval_dataset(s) during train() (TRL's eval "
                            "metrics, `eval_<name>_*` for a dict); 'no': only trainer.evaluate()"),
    "eval_steps": (None, "evaluate every eval_steps optimizer steps (a float < 1: a fraction of max_steps; None: "
                         "logging_steps)"),
    "eval_on_start": (False, "evaluate once before the first step"),
    "per_device_eval_batch_size": (8, "completions per evaluation step and rank: x world size must be a multiple of "
                                      "num_generations_eval; sets eval_steps_per_second"),
}
"""TRL arguments GRPOTrainer acts on itself (the evaluation schedule, engine/api/trl_callbacks.py `EvalSchedule`):
name -> (HF's default, what it does); they are not engine fields."""

CALLABLE_FIELDS = ("group_filter_func", "dynamic_prompts_fn")
"""Engine fields naming a user hook as `module:function`; a callable object is kept in memory and recorded by its
description (`config.describe_callable`)."""
_SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
"""TRL / transformers `lr_scheduler_type` -> the engine's (its `constant` honours warmup)."""
_REPORT_BACKENDS = ("tensorboard", "wandb")
_LOG_LEVELS = {"debug": True, "info": True, "warning": False, "error": False, "critical": False, "passive": False}
"""TRL's `log_level` -> `logging.verbose` (vLLM's INFO logs and the known-harmless warnings, engine/log_filters.py)."""


ACCELERATOR_DEFAULTS: dict[str, Any] = {"split_batches": False, "dispatch_batches": None, "even_batches": True,
                                        "use_seedable_sampler": True, "non_blocking": False,
                                        "gradient_accumulation_kwargs": None, "use_configured_state": False}
"""transformers' `AcceleratorConfig` fields and defaults: `args.accelerator_config` reads as such an object (the
values have no effect here; a streamed train_dataset sets dispatch_batches=False, as TRL: every rank reads it)."""


class AcceleratorSettings:
    """`args.accelerator_config` as transformers' `AcceleratorConfig` reads (attributes; `to_dict()`): the values
    given (a dict or JSON string) over transformers' defaults. No effect in this engine (named in the warning)."""

    def __init__(self, given: Any):
        if hasattr(given, "to_dict"):  # an AcceleratorSettings / AcceleratorConfig read back from a config
            given = given.to_dict()
        values = json.loads(given) if isinstance(given, str) else dict(given or {})
        unknown = sorted(set(values) - set(ACCELERATOR_DEFAULTS))
        if unknown:
            raise TypeError(f"GRPOConfig(accelerator_config=...): unknown key(s) {unknown}; transformers' "
                            f"AcceleratorConfig has {sorted(ACCELERATOR_DEFAULTS)}")
        self.__dict__.update({**ACCELERATOR_DEFAULTS, **values})

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict."""
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"AcceleratorSettings({self.__dict__})"


def known_argument_names() -> list[str]:
    """Every keyword `GRPOConfig` accepts: the engine's fields (TRL's names plus engine knobs) and TRL's others."""
    from engine.config import _FLAT_INDEX

    return sorted(set(_FLAT_INDEX) | set(NO_EFFECT) | set(REFUSED) | set(TRANSLATED) | set(TRAINER_ARGUMENTS))


# ---------------------------------------------------------------------------------------------------------------
# GRPOConfig


class GRPOConfig:
    """TRL's `GRPOConfig` over the engine's config tree.

    `GRPOConfig(output_dir=None, **kwargs)` takes TRL 1.16's GRPOConfig / TrainingArguments keywords and the
    engine's own knobs (tp_size, pp_size, vllm_tensor_parallel_size, loss_implementation, ...), by their flat names.
    Attributes read and write the engine fields of the same names (`args.learning_rate`, `args.max_steps = 5`);
    `to_engine_config()` returns the tree. Unknown names raise TypeError with a close match; TRL names with no
    effect here are kept (readable as attributes) and named in one UserWarning. Every TRL field reads back, TRL's
    default when not given.

    It is a dataclass over TRL 1.16's fields and the engine's (engine/api/trl_fields.py `declare_fields`), so
    transformers' `HfArgumentParser` and TRL's `TrlParser` build its flags (TRL's types, choices and defaults, the
    engine's docstrings as help) and construct it; given every field at once, only values that differ from the
    defaults count as given (`_explicit`). The engine names TRL's ScriptArguments / ModelConfig own (dtype, lora_*,
    dataset_*) stay keywords, not fields (`trl_fields.SCRIPT_OWNED`).

    Translated values: `bf16` / `fp16` / `model_init_kwargs["dtype"]` -> model.dtype, `warmup_steps` < 1 ->
    warmup_ratio, fractional `logging_steps` / `save_steps`, `report_to` forms, `lr_scheduler_type` and `optim`
    names, `pad_to_multiple_of="auto"`, JSON strings from TRL's command line, the deprecated
    `vllm_importance_sampling_cap`, `log_level` 'info' / 'debug' -> logging.verbose, `gradient_checkpointing_kwargs`
    (torch.utils.checkpoint's `use_reentrant` / `preserve_rng_state` named in the warning, other keys refused:
    `_translate_checkpointing_kwargs`), `router_aux_loss_coef` -> model.moe_aux_loss_coeff.

    The user hooks `group_filter_func` / `dynamic_prompts_fn`: any callable (a function of the user's script, a
    lambda, an instance) is kept as the object (`in_memory_callables`, handed to `engine.train.loop.train` by
    GRPOTrainer) while the tree records its description (`config.describe_callable`), so the resolved config and
    checkpoints stay plain data; a `module:function` string stays a string.
    """

    def __init__(self, output_dir: str | None = None, **kwargs: Any):
        kwargs = _explicit(type(self), {"output_dir": output_dir, **kwargs})
        output_dir = kwargs.pop("output_dir", None)
        given = {"output_dir": output_dir if output_dir is not None else TRL_DEFAULT_OUTPUT_DIR, **kwargs}
        object.__setattr__(self, "_kwargs", given)
        self._build(warn_names=list(given))

    # -- building ---------------------------------------------------------------------------------------------------

    def _build(self, warn_names: list[str]) -> None:
        given = dict(self._kwargs)
        trainer_arguments = {name: given.pop(name) for name in TRAINER_ARGUMENTS if name in given}
        object.__setattr__(self, "_trainer_arguments", trainer_arguments)
        flat, ignored = self._translate(given)
        nested: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            section, leaf = find_field(name)
            nested.setdefault(section, {})[leaf] = value
        try:
            engine_cfg = build_config(nested)
        except ConfigError as exc:
            raise ConfigError(f"GRPOConfig: {exc}") from None
        object.__setattr__(self, "_engine", engine_cfg)
        object.__setattr__(self, "_ignored", ignored)
        object.__setattr__(self, "explicit_names", frozenset(self._kwargs))
        noted = [name for name in ignored if name.split("[")[0] in warn_names]  # model_init_kwargs['x'] by its dict
        if noted:
            by_reason: dict[str, list[str]] = {}
            for name in noted:
                by_reason.setdefault(ignored[name][1], []).append(f"{name}={_shown(name, ignored[name][0])}")
            lines = "; ".join(f"{', '.join(args)} ({reason})" for reason, args in by_reason.items())
            warnings.warn(f"GRPOConfig: TRL arguments with no effect in this engine, ignored: {lines}", UserWarning,
                          stacklevel=3)

    @staticmethod
    def _translate(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, str]]]:
        """TRL keywords -> (engine flat field -> value, ignored TRL name -> (value, reason))."""
        from engine.config import _FLAT_INDEX

        unknown = [name for name in kwargs if name not in _FLAT_INDEX and name not in NO_EFFECT
                   and name not in REFUSED and name not in TRANSLATED]
        if unknown:
            known = known_argument_names()
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"'{name}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
            raise TypeError(f"GRPOConfig got unexpected keyword argument(s): {', '.join(hints)}; it takes TRL "
                            "1.16's GRPOConfig / TrainingArguments names and the engine's fields (engine/config.py)")
        for name, reason in REFUSED.items():
            if kwargs.get(name):
                raise NotImplementedError(f"GRPOConfig({name}={kwargs[name]!r}): {reason}")
        if kwargs.get("loss_type") == "vespo" and kwargs.get("use_vllm") is not True:
            # TRL without vLLM has no IS correction; here vLLM always samples: the token mode TRL's vespo accepts
            kwargs["vllm_importance_sampling_mode"] = vespo_importance_sampling_mode(
                "vespo", kwargs.get("vllm_importance_sampling_mode", "sequence_mask"),
                "vllm_importance_sampling_mode" in kwargs)
        if kwargs.get("use_vllm") is True:
            del kwargs["use_vllm"]  # what runs anyway: nothing to warn about
        if "accelerator_config" in kwargs:
            AcceleratorSettings(kwargs["accelerator_config"])  # transformers' keys only (TypeError naming others)
        ignored = {name: (kwargs.pop(name), NO_EFFECT[name]) for name in list(kwargs) if name in NO_EFFECT}
        for name in REFUSED:
            kwargs.pop(name, None)
        _translate_dtype(kwargs, ignored)
        _translate_checkpointing_kwargs(kwargs, ignored)
        aux = kwargs.pop("router_aux_loss_coef", None)
        if aux is not None:  # transformers' MoE name; None (TRL's default): the model config's value, as TRL
            _set_once(kwargs, "moe_aux_loss_coeff", float(aux), "router_aux_loss_coef")
        cap = kwargs.pop("vllm_importance_sampling_cap", None)
        if cap is not None:  # TRL's deprecated name
            _set_once(kwargs, "vllm_importance_sampling_clip_max", cap, "vllm_importance_sampling_cap")
        level = kwargs.pop("log_level", None)
        if level not in (None, "passive"):  # TRL's default 'passive' leaves logging as it is
            if level not in _LOG_LEVELS:
                raise ValueError(f"GRPOConfig(log_level={level!r}): expected one of {sorted(_LOG_LEVELS)}")
            _set_once(kwargs, "verbose", _LOG_LEVELS[level], "log_level")
        if isinstance(kwargs.get("warmup_steps"), float) and 0 < kwargs["warmup_steps"] < 1:
            _set_once(kwargs, "warmup_ratio", kwargs.pop("warmup_steps"), "warmup_steps")  # transformers 5: a ratio
        for name in ("logging_steps", "save_steps", "warmup_steps"):
            if name in kwargs:
                kwargs[name] = _whole_steps(name, kwargs[name], kwargs.get("max_steps", -1))
        if "report_to" in kwargs:
            kwargs["report_to"] = _report_backends(kwargs["report_to"])
        if "lr_scheduler_type" in kwargs:
            kwargs["lr_scheduler_type"] = _scheduler(kwargs["lr_scheduler_type"])
        for name in ("chat_template_kwargs", "generation_kwargs"):
            if isinstance(kwargs.get(name), str):  # TRL's command line passes JSON
                kwargs[name] = json.loads(kwargs[name])
        if "optim" in kwargs:
            kwargs["optim"] = _optimizer(kwargs["optim"])
        for name in CALLABLE_FIELDS:
            if callable(kwargs.get(name)):  # the object travels in memory (in_memory_callables)
                kwargs[name] = describe_callable(kwargs[name])
        if kwargs.get("pad_to_multiple_of") == "auto":
            kwargs["pad_to_multiple_of"] = None  # TRL 1.16: "auto" pads only on AWS Neuron
        if kwargs.get("output_dir") is None:
            kwargs["output_dir"] = TRL_DEFAULT_OUTPUT_DIR
        return kwargs, ignored

    # -- access -----------------------------------------------------------------------------------------------------

    def to_engine_config(self) -> EngineConfig:
        """The engine's config tree (frozen)."""
        return self._engine

    def to_dict(self) -> dict:
        """The engine's config tree as plain data."""
        return config_to_dict(self._engine)

    @property
    def in_memory_callables(self) -> dict[str, Any]:
        """The user hooks given as objects (`group_filter_func`, `dynamic_prompts_fn`), by name: GRPOTrainer hands
        them to `engine.train.loop.train`; the tree holds their descriptions."""
        return {name: self._kwargs[name] for name in CALLABLE_FIELDS if callable(self._kwargs.get(name))}

    @property
    def ignored_arguments(self) -> dict[str, Any]:
        """TRL arguments given but without effect here, with their values."""
        return {name: value for name, (value, _) in self._ignored.items()}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in ("bf16", "fp16"):
            return self._engine.model.dtype == {"bf16": "bfloat16", "fp16": "float16"}[name]
        if name == "accelerator_config":
            return AcceleratorSettings(self._ignored.get(name, (None,))[0])
        if name in self._ignored:
            return self._ignored[name][0]
        if name in TRAINER_ARGUMENTS:
            return self._trainer_arguments.get(name, TRAINER_ARGUMENTS[name][0])
        if name in CALLABLE_FIELDS and callable(self._kwargs.get(name)):
            return self._kwargs[name]  # the object given, as on TRL's config (the tree holds its description)
        try:
            section, leaf = find_field(name)
        except KeyError:
            if name in self._kwargs:  # e.g. use_vllm=True: accepted, nothing to configure
                return self._kwargs[name]
            if name in TRL_FIELDS:  # a TRL field not given: TRL's default, whether or not it acts here
                return trl_default(name)
            raise AttributeError(f"GRPOConfig has no attribute {name!r}") from None
        return getattr(getattr(self._engine, section), leaf)

    def __setattr__(self, name: str, value: Any) -> None:
        kwargs = {**self._kwargs, name: value}
        previous = self._kwargs
        object.__setattr__(self, "_kwargs", kwargs)
        try:
            self._build(warn_names=[name])
        except Exception:
            object.__setattr__(self, "_kwargs", previous)
            raise

    def set_for_stream(self) -> None:
        """What TRL sets for a streamed (iterable) train_dataset, without a warning: accelerator_config's
        dispatch_batches = False and dataloader_num_workers = 0 (both without effect here: every rank reads the
        stream itself, and the engine samples its own batches)."""
        accelerator = {**AcceleratorSettings(self._ignored.get("accelerator_config", (None,))[0]).to_dict(),
                       "dispatch_batches": False}
        kwargs = {**self._kwargs, "accelerator_config": accelerator, "dataloader_num_workers": 0}
        object.__setattr__(self, "_kwargs", kwargs)
        self._build(warn_names=[])

    def replace(self, **changes: Any) -> GRPOConfig:
        """A copy with some arguments changed (only the changed ones can warn)."""
        copy = object.__new__(type(self))
        object.__setattr__(copy, "_kwargs", {**self._kwargs, **changes})
        copy._build(warn_names=list(changes))
        return copy

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={_shown(k, v)}" for k, v in self._kwargs.items())
        return f"{type(self).__name__}({given})"


def _explicit(cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """The arguments a caller chose. Given every declared field at once (`HfArgumentParser`, TRL's `TrlParser`,
    `dataclasses.replace`), the values equal to their defaults count as not given, so that only the flags a user
    set can be named in the no-effect warning; otherwise every keyword given counts, at its default or not."""
    defaults = defaults_of(cls)
    if not set(defaults) <= set(given):
        return {name: value for name, value in given.items() if name != "output_dir" or value is not None}
    return {name: value for name, value in given.items() if name not in defaults or not _same(value, defaults[name])}


def _same(value: Any, default: Any) -> bool:
    """Whether a parsed value is the field's default (a bool flag over a string default, as
    include_num_input_tokens_seen='no', is the parser's reading of it)."""
    if isinstance(value, bool) and isinstance(default, str):
        return value == (default.lower() in ("yes", "true", "t", "y", "1"))
    if value is None and isinstance(default, (str, list)) and not default:  # a list flag never given: debug=''
        return True
    if isinstance(value, AcceleratorSettings):  # read back by dataclasses.replace
        return default is None and value.to_dict() == ACCELERATOR_DEFAULTS
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # e.g. an object whose == is elementwise
        return False


def _field_helps() -> dict[str, str]:
    """--help text of every declared field: the engine field's docstring (engine/config.py), or what the engine
    does with the TRL argument (the no-effect reason, the refusal, the translation)."""
    from pathlib import Path

    import engine.config as config_module
    from engine.config import _FLAT_INDEX
    from engine.config_docstrings import field_docstrings

    try:
        docs = field_docstrings(Path(config_module.__file__))
    except OSError:  # no source next to the package: short help
        docs = {}
    classes = {f.name: f.default_factory.__name__ for f in dataclasses.fields(EngineConfig)}  # type: ignore[misc]
    helps = {name: " ".join(docs.get((classes[section], leaf), "").split())
             for name, (section, leaf) in _FLAT_INDEX.items()}
    helps |= {name: f"No effect in this engine: {reason}." for name, reason in NO_EFFECT.items()}
    helps |= {name: f"Only TRL's default is accepted: {reason}." for name, reason in REFUSED.items()}
    helps |= {name: f"TRL's argument, here: {text}." for name, text in TRANSLATED.items() if name not in helps}
    helps |= {name: text for name, (_, text) in TRAINER_ARGUMENTS.items()}
    helps["use_vllm"] = "Generation always uses vLLM here: True is what runs; False is named in the no-effect warning."
    return {name: text.replace("%", "%%") for name, text in helps.items()}  # argparse formats help with %


class GFPOConfig(GRPOConfig):
    """TRL's experimental `GFPOConfig` (trl.experimental.gfpo, TRL <= 1.7.1): `GRPOConfig` plus
    `num_remains_in_group` (k: train on the k best of each group's G completions, scored by the trainer's
    `group_filter_func`; None = keep all; 2 <= k < num_generations). The engine's `grpo.num_remains_in_group`, so
    `GRPOConfig` accepts it too; this class exists for the documented name (`GFPOTrainer` takes either)."""


declare_fields(GRPOConfig, _field_helps())  # a dataclass for HfArgumentParser / TrlParser


def _set_once(kwargs: dict[str, Any], name: str, value: Any, given_as: str) -> None:
    """kwargs[name] = value, unless the caller also gave `name` a different value (then ValueError)."""
    if name in kwargs and kwargs[name] != value:
        raise ValueError(f"GRPOConfig: {given_as}={value!r} means {name}={value!r}, but {name}={kwargs[name]!r} "
                         "was given too")
    kwargs[name] = value


def _shown(name: str, value: Any) -> str:
    """repr(value) for messages; secrets (hub_token) are never printed."""
    return "'<redacted>'" if "token" in name and isinstance(value, str) else repr(value)


def _translate_dtype(kwargs: dict[str, Any], ignored: dict[str, tuple[Any, str]]) -> None:
    """bf16 / fp16 / model_init_kwargs["dtype"] -> model.dtype; other model_init_kwargs keys are ignored."""
    bf16, fp16 = kwargs.pop("bf16", None), kwargs.pop("fp16", None)
    init = kwargs.pop("model_init_kwargs", None) or {}
    init = dict(json.loads(init) if isinstance(init, str) else init)  # TRL's command line passes JSON
    chosen = []
    if bf16 and fp16:
        raise ValueError("GRPOConfig: bf16=True and fp16=True are exclusive")
    if bf16:
        chosen.append(("bf16=True", "bfloat16"))
    elif fp16:
        chosen.append(("fp16=True", "float16"))
    elif bf16 is False and not fp16:
        chosen.append(("bf16=False", "float32"))
    for key in ("dtype", "torch_dtype"):
        if key in init and init[key] not in (None, "auto"):
            chosen.append((f"model_init_kwargs[{key!r}]", str(init.pop(key)).replace("torch.", "")))
        init.pop(key, None)
    if "trust_remote_code" in init:
        kwargs.setdefault("trust_remote_code", init.pop("trust_remote_code"))
    attention = init.pop("attn_implementation", None)
    if attention is not None:  # eager -> eager; sdpa, flash_attention_2 / 3, flex... -> auto: torch's fused SDPA where
        # the layer's attention is the plain one, the family's own otherwise (as HF falls back per model)
        kwargs.setdefault("attention_implementation", "eager" if attention == "eager" else "auto")
    for key, value in init.items():
        ignored[f"model_init_kwargs[{key!r}]"] = (value, "the policy is built by Megatron from the checkpoint")
    if "dtype" in kwargs:
        chosen.append(("dtype", kwargs["dtype"]))
    values = {value for _, value in chosen}
    if len(values) > 1:
        raise ValueError(f"GRPOConfig: conflicting precisions: {', '.join(f'{s} -> {v}' for s, v in chosen)}")
    if values:
        kwargs["dtype"] = values.pop()


_CHECKPOINT_KWARGS_NO_EFFECT = (
    "Megatron's activation recompute is its own checkpoint function (tensor_parallel.CheckpointFunction: reentrant, "
    "RNG states always restored); torch.utils.checkpoint's use_reentrant / preserve_rng_state do not apply; "
    "train.recompute_granularity / recompute_method / recompute_num_layers / recompute_modules choose what is recomputed")


def _translate_checkpointing_kwargs(kwargs: dict[str, Any], ignored: dict[str, tuple[Any, str]]) -> None:
    """TRL's `gradient_checkpointing_kwargs` (torch.utils.checkpoint's keywords): `use_reentrant` and
    `preserve_rng_state` are named in the no-effect warning (Megatron's checkpoint is reentrant and restores RNG
    states whatever they say); any other key (context_fn, determinism_check, debug) is refused by name; with
    gradient_checkpointing=False the whole dict is named in the warning (nothing is recomputed)."""
    given = kwargs.pop("gradient_checkpointing_kwargs", None)
    if isinstance(given, str):  # TRL's command line passes JSON
        given = json.loads(given)
    if not given:
        return
    if kwargs.get("gradient_checkpointing") is False:
        ignored["gradient_checkpointing_kwargs"] = (given, "gradient_checkpointing=False: nothing is recomputed")
        return
    for key, value in given.items():
        if key not in ("use_reentrant", "preserve_rng_state"):
            raise ValueError(f"GRPOConfig(gradient_checkpointing_kwargs={{{key!r}: ...}}): {key!r} is a "
                             "torch.utils.checkpoint option with no counterpart in Megatron's activation recompute; "
                             "supported here: use_reentrant, preserve_rng_state (both without effect), and "
                             "train.recompute_granularity / recompute_method / recompute_num_layers / recompute_modules")
        ignored[f"gradient_checkpointing_kwargs[{key!r}]"] = (value, _CHECKPOINT_KWARGS_NO_EFFECT)


def _whole_steps(name: str, value: Any, max_steps: int) -> Any:
    """An int step count from TRL's int-or-float (a float below 1 is a ratio of max_steps)."""
    if isinstance(value, bool) or not isinstance(value, float):
        return value
    if value.is_integer():
        return int(value)
    if 0 < value < 1 and max_steps > 0:
        return max(1, math.ceil(value * max_steps))
    raise ValueError(f"GRPOConfig({name}={value}): a fraction of the run needs max_steps > 0 (got {max_steps}); "
                     "give a whole number of steps")


def _report_backends(value: Any) -> list[str]:
    """report_to as the engine's list (TRL: a str, a list, 'none', 'all'); other backends are refused."""
    items = [value] if isinstance(value, str) or value is None else list(value)
    items = [item for item in items if item not in (None, "none")]
    if "all" in items:
        items = [item for item in items if item != "all"] + [b for b in _REPORT_BACKENDS if b not in items]
    unsupported = [item for item in items if item not in _REPORT_BACKENDS]
    if unsupported:
        raise ValueError(f"GRPOConfig(report_to={value!r}): {unsupported} not supported; available: "
                         f"{list(_REPORT_BACKENDS)} (metrics.jsonl is always written)")
    return items


def _optimizer(value: Any) -> str:
    """transformers' `optim` -> Megatron's: every torch AdamW / Adam variant is `adam` (Megatron's adam is AdamW)."""
    name = str(getattr(value, "value", value))
    if name in ("adam", "sgd"):
        return name
    if name.endswith(("4bit", "8bit")):  # adamw_torch_4bit / _8bit would otherwise read as plain float32 AdamW
        raise ValueError(f"GRPOConfig(optim={name!r}): 4- / 8-bit Adam states are not built here; bf16 Adam moments "
                         "are: GRPOConfig(optim='adamw_torch', optimizer_state_dtype='bfloat16')")
    if name.startswith(("adamw_torch", "adamw_hf", "adamw_apex_fused")) or name == "adamw":
        return "adam"
    raise ValueError(f"GRPOConfig(optim={name!r}): Megatron's optimizers here are AdamW ('adamw_torch', "
                     "'adamw_torch_fused', ...) and 'sgd'")


def _scheduler(value: Any) -> str:
    name = str(getattr(value, "value", value))
    if name not in _SCHEDULERS:
        raise ValueError(f"GRPOConfig(lr_scheduler_type={name!r}): available here: {sorted(_SCHEDULERS)}")
    return _SCHEDULERS[name]
