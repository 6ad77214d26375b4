"""The kernels inside the whole GRPO loss: engine/grpo/policy_loss.py on the kernels' log-probs and entropies.

The loss maths lives only in engine/grpo/policy_loss.py; the kernels' backward consumes d loss / d logprob and
d loss / d entropy. Here d loss / dX and d loss / dW through each kernel must equal autograd through the
materialised-logits reference, for token-level (DAPO) and sequence-level (GSPO-style GRPO) importance sampling,
with a k3 KL term and an entropy bonus (so the entropy gradient path is exercised) and clipped and unclipped tokens.
Chunked path in float64 (1e-12 of the largest entry; measured ~2e-15); the Triton path in float32 against the
float64 reference (1e-4 of the largest entry; measured ~2e-6 on this 2-core CPU under the interpreter).
"""

from __future__ import annotations

import pytest
import torch

from engine.grpo.policy_loss import PolicyLossBatch, build_loss_normalizer, compute_policy_loss
from kernels import lm_head_logprob_entropy, reference_logprob_entropy
from kernels.reference import build_lm_head_problem
from tests.helpers.grpo_settings import build_loss_config

F64 = torch.float64
B, T, H, V_ROWS, VOCAB, TEMPERATURE = 4, 16, 32, 300, 290, 0.9
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# implementation -> (dtype, rtol of the gradients relative to their largest entry)
IMPLEMENTATIONS = {"torch_chunked": (F64, 1e-12), "triton": (torch.float32, 1e-4)}


def _batch(hidden, weight, ids) -> PolicyLossBatch:
    """Masks of uneven lengths, mixed-sign advantages, old / ref log-probs a little off-policy (some clipped)."""
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden.reshape(-1, H), weight, ids.reshape(-1), temperature=TEMPERATURE,
                                          vocab_size=VOCAB)
    lp = lp.reshape(B, T)
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([16, 9, 4, 12])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)  # (B, T)
    return PolicyLossBatch(
        mask=mask,
        advantages=torch.tensor([1.0, -0.5, 0.3, -1.2], dtype=F64),
        old_logprobs=lp + 0.3 * torch.randn(B, T, generator=gen, dtype=F64),
        ref_logprobs=lp + 0.1 * torch.randn(B, T, generator=gen, dtype=F64),
    )


def _loss_grads(hidden, weight, ids, batch, config, implementation, dtype):
    """(loss, dX, dW) of the GRPO loss on the given implementation's log-probs and entropies."""
    x = hidden.to(DEVICE if implementation == "triton" else "cpu", dtype).clone().requires_grad_(True)
    w = weight.to(x.device, dtype).clone().requires_grad_(True)
    lp, ent = lm_head_logprob_entropy(x, w, ids.to(x.device), temperature=TEMPERATURE, vocab_size=VOCAB,
                                      implementation=implementation, workspace_mb=16 * 128 * 24 / 2**20)
    cast = {k: getattr(batch, k).to(x.device, lp.dtype) for k in ("mask", "advantages", "old_logprobs",
                                                                    "ref_logprobs")}
    terms = "triton" if implementation == "triton" else "torch"  # the Triton path end to end: LM head and GRPO terms
    out = compute_policy_loss(lp, PolicyLossBatch(**cast), config, build_loss_normalizer(cast["mask"]), entropy=ent,
                              terms_implementation=terms)
    out.loss.backward()
    return out.loss.detach().cpu().double(), x.grad.cpu().double(), w.grad.cpu().double()


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize(("loss_type", "level"), [("dapo", "token"), ("grpo", "sequence")])
def test_grpo_loss_gradients_through_kernel_match_autograd_through_reference(loss_type, level, implementation):
    x, w, y = build_lm_head_problem(B * T, H, V_ROWS, vocab_size=VOCAB, logit_std=4.0, sampled_fraction=1.0,
                                    dtype=F64, seed=9)
    hidden, ids = x.reshape(B, T, H), y.reshape(B, T)  # (B, T, H), (B, T)
    batch = _batch(hidden, w, ids)
    config = build_loss_config(loss_type=loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01,
                              epsilon_high=0.28, use_bias_correction_kl=False)
    want = _loss_grads(hidden, w, ids, batch, config, "reference", F64)
    dtype, rtol = IMPLEMENTATIONS[implementation]
    got = _loss_grads(hidden, w, ids, batch, config, implementation, dtype)
    assert want[1].abs().max() > 0 and want[2].abs().max() > 0
    for name, a, b in zip(("loss", "dX", "dW"), got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item(), msg=lambda m, n=name: f"{n}: {m}")


def test_entropy_bonus_changes_the_kernel_gradient():
    x, w, y = build_lm_head_problem(B * T, H, V_ROWS, vocab_size=VOCAB, logit_std=4.0, dtype=F64, seed=9)
    hidden, ids = x.reshape(B, T, H), y.reshape(B, T)
    batch = _batch(hidden, w, ids)
    grads = [_loss_grads(hidden, w, ids, batch, build_loss_config(entropy_coef=coef), "torch_chunked", F64)[1]
             for coef in (0.0, 0.5)]
    assert (grads[0] - grads[1]).abs().max() > 1e-3 * grads[0].abs().max()
