"""kernels/grpo_token_terms.py through `compute_policy_loss`: the Triton per-token terms equal the torch terms of
engine/grpo/policy_loss.py (the reference) to fp32 rounding, forward (loss, every metric sum) and backward
(d loss / d logprobs, d loss / d entropy), for every loss type at both importance-sampling levels.

Odd shapes (B, T) = (3, 7); float32 log-probs with bf16 per-token inputs in one case (torch promotes them, the
launcher upcasts); the ratio lands on every branch: on-policy ties (ratio exactly 1, where torch.min splits the
gradient), clipped low / high, above delta. Interpreter on CPU, real kernel on a GPU. "Equal" = rtol 1e-6 with an
absolute floor of 1e-6 x the largest entry (fp32 rounding of a few operations).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.grpo.policy_loss import (
    PolicyLossBatch,
    build_loss_normalizer,
    compute_policy_loss,
    compute_vllm_importance_sampling_ratio,
)
from engine.grpo.settings import LOSS_TYPES
from tests.helpers.grpo_settings import build_loss_config

B, T = 3, 7
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KL_ESTIMATORS = ("k3", "k2", "k1")


def _batch(level: str, index: int, input_dtype: torch.dtype):
    """(logprobs, entropy, PolicyLossBatch): uneven masks, mixed-sign advantages, ratios on every branch."""
    gen = torch.Generator().manual_seed(11 + index)
    logprobs = -torch.rand(B, T, generator=gen) * 3.0  # (B, T)
    entropy = torch.rand(B, T, generator=gen) * 2.0
    old = logprobs + 0.4 * torch.randn(B, T, generator=gen)
    old[0, :4] = logprobs[0, :4]  # on-policy tokens: ratio exactly 1 (a tie in torch.min)
    mask = (torch.arange(T)[None, :] < torch.tensor([7, 4, 6])[:, None]).float()  # (B, T)
    sampling = old + 0.2 * torch.randn(B, T, generator=gen)
    mode = "token_truncate" if level == "token" else "sequence_mask"
    is_ratio = compute_vllm_importance_sampling_ratio(old, sampling, mask, mode, 0.5, 3.0)  # (B, T) or (B, 1)
    advantages = torch.tensor([0.8, -1.1, 0.0]) if index % 2 else torch.randn(B, T, generator=gen)
    batch = PolicyLossBatch(
        mask=mask, advantages=advantages.to(input_dtype), old_logprobs=old.to(input_dtype),
        ref_logprobs=(logprobs + 0.3 * torch.randn(B, T, generator=gen)).to(input_dtype),
        sampling_logprobs=sampling, importance_sampling_ratio=is_ratio,
    )
    return logprobs, entropy, batch


def _config(loss_type: str, level: str, index: int):
    return build_loss_config(
        loss_type=loss_type, importance_sampling_level=level, epsilon=0.2,
        epsilon_high=0.28 if loss_type != "cispo" else 1.5, delta=1.4 if index % 2 == 0 else None,
        beta=0.04 if index % 4 != 3 else 0.0, kl_estimator=KL_ESTIMATORS[index % 3],
        use_bias_correction_kl=index % 2 == 1, top_entropy_quantile=0.7 if index % 3 == 0 else 1.0,
        entropy_coef=0.01, off_policy_mask_threshold=0.05 if index % 2 == 0 else None,
        max_completion_length=T,
    )


def _loss_and_grads(terms: str, logprobs, entropy, batch, config):
    lp = logprobs.to(DEVICE).clone().requires_grad_(True)
    ent = entropy.to(DEVICE).clone().requires_grad_(True)
    moved = PolicyLossBatch(**{f.name: None if getattr(batch, f.name) is None else getattr(batch, f.name).to(DEVICE)
                               for f in dataclasses.fields(batch)})
    out = compute_policy_loss(lp, moved, config, build_loss_normalizer(moved.mask), entropy=ent,
                              terms_implementation=terms)
    out.loss.backward()
    sums = {name: value.detach().cpu() for name, value in sorted(out.sums.items())}
    return out.loss.detach().cpu(), lp.grad.cpu(), ent.grad.cpu(), sums


def _assert_fp32_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    floor = 1e-6 * max(want.abs().max().item(), 1e-30)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=floor, msg=lambda m: f"{name}: {m}")


CASES = [(loss_type, level) for loss_type in LOSS_TYPES for level in ("token", "sequence")]


@pytest.mark.parametrize(("loss_type", "level"), CASES)
def test_triton_terms_equal_torch_terms_forward_and_backward(loss_type, level):
    index = CASES.index((loss_type, level))
    input_dtype = torch.bfloat16 if index == 1 else torch.float32
    logprobs, entropy, batch = _batch(level, index, input_dtype)
    config = _config(loss_type, level, index)
    want = _loss_and_grads("torch", logprobs, entropy, batch, config)
    got = _loss_and_grads("triton", logprobs, entropy, batch, config)
    for name, a, b in zip(("loss", "d loss / d logprobs", "d loss / d entropy"), got[:3], want[:3]):
        _assert_fp32_equal(a, b, name)
    assert got[3].keys() == want[3].keys()
    for name in want[3]:
        _assert_fp32_equal(got[3][name], want[3][name], f"sums[{name}]")
    assert want[1].abs().max() > 0


def test_terms_implementation_auto_is_torch_off_cuda_and_names_are_checked():
    from engine.grpo.fused_terms import resolve_terms_implementation

    assert resolve_terms_implementation("auto", torch.device("cpu")) == "torch"
    assert resolve_terms_implementation("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="terms_implementation"):
        resolve_terms_implementation("fused", torch.device("cpu"))
