"""What `GRPOTrainer` exposes beyond running the loop, as TRL's trainer has it: the policy as a transformers model,
streaming and named datasets, and a failed run's clean-up contract.

A trainer built without `__init__` (TRL's unit tests: `object.__new__(GRPOTrainer)`) keeps `model`, `state` and
`processing_class` as plain assigned values (`TrainerSurface._unbuilt`).

Owns: `load_causal_lm` (a Hugging Face checkpoint directory as a `PreTrainedModel` on this process's CPU, or the
trained weights copied into the user's own model object), `model_directory` (where the policy's weights are: a
`builtin:` name resolved as the engine resolves it), `materialise_stream` (the rows of a streaming
`datasets.IterableDataset` a run of `max_steps` steps draws, in the stream's order, read once), and
`eval_sets` (TRL's `eval_dataset`: one dataset, a dict / `DatasetDict` of named ones, iterable or not, as
name -> `datasets.Dataset`).

Must not: start the engine, import Megatron or vLLM, or import trl.

Test: tests/unit/test_trl_api.py (datasets), tests/integration/test_trl_api_run.py (`trainer.model` before and after
`train()`, streams, eval dicts).
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from pathlib import Path
from typing import Any

from engine.train.step_schedule import rounds_for_steps

EXPORT_DIR = "hf"
"""Under output_dir: the trained policy as a Hugging Face checkpoint (a PEFT adapter with LoRA), exported at the end
of `train()` as every run exports it (checkpoint.save_hf_at_end)."""
INITIAL_MODEL_DIR = "initial_model"
"""Under output_dir: a `PreTrainedModel` passed as `model` (or assigned to `trainer.model`), saved so that Megatron
and vLLM can load it."""


def model_directory(name_or_path: str | Path, output_dir: Path) -> Path:
    """The directory holding `name_or_path`'s weights (a `builtin:` name is written where the engine writes it:
    `<output_dir>/models`, engine/train/run.py `build_run`)."""
    name = str(name_or_path)
    if name.startswith("builtin:"):
        from engine.models.tiny_model import resolve_builtin_model

        return Path(resolve_builtin_model(name, output_dir / "models"))
    return Path(name)


def load_causal_lm(model_dir: Path, into: Any = None) -> Any:
    """`AutoModelForCausalLM` of `model_dir` in the checkpoint's dtype; with `into` (the user's own model
    object), its parameters are overwritten with the checkpoint's and `into` is returned (TRL trains the object
    it was given)."""
    import torch
    from transformers import AutoModelForCausalLM

    if (Path(model_dir) / "adapter_config.json").exists():
        return _load_peft_adapter(Path(model_dir), into)
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype="auto")
    if into is None:
        return loaded
    with torch.no_grad():
        own = dict(into.named_parameters())
        for name, tensor in loaded.named_parameters():
            if name not in own:
                raise ValueError(f"the trained checkpoint {model_dir} has {name!r}, which the model object lacks")
            own[name].copy_(tensor.to(own[name].dtype))
    return into


def _load_peft_adapter(adapter_dir: Path, into: Any = None) -> Any:
    """A PEFT adapter directory (a LoRA run's export, engine/policy/peft_adapter.py): a `peft.PeftModel` on the base
    its adapter_config.json names, or, with `into` (a PeftModel), its adapter weights set from the file."""
    import json

    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    if into is None:
        base_dir = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype="auto"),
                                         adapter_dir)
    result = set_peft_model_state_dict(into, load_file(str(adapter_dir / "adapter_model.safetensors")))
    if result.unexpected_keys:
        raise ValueError(f"the trained adapter {adapter_dir} has {result.unexpected_keys[:3]}, which the model lacks")
    return into


def check_fits_in_memory(model_dir: Path, available_bytes: int | None = None, fraction: float = 0.8) -> None:
    """Refuse to load a checkpoint whose safetensors files exceed `fraction` of this machine's available memory
    (`MemAvailable`; `available_bytes` overrides it), naming how to load the export instead (a sharded 70B run's
    `trainer.model` would otherwise take the process down)."""
    size = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    if available_bytes is None:
        available_bytes = _available_memory()
    if available_bytes is not None and size > fraction * available_bytes:
        raise MemoryError(
            f"trainer.model would load {size / 2**30:.1f} GiB of weights ({model_dir}) into this process, with "
            f"{available_bytes / 2**30:.1f} GiB of memory available: load the export where it fits instead, e.g. "
            f"AutoModelForCausalLM.from_pretrained('{model_dir}', device_map='auto', torch_dtype='auto') on a "
            "machine with enough GPU / CPU memory, or serve it with vLLM")


def _available_memory() -> int | None:
    """`MemAvailable` of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def is_stream(dataset: Any) -> bool:
    """A streaming (`datasets.IterableDataset`) dataset."""
    import datasets

    return isinstance(dataset, datasets.IterableDataset)


def materialise_stream(dataset: Any, num_rows: int, name: str) -> Any:
    """The first `num_rows` rows of a stream, in its order, as a `datasets.Dataset` (fewer when it ends first; the
    run then wraps round to its start, as HF's Trainer re-iterates an exhausted iterable dataset).

    Raises:
        ValueError: the stream is empty or has no `prompt` column.
    """
    import datasets

    rows = list(itertools.islice(iter(dataset), num_rows))
    if not rows:
        raise ValueError(f"{name}: the iterable dataset yielded no rows")
    if "prompt" not in rows[0]:
        raise ValueError(f"{name}: the iterable dataset's rows have no 'prompt' column (columns: {list(rows[0])})")
    return datasets.Dataset.from_list(rows)


def stream_rows_needed(max_steps: int, derived, num_iterations: int, gradient_accumulation_steps: int) -> int:
    """Prompts a run of `max_steps` optimizer steps draws: whole rounds of `num_prompts_per_generation` (the
    rounds' micro-steps may span optimizer steps: engine/train/step_schedule.py)."""
    rounds = rounds_for_steps(max_steps, derived.steps_per_generation * num_iterations, gradient_accumulation_steps)
    return rounds * derived.num_prompts_per_generation


def eval_sets(eval_dataset: Any, max_prompts: int | None) -> dict | None:
    """TRL's `eval_dataset` as name -> `datasets.Dataset` (None: the one unnamed set), or None without one.
    Streams are read up to `max_prompts` rows (data.eval_max_prompts), else whole."""
    import datasets

    if eval_dataset is None:
        return None
    named = dict(eval_dataset) if isinstance(eval_dataset, (dict, datasets.DatasetDict, datasets.IterableDatasetDict)) \
        else {None: eval_dataset}
    sets = {}
    for name, dataset in named.items():
        label = "eval_dataset" if name is None else f"eval_dataset[{name!r}]"
        if is_stream(dataset):
            dataset = materialise_stream(dataset, max_prompts if max_prompts is not None else 2**62, label)
        if not isinstance(dataset, datasets.Dataset):
            raise TypeError(f"{label} must be a datasets.Dataset or IterableDataset, got {type(dataset).__name__}")
        if "prompt" not in dataset.column_names:
            raise ValueError(f"{label} has no 'prompt' column (columns: {dataset.column_names})")
        sets[name] = dataset
    return sets


def write_once(target: Path, write) -> None:
    """Rank 0 calls `write(staging_dir)` and renames it to `target`; other ranks (torchrun) wait for `target`."""
    if int(os.environ.get("RANK", "0")) == 0:
        staging = target.with_name(target.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        write(staging)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
        return
    deadline = time.monotonic() + 1800
    while not (target / "config.json").is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not write {target} within 30 minutes")
        time.sleep(1.0)


def save_model_object(model: Any, tokenizer: Any, target: Path, no_source: str) -> str:
    """A transformers model object and its tokenizer (or the one of its `name_or_path`) -> `target`, written once
    (atomically, by one rank); returns the directory."""
    from transformers import AutoTokenizer

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        tok = tokenizer
        if tok is None:
            source = getattr(model.config, "_name_or_path", "")
            if not source:
                raise ValueError(no_source)
            tok = AutoTokenizer.from_pretrained(source)
        tok.save_pretrained(staging)

    write_once(target, write)
    return str(target)


class TrainerSurface:
    """TRL's trainer attributes and methods around `GRPOTrainer.train()`: `model`, `ref_model`, `processing_class`,
    `reward_processing_classes`, `state`, the callback list (`add_callback` / `pop_callback` / `remove_callback`)
    and `evaluate()`. Mixed into GRPOTrainer (engine/api/trl_trainer.py), whose `__init__` calls
    `_init_trainer_surface` last."""

    def _init_trainer_surface(self, model: Any, callbacks: list | None, streamed: bool) -> None:
        """The model object (if one was given), the callback hooks with their TrainerState, the stream check;
        then HF's `on_init_end`."""
        import dataclasses
        import os

        from transformers import PreTrainedModel

        from engine.api.trl_callbacks import EvalSchedule, TrainerHooks

        is_peft_model = hasattr(model, "peft_config") and hasattr(model, "active_adapter")
        self._model_object = model if isinstance(model, PreTrainedModel) or is_peft_model else None
        if getattr(self, "_peft_config", None) is not None and self._model_object is not None and not is_peft_model:
            from peft import get_peft_model  # TRL wraps the model it is given, as here

            self._model_object = get_peft_model(self._model_object, self._peft_config)
        self._model, self._model_is_stale, self._ref_model, self._stream_rows = self._model_object, False, None, None
        self._entropy_coef = None  # the adaptive controller's last value, after train()
        self._ref_is_mixed = False  # self._ref_model is a TR-DPO run's mixed reference
        if streamed:
            if self.args.accelerator_config.dispatch_batches is True:
                raise ValueError("Iterable datasets require `dispatch_batches=False` (GRPOConfig(accelerator_config="
                                 "{'dispatch_batches': True}) was given): each process reads the stream itself")
            if self._cfg.train.max_steps <= 0:
                raise ValueError("train_dataset is an IterableDataset (streaming): it has no length, so max_steps "
                                 "has to be set (GRPOConfig(max_steps=...))")
            self.args.set_for_stream()  # as TRL: dispatch_batches=False, dataloader_num_workers=0
            # as TRL: an iterable dataset is read in its own order (no sampler shuffles it)
            self._cfg = dataclasses.replace(self._cfg, train=dataclasses.replace(self._cfg.train,
                                                                                   shuffle_dataset=False))
        schedule = EvalSchedule.from_args(self.args)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if schedule.strategy != "no" and not self._eval_sets:
            raise ValueError(f"GRPOConfig(eval_strategy={schedule.strategy!r}) evaluates during training, but no "
                             "eval_dataset was passed to GRPOTrainer: pass one or set eval_strategy='no'")
        g = self._cfg.grpo.num_generations_eval or self._cfg.grpo.num_generations
        if schedule.is_on and (schedule.batch_size * world) % g:
            raise ValueError(f"per_device_eval_batch_size={schedule.batch_size} x {world} process(es) = "
                             f"{schedule.batch_size * world} completions per evaluation step is not a multiple of "
                             f"num_generations_eval={g} (num_generations when unset)")
        self._hooks = TrainerHooks(self.args, list(callbacks or []), self._processing_class,
                                   self._eval_sets if schedule.is_on else None, schedule, world)
        self._hooks.state.max_steps = self._cfg.train.max_steps
        self._hooks.event("on_init_end")

    # -- TRL's attributes -------------------------------------------------------------------------------------------

    def _unbuilt(self) -> dict | None:
        """A trainer whose `__init__` never ran (TRL's unit tests build one with `object.__new__(GRPOTrainer)` and
        assign `model`, `state`, `processing_class` to test `_generate` alone) keeps those as plain values: this
        dict of them. None for a trainer built by `__init__` (its attributes are the properties below)."""
        if "_cfg" in vars(self):
            return None
        return vars(self).setdefault("_unbuilt_attributes", {})

    def _unbuilt_get(self, name: str) -> Any:
        try:
            return self._unbuilt()[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__}.{name}: the trainer was not built by __init__ and "
                                 f"{name} was never assigned") from None

    @property
    def state(self) -> Any:
        """transformers' `TrainerState` (global_step, log_history, epoch, ...), shared with the callbacks."""
        if self._unbuilt() is not None:
            return self._unbuilt_get("state")
        return self._hooks.state

    @state.setter
    def state(self, value: Any) -> None:
        """Only on a trainer not built by `__init__` (`_unbuilt`); a built trainer's state is its callbacks'."""
        if self._unbuilt() is None:
            raise AttributeError("trainer.state is the TrainerState the callbacks share; change its fields instead")
        self._unbuilt()["state"] = value

    @property
    def callback_handler(self) -> Any:
        """transformers' `CallbackHandler` holding the callbacks (HF's flow callback first)."""
        return self._hooks.handler

    def add_callback(self, callback: Any) -> None:
        """Add a `TrainerCallback` instance or class (a class is instantiated), as HF's Trainer."""
        self._hooks.handler.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return a callback (an instance, or the first of a class); None if absent."""
        return self._hooks.handler.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback (an instance, or the first of a class)."""
        self._hooks.handler.remove_callback(callback)

    def _current_model_dir(self) -> Path:
        """The policy's weights now: the export after `train()`, else the initial model."""
        if self._trained:
            return self.output_dir / EXPORT_DIR
        return model_directory(self.model_path, self.output_dir)

    @property
    def model(self) -> Any:
        """The policy as a transformers `PreTrainedModel` on this process's CPU: the initial weights before
        `train()`, the trained ones after (loaded from `<output_dir>/hf` when first read; a model
        object passed as `model` is that object, its parameters overwritten with the trained ones). It holds
        the whole model in memory: a checkpoint over 80% of the available memory raises MemoryError naming how to
        load the export instead (`check_fits_in_memory`; e.g. `AutoModelForCausalLM.from_pretrained(
        f"{args.output_dir}/hf", device_map="auto")` where it fits)."""
        if self._unbuilt() is not None:
            return self._unbuilt_get("model")
        if self._model is None or self._model_is_stale:
            peft_config = getattr(self, "_peft_config", None)
            if peft_config is not None and self._model_object is None:  # LoRA: a PeftModel, as TRL's
                from peft import get_peft_model

                base = load_causal_lm(model_directory(self.model_path, self.output_dir))
                self._model_object = get_peft_model(base, peft_config)
                if not self._trained:
                    self._model = self._model_object
                    return self._model
            check_fits_in_memory(self._current_model_dir())
            self._model = load_causal_lm(self._current_model_dir(), into=self._model_object)
            self._model_is_stale = False
        if getattr(self.args, "cast_lm_head_to_fp32", False):
            from engine.api.trl_compat import cast_lm_head_to_fp32

            cast_lm_head_to_fp32(self._model)
        return self._model

    @model.setter
    def model(self, value: Any) -> None:
        """`trainer.model = m` before `train()`, as on HF's Trainer: the transformers `PreTrainedModel` `m` becomes
        the policy the run trains (and `trainer.model`), with its weights as they are now: it is saved under
        `<output_dir>/initial_model`, which Megatron and vLLM load. Where the assignment could not act (anything
        but a `PreTrainedModel`, after `train()`, with a `peft_config`) it raises, naming why."""
        import dataclasses

        from transformers import PreTrainedModel

        if self._unbuilt() is not None:
            self._unbuilt()["model"] = value
            return
        if not isinstance(value, PreTrainedModel):
            raise TypeError(f"trainer.model must be a transformers PreTrainedModel, got {type(value).__name__}: the "
                            "engine trains a Megatron copy of the policy built from a checkpoint, so only a model it "
                            "can save as one replaces the policy (or pass model=... to GRPOTrainer)")
        if getattr(self, "_trained", False):
            raise RuntimeError("trainer.model cannot be replaced after train(): the run is over and the engine torn "
                               "down; build a new GRPOTrainer(model=...) to train or evaluate another model")
        if getattr(self, "_peft_config", None) is not None:
            raise RuntimeError("trainer.model cannot be replaced on a trainer with a peft_config: pass the model "
                               "to GRPOTrainer(model=..., peft_config=...) instead")
        path = save_model_object(value, self.processing_class, self.output_dir / INITIAL_MODEL_DIR,
                                 "trainer.model: a model without a name_or_path needs the trainer's processing_class")
        self.model_path = Path(path)
        self._cfg = dataclasses.replace(self._cfg, model=dataclasses.replace(self._cfg.model, name_or_path=path))
        self._check_layout()
        self._model_object = self._model = value
        self._model_is_stale = False

    @property
    def ref_model(self) -> Any:
        """TRL's reference model: None when beta == 0 (none is built), else the initial weights (a transformers
        model, loaded when first read); after a TR-DPO run (sync_ref_model) the mixed reference the run ended with
        (`<output_dir>/hf_reference`, exported next to the policy)."""
        if self._cfg.grpo.beta == 0:
            return None
        mixed = self._cfg.grpo.sync_ref_model and self._trained
        if self._ref_model is None or mixed != self._ref_is_mixed:
            where = self.output_dir / f"{EXPORT_DIR}_reference" if mixed else model_directory(self.model_path,
                                                                                            self.output_dir)
            self._ref_model, self._ref_is_mixed = load_causal_lm(where), mixed
        return self._ref_model

    @property
    def processing_class(self) -> Any:
        """The tokenizer given, else the model's own (loaded when first read)."""
        if self._unbuilt() is not None:
            return self._unbuilt_get("processing_class")
        if self._processing_class is None:
            from transformers import AutoTokenizer

            self._processing_class = AutoTokenizer.from_pretrained(model_directory(self.model_path,
                                                                                   self.output_dir))
        return self._processing_class

    @processing_class.setter
    def processing_class(self, value: Any) -> None:
        """Only on a trainer not built by `__init__` (`_unbuilt`); pass processing_class= to GRPOTrainer."""
        if self._unbuilt() is None:
            raise AttributeError("trainer.processing_class is fixed at construction: pass processing_class= to "
                                 "GRPOTrainer (prompts are tokenized with it before training)")
        self._unbuilt()["processing_class"] = value

    @property
    def reward_processing_classes(self) -> list:
        """One entry per reward function, as TRL: a reward model's tokenizer, None for a callable."""
        from engine.train.rewards import RewardModelReward

        return [f.tokenizer if isinstance(f, RewardModelReward) else None for f in self.reward_funcs]

    @property
    def reward_weights(self) -> "torch.Tensor":  # noqa: F821 (torch is imported lazily)
        """The weight of each reward function, float32, as TRL's tensor (args.reward_weights, else 1 each; an
        environment's `get_reward` column weighs 1). Read-only: set them through GRPOConfig(reward_weights=...)."""
        import torch

        weights = self._cfg.reward.reward_weights
        return torch.tensor(weights if weights is not None else [1.0] * len(self.reward_funcs), dtype=torch.float32)

    @property
    def entropy_coef(self) -> float:
        """The entropy-bonus coefficient: args.entropy_coef before `train()`, the adaptive controller's last value
        after it (TRL's attribute; set it through GRPOConfig(entropy_coef=...))."""
        return self._entropy_coef if self._entropy_coef is not None else self._cfg.grpo.entropy_coef

    @property
    def _entropy_bonus_enabled(self) -> bool:
        """TRL's flag: the entropy bonus is in the loss (entropy_coef != 0 or use_adaptive_entropy)."""
        return self._cfg.grpo.entropy_coef != 0.0 or self._cfg.grpo.use_adaptive_entropy

    @_entropy_bonus_enabled.setter
    def _entropy_bonus_enabled(self, value: bool) -> None:
        """TRL's tests assign the flag after `entropy_coef` / `use_adaptive_entropy`: it is derived from them here,
        so an assignment that agrees is accepted and one that does not raises, naming the settings to change."""
        if bool(value) != self._entropy_bonus_enabled:
            raise ValueError(f"_entropy_bonus_enabled={value} contradicts entropy_coef={self.entropy_coef} and "
                             f"use_adaptive_entropy={self.use_adaptive_entropy}, from which it follows: set those")

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        """Before `train()`: the coefficient the run starts from (grpo.entropy_coef); after it, an error."""
        self._set_grpo_before_train("entropy_coef", float(value))

    @property
    def use_adaptive_entropy(self) -> bool:
        """TRL's attribute: the Skywork-OR1 adaptive entropy controller is on (grpo.use_adaptive_entropy)."""
        return self._cfg.grpo.use_adaptive_entropy

    @use_adaptive_entropy.setter
    def use_adaptive_entropy(self, value: bool) -> None:
        """Before `train()`: switches the adaptive controller (grpo.use_adaptive_entropy); after it, an error."""
        self._set_grpo_before_train("use_adaptive_entropy", bool(value))

    def _set_grpo_before_train(self, name: str, value: Any) -> None:
        """TRL's trainer attribute `name` assigned: the run's grpo.<name>, checked again; refused after train()."""
        import dataclasses

        if getattr(self, "_trained", False):
            raise RuntimeError(f"trainer.{name} cannot be changed after train(): the run is over")
        self._cfg = dataclasses.replace(self._cfg, grpo=dataclasses.replace(self._cfg.grpo, **{name: value}))
        self._check_layout()
        setattr(self.args, name, value)  # trainer.args says what the run does

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's flag: the policy is a MoE model (its config has `output_router_logits`) trained with a non-zero
        load-balancing loss (model.moe_aux_loss_coeff, TRL's router_aux_loss_coef; None: the config's)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_directory(self.model_path, self.output_dir))
        config = getattr(config, "text_config", None) or config
        coef = self._cfg.model.moe_aux_loss_coeff
        coef = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
        return hasattr(config, "output_router_logits") and bool(coef)

    @property
    def _logs(self) -> dict:
        """TRL's completion log (a private attribute TRL's tests read): the last logged completions table
        (`<output_dir>/completions/*.parquet`, written with `log_completions=True`; empty without one) as
        {"images": [], "prompt", "completion", "rewards": {name: values}, "advantages", "extra": {column: values}}
        (extra: the reward functions' `log_extra` columns)."""
        from engine.train.metric_sinks import COMPLETIONS_DIR

        logs: dict = {"images": [], "prompt": [], "completion": [], "rewards": {}, "advantages": [], "extra": {}}
        tables = sorted((self.output_dir / COMPLETIONS_DIR).glob("completions_*.parquet"))
        if not tables:
            return logs
        import pandas as pd

        frame = pd.read_parquet(tables[-1])
        names = set(self.reward_func_names)
        for column in frame.columns:
            values = frame[column].tolist()
            if column in ("prompt", "completion"):
                logs[column] = values
            elif column == "advantage":
                logs["advantages"] = values
            elif column in names:
                logs["rewards"][column] = values
            elif column != "step":
                logs["extra"][column] = values
        return logs

    # -- data -------------------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        """TRL's method, for inspection: a `torch.utils.data.DataLoader` over the train rows (a stream's rows
        for max_steps, else the dataset) in batches of per_device_train_batch_size, as lists of row dicts, with
        args.dataloader_num_workers workers (0 for a stream, as TRL). The engine does not train from it: it
        tokenizes every prompt up front and samples its own batches (engine/train/sampling.py)."""
        return _row_loader(self._train_rows(), self.args.per_device_train_batch_size,
                           self.args.dataloader_num_workers)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """TRL's method, for inspection: as `get_train_dataloader`, over an eval set (the one given, else the only
        one, else a name of the dict given at construction) in batches of per_device_eval_batch_size; an iterable
        eval set gets 0 workers (TRL's scoped override: args.dataloader_num_workers is left as it is)."""
        given = self.eval_dataset if eval_dataset is None or isinstance(eval_dataset, str) else eval_dataset
        if isinstance(eval_dataset, str):
            given = given[eval_dataset]
        if given is None:
            raise ValueError("get_eval_dataloader needs an eval_dataset: pass one here or to GRPOTrainer")
        workers = 0 if is_stream(given) else self.args.dataloader_num_workers
        sets = eval_sets(given, self._cfg.data.eval_max_prompts)
        if len(sets) != 1:
            raise ValueError(f"get_eval_dataloader: eval_dataset has {len(sets)} sets {list(sets)}; name one")
        return _row_loader(next(iter(sets.values())), self._hooks.schedule.batch_size, workers)

    def _train_rows(self) -> Any:
        """The train dataset the engine reads: a stream's rows for max_steps steps (read once), else as given."""
        if not is_stream(self.train_dataset):
            return self.train_dataset
        if self._stream_rows is None:
            derived = self._derived
            needed = stream_rows_needed(self._cfg.train.max_steps, derived, self._cfg.grpo.num_iterations,
                                        self._cfg.train.gradient_accumulation_steps)
            self._stream_rows = materialise_stream(self.train_dataset, needed, "train_dataset")
        return self._stream_rows

    # -- evaluation -------------------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """TRL's `evaluate`: completions of the eval set(s) by the current policy (the trained one after
        `train()`), scored by the reward functions; returns `<prefix>_reward`, `<prefix>_rewards/<name>/mean`,
        `<prefix>_completions/mean_length`, ... (`<prefix>_<name>_*` for each set of a dict), HF's
        `<prefix>_runtime` / `_samples_per_second` / `_steps_per_second`, and `epoch`. Starts the engine for the
        call (every rank under torchrun); logged to `state.log_history` and heard by the callbacks
        (`on_evaluate`).

        Raises:
            ValueError: no eval dataset here or at construction.
        """
        import dataclasses

        from engine.api.trl_generate import patched_since_construction
        from engine.train.loop import evaluate_only

        patched_since_construction(self, getattr(self, "_dispatch_overrides", []))  # the rollout chosen at __init__
        sets = eval_sets(eval_dataset, self._cfg.data.eval_max_prompts) if eval_dataset is not None \
            else self._eval_sets
        if not sets:
            raise ValueError("evaluate() needs an eval_dataset: pass one here or to GRPOTrainer")
        cfg = self._cfg
        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, name_or_path=str(self._current_model_dir())),
            train=dataclasses.replace(cfg.train, output_dir=str(self.output_dir / "evaluate")),
            checkpoint=dataclasses.replace(cfg.checkpoint, resume_from_checkpoint=None))
        g = cfg.grpo.num_generations_eval or cfg.grpo.num_generations
        metrics = evaluate_only(cfg, train_dataset=self._train_rows(), eval_datasets=sets,
                                 reward_funcs=self.reward_funcs, tokenizer=self._processing_class,
                                 num_generations=g, batch_size=self._hooks.eval_batch_size,
                                 metric_key_prefix=metric_key_prefix,
                                 agentic=getattr(self, "_agentic", None) and self._agentic.loop_inputs or None)
        metrics["epoch"] = self.state.epoch or 0.0
        self.state.log_history.append({**metrics, "step": self.state.global_step})
        self._hooks.event("on_evaluate", metrics=metrics)
        return metrics


def _row_loader(dataset: Any, batch_size: int, num_workers: int) -> Any:
    """A DataLoader of `dataset`'s rows (dicts) in batches (lists) of `batch_size`, in order."""
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                      collate_fn=lambda rows: rows)
