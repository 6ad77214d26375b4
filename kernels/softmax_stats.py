"""Per-token softmax statistics of LM-head logits: the online log-sum-exp state, its merges, its TP exchange.

Owns:
- the state every implementation reduces the vocabulary to, per token (row) n, as a (4, N) tensor
  `stats = [m, s, q, t]`: running max `m = max_v z_v`, shifted sum `s = sum_v e^(z_v - m)`, shifted entropy
  accumulator `q = sum_v e^(z_v - m) (z_v - m)` and the target logit `t = z_y` (0 on a shard that does not own y),
  for tempered logits `z = x W^T / T` (soft-capped first, cap tanh(x W^T / cap) / T, where the model sets a final-logit
  cap; the state does not care) (docs/kernels.md). The shifted `q` avoids the cancellation of
  `lse - E[z]`: entropy = log s - q / s, a sum of two non-negative terms;
- `merge_stats`: the fixed-order merge of K partial states (vocab tiles, vocab splits, TP ranks);
- `reduce_stats_over_tp`: one all-gather of the (4, N) state over the TP group, then the same merge, in rank order,
  on every rank (so every rank holds bitwise the same log-probs);
- `finalize_stats`: state -> log-prob, entropy, and the (lse, E[z]) the backward needs;
- `VocabShard`: which global ids this LM-head shard holds and which of them are Megatron padding;
- `all_reduce_hidden_grad`: the backward's dX sum over the TP group.

Must not: compute logits, know about Triton, or import engine/. Collectives take the process group as an argument.

Tested through every implementation: `pytest tests/kernels` (TP=2 on gloo in tests/kernels/test_vocab_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

NUM_STATS = 4
"""Rows of the state tensor: m, s, q, t."""


@dataclass(frozen=True)
class VocabShard:
    """The rows of the global (padded) vocabulary held by one LM-head shard W (V_local, H)."""

    vocab_start: int
    """Global id of local row 0 (tp_rank * V_local for Megatron's even split)."""
    num_local: int
    """V_local: rows of this shard, padding included."""
    num_valid: int
    """Leading local rows with a global id < vocab_size; the rest is padding, masked to -inf (never computed)."""
    vocab_size: int
    """The real (tokenizer) vocabulary; global ids >= it are padding."""


def build_vocab_shard(
    num_local: int,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
) -> VocabShard:
    """Describe this rank's slice of the padded vocabulary.

    Args:
        num_local: V_local, the rows of the local LM-head weight.
        vocab_size: the real vocabulary; None = no padding (tp_size * V_local).
        tp_group: the tensor-parallel group the vocabulary is split over; None = one shard.
        vocab_start: global id of local row 0; None = tp_rank * V_local (Megatron's even split).

    Returns:
        `VocabShard`.
    """
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    vocab_start = tp_rank * num_local if vocab_start is None else vocab_start
    vocab_size = tp_size * num_local if vocab_size is None else vocab_size
    if num_local < 1 or vocab_start < 0 or vocab_size < 1:
        raise ValueError(f"need V_local >= 1, vocab_start >= 0, vocab_size >= 1; got {num_local}, {vocab_start}, "
                         f"{vocab_size}")
    num_valid = min(max(vocab_size - vocab_start, 0), num_local)
    return VocabShard(vocab_start=vocab_start, num_local=num_local, num_valid=num_valid, vocab_size=vocab_size)


def empty_stats(num_rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The state of a shard that holds no real vocabulary row: m = -inf, s = q = t = 0."""
    stats = torch.zeros(NUM_STATS, num_rows, dtype=dtype, device=device)  # (4, N)
    stats[0] = float("-inf")
    return stats


def merge_stats(parts: torch.Tensor) -> torch.Tensor:
    """Merge K partial states over disjoint vocabulary pieces into one, in a fixed order (deterministic).

    M = max_k m_k, S = sum_k s_k e^(m_k - M), Q = sum_k e^(m_k - M) (q_k + (m_k - M) s_k), T = sum_k t_k.
    A part that saw no column (m = -inf, s = 0) contributes nothing.

    Args:
        parts: (K, 4, N) partial states.

    Returns:
        (4, N) merged state, same dtype.
    """
    m, s, q, t = parts.unbind(1)  # each (K, N)
    m_max = m.amax(0)  # (N,)
    shift = m - m_max  # (K, N), -inf for a part that saw no column
    weight = torch.exp(shift)  # (K, N)
    q_shifted = torch.where(s > 0, q + shift * s, torch.zeros_like(q))  # (K, N); guards -inf * 0
    return torch.stack([m_max, (weight * s).sum(0), (weight * q_shifted).sum(0), t.sum(0)])  # (4, N)


def reduce_stats_over_tp(stats: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Combine the per-rank states of a vocab-parallel LM head: one all-gather of 4 floats per token, then
    `merge_stats` in rank order (the same arithmetic on the same data on every rank, so bitwise-equal results).

    Args:
        stats: (4, N) this rank's state over its shard.
        tp_group: the TP group; None or size 1 = nothing to do.

    Returns:
        (4, N) the state over the whole vocabulary.
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return stats
    tp_size = dist.get_world_size(tp_group)
    gathered = torch.empty(tp_size, *stats.shape, dtype=stats.dtype, device=stats.device)  # (TP, 4, N)
    dist.all_gather(list(gathered.unbind(0)), stats.contiguous(), group=tp_group)
    return merge_stats(gathered)


@dataclass(frozen=True)
class TokenStats:
    """Per-token results of the forward, all (N,) in the statistics' dtype."""

    logprobs: torch.Tensor
    """z_y - lse; NaN where the token id is outside [0, vocab_size)."""
    entropy: torch.Tensor
    """lse - E_p[z] = log s - q / s (>= 0)."""
    lse: torch.Tensor
    """log-sum-exp of the tempered logits (saved for the backward)."""
    mean_logit: torch.Tensor
    """E_p[z] (saved for the backward's entropy term)."""


def finalize_stats(stats: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> TokenStats:
    """Turn the whole-vocabulary state into log-probs and entropies.

    Args:
        stats: (4, N) merged state over the whole (real) vocabulary.
        token_ids: (N,) int64 global ids of the sampled tokens.
        vocab_size: ids outside [0, vocab_size) get a NaN log-prob (loud, never a silently wrong value).

    Returns:
        `TokenStats`.
    """
    m, s, q, t = stats.unbind(0)  # each (N,)
    log_s = torch.log(s)
    mean_shift = q / s  # (N,) E_p[z] - m, <= 0
    lse = m + log_s
    is_valid_id = (token_ids >= 0) & (token_ids < vocab_size)
    logprobs = torch.where(is_valid_id, t - lse, torch.full_like(t, float("nan")))
    return TokenStats(logprobs=logprobs, entropy=log_s - mean_shift, lse=lse, mean_logit=m + mean_shift)


def all_reduce_hidden_grad(grad_hidden: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum the partial d loss / d X of every vocab shard over the TP group, in place (Megatron's convention for a
    column-parallel layer whose input is replicated: the backward of `copy_to_tensor_model_parallel_region`)."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(grad_hidden, group=tp_group)
    return grad_hidden
