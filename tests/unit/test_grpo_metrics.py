"""engine/grpo/metrics.py: TRL's metric names and hand-computed values (equality with TRL: test_trl_parity.py)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.grpo.metrics import (
    compute_completion_metrics,
    compute_loss_metrics,
    compute_reward_metrics,
    compute_sampling_metrics,
)
from engine.grpo.policy_loss import LossNormalizer, PolicyLossBatch, compute_policy_loss
from tests.helpers.grpo_settings import build_loss_config

NAN = float("nan")


def test_reward_metrics_use_trl_names_and_skip_none():
    rewards = torch.tensor([[1.0, NAN], [3.0, NAN], [NAN, NAN], [2.0, NAN]])  # f1 never applies; row 2 unscorable
    metrics = compute_reward_metrics(rewards, ["accuracy", "format"], torch.tensor([True, True, False, False]),
                                     torch.tensor([2.0, 1.0]))
    assert metrics["rewards/accuracy/mean"] == 2.0
    assert metrics["rewards/accuracy/std"] == pytest.approx(1.0)
    assert math.isnan(metrics["rewards/format/mean"]) and math.isnan(metrics["rewards/format/std"])
    assert metrics["reward"] == 4.0  # weighted: 2, 6, 4
    assert metrics["reward_std"] == pytest.approx(2.0)
    assert metrics["frac_reward_zero_std"] == 0.5
    assert set(metrics) == {"rewards/accuracy/mean", "rewards/accuracy/std", "rewards/format/mean",
                            "rewards/format/std", "reward", "reward_std", "frac_reward_zero_std"}


def test_completion_metrics_by_hand_and_when_every_completion_is_truncated():
    metrics = compute_completion_metrics(torch.tensor([3, 8, 5, 8]), torch.tensor([False, True, False, True]))
    assert metrics == {
        "completions/mean_length": 6.0, "completions/min_length": 3.0, "completions/max_length": 8.0,
        "completions/clipped_ratio": 0.5, "completions/mean_terminated_length": 4.0,
        "completions/min_terminated_length": 3.0, "completions/max_terminated_length": 5.0,
    }
    all_truncated = compute_completion_metrics(torch.tensor([8, 8]), torch.tensor([True, True]))
    assert all_truncated["completions/mean_terminated_length"] == 0.0
    assert all_truncated["completions/clipped_ratio"] == 1.0


def test_sampling_metrics_leave_out_padding_and_unscored_tokens():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    sampling = torch.tensor([[-0.5, NAN, -9.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ratio = torch.tensor([[2.0], [0.5]])  # sequence mode
    metrics = compute_sampling_metrics(old, sampling, mask, ratio)
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(1.5 / 4)
    assert metrics["sampling/sampling_logp_difference/max"] == 1.0
    assert (metrics["sampling/importance_sampling_ratio/min"], metrics["sampling/importance_sampling_ratio/max"]) == (
        0.5, 2.0)
    token_ratio = torch.tensor([[2.0, 1.0, 99.0], [0.25, 1.0, 1.0]])
    assert compute_sampling_metrics(old, sampling, mask, token_ratio)["sampling/importance_sampling_ratio/max"] == 2.0


def test_loss_metrics_by_hand():
    # one token per row; ratios e^0.5 (A = +1, clipped high), e^-0.5 (A = -1, clipped low), 1 (A = 0), row 3 masked
    logprobs = torch.zeros(4, 1, dtype=torch.float64)
    batch = PolicyLossBatch(mask=torch.tensor([[1.0], [1.0], [1.0], [0.0]]),
                            advantages=torch.tensor([1.0, -1.0, 0.0, 1.0], dtype=torch.float64),
                            old_logprobs=torch.tensor([[-0.5], [0.5], [0.0], [-0.5]], dtype=torch.float64),
                            ref_logprobs=torch.zeros(4, 1, dtype=torch.float64))
    entropy = torch.tensor([[1.0], [2.0], [3.0], [100.0]], dtype=torch.float64)
    config = build_loss_config(loss_type="grpo", beta=0.1, use_bias_correction_kl=False)
    out = compute_policy_loss(logprobs, batch, config, LossNormalizer(num_tokens=3, num_sequences=4), entropy=entropy,
                              terms_implementation="torch")
    metrics = compute_loss_metrics(out)
    assert metrics == pytest.approx({
        "kl": 0.0, "entropy": 2.0, "clip_ratio/low_mean": 1 / 3, "clip_ratio/high_mean": 1 / 3,
        "clip_ratio/region_mean": 2 / 3, "clip_ratio/low_min": 0.0, "clip_ratio/high_max": 1.0,
    })
    assert "policy_loss" in compute_loss_metrics(out, include_policy_loss=True)
    cispo = compute_policy_loss(logprobs, batch, build_loss_config(loss_type="cispo", epsilon_high=1.2),
                                LossNormalizer(num_tokens=3, num_sequences=4), terms_implementation="torch")
    assert compute_loss_metrics(cispo) == pytest.approx({"cispo_clip_ratio": 1 / 3})


def test_min_max_loss_metrics_are_nan_when_every_sequence_is_empty():
    batch = PolicyLossBatch(mask=torch.zeros(2, 3), advantages=torch.ones(2))
    out = compute_policy_loss(torch.zeros(2, 3), batch, build_loss_config(loss_type="dapo"),
                              LossNormalizer(num_tokens=0, num_sequences=2), terms_implementation="torch")
    metrics = compute_loss_metrics(out)
    assert math.isnan(metrics["clip_ratio/low_min"]) and math.isnan(metrics["clip_ratio/high_max"])
    assert metrics["clip_ratio/region_mean"] == 0.0
