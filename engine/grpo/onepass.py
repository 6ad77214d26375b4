"""Which GRPO losses the one-pass LM head can take, and their per-token gradients for it.

The one-pass kernel (kernels/onepass_logprob.py) needs d loss / d log-prob and d loss / d entropy of each token while
the logits of its row chunk are still in memory, before the rest of the micro-batch's log-probs exist. That is
possible when they are token-local: a token's derivatives depend on its own log-prob and entropy and on inputs fixed
before the pass (advantages, old / reference / vLLM log-probs, masks, the normaliser's counts). The normalisers are
(`LossNormalizer`: the optimizer step's global token and sequence counts, from the masks; `TRLNormalizer`: counts of
the micro-batch's masks), so every loss type at token-level importance sampling qualifies, with or without KL, the
vLLM IS correction and the entropy bonus. Not token-local (two passes): sequence-level IS (GSPO: w_i is a mean over
the sequence), vespo (phi from the sequence's log-ratio), the off-policy mask (a sequence's mean KL under the current
log-probs) and the top-entropy mask (a quantile of this pass's entropies).

`build_token_grads` evaluates engine/grpo/policy_loss.py's own `compute_policy_loss` on each chunk (its tokens placed
in a (B, T) tensor whose other entries are the old log-probs) and differentiates it: the same maths and the same
autograd arithmetic per token as the two-pass loss, no copy of the GRPO formulas here.

Must not: talk to process groups or compute logits.

Test: `pytest tests/unit/test_onepass_loss.py` (every loss type, one pass vs two passes, micro-batch scaling).
"""

from __future__ import annotations

import torch

from engine.grpo.policy_loss import PolicyLossBatch, compute_policy_loss

ONE, TWO = "one", "two"


def choose_loss_pass(config, requested: str = "auto") -> tuple[str, str]:
    """("one" | "two", why) for a training pass of this loss config; `requested` is `kernels.loss_pass`.

    Raises:
        ValueError: `requested == "one"` for a loss whose gradient is not token-local.
    """
    if requested not in ("auto", ONE, TWO):
        raise ValueError(f"kernels.loss_pass must be 'auto', 'one' or 'two', got {requested!r}")
    blockers = []
    if config.importance_sampling_level == "sequence":
        blockers.append("sequence-level importance sampling (GSPO) averages the log-ratio over the sequence")
    if config.loss_type == "vespo":
        blockers.append("vespo's phi depends on the sequence's log-ratio")
    if config.off_policy_mask_threshold is not None:
        blockers.append("the off-policy mask depends on the sequence's mean KL under the current log-probs")
    if config.top_entropy_quantile < 1.0:
        blockers.append("the top-entropy mask is a quantile of this pass's entropies")
    if requested == TWO:
        return TWO, "kernels.loss_pass = 'two'"
    if blockers:
        if requested == ONE:
            raise ValueError(f"kernels.loss_pass = 'one' needs a token-local loss: {'; '.join(blockers)}")
        return TWO, "not token-local: " + "; ".join(blockers)
    return ONE, f"token-local ({config.loss_type}, token-level IS)"


def build_token_grads(mask: torch.Tensor, inputs: PolicyLossBatch, config, normalizer, *, entropy_coef=None,
                      terms_implementation: str):
    """The `kernels.onepass_logprob.TokenGrads` of one micro-batch's loss.

    Args:
        mask: (B, T) bool, the completion positions that go through the LM head, in the kernel's row order
            (row-major, as `completion_logprobs` selects them).
        inputs, config, normalizer, entropy_coef, terms_implementation: as `compute_policy_loss` takes them.

    Returns:
        (r0, r1, logprobs, entropy) -> (d loss / d logprobs, d loss / d entropy or None) for kernel rows [r0, r1),
        the unscaled micro-batch loss (the caller's scale reaches the kernel through its anchor).
    """
    rows, cols = mask.nonzero(as_tuple=True)  # (N,) each, row-major
    base = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device) if inputs.old_logprobs is None \
        else inputs.old_logprobs.detach()

    def token_grads(r0: int, r1: int, logprobs: torch.Tensor, entropy: torch.Tensor):
        lp_leaf = logprobs.detach().requires_grad_(True)
        ent_leaf = entropy.detach().requires_grad_(config.is_entropy_bonus_enabled)
        index = (rows[r0:r1], cols[r0:r1])
        lp_full = base.to(logprobs.dtype).index_put(index, lp_leaf)  # (B, T), only the chunk's tokens carry grad
        ent_full = torch.zeros(mask.shape, dtype=entropy.dtype, device=entropy.device).index_put(index, ent_leaf)
        out = compute_policy_loss(lp_full, inputs, config, normalizer, entropy=ent_full, entropy_coef=entropy_coef,
                                  terms_implementation=terms_implementation)
        leaves = (lp_leaf, ent_leaf) if ent_leaf.requires_grad else (lp_leaf,)
        grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
        g_lp = torch.zeros_like(lp_leaf) if grads[0] is None else grads[0]
        g_ent = grads[1] if len(grads) > 1 else None
        return g_lp, g_ent

    return token_grads
