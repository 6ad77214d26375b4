"""engine/grpo/policy_loss.py: hand-computed edge cases, masks, estimators, and layout independence of the normaliser.

Equality with TRL 1.16 (every loss type x level x beta x IS mode x masks, loss and gradient) lives in
tests/unit/test_trl_parity.py; here the values are worked out by hand and the layout tests split one batch several ways.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.grpo.policy_loss import (
    LossNormalizer,
    PolicyLossBatch,
    TRLNormalizer,
    build_loss_normalizer,
    compute_entropy_threshold,
    compute_off_policy_mask,
    compute_policy_loss,
    compute_vllm_importance_sampling_ratio,
    entropy_coef_to_apply,
    estimate_kl,
    find_truncated_completions,
    mask_truncated_completions,
    select_high_entropy_tokens,
    update_entropy_coef,
)
from engine.grpo.settings import IS_MODES, LOSS_TYPES
from tests.helpers.grpo_settings import build_loss_config

F64 = torch.float64


def _loss_and_grad(config, logprobs, batch, normalizer, **kwargs):
    leaf = logprobs.clone().requires_grad_(True)
    out = compute_policy_loss(leaf, batch, config, normalizer, **{"terms_implementation": "torch", **kwargs})
    out.loss.backward()
    return out, leaf.grad


# --- hand-computed values ---------------------------------------------------------------------------------------------


def test_single_token_completions_clip_and_average_by_hand():
    # row 0: r = e^0.5 = 1.6487 > 1.2 with A = +1 -> clipped: loss -1.2, no gradient.
    # row 1: r = e^-0.1 = 0.9048 inside [0.8, 1.2] with A = -1 -> loss +r, d/dlogp = r.
    logprobs = torch.tensor([[-1.0], [-1.0]], dtype=F64)
    batch = PolicyLossBatch(mask=torch.ones(2, 1), advantages=torch.tensor([1.0, -1.0], dtype=F64),
                            old_logprobs=torch.tensor([[-1.5], [-0.9]], dtype=F64))
    r1 = math.exp(-0.1)
    for loss_type in ("grpo", "dapo", "bnpo", "luspo"):
        out, grad = _loss_and_grad(build_loss_config(loss_type=loss_type), logprobs, batch,
                                   LossNormalizer(num_tokens=2, num_sequences=2))
        assert out.loss.item() == pytest.approx((-1.2 + r1) / 2, abs=1e-12), loss_type
        torch.testing.assert_close(grad, torch.tensor([[0.0], [r1 / 2]], dtype=F64))
    out, _ = _loss_and_grad(build_loss_config(loss_type="dr_grpo", max_completion_length=4), logprobs, batch,
                            LossNormalizer(num_tokens=2, num_sequences=2))
    assert out.loss.item() == pytest.approx((-1.2 + r1) / (2 * 4), abs=1e-12)


def test_ratios_far_outside_the_clip_range_by_hand():
    # log-ratios +-20: r = e^20 = 4.85e8 or e^-20 = 2.06e-9; eps = 0.2, eps_high = 0.28; one token per row.
    log_ratio = torch.tensor([[20.0], [20.0], [-20.0], [-20.0]], dtype=F64)
    logprobs = torch.full((4, 1), -1.0, dtype=F64)
    batch = PolicyLossBatch(mask=torch.ones(4, 1), advantages=torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64),
                            old_logprobs=logprobs - log_ratio)
    norm = LossNormalizer(num_tokens=4, num_sequences=4)
    big, small = math.exp(20.0), math.exp(-20.0)
    out, grad = _loss_and_grad(build_loss_config(loss_type="dapo", epsilon_high=0.28), logprobs, batch, norm)
    per_row = torch.tensor([-1.28, big, -small, 0.8], dtype=F64)  # A<0 with a huge ratio is not clipped (PPO-clip)
    assert out.loss.item() == pytest.approx(per_row.sum().item() / 4, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0], [big / 4], [-small / 4], [0.0]], dtype=F64))
    metrics = {k: (v[0] / v[1]).item() for k, v in out.sums.items()}
    assert metrics == {"clip_ratio/low_mean": 0.25, "clip_ratio/high_mean": 0.25, "clip_ratio/region_mean": 0.5}
    out, grad = _loss_and_grad(build_loss_config(loss_type="dapo", delta=3.0), logprobs, batch, norm)  # two-sided
    assert out.loss.item() == pytest.approx((-1.2 + 3.0 - small + 0.8) / 4, rel=1e-12)
    assert grad[1].item() == 0.0
    out, grad = _loss_and_grad(build_loss_config(loss_type="cispo", epsilon_high=5.0), logprobs, batch, norm)
    # cispo: -sg(min(r, 5)) A logp: rows (5, 5, r_small, r_small) * A * (-1) per row, gradient -sg(.) A
    assert out.loss.item() == pytest.approx((5.0 - 5.0 + small - small) / 4, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-5.0], [5.0], [-small], [small]], dtype=F64) / 4)
    assert (out.sums["cispo_clip_ratio"][0] / out.sums["cispo_clip_ratio"][1]).item() == 0.25
    out, grad = _loss_and_grad(build_loss_config(loss_type="sapo"), logprobs, batch, norm)
    # sapo: sigmoid(tau (r - 1)) * 4 / tau saturates: 4 for A>0 (tau 1), 4/1.05 for A<0; ~0 at r -> 0
    expected = (-4.0 + 4 / 1.05 - 4 * torch.sigmoid(torch.tensor(-1.0, dtype=F64)).item()
                + 4 / 1.05 * torch.sigmoid(torch.tensor(-1.05, dtype=F64)).item()) / 4
    assert out.loss.item() == pytest.approx(expected, abs=1e-8)
    assert grad[:2].abs().max().item() == 0.0


def test_kl_estimators_by_hand():
    logprobs = torch.tensor([[math.log(0.25)]], dtype=F64)
    ref = torch.tensor([[math.log(0.5)]], dtype=F64)  # d = ref - logp = ln 2
    ln2 = math.log(2.0)
    assert estimate_kl(logprobs, ref, "k3").item() == pytest.approx(2.0 - ln2 - 1.0)
    assert estimate_kl(logprobs, ref, "k1").item() == pytest.approx(-ln2)
    assert estimate_kl(logprobs, ref, "k2").item() == pytest.approx(ln2**2 / 2)
    with pytest.raises(ValueError, match="kl_estimator"):
        estimate_kl(logprobs, ref, "k4")


def test_beta_adds_the_kl_after_the_masks():
    # On-policy, A = -1, the sampler 1 nat away: the off-policy mask drops the policy term, the KL stays.
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    batch = PolicyLossBatch(mask=torch.ones(1, 2), advantages=-torch.ones(1, dtype=F64), ref_logprobs=ref,
                            sampling_logprobs=logprobs + 1.0)
    config = build_loss_config(loss_type="dapo", beta=0.5, kl_estimator="k2", off_policy_mask_threshold=0.0,
                               use_bias_correction_kl=False)
    out, grad = _loss_and_grad(config, logprobs, batch, LossNormalizer(num_tokens=2, num_sequences=1))
    assert out.loss.item() == pytest.approx(0.5 * (0.5 * 0.25 + 0.5 * 1.0) / 2)
    torch.testing.assert_close(grad, 0.5 * torch.tensor([[0.5, -1.0]], dtype=F64) / 2)  # d k2 / d logp = -d
    assert (out.sums["kl"][0] / out.sums["kl"][1]).item() == pytest.approx((0.125 + 0.5) / 2)


@pytest.mark.parametrize("normalizer", [LossNormalizer(num_tokens=0, num_sequences=3),
                                        TRLNormalizer(num_items_in_batch=0, gradient_accumulation_steps=2)])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fully_masked_batch_has_zero_loss_and_gradient_and_no_nan(loss_type, importance_sampling_level, normalizer):
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 4, generator=gen, dtype=F64)
    entropy = torch.rand(3, 4, generator=gen, dtype=F64).requires_grad_(True)
    mask = torch.zeros(3, 4)
    old = logprobs + 0.5
    batch = PolicyLossBatch(
        mask=mask, advantages=torch.tensor([1.0, -1.0, 0.5], dtype=F64), old_logprobs=old, ref_logprobs=logprobs - 1,
        sampling_logprobs=old - 1,
        importance_sampling_ratio=compute_vllm_importance_sampling_ratio(
            old, old - 1, mask, "sequence_mask", None, 3.0),
    )
    config = build_loss_config(loss_type=loss_type, importance_sampling_level=importance_sampling_level, beta=0.1,
                              top_entropy_quantile=0.5, entropy_coef=0.1, off_policy_mask_threshold=0.1,
                               use_bias_correction_kl=False)
    out, grad = _loss_and_grad(config, logprobs, batch, normalizer, entropy=entropy)
    assert out.loss.item() == 0.0 and torch.isfinite(out.loss)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert entropy.grad is None or torch.equal(entropy.grad, torch.zeros_like(entropy))


# --- masks and ratios -------------------------------------------------------------------------------------------------


def test_off_policy_mask_keeps_positive_advantages_and_low_kl_drops_the_rest():
    # mean KL(sampler || current) per row: 2, 0.5, 2, 2 (over 2 tokens); row 3 has A = 0 (kept: A >= 0).
    logprobs = torch.tensor([[-2.0, -2.0], [-0.5, -0.5], [-2.0, -2.0], [-2.0, -2.0]], dtype=F64)
    mask = torch.ones(4, 2)
    advantages = torch.tensor([[1.0], [-1.0], [-1.0], [0.0]], dtype=F64)
    keep = compute_off_policy_mask(advantages, logprobs, torch.zeros(4, 2, dtype=F64), mask, 1.0)
    assert keep.flatten().tolist() == [1.0, 1.0, 0.0, 1.0]
    padded = torch.tensor([[-2.0, 99.0]], dtype=F64)  # padding never counts: mean KL = 2 over one token
    keep = compute_off_policy_mask(torch.tensor([[-1.0]]), padded, torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), 1.9)
    assert keep.item() == 0.0


def test_entropy_mask_keeps_tokens_at_or_above_the_quantile_and_never_padding():
    entropy = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # the 9.0 is padding
    threshold = compute_entropy_threshold(entropy, mask, 0.5)  # quantile 0.5 of 0.1..0.7 = 0.4
    assert threshold.item() == pytest.approx(0.4)
    kept = select_high_entropy_tokens(entropy, mask, threshold)
    assert kept.tolist() == [[False, False, False, True], [True, True, True, False]]
    top = select_high_entropy_tokens(entropy, mask, compute_entropy_threshold(entropy, mask, 0.0))
    assert top.sum().item() == 1 and top[1, 2].item()  # rho = 0 keeps the argmax only
    assert select_high_entropy_tokens(entropy, mask, compute_entropy_threshold(entropy, mask, 1.0)).equal(mask.bool())
    assert compute_entropy_threshold(entropy, torch.zeros_like(mask), 0.5) is None
    assert not select_high_entropy_tokens(entropy, mask, None).any()


def test_vllm_importance_sampling_ratio_modes_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64)
    sampling = torch.tensor([[-math.log(2.0), math.log(4.0), float("nan")]], dtype=F64)  # ratios 2, 1/4, unscored
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    token_truncate = compute_vllm_importance_sampling_ratio(old, sampling, mask, "token_truncate", 0.5, 1.5)
    torch.testing.assert_close(token_truncate, torch.tensor([[1.5, 0.5, 1.0]], dtype=F64))
    token_mask = compute_vllm_importance_sampling_ratio(old, sampling, mask, "token_mask", 0.5, 1.5)
    torch.testing.assert_close(token_mask, torch.tensor([[0.0, 0.0, 1.0]], dtype=F64))
    # sequence: exp(sum) = 2 * 1/4 = 0.5 (a product of token ratios, not a geometric mean)
    seq = compute_vllm_importance_sampling_ratio(old, sampling, mask, "sequence_truncate", None, 3.0)
    torch.testing.assert_close(seq, torch.tensor([[0.5]], dtype=F64))
    assert compute_vllm_importance_sampling_ratio(old, sampling, mask, "sequence_mask", 0.6, None).item() == 0.0
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of"):
        compute_vllm_importance_sampling_ratio(old, sampling, mask, "token", None, 3.0)
    with pytest.raises(ValueError, match="needs a clip_min or a clip_max"):
        compute_vllm_importance_sampling_ratio(old, sampling, mask, "token_truncate", None, None)


def test_adaptive_entropy_coefficient_steps_and_gates():
    step = dict(entropy_target=0.5, entropy_coef_delta=0.1, entropy_coef_min=0.0, entropy_coef_max=0.25)
    assert update_entropy_coef(0.2, 0.4, **step) == 0.25  # below target: up, capped at max
    assert update_entropy_coef(0.05, 0.9, **step) == 0.0  # above target: down, floored at min
    assert entropy_coef_to_apply(0.2, math.inf, 0.5) == 0.0  # nothing measured yet: off (TRL)
    assert entropy_coef_to_apply(0.2, 0.5, 0.5) == 0.2


def test_config_rejects_unknown_loss_type_and_bad_quantile():
    with pytest.raises(ValueError, match="loss_type"):
        build_loss_config(loss_type="ppo")
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        build_loss_config(top_entropy_quantile=1.5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(torch.zeros(1, 1), PolicyLossBatch(mask=torch.ones(1, 1), advantages=torch.zeros(1)),
                            build_loss_config(beta=0.1, use_bias_correction_kl=False),
                            LossNormalizer(num_tokens=1, num_sequences=1), terms_implementation="torch")


# --- layout independence ----------------------------------------------------------------------------------------------


def _random_batch(seed, num_rows=12, num_tokens=6, is_mode=None):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, num_tokens + 1, (num_rows,), generator=gen)  # some rows fully masked
    mask = (torch.arange(num_tokens).unsqueeze(0) < lengths.unsqueeze(1)).to(F64)  # (B, T)
    logprobs = -torch.rand(num_rows, num_tokens, generator=gen, dtype=F64) * 2
    old = logprobs + 0.4 * torch.randn(num_rows, num_tokens, generator=gen, dtype=F64)
    sampling = old + 0.3 * torch.randn(num_rows, num_tokens, generator=gen, dtype=F64)
    batch = PolicyLossBatch(
        mask=mask, advantages=torch.randn(num_rows, generator=gen, dtype=F64), old_logprobs=old,
        ref_logprobs=logprobs + 0.3 * torch.randn(num_rows, num_tokens, generator=gen, dtype=F64),
        sampling_logprobs=sampling,
        importance_sampling_ratio=None if is_mode is None else compute_vllm_importance_sampling_ratio(
            old, sampling, mask, is_mode, 0.5, 2.0),
    )
    return logprobs, torch.rand(num_rows, num_tokens, generator=gen, dtype=F64) * 3, batch


def _rows(batch, rows):
    """The micro-batch of `batch` made of `rows`."""
    def take(x):
        return None if x is None else x[rows]

    return PolicyLossBatch(
        mask=batch.mask[rows], advantages=batch.advantages[rows], old_logprobs=take(batch.old_logprobs),
        ref_logprobs=take(batch.ref_logprobs), sampling_logprobs=take(batch.sampling_logprobs),
        importance_sampling_ratio=take(batch.importance_sampling_ratio),
    )


def _summed_over_split(config, logprobs, entropy, batch, normalizer, micro_batches, **kwargs):
    """Sum of the micro-batch losses (each a list of rows; any DP rank x accumulation step), and its gradients."""
    leaf, entropy_leaf = logprobs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    total = sum(
        compute_policy_loss(leaf[rows], _rows(batch, rows), config, normalizer, entropy=entropy_leaf[rows],
                            **{"terms_implementation": "torch", **kwargs}).loss
        for rows in micro_batches
    )
    total.backward()
    entropy_grad = entropy_leaf.grad if entropy_leaf.grad is not None else torch.zeros_like(entropy)
    return total.detach(), leaf.grad, entropy_grad


def _layouts(num_rows, seed):
    """The same 12 rows cut as: 1 micro-batch; 12 of 1; DP=2 x GA=3 x 2 rows (shuffled); DP=4 x GA=1 x 3; 5 + 7."""
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    return {
        "whole": [list(range(num_rows))],
        "micro_batch_1": [[i] for i in range(num_rows)],
        "dp2_ga3_mbs2": [perm[i : i + 2] for i in range(0, num_rows, 2)],
        "dp4_ga1_mbs3": [perm[i : i + 3] for i in range(0, num_rows, 3)],
        "uneven_5_7": [perm[:5], perm[5:]],
    }


@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_do_not_depend_on_micro_batch_accumulation_or_dp_split(loss_type, importance_sampling_level):
    for seed, (beta, is_mode, quantile) in enumerate([(0.0, None, 1.0), (0.04, "token_truncate", 1.0),
                                                      (0.04, "sequence_mask", 0.5)]):
        logprobs, entropy, batch = _random_batch(seed, is_mode=is_mode)
        config = build_loss_config(loss_type=loss_type, importance_sampling_level=importance_sampling_level, beta=beta,
                                  top_entropy_quantile=quantile, entropy_coef=0.01, epsilon_high=0.28,
                                  max_completion_length=6, use_bias_correction_kl=False)
        normalizer = build_loss_normalizer(batch.mask)  # once, over the whole generation batch
        threshold = compute_entropy_threshold(entropy, batch.mask, quantile)  # once, likewise
        layouts = _layouts(12, seed)
        reference = _summed_over_split(config, logprobs, entropy, batch, normalizer, layouts.pop("whole"),
                                       entropy_threshold=threshold)
        for name, micro_batches in layouts.items():
            split = _summed_over_split(config, logprobs, entropy, batch, normalizer, micro_batches,
                                       entropy_threshold=threshold)
            for what, ours, ref in zip(("loss", "d/dlogprobs", "d/dentropy"), split, reference, strict=True):
                torch.testing.assert_close(ours, ref, atol=1e-12, rtol=1e-10, msg=lambda m: f"{name} {what} {m}")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "luspo"])
def test_trl_normalizer_depends_on_the_split_which_is_why_it_is_not_the_default(loss_type):
    # TRL averages per micro-batch then divides by GA: two micro-batches of unequal token counts weigh tokens
    # differently from the whole batch; this pins that the TRL-exact mode really is TRL's (layout-dependent) one.
    logprobs, entropy, batch = _random_batch(7)
    config = build_loss_config(loss_type=loss_type, max_completion_length=6)
    whole = _summed_over_split(config, logprobs, entropy, batch, TRLNormalizer(num_items_in_batch=1.0),
                               [list(range(12))])
    split = _summed_over_split(config, logprobs, entropy, batch,
                               TRLNormalizer(num_items_in_batch=1.0, gradient_accumulation_steps=2),
                               [list(range(3)), list(range(3, 12))])
    assert not torch.allclose(whole[1], split[1], atol=1e-6)


def test_truncated_completions_are_those_without_a_stop_token_and_lose_their_mask():
    is_truncated = find_truncated_completions(torch.tensor([2, 5, 0, 7]), stop_token_ids=[2, 3, 0])  # EOS 2, 3; pad 0
    assert is_truncated.tolist() == [False, True, False, True]
    mask = mask_truncated_completions(torch.ones(4, 2, dtype=torch.long), is_truncated)
    assert mask.tolist() == [[1, 1], [0, 0], [1, 1], [0, 0]] and mask.dtype == torch.long


def test_build_loss_normalizer_counts_tokens_and_sequences():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert build_loss_normalizer(mask) == LossNormalizer(num_tokens=5.0, num_sequences=3.0)


@pytest.mark.parametrize("is_mode", IS_MODES)
def test_importance_sampling_ratio_multiplies_the_policy_term_but_not_the_kl(is_mode):
    logprobs, _, batch = _random_batch(11, is_mode=is_mode)
    config = build_loss_config(loss_type="dapo", beta=0.0)
    norm = build_loss_normalizer(batch.mask)
    with_is, _ = _loss_and_grad(config, logprobs, batch, norm)
    without = PolicyLossBatch(mask=batch.mask, advantages=batch.advantages, old_logprobs=batch.old_logprobs)
    without_is, _ = _loss_and_grad(config, logprobs, without, norm)
    assert with_is.loss.item() != pytest.approx(without_is.loss.item())
    zero = PolicyLossBatch(mask=batch.mask, advantages=batch.advantages * 0, old_logprobs=batch.old_logprobs,
                           ref_logprobs=batch.ref_logprobs,
                           importance_sampling_ratio=torch.zeros_like(batch.importance_sampling_ratio))
    kl_only, _ = _loss_and_grad(build_loss_config(loss_type="dapo", beta=1.0, use_bias_correction_kl=False), logprobs,
                                zero, norm)
    expected = (estimate_kl(logprobs, batch.ref_logprobs, "k3") * batch.mask).sum() / norm.num_tokens
    assert kl_only.loss.item() == pytest.approx(expected.item())
