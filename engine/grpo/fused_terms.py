"""The GRPO loss's per-token terms on the fused Triton kernel: config and batch -> kernels/grpo_token_terms.py.

Owns: `resolve_terms_implementation` ("auto" = the Triton terms on CUDA, the torch terms elsewhere: under the
interpreter they are far slower than torch, benchmarks/results/grpo_token_terms.csv) and `fused_per_token_loss`, the
drop-in for engine/grpo/policy_loss.py's `_per_token_loss` (same arguments, same results to fp32 rounding): it maps
the loss config onto `TokenTermParams` and hands the kernel the per-sequence values torch reduced (GSPO log weights,
VESPO phi, the off-policy mask).

Must not: import engine/grpo/policy_loss.py (which imports this module; its types are duck-typed here), normalise,
or hold any GRPO maths of its own.

Test: `pytest tests/kernels/test_grpo_token_terms.py` (through `compute_policy_loss`, torch terms vs Triton terms).
"""

from __future__ import annotations

import os

import torch

from engine.grpo.loss_statistics import CLIPPED_LOSS_TYPES
from engine.grpo.settings import TERMS_IMPLEMENTATIONS, TermsImplementation


def resolve_terms_implementation(implementation: TermsImplementation, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA, "torch" elsewhere; other names are checked and returned."""
    if implementation not in TERMS_IMPLEMENTATIONS:
        raise ValueError(f"terms_implementation must be one of {TERMS_IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if implementation == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"kernels.loss_terms_implementation = 'triton' needs CUDA tensors (got {device}) or the "
                         f"Triton interpreter (TRITON_INTERPRET=1); use 'auto' or 'torch' on the CPU")
    return implementation


def fused_per_token_loss(logprobs, old_logprobs, log_weights, advantages, off_policy_mask, entropy_mask, phi, batch,
                         config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(unnormalised per-token loss, the ratio the metrics see, per-token KL or None) from the Triton kernel.

    Args: as policy_loss._per_token_loss: logprobs, old_logprobs (B, T); log_weights (B, T) token level (unused:
    the kernel forms l - l_old itself) or (B, 1) sequence level; advantages (B, 1) or (B, T); the no-grad
    multipliers off_policy_mask, entropy_mask; vespo's phi (B, 1); the PolicyLossBatch and PolicyLossConfig.
    """
    from kernels.grpo_token_terms import TokenTermParams, grpo_token_terms

    is_sequence_level = config.importance_sampling_level == "sequence"
    surrogate = "clipped" if config.loss_type in CLIPPED_LOSS_TYPES else config.loss_type
    params = TokenTermParams(
        surrogate=surrogate, is_sequence_level=is_sequence_level, epsilon_low=config.epsilon_low,
        epsilon_high=config.resolved_epsilon_high, delta=config.delta, beta=config.beta,
        kl_estimator=config.kl_estimator, use_bias_correction_kl=config.use_bias_correction_kl,
        sapo_temperature_pos=config.sapo_temperature_pos, sapo_temperature_neg=config.sapo_temperature_neg,
    )
    is_ratio = batch.importance_sampling_ratio if config.loss_type != "vespo" else None
    loss, ratio, kl = grpo_token_terms(
        logprobs, advantages, params, old_logprobs=None if is_sequence_level else old_logprobs,
        seq_log_weights=log_weights if is_sequence_level else None,
        ref_logprobs=batch.ref_logprobs if config.beta != 0.0 else None, off_policy_mask=off_policy_mask,
        entropy_mask=entropy_mask, importance_sampling_ratio=is_ratio, phi=phi,
    )
    return loss, ratio[:, :1] if is_sequence_level else ratio, kl
