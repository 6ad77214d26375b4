"""Which slices of which generation rounds form each optimizer step: TRL's micro-step order over rounds.

TRL 1.16 (`GRPOTrainer._prepare_inputs` under the HF Trainer's accumulation loop) cuts every generation round into
`steps_per_generation` slices of `per_device_train_batch_size` completions per rank, serves them in order
`num_iterations` times (the round's micro-steps), and the HF Trainer takes `gradient_accumulation_steps` consecutive
micro-steps per optimizer step whatever round they come from. When `steps_per_generation * num_iterations` is not a
multiple of `gradient_accumulation_steps` an optimizer step therefore spans two rounds: the last slices of one round
are carried and trained together with the first slices of the next, each with its own round's old log-probs,
advantages and vLLM IS ratios (computed when that round was generated). A pass over the dataset ends with a
shorter optimizer step holding what is left (HF's last accumulation window of an epoch), so steps never span epochs.

Owns: `OptimizerStep` (one step's micro-batches and its global normaliser), `StepSchedule` (the carried slices and
the grouping), `uses_carried_slices`, `count_total_steps` (optimizer steps of a run by epochs, as HF counts them),
`rounds_for_steps` (rounds a run of N steps draws when no pass ends first) and `deferred_save_warning`.
Checkpoints hold no carried slice: a save that falls due while slices are carried (save_steps, a callback, SIGUSR1)
is written at the next round boundary that carries none (engine/train/loop.py; the warning names the interval).

Must not: run the model, touch process groups or read the config tree (it gets numbers).
Test: `pytest tests/unit/test_step_schedule.py`; the loop's use: tests/integration/test_resume.py
(`test_optimizer_steps_spanning_rounds...`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.grpo.policy_loss import LossNormalizer


@dataclass
class OptimizerStep:
    """One optimizer step (or one slice of one): this DP rank's micro-batches and the global loss normaliser."""

    microbatches: list[dict]
    """Padded rows, or rows by tokens and packed (engine/policy/packing.py), as engine/policy/batch.py lays them out."""
    normalizer: LossNormalizer


def uses_carried_slices(steps_per_generation: int, num_iterations: int, gradient_accumulation_steps: int) -> bool:
    """True when a round's micro-steps (steps_per_generation * num_iterations) do not fill whole optimizer steps."""
    return (steps_per_generation * num_iterations) % gradient_accumulation_steps != 0


def merge_steps(parts: list[OptimizerStep]) -> OptimizerStep:
    """One optimizer step of consecutive slices: their micro-batches in order, their token and sequence counts
    added (each slice's normaliser counts its own rows over all ranks, so the sum is the step's)."""
    return OptimizerStep(
        [mb for part in parts for mb in part.microbatches],
        LossNormalizer(num_tokens=sum(p.normalizer.num_tokens for p in parts),
                       num_sequences=sum(p.normalizer.num_sequences for p in parts)))


class StepSchedule:
    """Groups each round's units (micro-step slices, or whole optimizer steps when rounds divide evenly) into
    optimizer steps of `units_per_step`, carrying what is left to the next round."""

    def __init__(self, units_per_step: int, num_iterations: int):
        self.units_per_step = units_per_step
        self.num_iterations = num_iterations
        self.carried: list[OptimizerStep] = []
        """Units of earlier rounds not yet trained (empty at every checkpoint)."""

    def take(self, units: list[OptimizerStep], *, ends_pass: bool, steps_left: int) -> list[OptimizerStep]:
        """The optimizer steps this round trains: the carried units, then this round's `num_iterations` times,
        `units_per_step` at a time; a pass's end trains the rest as one shorter step. At most `steps_left`;
        whatever remains once `steps_left` is reached is dropped (the run ends there, as TRL's does)."""
        queue = self.carried + units * self.num_iterations
        steps: list[OptimizerStep] = []
        while len(queue) >= self.units_per_step and len(steps) < steps_left:
            steps.append(merge_steps(queue[: self.units_per_step]))
            queue = queue[self.units_per_step:]
        if ends_pass and queue and len(steps) < steps_left:
            steps.append(merge_steps(queue))
            queue = []
        self.carried = queue if len(steps) < steps_left else []
        return steps


def count_total_steps(rounds_per_epoch: int, micro_steps_per_round: int, gradient_accumulation_steps: int,
                      num_train_epochs: float) -> int:
    """Optimizer steps of a run by epochs when steps span rounds, as the HF Trainer counts them: each pass is
    ceil(rounds_per_epoch * micro_steps_per_round / gradient_accumulation_steps) steps (the last one shorter),
    and ceil(num_train_epochs * that) in all."""
    per_epoch = max(math.ceil(rounds_per_epoch * micro_steps_per_round / gradient_accumulation_steps), 1)
    return math.ceil(num_train_epochs * per_epoch)


def rounds_for_steps(max_steps: int, micro_steps_per_round: int, gradient_accumulation_steps: int) -> int:
    """Generation rounds a run of `max_steps` optimizer steps draws when no pass over the data ends on the way
    (a stream): ceil(max_steps * gradient_accumulation_steps / micro_steps_per_round)."""
    return -(-max_steps * gradient_accumulation_steps // max(micro_steps_per_round, 1))


def deferred_save_warning(save_steps: int, steps_per_generation: int, num_iterations: int,
                          gradient_accumulation_steps: int) -> str | None:
    """The one warning of a run whose optimizer steps span rounds and that saves on schedule: where its
    checkpoints fall instead (None when nothing is deferred)."""
    micro = steps_per_generation * num_iterations
    if save_steps <= 0 or not uses_carried_slices(steps_per_generation, num_iterations, gradient_accumulation_steps):
        return None
    cycle = math.lcm(micro, gradient_accumulation_steps)
    return (f"checkpoint.save_steps={save_steps}: optimizer steps span generation rounds (steps_per_generation * "
            f"num_iterations = {steps_per_generation} * {num_iterations} = {micro} micro-steps per round, "
            f"gradient_accumulation_steps={gradient_accumulation_steps}); a checkpoint holds no carried slice, so one "
            f"that falls due while slices are carried is written at the next round boundary that carries none (every "
            f"{cycle // micro} rounds = {cycle // gradient_accumulation_steps} optimizer steps, and at a pass's end)")
