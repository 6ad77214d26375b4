"""transformers callbacks and TRL's evaluation schedule for `GRPOTrainer`, over the loop's hook points.

Owns: `TrainerHooks` (engine/train/hooks.py `LoopHooks` implemented with transformers' own `CallbackHandler`,
`TrainerState` and `TrainerControl`: the user's `TrainerCallback` instances or classes hear `on_train_begin`,
`on_epoch_begin/end`, `on_step_begin/end`, `on_log` (the step's record), `on_evaluate`, `on_save`, `on_train_end`;
their `should_training_stop` / `should_save` / `should_evaluate` / `should_log` are handed back to the loop),
`EvalSchedule` (TRL's `eval_strategy` / `eval_steps` / `eval_on_start` / `per_device_eval_batch_size`, read from the
GRPOConfig) and `FlowCallback` (HF's DefaultFlowCallback for that schedule: it sets `should_evaluate` on eval steps
and `should_training_stop` at max_steps, first in the list as in HF's Trainer).

The hooks run on rank 0 only (the loop calls them through `on_rank0`): once per step in the user's process, however
many ranks train. During `train()` the policy lives in Megatron's shards, so the events' `model` is None.

Must not: import the loop or Megatron (the loop calls in), or trl.

Test: tests/unit/test_trl_api.py (schedule checks), tests/integration/test_trl_api_run.py (callbacks in a real run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerControl,
    TrainerState,
)

from engine.train.hooks import Decision, LoopHooks

EVAL_STRATEGIES = ("no", "steps", "epoch")


@dataclass(frozen=True)
class EvalSchedule:
    """When `train()` evaluates (HF's TrainingArguments semantics)."""

    strategy: str = "no"
    steps: int | None = None
    """Evaluate every `steps` optimizer steps (strategy "steps"); None = logging_steps, as HF."""
    on_start: bool = False
    batch_size: int = 8
    """per_device_eval_batch_size."""

    @classmethod
    def from_args(cls, args: Any) -> EvalSchedule:
        """Read and check TRL's fields; ValueError naming the field."""
        strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
        if strategy not in EVAL_STRATEGIES:
            raise ValueError(f"eval_strategy={strategy!r}: expected one of {list(EVAL_STRATEGIES)}")
        steps = args.eval_steps
        if steps is not None:
            if isinstance(steps, float) and 0 < steps < 1:
                if args.max_steps <= 0:
                    raise ValueError(f"eval_steps={steps}: a fraction of the run needs max_steps > 0")
                steps = max(1, math.ceil(steps * args.max_steps))
            if int(steps) != steps or steps < 1:
                raise ValueError(f"eval_steps={steps}: expected a whole number of steps >= 1 (or a float in (0, 1))")
            steps = int(steps)
        if strategy == "steps" and steps is None:
            steps = args.logging_steps
        batch_size = int(args.per_device_eval_batch_size)
        if batch_size < 1:
            raise ValueError(f"per_device_eval_batch_size={batch_size}: expected >= 1")
        return cls(strategy, steps, bool(args.eval_on_start), batch_size)

    @property
    def is_on(self) -> bool:
        return self.strategy != "no" or self.on_start


class FlowCallback(DefaultFlowCallback):
    """HF's flow for this engine: `should_evaluate` on eval steps / epoch ends, `should_training_stop` at max_steps.
    Logging and saving follow the engine's logging_steps / save_steps (the loop's own schedule); a callback may
    still ask for either."""

    def __init__(self, schedule: EvalSchedule):
        self.schedule = schedule

    def on_step_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        s = self.schedule
        if s.strategy == "steps" and state.global_step % s.steps == 0:
            control.should_evaluate = True
        if state.global_step >= state.max_steps:
            control.should_training_stop = True
        return control

    def on_epoch_end(self, args, state: TrainerState, control: TrainerControl, **kwargs):
        if self.schedule.strategy == "epoch":
            control.should_evaluate = True
        return control


class TrainerHooks(LoopHooks):
    """The loop's hooks as transformers' callback events (see the module docstring)."""

    def __init__(self, args: Any, callbacks: list, processing_class: Any, eval_sets: dict | None,
                 schedule: EvalSchedule, world_size: int):
        self.args = args
        self.schedule = schedule
        self.handler = CallbackHandler([FlowCallback(schedule), *callbacks], None, processing_class, None, None)
        self.state = TrainerState(logging_steps=args.logging_steps, eval_steps=schedule.steps or 500,
                                  save_steps=args.save_steps, train_batch_size=args.per_device_train_batch_size,
                                  num_train_epochs=args.num_train_epochs, log_history=[])
        self.control = TrainerControl()
        self.eval_sets = eval_sets
        self.eval_num_generations = args.num_generations_eval
        self.eval_batch_size = schedule.batch_size * world_size

    def event(self, name: str, **kwargs) -> None:
        self.control = getattr(self.handler, name)(self.args, self.state, self.control, **kwargs)

    def train_begin(self, step: int, max_steps: int) -> Decision:
        self.state.global_step, self.state.max_steps = step, max_steps
        self.event("on_train_begin")
        return Decision(evaluate=bool(self.eval_sets) and self.schedule.on_start)

    def epoch_begin(self, epoch: float) -> None:
        self.state.epoch = epoch
        self.event("on_epoch_begin")

    def epoch_end(self, epoch: float) -> None:
        self.state.epoch = epoch
        self.event("on_epoch_end")

    def step_begin(self, step: int) -> None:
        self.event("on_step_begin")

    def step_end(self, step: int) -> None:
        self.state.global_step = step
        self.event("on_step_end")

    def round_end(self, step: int, record: dict | None, epoch: float, log_now=None) -> Decision:
        self.state.epoch = epoch
        if record is None and self.control.should_log and log_now is not None:
            record = log_now()  # a callback asked for a log on a step the schedule skips
        if record is not None:
            logs = {k: v for k, v in record.items() if k not in ("step", "elapsed_s")}
            if "num_tokens" in logs:
                self.state.num_input_tokens_seen = int(logs["num_tokens"])
            self.state.log_history.append({**logs, "step": step})
            self.event("on_log", logs=logs)
        c = self.control
        decision = Decision(evaluate=c.should_evaluate and bool(self.eval_sets), save=c.should_save,
                            stop=c.should_training_stop)
        c.should_log = c.should_evaluate = c.should_save = False  # handed to the loop, which acts on them
        return decision

    def evaluated(self, step: int, metrics: dict) -> None:
        self.state.log_history.append({**metrics, "epoch": self.state.epoch, "step": step})
        self.event("on_evaluate", metrics=metrics)

    def saved(self, step: int, path: Any) -> None:
        self.event("on_save")

    def train_end(self, step: int) -> None:
        self.state.global_step = step
        self.event("on_train_end")
