"""engine/grpo/group_filter.py (GFPO): aligned groups, top-k per group, advantages over the survivors.

`test_filter_sees_each_groups_own_completions_next_to_its_rewards` is the test that would have caught TRL's
overlapping-slice bug (trl.experimental.gfpo): TRL built `[completions[i : i + G] for i in range(N // G)]`.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.grpo.group_filter import filter_groups, select_top_k_in_groups, split_into_groups
from tests.helpers.grpo_settings import compute_default_advantages

G = 4


def _trl_overlapping_groups(completions, num_generations):
    """What TRL's GFPO handed the filter (the bug)."""
    return [completions[i : i + 1 * num_generations] for i in range(len(completions) // num_generations)]


def test_filter_sees_each_groups_own_completions_next_to_its_rewards():
    # completion "p{p}c{c}" of prompt p has reward 10 p + c: every (completion, reward) pair can be checked.
    num_groups = 3
    completions = [f"p{p}c{c}" for p in range(num_groups) for c in range(G)]
    rewards = torch.tensor([10.0 * p + c for p in range(num_groups) for c in range(G)])
    seen = {}

    def record(group_completions, group_rewards):
        seen.update(completions=group_completions, rewards=group_rewards)
        return [[0.0] * G for _ in group_completions]

    filter_groups(record, completions, rewards, G, 2)
    assert seen["completions"] == [completions[p * G : (p + 1) * G] for p in range(num_groups)]
    for group_completions, group_rewards in zip(seen["completions"], seen["rewards"], strict=True):
        for completion, reward in zip(group_completions, group_rewards, strict=True):
            assert completion == f"p{int(reward) // 10}c{int(reward) % 10}"
    assert _trl_overlapping_groups(completions, G) != seen["completions"]  # the bug would have failed the check


def test_shortest_completion_filter_keeps_the_shortest_of_each_group():
    lengths = [5, 1, 4, 2, 3, 9, 8, 7]  # group 0 keeps rows 1, 3; group 1 keeps rows 4, 7
    completions = ["x" * n for n in lengths]

    def shortest(group_completions, group_rewards):
        return [[-len(c) for c in group] for group in group_completions]

    kept = filter_groups(shortest, completions, torch.zeros(8), G, 2)
    assert kept.tolist() == [1, 3, 4, 7]
    trl_view = [[-len(c) for c in group] for group in _trl_overlapping_groups(completions, G)]
    assert select_top_k_in_groups(torch.tensor(trl_view, dtype=torch.float64), 2).tolist() != kept.tolist()


def test_advantages_are_computed_over_the_survivors_only():
    rewards = torch.tensor([1.0, 5.0, 2.0, 9.0, 0.0, 0.0, 3.0, 3.0])
    completions = ["aa", "aaaaa", "a", "aaaa", "a", "aaa", "aa", "aaaaaaa"]
    kept = filter_groups(lambda group_completions, group_rewards: [[-len(c) for c in g] for g in group_completions],
                         completions, rewards, G, 2)
    assert kept.tolist() == [0, 2, 4, 6]  # survivors: rewards [1, 2] and [0, 3]
    result = compute_default_advantages(rewards[kept].unsqueeze(1), num_generations=2)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    b = 1.5 / (math.sqrt(4.5) + 1e-4)
    assert result.advantages.tolist() == pytest.approx([-a, a, -b, b])


def test_top_k_breaks_ties_towards_the_earlier_completion_and_keeps_original_order():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert select_top_k_in_groups(scores, 2).tolist() == [1, 2, 4, 5]
    assert select_top_k_in_groups(scores, 3).tolist() == [0, 1, 2, 4, 5, 6]


def test_filter_kwargs_pass_through_and_split_into_groups_is_non_overlapping():
    assert split_into_groups([0, 1, 2, 3, 4, 5], 3) == [[0, 1, 2], [3, 4, 5]]
    got = {}

    def keep_first(group_completions, group_rewards, **kwargs):
        got.update(kwargs)
        return [[-i for i in range(G)] for _ in group_completions]

    assert filter_groups(keep_first, list("abcd"), torch.zeros(4), G, 2, lengths=[[1, 2, 3, 4]]).tolist() == [0, 1]
    assert got == {"lengths": [[1, 2, 3, 4]]}


@pytest.mark.parametrize(
    "scores, message",
    [
        ([[1.0, 2.0, 3.0]], r"shape \(1, 3\), expected \[P=1\]\[G=4\]"),
        ([[1.0, float("nan"), 0.0, 0.0]], "NaN or infinite"),
        ("best", "one score per completion"),
    ],
)
def test_filter_output_of_the_wrong_shape_or_type_is_an_error(scores, message):
    with pytest.raises(ValueError, match=message):
        filter_groups(lambda **_: scores, list("abcd"), torch.zeros(4), G, 2)


def test_num_remains_in_group_must_leave_a_group():
    with pytest.raises(ValueError, match="num_remains_in_group=1"):
        filter_groups(lambda **_: [[0.0] * G], list("abcd"), torch.zeros(4), G, 1)
    with pytest.raises(ValueError, match="num_remains_in_group=5"):
        filter_groups(lambda **_: [[0.0] * G], list("abcd"), torch.zeros(4), G, 5)
    with pytest.raises(ValueError, match="rewards has shape"):
        filter_groups(lambda **_: [[0.0] * G], list("abcd"), torch.zeros(3), G, 2)
