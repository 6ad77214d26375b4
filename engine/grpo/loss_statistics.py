"""The per-micro-batch sums behind TRL's loss metrics (`kl`, `entropy`, `clip_ratio/*`, `cispo_clip_ratio`,
`vespo/phi_seq_mean`), kept as [sum, count] pairs and per-sequence values so that they reduce over micro-batches and
ranks by summation (and nanmin / nanmax).

Owns: `compute_loss_statistics` (called by engine/grpo/policy_loss.py inside `compute_policy_loss`) and
`CLIPPED_LOSS_TYPES`, the loss types with the PPO-style clipped surrogate (the surrogate and the clip metrics both
branch on it). The imports run one way: policy_loss.py -> loss_statistics.py, and metrics.py (which turns the
reduced sums into metric values) -> policy_loss.py.

Must not: turn the sums into metric values (engine/grpo/metrics.py `compute_loss_metrics`), log, or talk to process
groups (the trainer all-reduces the sums and gathers the per-sequence values).

Test: `pytest tests/unit/test_grpo_metrics.py` (the loss metrics through `compute_policy_loss`) and
`pytest tests/unit/test_trl_parity.py` (equality with TRL 1.16).
"""

from __future__ import annotations

import torch

CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""The loss types with the PPO-style clipped surrogate, which log the clip_ratio/* metrics."""


def compute_loss_statistics(
    *,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    per_token_kl: torch.Tensor | None,
    entropy: torch.Tensor | None,
    phi: torch.Tensor | None,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What TRL's loss metrics are made of, as sums that add up over micro-batches and ranks.

    Args:
        ratio: (B, T) token or (B, 1) sequence importance ratio, after the delta cap (TRL's coef_1).
        advantages: (B, 1) or (B, T).
        mask: (B, T) float loss mask.
        per_token_kl: (B, T) or None (beta = 0).
        entropy: (B, T) or None.
        phi: (B, 1) VESPO weights or None.
        loss_type: selects clip_ratio/* (clipped losses), cispo_clip_ratio or vespo/phi_seq_mean.
        epsilon_low, epsilon_high: the clip range (cispo: epsilon_high is the cap).

    Returns:
        (sums, seq_min, seq_max): metric name -> (2,) [sum, count] (token-weighted over the mask; over sequences for
        (B, 1) values, as TRL), and metric name -> (B,) per-sequence masked means (NaN for empty sequences) whose
        nanmin / nanmax is the metric.
    """
    with torch.no_grad():
        sums: dict[str, torch.Tensor] = {}
        seq_min: dict[str, torch.Tensor] = {}
        seq_max: dict[str, torch.Tensor] = {}
        if per_token_kl is not None:
            sums["kl"] = _sum_and_count(per_token_kl, mask)
        if entropy is not None:
            sums["entropy"] = _sum_and_count(entropy, mask)
        if loss_type in CLIPPED_LOSS_TYPES:
            is_low = ((ratio < 1 - epsilon_low) & (advantages < 0)).to(mask.dtype)
            is_high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(mask.dtype)
            sums["clip_ratio/low_mean"] = _sum_and_count(is_low, mask)
            sums["clip_ratio/high_mean"] = _sum_and_count(is_high, mask)
            sums["clip_ratio/region_mean"] = _sum_and_count(torch.maximum(is_low, is_high), mask)
            seq_min["clip_ratio/low_min"] = _sequence_mean(is_low, mask)
            seq_max["clip_ratio/high_max"] = _sequence_mean(is_high, mask)
        elif loss_type == "cispo":
            sums["cispo_clip_ratio"] = _sum_and_count(((ratio > epsilon_high) & (advantages > 0)).to(mask.dtype), mask)
        elif loss_type == "vespo":
            sums["vespo/phi_seq_mean"] = _sum_and_count(phi, mask)
        return sums, seq_min, seq_max


def _sum_and_count(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(2,) [sum, count]: over masked tokens for (B, T) x, over sequences for (B, 1) x (TRL's global_masked_mean)."""
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return torch.stack([x.sum(), torch.tensor(float(x.shape[0]), dtype=x.dtype, device=x.device)])
    x = x.expand_as(mask)
    return torch.stack([(x * mask).sum(), mask.sum().to(x.dtype)])


def _sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-sequence masked mean; NaN for a sequence with no loss token (TRL's masked_seq_mean)."""
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return x.squeeze(1)
    x = x.expand_as(mask)
    return (x * mask).sum(-1) / mask.sum(-1)
