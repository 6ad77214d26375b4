"""engine/grpo/advantages.py: hand-computed advantages (equality with TRL on random rewards: test_trl_parity.py)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from engine.grpo.advantages import aggregate_rewards, nanstd, rewards_to_tensor
from tests.helpers.grpo_settings import compute_default_advantages

NAN = float("nan")
EPS = 1e-4


def _no_warning_advantages(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return compute_default_advantages(*args, **kwargs)


def test_advantages_group_scaling_by_hand():
    # group [1, 2, 3, 4]: mean 2.5, Bessel std sqrt((2.25 + 0.25 + 0.25 + 2.25) / 3) = sqrt(5/3)
    result = _no_warning_advantages(torch.tensor([[1.0], [2.0], [3.0], [4.0]], dtype=torch.float64), 4)
    std = math.sqrt(5 / 3)
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5], dtype=torch.float64) / (std + EPS)
    torch.testing.assert_close(result.advantages, expected)
    torch.testing.assert_close(result.std_rewards, torch.full((4,), std, dtype=torch.float64))


def test_advantages_zero_std_group_is_zero():
    rewards = torch.tensor([[0.7], [0.7], [0.7], [0.0], [1.0], [0.0]], dtype=torch.float64)  # P = 2, G = 3
    for scale_rewards in ("group", "batch", "none"):
        result = _no_warning_advantages(rewards, 3, scale_rewards=scale_rewards)
        assert result.advantages[:3].tolist() == [0.0, 0.0, 0.0], scale_rewards
    assert _no_warning_advantages(rewards, 3).is_std_zero.tolist() == [True] * 3 + [False] * 3


def test_batch_scaling_keeps_the_group_mean_and_divides_by_the_batch_std():
    rewards = torch.tensor([[1.0], [3.0], [10.0], [14.0]], dtype=torch.float64)  # groups [1, 3], [10, 14]
    batch_std = torch.tensor([1.0, 3.0, 10.0, 14.0], dtype=torch.float64).std().item()  # Bessel over 4 rows
    result = _no_warning_advantages(rewards, 2, scale_rewards="batch")
    expected = torch.tensor([-1.0, 1.0, -2.0, 2.0], dtype=torch.float64) / (batch_std + EPS)
    torch.testing.assert_close(result.advantages, expected)
    none = _no_warning_advantages(rewards, 2, scale_rewards="none")
    assert none.advantages.tolist() == [-1.0, 1.0, -2.0, 2.0]


def test_weighted_rewards_skip_none_and_an_all_none_row_gets_zero_advantage_and_a_warning():
    # f0 = [1, None, 3, None], f1 = [None, None, 1, 2], weights (1, 2): r = [1, unscorable, 5, 4]
    rewards = rewards_to_tensor([[1.0, None, 3.0, None], [None, None, 1.0, 2.0]], dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"All reward functions returned None for 1 of 4 completions \(rows \[1\]"):
        result = compute_default_advantages(rewards, 4, reward_weights=torch.tensor([1.0, 2.0]))
    assert result.is_unscorable.tolist() == [False, True, False, False]
    mean, std = 10 / 3, math.sqrt(((1 - 10 / 3) ** 2 + (5 - 10 / 3) ** 2 + (4 - 10 / 3) ** 2) / 2)
    expected = [(1 - mean) / (std + EPS), 0.0, (5 - mean) / (std + EPS), (4 - mean) / (std + EPS)]
    assert result.advantages.tolist() == pytest.approx(expected)
    assert math.isnan(result.rewards[1])


def test_all_none_rewards_give_zero_advantages_and_a_warning():
    rewards = rewards_to_tensor([[None] * 4, [None] * 4])
    with pytest.warns(UserWarning, match="All reward functions returned None for 4 of 4"):
        result = compute_default_advantages(rewards, 2)
    assert result.advantages.tolist() == [0.0] * 4
    assert result.is_unscorable.all()


def test_a_group_with_one_scorable_row_carries_no_signal():
    rewards = rewards_to_tensor([[5.0, None, 1.0, 2.0]])  # row 1 unscorable: group 0 has one valid reward
    with pytest.warns(UserWarning):
        result = compute_default_advantages(rewards, 2, scale_rewards="group")
    assert result.advantages[:2].tolist() == [0.0, 0.0]
    assert result.advantages[2] < 0 < result.advantages[3]


def test_normalize_then_sum_normalises_each_function_in_its_group_then_the_batch():
    # G = 2, one group. f0 = [0, 1] -> Z0 = [-a, a] with a = 0.5 / (sqrt(0.5) + 1e-4); f1 = [2, 2] -> Z1 = [0, 0].
    # r = Z0 + Z1 = [-a, a]; batch: mean 0, Bessel std a*sqrt(2): A = [-a, a] / (a*sqrt(2) + 1e-4).
    rewards = torch.tensor([[0.0, 2.0], [1.0, 2.0]], dtype=torch.float64)
    result = _no_warning_advantages(rewards, 2, multi_objective_aggregation="normalize_then_sum")
    a = 0.5 / (math.sqrt(0.5) + EPS)
    assert result.advantages.tolist() == pytest.approx([-a / (a * math.sqrt(2) + EPS), a / (a * math.sqrt(2) + EPS)])
    sum_first = _no_warning_advantages(rewards, 2)  # r = [2, 3]: same sign, different scale
    assert sum_first.advantages[1].item() == pytest.approx(0.5 / (math.sqrt(0.5) + EPS))


def test_nanstd_is_bessel_corrected_and_ignores_nan():
    x = torch.tensor([[1.0, NAN, 3.0], [2.0, NAN, NAN]])
    assert nanstd(x, dim=1)[0].item() == pytest.approx(math.sqrt(2.0))
    assert math.isnan(nanstd(x, dim=1)[1].item())  # one valid value: undefined
    assert nanstd(x).item() == pytest.approx(torch.tensor([1.0, 3.0, 2.0]).std().item())
    assert nanstd(x, dim=1, keepdim=True).shape == (2, 1)


def test_aggregate_rewards_weights_and_marks_unscorable_rows_nan():
    rewards = torch.tensor([[1.0, NAN], [NAN, NAN], [2.0, 3.0]])
    out = aggregate_rewards(rewards, torch.tensor([0.5, 2.0]))
    assert out[0].item() == 0.5 and math.isnan(out[1].item()) and out[2].item() == 7.0


def test_bad_inputs_are_rejected_with_a_message():
    with pytest.raises(ValueError, match="not a whole number of groups"):
        compute_default_advantages(torch.zeros(5, 1), 2)
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_default_advantages(torch.zeros(4, 1), 2, scale_rewards=True)
    with pytest.raises(ValueError, match="reward_weights has 1 entries but there are 2"):
        compute_default_advantages(torch.zeros(4, 2), 2, reward_weights=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        compute_default_advantages(torch.zeros(4, 1), 2, multi_objective_aggregation="mean")
    with pytest.raises(ValueError, match="reward function 1 returned 1 rewards"):
        rewards_to_tensor([[1.0, 2.0], [1.0]])
