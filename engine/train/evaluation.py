"""Evaluation as TRL's GRPOTrainer does it: completions of held-out prompts scored by the reward functions, reported
under TRL's metric names with the `eval_` prefix (`eval_<name>_` for each set of a dict of eval datasets).

Owns: `evaluation_metrics` (one set: TRL's reward and completion metrics plus HF's `runtime` / `samples_per_second` /
`steps_per_second`; `loss` averaged per evaluation batch: `batch_mean_loss`), `evaluate_sets` (several named sets,
`eval_<name>_*` keys) and `tokenize_eval_sets`.
Generating and scoring the held-out prompts is engine/train/sampling.py's `score_held_out`; a run built only to
evaluate (`GRPOTrainer.evaluate()`) is engine/train/loop.py's `evaluate_only`.

Must not: train, hold maths (engine/grpo/metrics.py, engine/grpo/advantages.py), import vLLM
(engine/rollout/vllm_engine.py) or read Megatron's global parallel state.

Test: tests/integration/test_trl_api_run.py (scheduled evaluation with a dict of eval sets, `trainer.evaluate()`);
the metric names: tests/unit/test_trl_api.py.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from engine.grpo.advantages import compute_advantages
from engine.grpo.metrics import compute_completion_metrics, compute_reward_metrics


def eval_prefix(name: str | None, metric_key_prefix: str = "eval") -> str:
    """HF's key prefix: `eval_` for one set, `eval_<name>_` for the set `name` of a dict."""
    return f"{metric_key_prefix}_" if name is None else f"{metric_key_prefix}_{name}_"


def batch_mean_loss(run, rollout, advantages: torch.Tensor, batch_size: int, loss_of) -> float:
    """HF's `eval_loss`: `loss_of` of each evaluation batch (`batch_size` rows in order, the last one shorter),
    averaged over the rows (HF repeats each batch's loss once per sample before the mean). Collective."""
    total = 0.0
    for start in range(0, len(rollout), max(batch_size, 1)):
        rows = list(range(start, min(start + max(batch_size, 1), len(rollout))))
        total += loss_of(run, rollout.select(rows), advantages[rows]) * len(rows)
    return total / max(len(rollout), 1)


def evaluation_metrics(run, prompts, *, num_generations: int, batch_size: int, loss_of=None) -> dict[str, float]:
    """One held-out set, TRL's names without the prefix (rank 0's values; {} on other ranks).

    Args:
        prompts: the tokenized set (engine/train/data.py `PromptDataset`); its first `data.eval_max_prompts`.
        num_generations: completions per prompt (TRL's `num_generations_eval`, else `num_generations`).
        batch_size: completions per evaluation step (HF's `per_device_eval_batch_size` * world size), for
            `steps_per_second`.
        loss_of: `loss_of(run, rollout, advantages) -> float` (collective), TRL's `loss` of one evaluation batch;
            None = no loss.
    """
    start = time.perf_counter()
    limit = run.cfg.data.eval_max_prompts
    num_prompts = len(prompts) if limit is None else min(limit, len(prompts))
    from engine.train.sampling import score_held_out

    rollout, rewards = score_held_out(run.sampler, prompts, num_prompts, num_generations)
    advantages = torch.zeros(len(rollout.completion_ids), dtype=torch.float64)
    if run.ps.rank == 0:
        adv = compute_advantages(rewards, num_generations, run.rewards.weights, run.cfg.grpo.scale_rewards,
                                 run.cfg.reward.multi_objective_aggregation)
        advantages = adv.advantages.double()
    on_device = advantages.to(run.ps.device)
    dist.broadcast(on_device, src=0)
    loss = None if loss_of is None else batch_mean_loss(run, rollout, on_device.cpu().float(), batch_size, loss_of)
    if run.ps.rank != 0:
        return {}
    metrics = {} if loss is None else {"loss": loss}
    metrics |= compute_reward_metrics(rewards, run.rewards.names, adv.is_std_zero, run.rewards.weights)
    lengths = torch.tensor([float(len(c)) for c in rollout.completion_ids])
    metrics |= compute_completion_metrics(lengths, torch.tensor(rollout.is_truncated, dtype=torch.bool))
    runtime = time.perf_counter() - start
    samples = num_prompts * num_generations
    metrics |= {"runtime": round(runtime, 4), "samples_per_second": round(samples / runtime, 3),
                "steps_per_second": round(math.ceil(samples / max(batch_size, 1)) / runtime, 3)}
    return metrics


def evaluate_sets(run, sets: dict, *, num_generations: int, batch_size: int, metric_key_prefix: str = "eval",
                  loss_of=None) -> dict[str, float]:
    """Every named set (None = the single eval set): `<prefix>_<name>_<metric>` keys, the same dict on every rank
    (rank 0's, broadcast)."""
    merged: dict[str, float] = {}
    for name, prompts in sets.items():
        metrics = evaluation_metrics(run, prompts, num_generations=num_generations, batch_size=batch_size,
                                     loss_of=loss_of)
        merged |= {eval_prefix(name, metric_key_prefix) + key: value for key, value in metrics.items()}
    shared = [merged]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def tokenize_eval_sets(run, datasets: dict) -> dict:
    """Each in-memory eval dataset (name -> `datasets.Dataset`) tokenized and length-checked as the train set."""
    from transformers import AutoConfig

    from engine.train.data import load_prompts

    max_len = run.cfg.rollout.vllm_max_model_length or AutoConfig.from_pretrained(run.model_dir).max_position_embeddings
    return {name: load_prompts(run.cfg.data, run.tokenizer, run.sampler.generation, split="test",  # tools shown
                               max_model_length=max_len, dataset=dataset)
            for name, dataset in datasets.items()}
