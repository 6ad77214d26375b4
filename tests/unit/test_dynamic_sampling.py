"""engine/grpo/dynamic_sampling.py (DAPO): which groups carry signal, and a full batch assembled from several rounds."""

from __future__ import annotations

import pytest
import torch

from engine.grpo.dynamic_sampling import (
    DynamicBatchSelection,
    assemble_rounds,
    find_informative_groups,
    is_dynamic_batch_full,
    rows_per_round,
    select_dynamic_batch,
)

NAN = float("nan")


def test_groups_with_identical_or_single_rewards_are_uninformative():
    rewards = torch.tensor([
        1.0, 1.0, 1.0, 1.0,  # all equal: no signal
        0.0, 1.0, 0.0, 0.0,  # signal
        NAN, 1.0, NAN, NAN,  # one scored row: no std
        NAN, 1.0, NAN, 2.0,  # two scored rows that differ: signal
        NAN, NAN, NAN, NAN,  # nothing scored
        0.3, 0.3 + 1e-12, 0.3, 0.3,  # equal up to float noise (torch.isclose, as TRL's frac_reward_zero_std)
    ])
    assert find_informative_groups(rewards, 4).tolist() == [False, True, False, True, False, False]


def test_batch_takes_informative_groups_from_the_earliest_rounds_and_trims_the_excess():
    rounds = [torch.tensor([True, False, True]), torch.tensor([False, True, True, True])]
    assert not is_dynamic_batch_full(rounds[:1], 4)
    assert is_dynamic_batch_full(rounds, 4)
    selection = select_dynamic_batch(rounds, 4)
    assert selection == DynamicBatchSelection(groups=((0, 0), (0, 2), (1, 1), (1, 2)), num_informative=4)


def test_short_batch_is_filled_with_uninformative_groups_or_left_short():
    rounds = [torch.tensor([False, True]), torch.tensor([False, False])]
    filled = select_dynamic_batch(rounds, 3)
    assert filled.groups == ((0, 0), (0, 1), (1, 0)) and filled.num_informative == 1
    short = select_dynamic_batch(rounds, 3, fill_with_uninformative=False)
    assert short.groups == ((0, 1),) and short.num_informative == 1
    with pytest.raises(ValueError, match="4 groups generated in all, fewer than the 5"):
        select_dynamic_batch(rounds, 5)


def test_assembled_batch_has_the_selected_groups_rows_in_order_for_tensors_and_lists():
    num_generations = 2
    round0 = torch.arange(6.0).view(6, 1) * 10  # 3 groups: rows (0, 1), (2, 3), (4, 5)
    round1 = torch.arange(100.0, 104.0).view(4, 1)  # 2 groups
    selection = DynamicBatchSelection(groups=((0, 2), (1, 0), (1, 1)), num_informative=3)
    assert [rows.tolist() for rows in rows_per_round(selection, num_generations, 2)] == [[4, 5], [0, 1, 2, 3]]
    batch = assemble_rounds([round0, round1], selection, num_generations)
    assert batch.flatten().tolist() == [40.0, 50.0, 100.0, 101.0, 102.0, 103.0]
    texts = assemble_rounds([list("abcdef"), list("wxyz")], selection, num_generations)
    assert texts == ["e", "f", "w", "x", "y", "z"]


def test_a_round_with_nothing_selected_contributes_no_rows():
    selection = DynamicBatchSelection(groups=((1, 0),), num_informative=1)
    rows = rows_per_round(selection, 3, 2)
    assert rows[0].numel() == 0 and rows[1].tolist() == [0, 1, 2]
    batch = assemble_rounds([torch.zeros(3, 2), torch.ones(3, 2)], selection, 3)
    assert batch.shape == (3, 2) and batch.eq(1).all()


def test_rewards_that_are_not_whole_groups_are_rejected():
    with pytest.raises(ValueError, match="not whole groups of 4"):
        find_informative_groups(torch.zeros(6), 4)
