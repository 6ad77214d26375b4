"""TRL's own behaviour where TRL defines it: its construction-time warnings, its static helpers, vespo's IS mode.

Owns (issue #27 item 6; reward models by hub id, item 9, are engine/train/rewards.py's `resolve_reward_func`):
- `warn_objective_settings(args)`: the warnings TRL's GRPOTrainer logs at construction about the objective
  (sequence-level importance sampling with a loss that sums per-token terms; luspo at token level; vespo at
  sequence level), word for word, on the `logging` logger of engine/api/trl_trainer.py (TRL logs them with
  `logger.warning`, so a test reads them with pytest's `caplog`);
- `get_off_policy_mask` and `get_high_entropy_mask`: TRL's GRPOTrainer helpers with TRL's signatures, computed by
  the engine's own maths (engine/grpo/policy_loss.py), bound onto `GRPOTrainer`;
- `vespo_importance_sampling_mode(...)`: the vLLM IS mode a vespo run gets when the user named none (TRL without
  vLLM has no IS correction; with vLLM it requires a token mode).

Must not: implement maths (engine/grpo/*), run the loop, import trl (a test-only dependency) or vLLM.

Test: tests/unit/test_trl_compat.py (warnings, helpers against TRL's own expected values, vespo's mode, hub reward
models from a temporary HF cache with HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("engine.api.trl_trainer")

TOKEN_SUMMED_LOSS_TYPES = ("bnpo", "dr_grpo", "dapo", "cispo")
"""Loss types TRL warns about at `importance_sampling_level='sequence'` (they sum per-token terms)."""

VESPO_IS_MODES = ("token_truncate", "token_mask")
"""The vLLM IS modes TRL accepts with loss_type='vespo' (it folds the ratio into its token weights)."""


def warn_objective_settings(loss_type: str, importance_sampling_level: str) -> None:
    """Log TRL's construction-time warnings about the loss type and the importance-sampling level."""
    if loss_type == "luspo" and importance_sampling_level != "sequence":
        logger.warning("When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to "
                       "mirror the paper's setup.")
    if loss_type == "vespo" and importance_sampling_level != "token":
        logger.warning("VESPO computes sequence-level importance weights internally. `importance_sampling_level` "
                       "should be set to `'token'` (the default).")
    if importance_sampling_level == "sequence" and loss_type in TOKEN_SUMMED_LOSS_TYPES:
        logger.warning(
            f"When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums per-token "
            "contributions, which effectively weights each sequence by its completion length instead of optimizing "
            "the per-sequence objective. To reproduce the GSPO paper's setup, set `loss_type='grpo'` (see "
            "https://huggingface.co/docs/trl/main/en/paper_index#group-sequence-policy-optimization).")


def vespo_importance_sampling_mode(loss_type: str, mode: str, mode_is_explicit: bool) -> str:
    """The vLLM IS mode of a run: vespo with no mode named gets 'token_truncate' (TRL accepts only token modes with
    vespo; its default 'sequence_mask' would be refused), an explicit mode stays (engine/validation.py checks it)."""
    if loss_type == "vespo" and not mode_is_explicit and mode not in VESPO_IS_MODES:
        return VESPO_IS_MODES[0]
    return mode


def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                        sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                        off_policy_threshold: float) -> torch.Tensor:
    """TRL's `GRPOTrainer.get_off_policy_mask` (DeepSeek-V3.2): (B, 1) 1.0 keep / 0.0 drop, a sequence dropped iff
    A < 0 and its mean KL(sampler || current) over `mask` exceeds the threshold (engine/grpo/policy_loss.py)."""
    from engine.grpo.policy_loss import compute_off_policy_mask

    return compute_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold)


def get_high_entropy_mask(trainer: Any, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """TRL's `GRPOTrainer.get_high_entropy_mask`: (B, T) bool, True where a token's entropy is at or above the
    `threshold` quantile of the unmasked entropies (TRL passes 1 - top_entropy_quantile), padding always False.

    `trainer` is unused: the engine computes the population on the rank that calls it (the loop passes the whole
    generation batch's), where TRL gathers it across processes with its accelerator.
    """
    import torch

    from engine.grpo.policy_loss import compute_entropy_threshold, select_high_entropy_tokens

    if not mask.bool().any():
        return torch.zeros_like(entropies, dtype=torch.bool)
    cutoff = compute_entropy_threshold(entropies.float(), mask, 1.0 - threshold)
    return select_high_entropy_tokens(entropies.float(), mask, cutoff) & mask.bool()
