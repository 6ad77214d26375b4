"""`grpo-engine grpo`: TRL's `trl grpo` command line over this engine (`GRPOTrainer` of engine/api/trl_trainer.py).

Owns: the script's argument dataclasses with TRL 1.16's names and defaults (`ScriptArguments`, with the GRPO
script's `reward_model_name_or_path` / `reward_funcs`, and `ModelConfig`), the parser (`ArgumentParser`:
transformers' HfArgumentParser plus TRL's `--config recipe.yaml`, whose values become the flags' defaults and whose
`env:` mapping sets environment variables), loading the dataset by name or local path, the reward functions by
TRL's names or dotted paths, and `main`, which runs what TRL's `trl/scripts/grpo.py` runs: train, save the model to
output_dir, print on the main process.

Where TRL's script and this one differ: ModelConfig's `dtype` at TRL's default ('float32', the weights TRL loads
before its bf16 autocast) leaves the precision to `bf16` / `fp16` (Megatron's bf16 with float32 master weights);
set explicitly it is the model dtype. `model_revision` other than 'main', 4 / 8-bit loading and DoRA are refused by
name; TRL's dataset mixtures (`datasets:`) are not taken.

Must not: import trl (a test-only dependency) or start the engine before the arguments are checked.

Test: tests/unit/test_trl_script.py (flags and YAML recipes into the configs, datasets, rewards),
tests/integration/test_trl_cli_run.py (a tiny run from a YAML recipe).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.api.trl_config import GRPOConfig

PROG = "grpo-engine grpo"


@dataclass
class ScriptArguments:
    """TRL's `ScriptArguments` and the GRPO script's own arguments."""

    dataset_name: str | None = field(default=None, metadata={
        "help": "Dataset: a hub name, a local directory or save_to_disk copy, a .json / .jsonl / .parquet / .arrow / "
                ".csv file (its split is 'train'), or builtin:arithmetic."})
    dataset_config: str | None = field(default=None, metadata={"help": "The dataset's configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={
        "help": "Split to evaluate on (used when eval_strategy is not 'no', as TRL)."})
    dataset_streaming: bool = field(default=False, metadata={
        "help": "Stream the dataset (an IterableDataset: needs max_steps)."})
    ignore_bias_buffers: bool = field(default=False, metadata={
        "help": "TRL's DDP setting for bool buffers; no effect in this engine (Megatron owns the model)."})
    reward_model_name_or_path: str | None = field(default=None, metadata={
        "help": "A sequence-classification reward model: a local directory or a hub id (the first reward)."})
    reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "Reward functions: TRL's names (accuracy_reward, reasoning_accuracy_reward, think_format_reward, "
                "get_soft_overlong_punishment with max_completion_len=1280, soft_punish_cache=256), a dotted import "
                "path (my_lib.rewards.my_reward) or module:function, or the engine's names (exact_match, length)."})


@dataclass
class ModelConfig:
    """TRL's `ModelConfig`: the model and its LoRA adapter."""

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "The policy: a local checkpoint directory, a hub name, or a builtin: name (builtin:tiny-qwen2)."})
    model_revision: str = field(default="main", metadata={"help": "Hub revision; only 'main' here."})
    dtype: str | None = field(default="float32", metadata={
        "help": "Model dtype. TRL's default 'float32' leaves it to bf16 / fp16 (mixed precision over float32 master "
                "weights); any other value is the policy's dtype.",
        "choices": ["auto", "bfloat16", "float16", "float32"]})
    attn_implementation: str | None = field(default=None, metadata={
        "help": "Attention implementation: eager, or any other name for the fused one (sdpa) where it applies."})
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters (peft.LoraConfig from lora_*)."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "LoRA target modules."})
    lora_target_parameters: list[str] | None = field(default=None, metadata={"help": "LoRA target parameters."})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={
        "help": "Modules trained in full and saved besides the adapter."})
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "PEFT task type."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA scaling (alpha / sqrt(r))."})
    use_dora: bool = field(default=False, metadata={"help": "DoRA; refused here (not supported)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "8-bit loading; refused here (no quantization)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "4-bit loading; refused here (no quantization)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "With load_in_4bit only.",
                                                              "choices": ["fp4", "nf4"]})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "With load_in_4bit only."})
    bnb_4bit_quant_storage: str | None = field(default=None, metadata={"help": "With load_in_4bit only."})


def _parser_class():
    from transformers import HfArgumentParser

    class ArgumentParser(HfArgumentParser):
        """HfArgumentParser plus TRL's `--config recipe.yaml`: the file's keys are the flags' defaults (flags given
        on the command line win), its `env:` mapping is set in the environment, an unknown key is an error."""

        def parse_args_and_config(self, args: list[str] | None = None) -> tuple:
            args = list(sys.argv[1:] if args is None else args)
            if "--config" in args:
                at = args.index("--config")
                if at + 1 >= len(args):
                    self.error("--config needs a YAML file")
                self.apply_recipe(args[at + 1])
                del args[at:at + 2]
            namespace, unknown = self.parse_known_args(args)
            if unknown:
                self.error(f"unrecognized arguments: {' '.join(unknown)}")
            push_to_hub = bool(namespace.push_to_hub)  # acted on by `main` after training, as TRL's script
            namespace.push_to_hub = False
            values = vars(namespace)
            objects = [cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.init})
                       for cls in self.dataclass_types]
            return (*objects, push_to_hub)

        def apply_recipe(self, path: str) -> None:
            import yaml

            recipe = yaml.safe_load(Path(path).read_text())
            if not isinstance(recipe, dict):
                raise ValueError(f"{path}: a recipe is a YAML mapping of argument names to values")
            env = recipe.pop("env", {}) or {}
            if not isinstance(env, dict):
                raise ValueError(f"{path}: `env` must be a mapping of environment variables")
            os.environ.update({str(key): str(value) for key, value in env.items()})
            used = set()
            for action in self._actions:
                if action.dest in recipe:
                    action.default, action.required = recipe[action.dest], False
                    used.add(action.dest)
            unknown = sorted(set(recipe) - used)
            if unknown:
                raise ValueError(f"{path}: unknown argument(s) {unknown}; `{PROG} --help` lists them")

    return ArgumentParser


def build_parser(prog: str = PROG) -> Any:
    """The parser over (ScriptArguments, GRPOConfig, ModelConfig), as TRL's `trl grpo` builds it."""
    parser = _parser_class()((ScriptArguments, GRPOConfig, ModelConfig), prog=prog,
                             description="GRPO training with TRL's arguments (trl grpo), run by this engine.")
    parser.add_argument("--config", metavar="RECIPE.yaml",
                        help="YAML recipe: argument names to values (command-line flags win); `env:` sets variables")
    return parser


@dataclass
class ParsedArguments:
    """What the command line asked for: TRL's three argument objects, and whether to push the model to the hub
    after training (`--push_to_hub`: GRPOConfig itself refuses pushing during training)."""

    script: ScriptArguments
    training: GRPOConfig
    model: ModelConfig
    push_to_hub: bool = False


def parse_arguments(argv: list[str] | None = None) -> ParsedArguments:
    """TRL-style flags (and `--config recipe.yaml`) -> the script, training and model arguments, the model
    arguments applied to the training arguments (`apply_model_arguments`)."""
    script_args, training_args, model_args, push = build_parser().parse_args_and_config(argv)
    return ParsedArguments(script_args, apply_model_arguments(training_args, model_args), model_args, push)


def apply_model_arguments(training_args: GRPOConfig, model_args: ModelConfig) -> GRPOConfig:
    """ModelConfig's dtype / attn_implementation as `model_init_kwargs` (as TRL's script does), LoRA as the
    engine's `lora` fields; what has no counterpart here is refused by name."""
    refused = {"load_in_8bit": "quantized loading is not supported", "load_in_4bit": "quantized loading is not "
               "supported", "use_dora": "DoRA is not supported"}
    for name, why in refused.items():
        if getattr(model_args, name):
            raise NotImplementedError(f"--{name}: {why}")
    if model_args.model_revision != "main":
        raise NotImplementedError(f"--model_revision {model_args.model_revision}: only the 'main' revision is "
                                  "resolved here; download that revision and pass its directory")
    init = dict(training_args.model_init_kwargs or {})
    if model_args.dtype not in (None, "float32"):  # TRL's default float32 + bf16 autocast = the engine's bf16
        init.setdefault("dtype", model_args.dtype)
    if model_args.attn_implementation is not None:
        init.setdefault("attn_implementation", model_args.attn_implementation)
    changes: dict[str, Any] = {"model_init_kwargs": init} if init else {}
    if model_args.use_peft:
        changes |= {"use_peft": True, "lora_r": model_args.lora_r, "lora_alpha": model_args.lora_alpha,
                    "lora_dropout": model_args.lora_dropout, "use_rslora": model_args.use_rslora}
        for name in ("lora_target_modules", "lora_target_parameters", "lora_modules_to_save"):
            if getattr(model_args, name) is not None:
                changes[name] = list(getattr(model_args, name))
    return training_args.replace(**changes) if changes else training_args


# ---------------------------------------------------------------------------------------------------------------
# datasets and rewards


def load_split(script_args: ScriptArguments, split: str) -> Any:
    """One split of the dataset: a hub name, a local data file (json / jsonl / parquet / arrow / csv: its one split
    is 'train'), a local directory or a `save_to_disk` copy, or `builtin:arithmetic` (engine/train/data.py's
    `load_dataset_split`); with `dataset_streaming`, datasets' stream of it."""
    name = script_args.dataset_name
    if not name:
        raise ValueError("--dataset_name is required: a hub dataset name, a local directory or a data file")
    if script_args.dataset_streaming:
        import datasets

        return datasets.load_dataset(name, name=script_args.dataset_config, split=split, streaming=True)
    from engine.train.data import load_dataset_split

    return load_dataset_split(name, split, script_args.dataset_config)


def trl_reward_functions() -> dict[str, Any]:
    """TRL's grpo script's reward names -> this engine's functions of the same behaviour."""
    from engine.train.builtin_rewards import (
        SoftOverlongPunishment,
        accuracy_reward,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    return {"accuracy_reward": accuracy_reward, "reasoning_accuracy_reward": reasoning_accuracy_reward,
            "think_format_reward": think_format_reward,
            "get_soft_overlong_punishment": SoftOverlongPunishment(max_completion_len=1280, soft_punish_cache=256)}


def resolve_rewards(script_args: ScriptArguments) -> list[Any]:
    """The reward functions of the script arguments: the reward model first (as TRL), then each of
    `reward_funcs`: a TRL name, a dotted path `package.module.function` (imported with the working directory on
    sys.path, as TRL), or a string GRPOTrainer resolves (`module:function`, the engine's built-in names)."""
    funcs: list[Any] = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    registry = trl_reward_functions()
    for name in script_args.reward_funcs or []:
        if name in registry:
            funcs.append(registry[name])
        elif ":" not in name and "." in name and not Path(name).exists():
            module_name, attribute = name.rsplit(".", 1)
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            try:
                funcs.append(getattr(importlib.import_module(module_name), attribute))
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"--reward_funcs {name}: cannot import it ({exc}); expected one of "
                                 f"{sorted(registry)}, a dotted path or module:function") from exc
        else:
            funcs.append(name)  # module:function, a built-in name or a reward-model directory: GRPOTrainer's
    if not funcs:
        raise ValueError(f"no reward: give --reward_funcs (e.g. {', '.join(sorted(registry))}) or "
                         "--reward_model_name_or_path")
    return funcs


# ---------------------------------------------------------------------------------------------------------------
# the run


def main(argv: list[str] | None = None) -> int:
    """Parse, train, save the model to output_dir, as TRL's `trl grpo`; returns the exit status."""
    parsed = parse_arguments(argv)
    script_args, training_args, model_args = parsed.script, parsed.training, parsed.model
    if not model_args.model_name_or_path:
        raise ValueError("--model_name_or_path is required")
    if script_args.ignore_bias_buffers:
        warnings.warn("ignore_bias_buffers=True has no effect in this engine (Megatron owns the model)", UserWarning)
    from engine.api.trl_trainer import GRPOTrainer

    use_eval = training_args.eval_strategy != "no"
    trainer = GRPOTrainer(model=model_args.model_name_or_path, reward_funcs=resolve_rewards(script_args),
                          args=training_args, train_dataset=load_split(script_args, script_args.dataset_train_split),
                          eval_dataset=load_split(script_args, script_args.dataset_test_split) if use_eval else None)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if parsed.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"Model pushed to the Hub: https://huggingface.co/{trainer.hub_model_id}.")
    trainer.end()
    return 0
