"""Completions as Megatron micro-batches: right-padded sequences plus TRL's (B, C) per-completion-token tensors.

Owns: `pack_completions` (prompt + completion token ids -> a `MicroBatch`, engine/policy/microbatch.py:
`tokens (B, T)` right-padded, `prompt_lengths (B,)`, `completion_ids` / `completion_mask (B, C)`) and
`split_microbatches`. Sequences are right-padded
([prompt, completion, pad]) so causal attention needs no mask: a real token never attends to padding, and the
logits at padding positions are never read. Completion token j of row i is predicted by the hidden state at
position prompt_lengths[i] - 1 + j, so per-token tensors keep TRL's layout (B, C) whatever the prompt lengths.
Every micro-batch of one call has the same shape (Megatron's pipeline p2p needs a fixed seq_length). Token-budget
micro-batches and packed rows (`train.padding_free`, `train.max_tokens_per_microbatch`) are engine/policy/packing.py's.

Must not: tokenize, talk to process groups, or compute losses.

Test: tests/unit/test_batch.py.
"""

from __future__ import annotations

import torch

from engine.policy.microbatch import MicroBatch


def pack_completions(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_token_id: int) -> MicroBatch:
    """Right-padded token rows and the completion index tensors.

    Args:
        prompt_ids: B lists of prompt token ids (each non-empty).
        completion_ids: B lists of completion token ids (may be empty).
        pad_token_id: id written into padding (never read by the loss).
    Returns:
        a MicroBatch with `tokens` (B, T) int64, `position_ids` (B, T), `prompt_lengths` (B,), `lengths` (B,) prompt +
        completion tokens (what packing counts: the completion mask may be zeroed for truncated completions),
        `completion_ids` (B, C) int64, `completion_mask` (B, C) float32 (1 for real completion tokens).
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (the first completion token is predicted from it)")
    num_rows = len(prompt_ids)
    seq_len = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    max_completion = max(1, max(len(c) for c in completion_ids))
    tokens = torch.full((num_rows, seq_len), pad_token_id, dtype=torch.long)  # (B, T)
    completions = torch.full((num_rows, max_completion), pad_token_id, dtype=torch.long)  # (B, C)
    mask = torch.zeros((num_rows, max_completion), dtype=torch.float32)  # (B, C)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        tokens[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        completions[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, : len(c)] = 1.0
    return MicroBatch(
        tokens=tokens,
        position_ids=torch.arange(seq_len).expand(num_rows, seq_len).contiguous(),  # (B, T)
        prompt_lengths=torch.tensor([len(p) for p in prompt_ids], dtype=torch.long),  # (B,)
        lengths=torch.tensor([len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)], dtype=torch.long),
        completion_ids=completions,
        completion_mask=mask,
    )


def check_completion_ids(completion_ids: torch.Tensor, completion_mask: torch.Tensor, vocab_size: int) -> None:
    """Refuse a completion token outside the model's real vocabulary [0, vocab_size): ids at or above it are
    Megatron's (or vLLM's) padding rows, not tokens; their log-prob would be NaN and poison the step silently.

    Args:
        completion_ids: (B, C) int64; completion_mask: (B, C), nonzero for real tokens; vocab_size: the real V.
    Raises:
        ValueError naming the row, the position and the id.
    """
    bad = completion_mask.bool() & ((completion_ids < 0) | (completion_ids >= vocab_size))  # (B, C)
    if bool(bad.any()):
        row, pos = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"completion row {row} (of this micro-batch), token {pos}: id {int(completion_ids[row, pos])} is outside "
            f"the model's vocabulary [0, {vocab_size}) ({int(bad.sum())} such tokens): ids from {vocab_size} up are "
            "padding rows of the embedding, never real tokens. The sampler and the trainer disagree on the "
            "vocabulary: serve the same checkpoint (config.json vocab_size) on both sides")


def split_microbatches(batch: MicroBatch, micro_batch_size: int) -> list[MicroBatch]:
    """Split every per-sequence tensor of a batch along dim 0 into micro-batches of `micro_batch_size` rows (None
    stays None)."""
    num_rows = batch.num_sequences
    if num_rows % micro_batch_size:
        raise ValueError(f"{num_rows} rows do not split into micro-batches of {micro_batch_size}")
    return [batch.take(slice(i, i + micro_batch_size)) for i in range(0, num_rows, micro_batch_size)]
