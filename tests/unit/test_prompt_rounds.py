"""Rounds of prompts and sampling seeds are pure functions of (seed, round): what exact resume relies on
(engine/train/prompt_rounds.py)."""

import itertools

import pytest
import torch

from engine.train.prompt_rounds import PromptRounds, sampling_seeds, shuffle_order


def _one_generator_rounds(num_prompts, per_round, seed):
    """The historical order: one generator drawing a permutation per epoch, chunks of per_round."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(num_prompts, generator=gen)
        for start in range(0, num_prompts - per_round + 1, per_round):
            yield order[start : start + per_round].tolist()


def test_rounds_keep_the_one_generator_order_across_epochs():
    expected = list(itertools.islice(_one_generator_rounds(10, 3, seed=7), 10))  # 3 rounds per epoch, 4th epoch
    assert list(itertools.islice(PromptRounds(10, 3, seed=7, shuffle=True), 10)) == expected


@pytest.mark.parametrize("start", [0, 1, 3, 7])
def test_resumed_rounds_equal_the_uninterrupted_ones(start):
    uninterrupted = list(itertools.islice(PromptRounds(10, 3, seed=5, shuffle=True), 12))
    resumed = PromptRounds(10, 3, seed=5, shuffle=True, start=start)
    assert [next(resumed) for _ in range(12 - start)] == uninterrupted[start:]
    assert resumed.position == 12


def test_each_epoch_uses_every_prompt_once_and_epochs_differ():
    rounds = PromptRounds(12, 4, seed=1, shuffle=True)
    epochs = [sum((next(rounds) for _ in range(3)), []) for _ in range(2)]
    assert all(sorted(e) == list(range(12)) for e in epochs)
    assert epochs[0] != epochs[1]
    assert list(itertools.islice(PromptRounds(12, 4, seed=1, shuffle=False), 3)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_a_round_larger_than_the_dataset_is_refused():
    with pytest.raises(ValueError, match="needs 8 prompts but the dataset has 5"):
        PromptRounds(5, 8, seed=0, shuffle=True)


def test_sampling_seeds_depend_on_seed_round_and_prompt_only():
    seeds = sampling_seeds(42, step=4, attempt=0, prompt_indices=[3, 9, 3])
    assert seeds == sampling_seeds(42, 4, 0, [3, 9, 3]) and seeds[0] == seeds[2] != seeds[1]
    assert all(0 <= s < 2**63 for s in seeds)
    others = [sampling_seeds(43, 4, 0, [3]), sampling_seeds(42, 5, 0, [3]), sampling_seeds(42, 4, 1, [3])]
    assert all(o[0] != seeds[0] for o in others)


def test_row_shuffle_is_a_permutation_fixed_by_seed_and_step():
    order = shuffle_order(16, seed=42, step=2)
    assert sorted(order.tolist()) == list(range(16))
    assert torch.equal(order, shuffle_order(16, 42, 2)) and not torch.equal(order, shuffle_order(16, 42, 3))
