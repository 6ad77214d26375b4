"""TRL's own behaviour where TRL defines it: its construction-time warnings, its static helpers, vespo's IS mode.

Owns (issue #27 item 6; reward models by hub id, item 9, are engine/train/rewards.py's `resolve_reward_func`):
- `warn_objective_settings(args)`: the warnings TRL's GRPOTrainer logs at construction about the objective
  (sequence-level importance sampling with a loss that sums per-token terms; luspo at token level; vespo at
  sequence level), word for word, on the `logging` logger of engine/api/trl_trainer.py (TRL logs them with
  `logger.warning`, so a test reads them with pytest's `caplog`);
- `get_off_policy_mask` and `get_high_entropy_mask`: TRL's GRPOTrainer helpers with TRL's signatures, computed by
  the engine's own maths (engine/grpo/policy_loss.py), bound onto `GRPOTrainer`;
- `get_per_token_logps_and_entropies`: TRL's private `_get_per_token_logps_and_entropies` on a transformers
  model, by the engine's LM-head maths (kernels/lm_head_logprob.py);
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


def get_per_token_logps_and_entropies(trainer: Any, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                      logits_to_keep: int, batch_size: int | None = None, compute_entropy: bool = False,
                                      compute_aux_loss: bool = False, **multimodal: Any) -> tuple:
    """TRL's private `GRPOTrainer._get_per_token_logps_and_entropies` on a transformers causal LM (`trainer.model`):
    the decoder's last hidden states of the positions that predict the last `logits_to_keep` tokens, then the
    engine's LM-head maths (kernels/lm_head_logprob.py: softmax of X W^T / temperature, soft-capped first when the
    config has `final_logit_softcapping` (Gemma 2), never the full logits),
    in chunks of `batch_size` rows.

    Returns:
        (logps (B, logits_to_keep), entropies (B, logits_to_keep) or None, None). As TRL, the entropies carry a
        gradient only while the entropy bonus is on (`trainer._entropy_bonus_enabled`); detached otherwise.
    Raises:
        NotImplementedError: `compute_aux_loss` (the engine's MoE aux loss is Megatron's, logged as `aux_loss`) or
            multimodal inputs (text models only).
    """
    from kernels.lm_head_logprob import lm_head_logprob_entropy

    given = sorted(k for k, v in multimodal.items() if v is not None)
    if compute_aux_loss or given:
        raise NotImplementedError(f"_get_per_token_logps_and_entropies: {'compute_aux_loss' if compute_aux_loss else given}"
                                  " is not supported here (text models; the MoE aux loss is the trainer's, logged as "
                                  "aux_loss)")
    cfg = trainer.engine_config
    weight = model.get_output_embeddings().weight  # (V, H)
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]  # (b, T)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # (b, T, H)
        hidden = hidden[:, -logits_to_keep - 1:-1]  # (b, K, H): position t predicts token t + 1
        logp, entropy = lm_head_logprob_entropy(hidden, weight, ids[:, -logits_to_keep:],
                                                workspace_mb=cfg.kernels.loss_workspace_mb,
                                                implementation=cfg.kernels.loss_implementation,
                                                temperature=cfg.generation.temperature,
                                                softcap=getattr(model.config, "final_logit_softcapping", None))
        logps.append(logp)
        entropies.append(entropy if trainer._entropy_bonus_enabled else entropy.detach())
    import torch

    return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None
