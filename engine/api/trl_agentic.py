"""TRL's agentic arguments of `GRPOTrainer`: `tools`, `environment_factory`, `rollout_func`, checked at
construction and handed to the loop (engine/agent/ runs them).

Owns: `AgenticInputs` (what `GRPOTrainer` hands to `engine.train.loop.train` as `agentic=`, and the reward
functions and weights that environments with `get_reward` add), `BoundRolloutFunc` (the user's `rollout_func` bound
to the trainer, or for a round generated ahead to a `trainer_view` of it) and `resolve_agentic` (the construction-time
checks: every tool's schema, each environment has `reset` and documented tool methods, the chat template renders
tools, naming the model; without a train_dataset, `max_steps` and a placeholder dataset, as TRL).

Must not: run tools or generate (engine/agent/), import vLLM or Megatron.

Test: tests/unit/test_agent_tools.py (construction errors), tests/integration/test_agentic.py (a run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.agent.chat_tokens import check_renders_tools
from engine.agent.environments import EnvironmentPool, environment_tools
from engine.agent.toolbox import tool_schema


@dataclass
class AgenticInputs:
    """The loop's `agentic=` inputs and what they add to the reward functions."""

    loop_inputs: dict = field(default_factory=dict)
    """tools / environment_factory / rollout_func (the latter bound to the trainer: `rollout_func(prompts)`)."""
    reward_funcs: list = field(default_factory=list)
    """One per environment with `get_reward` (named after its class, weight 1)."""
    tools: list = field(default_factory=list)
    """TRL's `trainer.tools`: the tools given, then each environment's public methods (of its first instance)."""


def resolve_agentic(trainer: Any, tools: list | None, rollout_func: Any, environment_factory: Any, *,
                    tokenizer: Any, model_name: str, chat_template_kwargs: dict | None) -> AgenticInputs:
    """Check TRL's agentic arguments now (module docstring); `tokenizer`: the policy's, or None when it is not
    known before `train()` (the template is then checked when the run starts)."""
    if not tools and rollout_func is None and environment_factory is None:
        return AgenticInputs()
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of callables, got {type(tools).__name__}")
    if rollout_func is not None and (tools or environment_factory is not None):
        raise ValueError("rollout_func builds whole rollouts itself: pass it without tools / environment_factory")
    if rollout_func is not None and not callable(rollout_func):
        raise TypeError(f"rollout_func must be callable: rollout_func(prompts, trainer) -> dict, got "
                        f"{type(rollout_func).__name__}")
    schemas = [tool_schema(t) for t in tools or []]
    pool = EnvironmentPool(environment_factory) if environment_factory is not None else None
    schemas += [s for per_env in (pool.schemas.values() if pool else []) for s in per_env]
    if schemas and tokenizer is not None:
        check_renders_tools(tokenizer, schemas, model_name, chat_template_kwargs)
    bound = BoundRolloutFunc(rollout_func, trainer) if rollout_func is not None else None
    env_tools = [m for pool_ in (pool.instances.values() if pool else []) for m in environment_tools(pool_[0]).values()]
    return AgenticInputs({"tools": list(tools or []) or None, "environment_factory": pool,  # built once, reused
                          "rollout_func": bound}, pool.reward_functions() if pool else [], [*(tools or []), *env_tools])


class BoundRolloutFunc:
    """TRL's `rollout_func(prompts, trainer)` bound to its trainer: the loop calls it with the prompts alone."""

    def __init__(self, rollout_func: Any, trainer: Any):
        self.rollout_func, self.trainer = rollout_func, trainer

    def __call__(self, prompts: list) -> dict:
        return self.rollout_func(prompts, self.trainer)

    def for_round_ahead(self, tokenizer: Any) -> BoundRolloutFunc:
        """Bound to a view of the trainer for a round generated ahead (`rollout.max_staleness` > 0): rank 0's
        background thread calls it while the trainer trains in the main thread (engine/train/sampling.py
        `PendingAgenticRound`), so it must not share what the main thread changes. The view (`trainer_view`) is a
        shallow copy of the trainer taken when the round is issued: its `state` a copy (`global_step` is the step
        the round was issued at, whose weights the engine holds for the whole round), its `processing_class` the
        background thread's own tokenizer (a fast tokenizer is not safe to share between threads); generating
        through `trainer._generate_single_turn` (or an override's `super()._generate`) uses the engine's turn
        channel, which the trainer's thread does not use meanwhile. What it must not touch: `trainer.model` (being
        trained: read it through the engine, which holds the round's weights) and anything the user's function
        assigns on the view, which does not reach the trainer."""
        return BoundRolloutFunc(self.rollout_func, trainer_view(self.trainer, tokenizer))


def trainer_view(trainer: Any, tokenizer: Any) -> Any:
    """A shallow copy of a built `GRPOTrainer` with its own `processing_class` (`tokenizer`) and a copy of its
    `state` (TrainerState) as it is now (`BoundRolloutFunc.for_round_ahead`); a trainer not built by `__init__`
    (TRL's unit tests assign its attributes) is copied as it is."""
    import copy

    view = copy.copy(trainer)
    hooks = vars(trainer).get("_hooks")
    if hooks is not None:
        hooks = copy.copy(hooks)
        hooks.state = copy.copy(hooks.state)
        hooks.state.log_history = list(hooks.state.log_history)
        vars(view).update(_hooks=hooks, _processing_class=tokenizer)
    return view


PLACEHOLDER_ROWS = 1024
"""Rows of the placeholder dataset (empty prompts: the run's length is max_steps, whatever the rows)."""


def placeholder_dataset(num_rows: int):
    """TRL's dataset when an environment owns the data: `num_rows` empty user prompts (reset() supplies them)."""
    import datasets

    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * num_rows})


def with_placeholder_prompts(dataset):
    """A dataset without a `prompt` column (the environments own the data, e.g. only an `environment` column) gets
    TRL's placeholder: an empty user message per row; others are returned as they are."""
    if dataset is None or "prompt" in getattr(dataset, "column_names", ["prompt"]):
        return dataset
    return dataset.add_column("prompt", [[{"role": "user", "content": ""}]] * len(dataset))
