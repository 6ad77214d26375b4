"""engine/policy/batch.py: right padding and TRL's (B, C) completion layout."""

from dataclasses import replace

import pytest
import torch

from engine.policy.batch import pack_completions, split_microbatches


def test_pack_completions_right_pads_and_indexes_completions():
    batch = pack_completions([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_token_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 0]]
    assert batch.prompt_lengths.tolist() == [3, 1]
    assert batch.lengths.tolist() == [5, 4]  # prompt + completion: what token budgets and packing count
    assert batch.completion_ids.tolist() == [[1, 2, 0], [3, 4, 9]]
    assert batch.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    # the hidden state at prompt_length - 1 + j predicts completion token j
    index = batch.prompt_lengths[:, None] - 1 + torch.arange(3)
    assert batch.tokens.gather(1, (index + 1).clamp(max=4))[batch.completion_mask.bool()].tolist() == [1, 2, 3, 4, 9]


def test_pack_completions_refuses_empty_prompt_and_count_mismatch():
    with pytest.raises(ValueError, match="at least one token"):
        pack_completions([[]], [[1]], 0)
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        pack_completions([[1], [2]], [[1]], 0)


def test_split_microbatches_keeps_rows_together_and_none_values():
    batch = replace(pack_completions([[1]] * 4, [[2, 3]] * 4, 0), advantages=torch.arange(4.0), ref_logprobs=None)
    parts = split_microbatches(batch, 2)
    assert [p.advantages.tolist() for p in parts] == [[0, 1], [2, 3]] and parts[1].ref_logprobs is None
    with pytest.raises(ValueError, match="do not split"):
        split_microbatches(batch, 3)
