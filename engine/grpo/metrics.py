"""The values of TRL's GRPO metrics, under TRL's names (TRL 1.16 `GRPOTrainer._metrics`), from tensors.

Owns: the values of `reward`, `reward_std`, `rewards/{name}/mean`, `rewards/{name}/std`, `frac_reward_zero_std`,
`completions/*` (lengths, clipped ratio, terminated lengths) and `sampling/*` (vLLM importance sampling); and turning
a `PolicyLossOutput`'s sums (made inside the loss by engine/grpo/loss_statistics.py) into `kl`, `entropy`,
`clip_ratio/*`, `cispo_clip_ratio`, `vespo/phi_seq_mean` and `policy_loss`. Imports run one way: metrics.py ->
policy_loss.py -> loss_statistics.py. Differences from TRL: `compute_sampling_metrics`, `compute_loss_metrics`.

Must not: log, write files, keep history or talk to process groups (engine/train/metric_logger.py does that). Inputs
are the gathered tensors of the generation batch (every rank's rows); for the loss metrics the caller all-reduces
`sums` and gathers `seq_min` / `seq_max` over ranks first. Each function returns plain floats for one generation batch
(or one micro-batch, for the loss metrics); the logger averages those over the logging window, dropping NaNs, as TRL.

Test: `pytest tests/unit/test_grpo_metrics.py` (hand-computed values); equality with TRL 1.16 on the same inputs:
`pytest tests/unit/test_trl_parity.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.grpo.advantages import aggregate_rewards, nanstd
from engine.grpo.policy_loss import PolicyLossOutput


def compute_reward_metrics(
    rewards_per_func: torch.Tensor,
    reward_func_names: Sequence[str],
    is_std_zero: torch.Tensor,
    reward_weights: torch.Tensor | None = None,
) -> dict[str, float]:
    """Reward metrics of one generation batch.

    Args:
        rewards_per_func: (B, K) rewards, NaN = None.
        reward_func_names: K names (TRL: the callable's name, or the reward model id's last path component).
        is_std_zero: (B,) bool from `compute_advantages`.
        reward_weights: (K,) or None.

    Returns:
        `rewards/{name}/mean` and `/std` (NaN-aware, unweighted), `reward` and `reward_std` (of the weighted sum,
        unscorable rows left out), `frac_reward_zero_std`.
    """
    if len(reward_func_names) != rewards_per_func.shape[1]:
        raise ValueError(f"{len(reward_func_names)} names for {rewards_per_func.shape[1]} reward functions")
    metrics: dict[str, float] = {}
    for k, name in enumerate(reward_func_names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, k]).item()
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, k]).item()
    rewards = aggregate_rewards(rewards_per_func, reward_weights)  # (B,)
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = nanstd(rewards).item()
    metrics["frac_reward_zero_std"] = is_std_zero.float().mean().item()
    return metrics


def compute_completion_metrics(completion_lengths: torch.Tensor, is_truncated: torch.Tensor) -> dict[str, float]:
    """Completion-length metrics of one generation batch.

    Args:
        completion_lengths: (B,) generated tokens per completion (tool-result tokens excluded), before any masking.
        is_truncated: (B,) bool, the completion never emitted EOS.

    Returns:
        `completions/mean_length`, `/min_length`, `/max_length`, `/clipped_ratio`, `/mean_terminated_length`,
        `/min_terminated_length`, `/max_terminated_length` (the terminated ones are 0 when every completion is
        truncated, as in TRL).
    """
    lengths = completion_lengths.float()  # (B,)
    terminated = lengths[~is_truncated.bool()]  # (B_term,)
    if terminated.numel() == 0:
        terminated = torch.zeros(1)  # (1,)
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": is_truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item(),
        "completions/min_terminated_length": terminated.min().item(),
        "completions/max_terminated_length": terminated.max().item(),
    }


def compute_sampling_metrics(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    importance_sampling_ratio: torch.Tensor,
) -> dict[str, float]:
    """Trainer-vs-vLLM mismatch metrics (only when the vLLM importance-sampling correction is on).

    Differences from TRL: the values are computed over all rows at once; TRL takes a per-rank mean/min/max and then
    averages the per-rank means (equal on one rank). With single-token completions (T = 1) TRL's sequence-mode IS
    metrics take the (B, 1) tensors as per-sequence values and ignore the mask; we keep the mask.

    Args:
        old_logprobs: (B, T) trainer log-probs at generation time.
        sampling_logprobs: (B, T) vLLM log-probs; NaN tokens are left out.
        mask: (B, T) loss mask.
        importance_sampling_ratio: (B, T) token modes or (B, 1) sequence modes.

    Returns:
        `sampling/sampling_logp_difference/mean`, `/max`, `sampling/importance_sampling_ratio/min`, `/mean`, `/max`
        (0 when nothing is left, as in TRL).
    """
    delta = torch.abs(old_logprobs - sampling_logprobs)  # (B, T)
    delta = delta[mask.bool() & ~torch.isnan(delta)]  # (N,)
    if importance_sampling_ratio.shape[-1] == 1 and mask.shape[-1] != 1:
        ratio = importance_sampling_ratio.flatten()  # (B,)
    else:
        ratio = importance_sampling_ratio[mask.bool()]  # (N,)
    return {
        "sampling/sampling_logp_difference/mean": _or_zero(delta, torch.mean),
        "sampling/sampling_logp_difference/max": _or_zero(delta, torch.max),
        "sampling/importance_sampling_ratio/min": _or_zero(ratio, torch.min),
        "sampling/importance_sampling_ratio/mean": _or_zero(ratio, torch.mean),
        "sampling/importance_sampling_ratio/max": _or_zero(ratio, torch.max),
    }


def compute_loss_metrics(output: PolicyLossOutput, include_policy_loss: bool = False) -> dict[str, float]:
    """The loss metrics of one micro-batch (after the caller reduced its sums over ranks).

    Differences from TRL: with single-token completions (T = 1) TRL's loss metrics take the (B, 1) tensors as
    per-sequence values and ignore the mask; we keep the mask.

    Args:
        output: from `compute_policy_loss`.
        include_policy_loss: add `policy_loss` (TRL logs it only while the entropy bonus is on).

    Returns:
        `kl` (beta != 0), `entropy` (when entropies were given), `clip_ratio/low_mean`, `/high_mean`,
        `/region_mean`, `/low_min`, `/high_max` (grpo, bnpo, dr_grpo, dapo, luspo), `cispo_clip_ratio`,
        `vespo/phi_seq_mean`, and `policy_loss`.
    """
    metrics = {name: (pair[0] / pair[1].clamp(min=1.0)).item() for name, pair in output.sums.items()}
    metrics.update({name: _nan_reduce(values, torch.min) for name, values in output.seq_min.items()})
    metrics.update({name: _nan_reduce(values, torch.max) for name, values in output.seq_max.items()})
    if include_policy_loss:
        metrics["policy_loss"] = output.policy_loss.item()
    return metrics


def _or_zero(values: torch.Tensor, reduce) -> float:
    """reduce(values) as a float, or 0.0 for an empty tensor."""
    return reduce(values).item() if values.numel() > 0 else 0.0


def _nan_reduce(values: torch.Tensor, reduce) -> float:
    """reduce over the non-NaN entries; NaN when there are none (TRL's nanmin / nanmax)."""
    valid = values[~torch.isnan(values)]  # (N,)
    return reduce(valid).item() if valid.numel() > 0 else float("nan")
