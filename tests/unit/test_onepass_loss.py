"""engine/grpo/onepass.py: which configs take the one-pass LM head, and that their gradient through it equals the
two-pass gradient for every loss type (token-level IS, with and without KL, IS correction, entropy bonus, both
normalisers), with the micro-batch's scale passed through the anchor; per-token derivatives bitwise equal to
autograd through `compute_policy_loss`."""

from __future__ import annotations

import pytest
import torch

from engine.grpo.onepass import ONE, TWO, build_token_grads, choose_loss_pass
from engine.grpo.policy_loss import LossNormalizer, PolicyLossBatch, TRLNormalizer, compute_policy_loss
from engine.grpo.settings import LOSS_TYPES
from kernels import lm_head_logprob_entropy
from kernels.onepass_logprob import onepass_logprob_entropy
from kernels.reference import build_lm_head_problem
from tests.helpers.grpo_settings import build_loss_config

F64 = torch.float64
B, T, H, V_ROWS, VOCAB = 5, 7, 16, 67, 61
TOKEN_LOCAL = [t for t in LOSS_TYPES if t != "vespo"]
SETTINGS = {  # name -> (config fields, batch extras)
    "plain": (dict(), ()),
    "kl_k3_bias": (dict(beta=0.04, use_bias_correction_kl=True, epsilon_high=0.28), ("ref",)),
    "kl_k2_is_delta": (dict(beta=0.1, kl_estimator="k2", delta=1.5), ("ref", "is")),
    "entropy_bonus": (dict(entropy_coef=0.01), ("is_row",)),
}


def _batch(seed: int, extras, dtype):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 0, 5, 1])  # an empty sequence too
    mask = (torch.arange(T)[None, :] < lengths[:, None])
    fields = dict(mask=mask.to(dtype), advantages=torch.randn(B, generator=gen, dtype=dtype),
                  old_logprobs=-torch.rand(B, T, generator=gen, dtype=dtype) * 3 - 1.0)
    if "ref" in extras:
        fields["ref_logprobs"] = -torch.rand(B, T, generator=gen, dtype=dtype) * 3 - 1.0
    if "is" in extras:
        fields["importance_sampling_ratio"] = torch.rand(B, T, generator=gen, dtype=dtype) + 0.5
    if "is_row" in extras:
        fields["importance_sampling_ratio"] = torch.rand(B, 1, generator=gen, dtype=dtype) + 0.5
    return PolicyLossBatch(**fields), mask


def _problem(mask, dtype, seed=0):
    n = int(mask.sum())
    x, w, y = build_lm_head_problem(n, H, V_ROWS, vocab_size=VOCAB, logit_std=2.0, dtype=F64, seed=seed,
                                    sampled_fraction=0.7)
    return x.to(dtype), w.to(dtype), y


def _two_pass(x, w, y, mask, inputs, config, normalizer, scale):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = lm_head_logprob_entropy(x, w, y, workspace_mb=0.01, implementation="torch_chunked", vocab_size=VOCAB)
    zeros = torch.zeros(mask.shape, dtype=lp.dtype)
    out = compute_policy_loss(zeros.masked_scatter(mask, lp), inputs, config, normalizer,
                              entropy=zeros.masked_scatter(mask, ent), terms_implementation="torch")
    (out.loss * scale).backward()
    return out.loss.detach(), x.grad, w.grad


def _one_pass(x, w, y, mask, inputs, config, normalizer, scale):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    grads = build_token_grads(mask, inputs, config, normalizer, terms_implementation="torch")
    lp, ent, anchor = onepass_logprob_entropy(x, w, y, grads, workspace_mb=0.01, implementation="torch_chunked",
                                              vocab_size=VOCAB)
    zeros = torch.zeros(mask.shape, dtype=lp.dtype)
    out = compute_policy_loss(zeros.masked_scatter(mask, lp), inputs, config, normalizer,
                              entropy=zeros.masked_scatter(mask, ent), terms_implementation="torch")
    ((out.loss.detach() + anchor) * scale).backward()
    return out.loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("loss_type", TOKEN_LOCAL)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("dtype,tol", [(F64, 1e-11), (torch.float32, 2e-5)])
def test_one_pass_gradient_equals_two_pass_for_every_token_local_loss(loss_type, setting, dtype, tol):
    fields, extras = SETTINGS[setting]
    config = build_loss_config(loss_type=loss_type, max_completion_length=T, **fields)
    assert choose_loss_pass(config)[0] == ONE
    inputs, mask = _batch(LOSS_TYPES.index(loss_type), extras, dtype if dtype == F64 else torch.float32)
    x, w, y = _problem(mask, dtype, seed=len(setting))
    for normalizer in (LossNormalizer(num_tokens=41.0, num_sequences=12.0),
                       TRLNormalizer(num_items_in_batch=33.0, num_processes=2, gradient_accumulation_steps=3)):
        want = _two_pass(x, w, y, mask, inputs, config, normalizer, scale=0.25)
        got = _one_pass(x, w, y, mask, inputs, config, normalizer, scale=0.25)
        for name, a, b in zip(("loss", "dX", "dW"), got, want):
            scale = b.abs().max().clamp(min=1e-30)
            torch.testing.assert_close(a / scale, b / scale, rtol=tol, atol=tol,
                                       msg=lambda m, n=f"{loss_type}/{setting}/{type(normalizer).__name__} {name}":
                                       f"{n}: {m}")


@pytest.mark.parametrize("loss_type", TOKEN_LOCAL)
def test_token_grads_are_bitwise_autograd_through_compute_policy_loss(loss_type):
    """Given the same log-probs, each chunk's derivatives are exactly what the two-pass backward would receive."""
    config = build_loss_config(loss_type=loss_type, max_completion_length=T, beta=0.04, entropy_coef=0.02)
    inputs, mask = _batch(3, ("ref", "is"), torch.float32)
    gen = torch.Generator().manual_seed(9)
    lp = (-torch.rand(B, T, generator=gen) * 4).requires_grad_(True)
    ent = (torch.rand(B, T, generator=gen) * 2).requires_grad_(True)
    normalizer = LossNormalizer(num_tokens=20.0, num_sequences=5.0)
    out = compute_policy_loss(lp, inputs, config, normalizer, entropy=ent, terms_implementation="torch")
    want_lp, want_ent = torch.autograd.grad(out.loss, (lp, ent))
    grads = build_token_grads(mask, inputs, config, normalizer, terms_implementation="torch")
    n = int(mask.sum())
    got = [grads(r0, min(r0 + 4, n), lp.detach()[mask][r0:r0 + 4], ent.detach()[mask][r0:r0 + 4])
           for r0 in range(0, n, 4)]
    assert torch.equal(torch.cat([g[0] for g in got]), want_lp[mask])
    assert torch.equal(torch.cat([g[1] for g in got]), want_ent[mask])


def test_which_configs_take_one_pass_and_why():
    assert choose_loss_pass(build_loss_config(loss_type="dapo")) == (ONE, "token-local (dapo, token-level IS)")
    blocked = {
        "gspo": build_loss_config(loss_type="grpo", importance_sampling_level="sequence"),
        "vespo": build_loss_config(loss_type="vespo"),
        "off_policy": build_loss_config(loss_type="dapo", off_policy_mask_threshold=0.5),
        "top_entropy": build_loss_config(loss_type="dapo", top_entropy_quantile=0.2),
    }
    for name, config in blocked.items():
        path, why = choose_loss_pass(config)
        assert path == TWO and why.startswith("not token-local"), name
        with pytest.raises(ValueError, match="token-local"):
            choose_loss_pass(config, "one")
    assert choose_loss_pass(build_loss_config(loss_type="dapo"), "two")[0] == TWO
    with pytest.raises(ValueError, match="loss_pass"):
        choose_loss_pass(build_loss_config(loss_type="dapo"), "three")
