"""kernels/reference.py: the materialised-logits reference against torch.log_softmax written out by hand."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import build_lm_head_problem, reference_logprob_entropy

F64 = torch.float64


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_reference_matches_log_softmax_over_the_real_vocab(temperature):
    x, w, y = build_lm_head_problem(16, 8, 40, vocab_size=33, logit_std=4.0, dtype=F64, seed=3)
    lp, ent = reference_logprob_entropy(x, w, y, temperature=temperature, vocab_size=33)
    log_p = torch.log_softmax((x @ w[:33].T) / temperature, dim=-1)  # (N, 33): padding rows dropped
    torch.testing.assert_close(lp, log_p.gather(1, y[:, None])[:, 0], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ent, -(log_p.exp() * log_p).sum(-1), rtol=1e-12, atol=1e-13)


def test_reference_padding_rows_get_no_gradient_and_padded_ids_give_nan():
    x, w, y = build_lm_head_problem(8, 8, 40, vocab_size=33, dtype=F64, seed=4)
    w.requires_grad_(True)
    y[0] = 35  # a padding row: never sampled by vLLM, so a NaN makes the bug visible
    lp, ent = reference_logprob_entropy(x, w, y, vocab_size=33)
    assert lp[0].isnan() and not lp[1:].isnan().any()
    (lp[1:].sum() + ent.sum()).backward()
    assert torch.count_nonzero(w.grad[33:]) == 0 and torch.count_nonzero(w.grad[:33]) > 0


def test_problem_builder_scales_logits_and_samples_likely_tokens():
    x, w, y = build_lm_head_problem(32, 16, 50, max_abs_logit=50.0, sampled_fraction=0.5, dtype=F64, seed=5)
    z = x @ w.T
    assert z.abs().max().item() == pytest.approx(50.0, rel=1e-12)
    log_p = torch.log_softmax(z, -1).gather(1, y[:, None])[:, 0]
    assert log_p[:16].mean() > log_p[16:].mean() + 5  # sampled ids are far likelier than uniform ones
