"""kernels/softmax_stats.py: the online-softmax state, its fixed-order merge and its conversion, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.softmax_stats import build_vocab_shard, empty_stats, finalize_stats, merge_stats

F64 = torch.float64


def _state_of(z: torch.Tensor, target_col: torch.Tensor) -> torch.Tensor:
    """(4, N) state of a whole (N, V) block computed directly; target_col may be outside the block (t = 0)."""
    m = z.amax(1)
    e = torch.exp(z - m[:, None])
    owned = (target_col >= 0) & (target_col < z.shape[1])
    t = torch.where(owned, z.gather(1, target_col.clamp(0, z.shape[1] - 1)[:, None])[:, 0], torch.zeros_like(m))
    return torch.stack([m, e.sum(1), (e * (z - m[:, None])).sum(1), t])


def test_merge_of_vocab_pieces_equals_state_of_the_whole():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(5, 37, generator=gen, dtype=F64) * 20  # (N, V)
    target = torch.tensor([0, 36, 17, 20, 5])
    cuts = [0, 3, 20, 21, 37]  # uneven pieces, one of width 1
    parts = torch.stack([_state_of(z[:, a:b], target - a) for a, b in zip(cuts, cuts[1:])])  # (K, 4, N)
    torch.testing.assert_close(merge_stats(parts), _state_of(z, target), rtol=1e-13, atol=1e-12)


def test_merge_ignores_an_empty_part_without_nan():
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(3, 11, generator=gen, dtype=F64)
    whole = _state_of(z, torch.tensor([1, 2, 3]))
    merged = merge_stats(torch.stack([empty_stats(3, F64, z.device), whole]))
    assert not merged.isnan().any()
    torch.testing.assert_close(merged, whole, rtol=0, atol=0)


def test_finalize_gives_log_softmax_and_entropy_and_nan_for_ids_outside_vocab():
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(4, 9, generator=gen, dtype=F64) * 5
    ids = torch.tensor([0, 8, 9, -1])  # vocab_size 9: the last two are invalid
    out = finalize_stats(_state_of(z, ids), ids, vocab_size=9)
    log_p = torch.log_softmax(z, -1)
    torch.testing.assert_close(out.logprobs[:2], log_p[[0, 1], [0, 8]], rtol=1e-13, atol=1e-13)
    assert out.logprobs[2:].isnan().all()
    torch.testing.assert_close(out.entropy, -(log_p.exp() * log_p).sum(-1), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(out.lse, torch.logsumexp(z, -1), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(out.mean_logit, (log_p.exp() * z).sum(-1), rtol=1e-12, atol=1e-13)


def test_entropy_of_a_uniform_distribution_is_log_v():
    z = torch.full((2, 1000), 3.25, dtype=F64)
    out = finalize_stats(_state_of(z, torch.tensor([0, 1])), torch.tensor([0, 1]), vocab_size=1000)
    torch.testing.assert_close(out.entropy, torch.full((2,), math.log(1000), dtype=F64), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize(
    ("num_local", "vocab_size", "vocab_start", "num_valid"),
    [(150, 290, 0, 150), (150, 290, 150, 140), (150, 140, 150, 0), (300, None, 0, 300)],
)
def test_vocab_shard_counts_real_rows(num_local, vocab_size, vocab_start, num_valid):
    shard = build_vocab_shard(num_local, vocab_size, vocab_start=vocab_start)
    assert shard.num_valid == num_valid
    assert shard.vocab_size == (num_local if vocab_size is None else vocab_size)
