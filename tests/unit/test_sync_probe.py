"""The weight-sync probe compares every token of the probe sequences, each distinct prefix once
(engine/rollout/sync_check.py `full_sequence_probe`), on the packed layout the trainer's forward reads."""

import torch

from engine.policy.batch import pack_completions
from engine.policy.packing import build_microbatch
from engine.rollout.sync_check import full_sequence_probe


def test_full_sequence_probe_compares_each_distinct_token_once_in_the_packed_layout():
    # a GRPO group: one prompt, four completions, two identical, one a prefix of another, one ending in the pad id
    prompt = [7, 8, 9, 10]
    completions = [[3, 4, 5], [3, 4, 5], [3, 4], [6, 0]]
    batch = pack_completions([prompt] * 4 + [[11, 12]], completions + [[13]], pad_token_id=0)
    probe = build_microbatch(batch, [0, 1, 2, 3, 4], "mask", pad_token_id=0)
    full, sequences = full_sequence_probe(probe)

    assert sequences == [prompt + c for c in completions] + [[11, 12, 13]]
    mask = full.completion_mask.bool()
    compared = {tuple(sequences[i][: j + 2]) for i, j in mask.nonzero().tolist()}
    every = {tuple(s[: j + 1]) for s in sequences for j in range(1, len(s))}
    assert compared == every and int(mask.sum()) == len(every), "each distinct prefix exactly once"
    assert int(mask.sum()) == 3 + 3 + 2 + 2, "the prompt once, [3, 4, 5] once ([3, 4] is in it), [6, 0], [12, 13]"
    # token j + 1 of sequence i sits where the trainer's forward reads it: position seq_offset + j + 1 of its row
    for i, j in mask.nonzero().tolist():
        assert full.completion_ids[i, j] == sequences[i][j + 1]
        assert probe.input_ids[probe.seq_row[i], probe.seq_offset[i] + j + 1] == sequences[i][j + 1]
    assert torch.equal(full.prompt_lengths, torch.ones(5, dtype=torch.long))
    assert torch.equal(full.input_ids, probe.input_ids), "the model inputs are the probe's own"
