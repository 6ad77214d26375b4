"""The loop's hook points: what `engine.train.loop.train` tells its caller at named points of a run, and what the
caller may ask of the loop in return (evaluate now, save now, stop).

Owns: `LoopHooks` (the no-op base the loop calls; engine/api/trl_callbacks.py implements it with transformers'
callbacks), `Decision` (the caller's requests at a round boundary), `on_rank0` (a hook runs once, on rank 0: the user's
process however many ranks train; a decision is broadcast so every rank acts alike) and
`scheduled_evaluation` (a requested evaluation on every rank, reported back through the hooks).

Must not: hold loop logic (engine/train/loop.py decides where each hook is called), import transformers' callback
machinery (engine/api/), or read Megatron's global parallel state.

Test: tests/integration/test_trl_api_run.py (callbacks, scheduled evaluation and stop requests through a real run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist


@dataclass
class Decision:
    """What the caller asks at a round boundary (HF's TrainerControl: should_evaluate, should_save,
    should_training_stop)."""

    evaluate: bool = False
    save: bool = False
    stop: bool = False


class LoopHooks:
    """Called by the loop on rank 0 only (through `on_rank0`); every method may be left as this no-op.

    Steps are optimizer steps, 1-based after `step_end`; a round (one generation batch) holds one or more.
    """

    eval_sets: dict | None = None
    """name (None: a single set) -> in-memory `datasets.Dataset` evaluated when a `Decision` asks for it."""
    eval_num_generations: int | None = None
    eval_batch_size: int = 1

    def train_begin(self, step: int, max_steps: int) -> Decision:
        """Before the first round (`step` > 0 when resumed); may ask for an evaluation (eval_on_start)."""
        return Decision()

    def epoch_begin(self, epoch: float) -> None:
        """A round starts a new pass over the dataset."""

    def epoch_end(self, epoch: float) -> None:
        """The round that finished a pass over the dataset ended."""

    def step_begin(self, step: int) -> None:
        """Before optimizer step `step + 1`."""

    def step_end(self, step: int) -> None:
        """After optimizer step `step`."""

    def round_end(self, step: int, record: dict | None, epoch: float, log_now: Callable | None = None) -> Decision:
        """After the round's metrics: `record` is the logged record (None when this step logged nothing);
        `log_now()` writes the metrics gathered since the last record now and returns that record."""
        return Decision()

    def evaluated(self, step: int, metrics: dict) -> None:
        """After a requested evaluation, with its `eval_*` metrics (also logged to the metric sinks)."""

    def saved(self, step: int, path: Any) -> None:
        """After a checkpoint was written."""

    def train_end(self, step: int) -> None:
        """After the last round (before the final checkpoint and export)."""


def on_rank0(ps, hook: Callable, *args, agree: bool = True) -> Any:
    """`hook(*args)` on rank 0; with `agree` its result is broadcast to every rank (collective), else only rank 0's
    call returns it (a notification: no collective)."""
    result = [hook(*args) if ps.rank == 0 else None]
    if agree and ps.world_size > 1:
        dist.broadcast_object_list(result, src=0)
    return result[0]


def scheduled_evaluation(run, hooks: LoopHooks, step: int, prepared: dict, loss_of: Callable | None = None) -> dict:
    """Evaluate the hooks' eval sets now (every rank), log the record and report it (rank 0); `prepared` caches
    the tokenized sets between calls; `loss_of` computes the eval loss (engine/train/round_batch.py `eval_loss`). Returns the
    `eval_*` metrics."""
    from engine.train.evaluation import evaluate_sets, tokenize_eval_sets

    if not hooks.eval_sets:
        return {}
    if not prepared:
        prepared.update(tokenize_eval_sets(run, hooks.eval_sets))
    g = hooks.eval_num_generations or run.cfg.grpo.num_generations_eval or run.cfg.grpo.num_generations
    metrics = evaluate_sets(run, prepared, num_generations=g, batch_size=hooks.eval_batch_size, loss_of=loss_of)
    if run.ps.rank == 0:
        run.logger.sinks.write(step, {"step": step, **metrics})
        hooks.evaluated(step, metrics)
    return metrics
