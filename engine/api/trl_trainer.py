"""TRL-compatible API: `GRPOConfig` and `GRPOTrainer` with TRL 1.16's arguments, run by this engine's loop.

A TRL GRPO script runs here with its import line changed (`from engine import GRPOConfig, GRPOTrainer`) and, where
the model is a hub name and the machine is offline, the model path. `examples/` holds such scripts. How we differ
from TRL (all loud): `GRPOTrainer`.

Owns: `GRPOTrainer` (refusals, resolving `model` and `reward_funcs`, the batch-geometry check, handing everything to
`engine.train.loop.train` in memory; `train()` and its HF-style `log_history`: `GRPOTrainer.train`, `final_record`;
`save_model()`) and TRL's experimental `GFPOTrainer` (trl.experimental.gfpo, TRL <= 1.7.1, also at
`engine.experimental.gfpo`). TRL's other attributes and methods (`model`, `ref_model`, `state`, `evaluate()`,
streaming datasets) are engine/api/trl_surface.py's `TrainerSurface`; callbacks and the evaluation schedule
engine/api/trl_callbacks.py's; the argument mapping `GRPOConfig` engine/api/trl_config.py's.

Must not: implement any part of the loop (engine/train/loop.py), import vLLM or Megatron at import time (importing
`engine` stays light), or import trl (a test-only dependency).

Test: `pytest tests/unit/test_trl_api.py` (mapping, warnings, refusals; no engine start),
`pytest tests/integration/test_trl_api_run.py` (objects end to end) and `tests/integration/test_trl_examples.py`
(the examples end to end, and as TRL scripts).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from engine.api import trl_compat, trl_generate
from engine.api.spawn_guard import spawn_children_skip_main_script
from engine.api.trl_accelerator import AcceleratorSurface
from engine.api.trl_agentic import PLACEHOLDER_ROWS, placeholder_dataset, resolve_agentic, with_placeholder_prompts
from engine.api.trl_config import GFPOConfig, GRPOConfig
from engine.api.trl_hub import HubSurface
from engine.api.trl_surface import (
    EXPORT_DIR,
    INITIAL_MODEL_DIR,
    TrainerSurface,
    eval_sets,
    is_stream,
    save_model_object,
)
from engine.config import EngineConfig
from engine.models.hub import resolve_hub_model

__all__ = ["GFPOConfig", "GFPOTrainer", "GRPOConfig", "GRPOTrainer"]

FINAL_MODEL_DIR = EXPORT_DIR
"""Under output_dir: the trained policy as a Hugging Face checkpoint, written at the end of `train()` (the same
`hf` folder a config-file run exports to); `save_model()` copies it into output_dir itself, as TRL's."""


# ---------------------------------------------------------------------------------------------------------------
# GRPOTrainer


class GRPOTrainer(TrainerSurface, HubSurface, AcceleratorSurface):
    """TRL's `GRPOTrainer` signature over `engine.train.loop.train` (Megatron training, full or LoRA; vLLM rollout).

    It refuses with a message what this engine does not do (custom optimizers, `quantization_config`, a PEFT model
    together with `peft_config`), turns `peft_config` (or a `peft.PeftModel` passed as `model`) into LoRA adapters on
    the frozen Megatron policy (the `lora` section, engine/policy/lora.py), resolves `model` (a
    local directory, a `builtin:` name, a hub name from the local cache or a download, a `PreTrainedModel` saved under
    output_dir) and `reward_funcs` (callables, config strings, reward-model directories or objects with their
    `reward_processing_classes`), checks the batch geometry before anything starts, and hands datasets, reward
    callables, the tokenizer and the user hooks (`group_filter_func`, `dynamic_prompts_fn`: any callable, a function
    of the script, a lambda or an instance) to `engine.train.loop.train` in memory.

    Differences from TRL (all loud): the model is trained by Megatron (full fine-tuning or LoRA; no DeepSpeed / FSDP;
    a subclass overriding HF Trainer's `training_step` / `_prepare_inputs` / `compute_loss` is refused, naming why,
    while one overriding TRL's `_generate` / `_generate_single_turn` acts: engine/api/trl_generate.py);
    generation always uses vLLM; a single `eval_dataset` is also scored before and after training (held-out reward,
    `eval_reward_before` / `_after`), besides TRL's `eval_strategy` schedule; `train()` runs once per trainer (the
    engine tears its process group down at the end, and on any exception, so a new trainer can train in the same
    process). Under torchrun every rank runs the script, so every rank builds the same objects; files written on the
    way (a saved `PreTrainedModel`) are written by rank 0 and awaited by the others.

    Args:
        model: a local Hugging Face checkpoint directory, a `builtin:` name (engine/models/tiny_model.py), a hub name (the
            local cache first; downloaded unless HF_HUB_OFFLINE is set), or a `transformers.PreTrainedModel`
            (saved to `<output_dir>/initial_model` and loaded from there).
        reward_funcs: a callable, a str (a built-in reward name, `module:function`, or a local reward-model
            directory), a sequence-classification `PreTrainedModel`, or a list of these. TRL's calling contract.
        args: `GRPOConfig` (this module's); None = TRL's `GRPOConfig("<model name>-GRPO")`.
        train_dataset: `datasets.Dataset` with a `prompt` column (text, or a list of messages); every other column
            reaches the reward functions. A streaming `datasets.IterableDataset` needs max_steps: the rows the run
            draws are read once, in the stream's order (not shuffled, as TRL), at `train()`.
        eval_dataset: a `datasets.Dataset` or `IterableDataset`, or a dict / DatasetDict of them (metrics
            `eval_<name>_*`): evaluated on TRL's `eval_strategy` schedule and by `evaluate()`; a single Dataset is
            also scored before and after training (held-out reward).
        processing_class: the tokenizer (chat template for conversational prompts, `chat_template_kwargs` applied);
            None = the model's own.
        reward_processing_classes: tokenizers of reward models (one per reward function, None for callables).
        callbacks: transformers `TrainerCallback` instances or classes (engine/api/trl_callbacks.py).
        peft_config: a `peft.LoraConfig`: LoRA adapters on the frozen Megatron policy (the `lora` config section;
            engine/policy/lora.py); save_model() then writes a PEFT adapter.
        optimizers, quantization_config: TRL's; anything but their defaults is refused with a message.
        tools, environment_factory, rollout_func: TRL's multi-turn arguments, with TRL's meaning (engine/api/
            trl_agentic.py checks them now; engine/agent/ runs them: each sample advances on its own).
        group_filter_func: GFPO's filter (TRL's experimental GFPOTrainer argument): any callable
            `f(group_completions, group_rewards, **kw) -> [P][G]` scores, higher = keep (a function, a lambda, an
            instance with `__call__`), kept in memory; used with `num_remains_in_group` (without it: a warning,
            and the filter is not used). `num_remains_in_group` without a filter is an error.
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: list | None = None, rollout_func: Any = None,
                 environment_factory: Any = None, group_filter_func: Any = None):
        trl_compat.refuse_step_overrides(self)  # HF Trainer's step methods cannot act here
        given_model = model  # trainer.model is this object (a PeftModel's adapters set after train())
        if peft_config is None and type(model).__name__.startswith("Peft"):  # TRL takes a PeftModel too
            model, peft_config = _split_peft_model(model)
        _refuse_unsupported(model, optimizers, quantization_config, peft_config)
        if args is None:
            args = GRPOConfig(output_dir=f"{_model_name(model)}-GRPO")
        elif not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be engine.GRPOConfig, got {type(args).__module__}.{type(args).__name__}; "
                            "change `from trl import GRPOConfig` to `from engine import GRPOConfig`")
        if group_filter_func is not None:  # TRL's GFPOTrainer argument (with num_remains_in_group)
            args = args.replace(group_filter_func=group_filter_func)
        if args.group_filter_func is not None and args.num_remains_in_group is None:  # as TRL's GFPOTrainer
            warnings.warn("group_filter_func is not used: num_remains_in_group is not set (GFPO trains on the "
                          "num_remains_in_group best-scored completions of each group)", UserWarning, stacklevel=2)
        self.args = args
        trl_compat.warn_objective_settings(args.loss_type, args.importance_sampling_level)
        cfg = args.to_engine_config()
        self.output_dir = Path(cfg.train.output_dir)
        self._processing_class = _check_tokenizer(processing_class)
        if environment_factory is not None and not is_stream(train_dataset):  # TRL: reset() may own the prompt
            train_dataset = with_placeholder_prompts(train_dataset)
        self.train_dataset = train_dataset if is_stream(train_dataset) else _check_dataset(train_dataset,
                                                                                            "train_dataset")
        self.eval_dataset = eval_dataset
        self._eval_sets = eval_sets(eval_dataset, cfg.data.eval_max_prompts)
        engine_eval = self._eval_sets[None] if self._eval_sets and list(self._eval_sets) == [None] else None
        if self.train_dataset is None and environment_factory is not None and "dataset_name" not in args.explicit_names:
            if isinstance(environment_factory, dict):  # TRL: each row's `environment` column picks its environment
                raise ValueError("environment_factory as a dict (several environments) requires a `train_dataset` "
                                 "with an `environment` column naming each row's environment")
            if cfg.train.max_steps <= 0:  # TRL: the environment owns the data (reset() supplies the prompt)
                raise ValueError("environment_factory without train_dataset: set GRPOConfig(max_steps=...) > 0 to "
                                 "define the training length (the environments' reset() supply the prompts)")
            self.train_dataset = placeholder_dataset(PLACEHOLDER_ROWS)
        if self.train_dataset is None and "dataset_name" not in args.explicit_names:
            raise ValueError("`train_dataset` is required: a datasets.Dataset with a 'prompt' column (or set "
                             "GRPOConfig(dataset_name=...) to a local file, a hub name or builtin:arithmetic)")
        model_path = resolve_model(model, self.output_dir, processing_class, cfg.model.trust_remote_code)
        self.rollout_func, self._last_loaded_step = rollout_func, 0  # TRL's attributes (`_generate` reads them)
        rollout = trl_generate.dispatch_override(self, rollout_func, tools,
                                                 environment_factory)  # a subclass's _generate override
        self._dispatch_overrides = trl_generate.overridden(type(self))
        self._agentic = resolve_agentic(self, tools, rollout, environment_factory, model_name=str(model_path),
                                        tokenizer=self._processing_class or _local_tokenizer(model_path),
                                        chat_template_kwargs=cfg.generation.chat_template_kwargs)
        self.tools = self._agentic.tools  # TRL's attribute: the tools, then the environments' methods
        if self._agentic.reward_funcs:  # environments' get_reward, weight 1 (TRL)
            reward_funcs = [*(reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs] * (
                reward_funcs is not None))] + self._agentic.reward_funcs
            if reward_processing_classes is not None:
                reward_processing_classes = [*reward_processing_classes] + [None] * len(self._agentic.reward_funcs)
            if cfg.reward.reward_weights is not None:
                cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, reward_weights=[
                    *cfg.reward.reward_weights, *[1.0] * len(self._agentic.reward_funcs)]))
        self.reward_funcs = resolve_reward_funcs(reward_funcs, reward_processing_classes, self.output_dir, cfg)
        self.reward_func_names = _reward_names(self.reward_funcs)
        data = {}
        if self.train_dataset is not None:
            data["dataset_name"] = "<GRPOTrainer train_dataset>"
            if engine_eval is None:
                data["dataset_test_split"] = None
        reward = {"reward_funcs": [_reward_spec(f) for f in self.reward_funcs]}
        self._cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, name_or_path=str(model_path)),
            data=dataclasses.replace(cfg.data, **data), reward=dataclasses.replace(cfg.reward, **reward))
        if peft_config is not None:  # LoRA on the Megatron policy (engine/policy/lora.py)
            from engine.lora_settings import lora_fields_from_peft

            self._cfg = dataclasses.replace(self._cfg, lora=dataclasses.replace(self._cfg.lora,
                                                                                **lora_fields_from_peft(peft_config)))
        trl_compat.check_liger_installed(bool(getattr(args, "use_liger_kernel", False)))  # after PEFT's, as TRL
        self._engine_eval_dataset = engine_eval  # scored before and after training by the engine
        self._check_layout()
        self.model_path = Path(model_path)
        self._trained = False
        self._peft_config = peft_config  # trainer.model is then a peft.PeftModel (trl_surface.py)
        self._init_trainer_surface(given_model, callbacks, is_stream(train_dataset))

    use_vllm = True
    """TRL's flag: generation always uses vLLM here."""
    vllm_generation = trl_generate.EngineWeightSync()
    """TRL's generation backend handle, as `_generate` uses it (engine/api/trl_generate.py)."""
    _generate = trl_generate.generate  # TRL's private rollout dispatch; a subclass's override acts (trl_generate.py)
    _generate_single_turn = trl_generate.generate_single_turn
    training_step = trl_compat.training_step  # HF Trainer's; refused with why (trl_compat.STEP_METHODS_WHY)
    get_off_policy_mask = staticmethod(trl_compat.get_off_policy_mask)
    get_high_entropy_mask = trl_compat.get_high_entropy_mask  # TRL's signature: (self, entropies, mask, threshold)
    _get_per_token_logps_and_entropies = trl_compat.get_per_token_logps_and_entropies  # TRL's private signature

    def _check_layout(self) -> None:
        """Batch geometry and objective checks before anything starts (the world size torchrun gives, else 1), with
        TRL's messages (a ValueError, as TRL's GRPOConfig raises)."""
        from engine.validation import validate

        self._derived = validate(self._cfg, int(os.environ.get("WORLD_SIZE", "1")))

    @property
    def engine_config(self) -> EngineConfig:
        """The config the engine runs (args' tree with the model, data and reward inputs filled in)."""
        return self._cfg

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: Any = None):
        """Run GRPO; returns `transformers.trainer_utils.TrainOutput(global_step, training_loss, metrics)`.

        Leaves `state.log_history` as HF's Trainer does: the per-step records, then the final one (train_runtime,
        train_samples_per_second, train_steps_per_second, total_flos, train_loss, epoch, step; `final_record`).

        Args:
            resume_from_checkpoint: a checkpoint directory, or True for the newest under output_dir.
            trial, ignore_keys_for_eval: TRL's; must be None.
        """
        from transformers.trainer_utils import TrainOutput

        from engine.train.loop import train

        if trial is not None:
            raise NotImplementedError("hyperparameter search trials are not supported")
        if self._trained:
            raise RuntimeError("train() already ran: the engine's process group and policy are torn down at the end "
                               "of a run; build a new GRPOTrainer (e.g. with model=<output_dir>/hf)")
        trl_generate.patched_since_construction(self, self._dispatch_overrides)
        trl_compat.refuse_step_overrides(self)  # e.g. training_step patched onto the class since construction
        cfg = self._cfg
        if resume_from_checkpoint:
            where = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume_from_checkpoint=where))
        start, old_history = time.perf_counter(), _read_history(self.output_dir)
        with spawn_children_skip_main_script():
            summary = train(cfg, train_dataset=self._train_rows(), eval_dataset=self._engine_eval_dataset,
                            reward_funcs=self.reward_funcs, tokenizer=self._processing_class,
                            **self.args.in_memory_callables,  # group_filter_func / dynamic_prompts_fn objects
                            export_dir=self.output_dir / FINAL_MODEL_DIR, hooks=self._hooks,
                            agentic=self._agentic.loop_inputs or None)
        runtime = time.perf_counter() - start
        self._trained = True
        self._model = self._model_object  # trainer.model: reloaded from the export when read
        self._model_is_stale = True
        self._entropy_coef = summary.get("entropy_coef")
        history = _new_records(old_history, _read_history(self.output_dir))
        params = _count_non_embedding_parameters(self.output_dir / FINAL_MODEL_DIR)
        final = final_record(history, steps=summary["steps"], start_step=summary.get("start_step", 0),
                             runtime_s=runtime, samples_per_step=self._derived.global_batch_size,
                             total_flos=6.0 * params * summary.get("num_tokens", 0) * cfg.grpo.num_iterations)
        history, final = merge_unlogged_step(history, final, cfg.logging.logging_steps)
        history.append(final)  # HF's Trainer logs it last: `trainer.state.log_history[-1]["train_loss"]`
        state = self.state
        state.global_step, state.max_steps, state.log_history = summary["steps"], summary["steps"], history
        state.epoch, state.total_flos = final.get("epoch"), final["total_flos"]
        metrics = {k: v for k, v in final.items() if k != "step"}  # as HF: the record without its step
        for key in ("eval_reward_before", "eval_reward_after"):
            if summary.get(key) is not None:
                metrics[key] = summary[key]
        return TrainOutput(summary["steps"], final["train_loss"], metrics)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the policy as a Hugging Face checkpoint (safetensors, config, tokenizer) to `output_dir`
        (default: args.output_dir): the trained policy after `train()`, the initial model before it; with LoRA a
        PEFT adapter (before `train()`: the initial one, A as the run draws it, B = 0)."""
        target = Path(output_dir) if output_dir is not None else self.output_dir
        source = self._current_model_dir()  # the export after train(), the initial model (resolved) before
        if int(os.environ.get("RANK", "0")) != 0:
            return
        if self._cfg.lora.use_peft and not self._trained:  # the initial PEFT adapter, as TRL's PeftModel saves
            from engine.train.run import export_initial_adapter

            export_initial_adapter(self._cfg, target)
        elif source.resolve() != target.resolve():
            target.mkdir(parents=True, exist_ok=True)
            for item in source.iterdir():
                if item.is_file():
                    _link_or_copy(item, target / item.name)
        if self._processing_class is not None:
            self._processing_class.save_pretrained(target)


class GFPOTrainer(GRPOTrainer):
    """TRL's experimental `GFPOTrainer` (trl.experimental.gfpo, TRL <= 1.7.1): `GRPOTrainer`,
    whose `group_filter_func` argument scores the G completions of each group (`f(group_completions,
    group_rewards, **kw) -> [P][G]`, higher = keep) so that only the `num_remains_in_group` best of each group are
    trained on (engine/grpo/group_filter.py). As TRL: `num_remains_in_group` without a filter is an error, a filter
    without `num_remains_in_group` a warning. `args` is a `GFPOConfig` (or a `GRPOConfig`: the same fields)."""


def _split_peft_model(model: Any) -> tuple[Any, Any]:
    """A `peft.PeftModel` as (a copy of its base model without adapters, its active adapter's config): the engine
    puts adapters of that setting on Megatron (its initial adapter weights are not carried over: PEFT's init)."""
    import copy

    return copy.deepcopy(model).unload(), model.peft_config[model.active_adapter]


def _refuse_unsupported(model, optimizers, quantization_config, peft_config) -> None:
    """NotImplementedError for TRL features this engine does not have."""
    if type(model).__name__.startswith("Peft"):
        raise NotImplementedError("a PEFT model together with peft_config: pass one of them (the base model and "
                                  "peft_config=LoraConfig(...), or the PeftModel alone)")
    if optimizers is not None and tuple(optimizers) != (None, None):
        raise NotImplementedError("custom optimizers / schedulers are not supported: the optimizer is Megatron's "
                                  "distributed optimizer, set through GRPOConfig (optim, learning_rate, "
                                  "weight_decay, adam_*, lr_scheduler_type, warmup_*)")
    if quantization_config is not None:
        raise NotImplementedError("quantization_config is not supported: the policy trains in model.dtype")


def _local_tokenizer(model_path: Any) -> Any:
    """The model directory's tokenizer, or None when there is none yet (a builtin model built at train())."""
    if not (Path(str(model_path)) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def _model_name(model: Any) -> str:
    """TRL's default run name: the model id's last path component (':' of builtin names replaced)."""
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "") or "model"
    return str(name).rstrip("/").split("/")[-1].replace(":", "-")


def _check_tokenizer(processing_class: Any) -> Any:
    if processing_class is None:
        return None
    from transformers import PreTrainedTokenizerBase

    if not isinstance(processing_class, PreTrainedTokenizerBase):
        raise NotImplementedError(f"processing_class must be a tokenizer (PreTrainedTokenizerBase), got "
                                  f"{type(processing_class).__name__}: multimodal processors are not supported")
    return processing_class


def _check_dataset(dataset: Any, name: str) -> Any:
    """A `datasets.Dataset` or None; iterable, dict and other inputs refused with what to do."""
    if dataset is None:
        return None
    import datasets

    if isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise NotImplementedError(
            f"{name}: iterable (streaming) datasets are not supported: every prompt is tokenized and length-checked "
            "before the first step. Materialise it, e.g. datasets.Dataset.from_list(list(ds.take(n)))")
    if isinstance(dataset, (datasets.DatasetDict, dict)):
        raise TypeError(f"{name}: pass one datasets.Dataset (e.g. dataset['{'train' if 'train' in name else 'test'}']"
                        f"), not a {type(dataset).__name__} of splits {list(dataset)}")
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"{name} must be a datasets.Dataset, got {type(dataset).__name__} (a list of rows: "
                        "datasets.Dataset.from_list(rows))")
    if "prompt" not in dataset.column_names:
        raise ValueError(f"{name} has no 'prompt' column (columns: {dataset.column_names}); rename the text "
                         "column, e.g. dataset.rename_column('question', 'prompt')")
    return dataset


# ---------------------------------------------------------------------------------------------------------------
# the model


def resolve_model(model: Any, output_dir: Path, processing_class: Any = None, trust_remote_code: bool = False) -> str:
    """A `name_or_path` the engine loads: builtin names and local directories as given, hub names as their local
    snapshot, `PreTrainedModel` objects saved under `<output_dir>/initial_model`.

    Raises:
        ValueError: a hub model that is not cached and cannot be downloaded (offline), with what to do.
        TypeError: anything else.
    """
    if isinstance(model, os.PathLike):
        model = str(model)
    if isinstance(model, str):
        if model.startswith("builtin:") or Path(model).expanduser().is_dir():
            return str(Path(model).expanduser()) if not model.startswith("builtin:") else model
        if model.startswith((".", "/", "~")) or model.count("/") > 1:
            raise ValueError(f"model={model!r}: no such local directory")
        return resolve_hub_model(model, trust_remote_code)
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return save_model_object(model, processing_class, output_dir / INITIAL_MODEL_DIR,
                                  "model is a PreTrainedModel without a name_or_path: pass processing_class")
    raise TypeError(f"model must be a path, a hub name, a builtin: name or a transformers PreTrainedModel, got "
                    f"{type(model).__name__}")


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# ---------------------------------------------------------------------------------------------------------------
# reward functions


def resolve_reward_funcs(reward_funcs: Any, processing_classes: Any, output_dir: Path, cfg: EngineConfig) -> list:
    """TRL's `reward_funcs` (+ `reward_processing_classes`) as a list the engine's `RewardFunctions` takes:
    callables as given, strings resolved now (so a bad name fails before training), reward-model objects saved
    under `<output_dir>/reward_models/<i>` and loaded from there."""
    import torch

    from engine.train.rewards import RewardModelReward, resolve_reward_func

    if reward_funcs is None:
        raise ValueError("No reward source provided. Pass `reward_funcs`: a callable, a reward-model path or hub id, "
                         "or a list of them")
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("No reward source provided: reward_funcs is empty (GRPO needs at least one reward function)")
    if processing_classes is None:
        processing_classes = [None] * len(funcs)
    elif not isinstance(processing_classes, (list, tuple)):
        processing_classes = [processing_classes]
    if len(processing_classes) != len(funcs):
        raise ValueError(f"{len(processing_classes)} reward_processing_classes for {len(funcs)} reward_funcs; "
                         "they must match one to one (None for plain functions)")
    weights = cfg.reward.reward_weights
    if weights is not None and len(weights) != len(funcs):
        raise ValueError(f"Number of reward weights ({len(weights)}) must match number of reward functions "
                         f"({len(funcs)})")
    resolved = []
    for i, (func, tokenizer) in enumerate(zip(funcs, processing_classes)):
        if isinstance(func, torch.nn.Module):
            func = _save_reward_model(func, tokenizer, output_dir / "reward_models" / str(i))
        if isinstance(func, (str, os.PathLike)):
            func = resolve_reward_func(str(func), cfg.generation)
        if not callable(func):
            raise TypeError(f"reward_funcs[{i}] is a {type(func).__name__}: expected a callable, a str or a model")
        if tokenizer is not None and tokenizer.pad_token is not None \
                and tokenizer.pad_token not in tokenizer.get_vocab():
            raise ValueError(f"reward_processing_classes[{i}].pad_token = {tokenizer.pad_token!r} is not in that "
                             f"tokenizer's vocabulary (pad_token_id {tokenizer.pad_token_id}): the reward model "
                             "could not find where each padded row ends; set a pad_token the tokenizer has")
        if isinstance(func, RewardModelReward) and tokenizer is not None:
            func.tokenizer = tokenizer
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            func.model.config.pad_token_id = tokenizer.pad_token_id
        resolved.append(func)
    return resolved


def _save_reward_model(model: Any, tokenizer: Any, target: Path) -> str:
    """A sequence-classification model object -> a local directory with its tokenizer."""
    return save_model_object(model, tokenizer, target,
                              "a reward model object without a name_or_path needs its reward_processing_class")


def _reward_names(funcs: list) -> list[str]:
    from engine.train.rewards import _unique_names, get_callable_name

    return _unique_names([get_callable_name(f) for f in funcs])


def _reward_spec(func: Any) -> str:
    """How a reward function is recorded in the resolved config: `module:qualname` for functions."""
    from engine.train.rewards import RewardModelReward, get_callable_name

    if isinstance(func, RewardModelReward):
        return func.__name__
    module = getattr(func, "__module__", None) or type(func).__module__
    return f"{module}:{get_callable_name(func)}"


# ---------------------------------------------------------------------------------------------------------------
# results


def _read_history(output_dir: Path) -> list[dict]:
    """The records of metrics.jsonl (empty where this rank cannot see it)."""
    from engine.train.metric_sinks import METRICS_FILE, read_metrics

    path = output_dir / METRICS_FILE
    return read_metrics(path) if path.is_file() else []


def _new_records(before: list[dict], after: list[dict]) -> list[dict]:
    """The records this run added: metrics.jsonl appends across runs, and a resumed run first drops the lines after
    its checkpoint, so the new records follow the longest common prefix of the file before and after."""
    common = 0
    while common < min(len(before), len(after)) and before[common] == after[common]:
        common += 1
    return after[common:]


def final_record(history: list[dict], *, steps: int, start_step: int, runtime_s: float, samples_per_step: int,
                 total_flos: float) -> dict:
    """The record HF's Trainer appends to `log_history` after the last step's (`_finalize_training`), in its order:
    train_runtime, train_samples_per_second, train_steps_per_second, total_flos, train_loss, epoch, step.

    Args:
        history: this run's per-step records (`loss` per logged step, `epoch`: the fraction of the dataset drawn).
        steps: the optimizer step reached; start_step: the step this call started from (a resumed run's > 0).
        runtime_s: wall time of the call.
        samples_per_step: completions per optimizer step, per_device_train_batch_size * gradient_accumulation_steps
            * dp_size: HF's `total_train_batch_size`, by which it counts samples when `max_steps` is set (with
            `num_train_epochs` HF counts dataset rows * epochs instead; here it is completions either way).
        total_flos: HF's `6 * tokens * non-embedding parameters` (TRL's GRPOTrainer logs 0: its batches carry no
            `input_ids`).
    Returns:
        the record; `train_loss` is HF's total loss / steps = the mean of the per-step `loss` values (0.0 without a
        step, as HF; NaN where the records cannot be read), the rates are left out at zero runtime (as HF).
    """
    trained = steps - start_step
    record: dict = {"train_runtime": round(runtime_s, 4)}
    if runtime_s > 0:
        record["train_samples_per_second"] = round(samples_per_step * trained / runtime_s, 3)
        record["train_steps_per_second"] = round(trained / runtime_s, 3)
    record["total_flos"] = float(total_flos)
    record["train_loss"] = _mean_loss(history, start_step) if trained > 0 else 0.0
    epochs = [r["epoch"] for r in history if r.get("epoch") is not None]
    if epochs:
        record["epoch"] = epochs[-1]
    record["step"] = steps
    return record


HF_STEP_KEYS = ("loss", "grad_norm", "learning_rate", "epoch", "step", "elapsed_s")
"""Keys of a step record that HF's Trainer logs itself (or the engine adds), not TRL's step metrics."""


def merge_unlogged_step(history: list[dict], final: dict, logging_steps: int) -> tuple[list[dict], dict]:
    """TRL's log_history when the last step is not a logging step: the engine logs it anyway (its record is the
    last of `history`), TRL instead merges the metrics gathered since the last logging step into the final record
    (`GRPOTrainer.log`), so `log_history[-1]` holds `reward`, `rewards/<name>/mean`, ... next to `train_loss`.
    Returns the history without that record and the final record with its TRL metrics (before epoch and step)."""
    step = final.get("step")
    if not history or history[-1].get("step") != step or not step or step % logging_steps == 0 \
            or "loss" not in history[-1]:
        return history, final
    *kept, last = history
    merged = {k: v for k, v in final.items() if k not in ("epoch", "step")}
    merged |= {k: v for k, v in last.items() if k not in HF_STEP_KEYS and k not in merged}
    merged |= {k: final[k] for k in ("epoch", "step") if k in final}
    return kept, merged


def _count_non_embedding_parameters(model_dir: Path) -> int:
    """Parameters of a safetensors checkpoint without the input embedding (HF's `num_parameters(exclude_embeddings=
    True)`; a tied LM head is not stored); 0 where the files cannot be read (another node's rank)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as tensors:
            for name in tensors.keys():
                if "embed_tokens" not in name:
                    total += math.prod(tensors.get_slice(name).get_shape())
    return total


def _mean_loss(history: list[dict], start_step: int = 0) -> float:
    """TRL's training_loss: the mean loss over the run's optimizer steps (each record weighs the steps it covers,
    the first from `start_step`, where a resumed run began)."""
    total, steps, previous = 0.0, 0, start_step
    for record in history:
        step, loss = record.get("step"), record.get("loss")
        if step is None or loss is None:
            continue
        covered = max(int(step) - previous, 1)
        total, steps, previous = total + float(loss) * covered, steps + covered, int(step)
    return total / steps if steps else float("nan")
