"""TRL's own behaviour where TRL defines it: its construction-time warnings, its static helpers, vespo's IS mode.

Owns (hub reward models are engine/train/rewards.py's `resolve_reward_func`):
- `warn_objective_settings(args)`: TRL's construction-time warnings about the objective (sequence-level IS with a
  token-summed loss; luspo at token level; vespo at sequence level), word for word, on the `logging` logger of
  engine/api/trl_trainer.py (TRL uses `logger.warning`: tests read them with `caplog`);
- `get_off_policy_mask`, `get_high_entropy_mask`, `get_per_token_logps_and_entropies`: TRL's GRPOTrainer helpers
  (the last one private) with TRL's signatures, by the engine's maths (engine/grpo/policy_loss.py,
  kernels/lm_head_logprob.py), bound onto `GRPOTrainer`;
- `vespo_importance_sampling_mode(...)`: the vLLM IS mode of a vespo run that named none (a token mode, as TRL);
- `cast_lm_head_to_fp32(model)`: TRL's float32 LM head on `trainer.model` (training computes float32 logits anyway);
- `check_liger_installed`: TRL's ImportError for `use_liger_kernel=True` without liger-kernel (after PEFT's checks);
- HF Trainer's step methods (`training_step`, `_prepare_inputs`, `compute_loss`): `refuse_step_overrides` (an
  override or patch is refused, naming why and what acts instead) and `training_step`, which says the same.

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
    config has `final_logit_softcapping` (Gemma 2), x `logit_scale` (Cohere 2: the temperature divided by it), never
    the full logits),
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
    logit_scale = getattr(model.config, "logit_scale", 1.0)  # Cohere 2: softmax(z x scale / T)
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]  # (b, T)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # (b, T, H)
        hidden = hidden[:, -logits_to_keep - 1:-1]  # (b, K, H): position t predicts token t + 1
        logp, entropy = lm_head_logprob_entropy(hidden, weight, ids[:, -logits_to_keep:],
                                                workspace_mb=cfg.kernels.loss_workspace_mb,
                                                implementation=cfg.kernels.loss_implementation,
                                                temperature=cfg.generation.temperature / logit_scale,
                                                softcap=getattr(model.config, "final_logit_softcapping", None))
        logps.append(logp)
        entropies.append(entropy if trainer._entropy_bonus_enabled else entropy.detach())
    import torch

    return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None


STEP_METHODS = ("training_step", "_prepare_inputs", "compute_loss")
"""HF Trainer's per-micro-step methods that TRL's GRPOTrainer runs in the user's process."""

STEP_METHODS_WHY = (
    "the engine's training step is Megatron's forward-backward over the engine's own micro-batches (token ids, old "
    "log-probs, advantages; engine/train/loop.py), run by every rank in its own worker process, not HF Trainer's "
    "training_step(model, inputs, num_items_in_batch) over the dataloader's raw rows: an override would never be "
    "called and a patched one would see no call. What acts instead: callbacks (on_step_begin / on_step_end / "
    "on_log with the step's metrics), reward functions (log_metric / log_extra), a rollout_func or a _generate "
    "override for the rows, GRPOConfig for the loss")


def refuse_step_overrides(trainer: Any) -> None:
    """NotImplementedError when HF Trainer's step methods (`STEP_METHODS`) are not GRPOTrainer's own: a user's
    subclass overrides one, or one was patched onto the class or the trainer (`unittest.mock.patch.object`); the
    replacement could not act (`STEP_METHODS_WHY`). GRPOTrainer calls it at construction and at `train()`."""
    own = {"training_step": training_step}
    names = [n for n in STEP_METHODS if n in vars(trainer) or getattr(type(trainer), n, None) is not own.get(n)]
    if names:
        raise NotImplementedError(f"{type(trainer).__name__} overrides {', '.join(names)}: not supported, because "
                                  f"{STEP_METHODS_WHY}")


def training_step(trainer: Any, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
    """HF Trainer's `training_step`, as TRL's GRPOTrainer has it: not callable here (`STEP_METHODS_WHY`)."""
    raise NotImplementedError(f"GRPOTrainer.training_step: {STEP_METHODS_WHY}")


def check_liger_installed(use_liger_kernel: bool) -> None:
    """ImportError, as TRL's trainer raises at construction, when `use_liger_kernel=True` and liger-kernel is not
    installed (a TRL script that fails there fails here alike). Installed, the setting changes nothing here: it is
    named in GRPOConfig's no-effect warning (Megatron's kernels and the engine's fused LM-head loss run anyway)."""
    import importlib.util

    if use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        raise ImportError("use_liger_kernel=True but the liger-kernel package is not installed (TRL raises this too): "
                          "pip install liger-kernel, or set use_liger_kernel=False; the engine itself runs Megatron's "
                          "kernels and its own fused LM-head loss either way")


def cast_lm_head_to_fp32(model: Any) -> Any:
    """TRL's `cast_lm_head_to_fp32=True` on a transformers causal LM (`trainer.model`), done once: the output
    embedding's weight (and bias) in float32 and its forward in float32 (logits float32 whatever the hidden
    states' dtype); with tied word embeddings (one Parameter) the input embedding's outputs are cast back to the
    model's dtype, so the decoder still runs in it. A PEFT adapter on the LM head is refused, as TRL does."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if getattr(head, "_engine_fp32_head", False):
        return model
    if hasattr(head, "base_layer"):
        raise ValueError("`cast_lm_head_to_fp32=True` with a PEFT adapter on lm_head: drop lm_head from the "
                         "adapter's target modules, or set cast_lm_head_to_fp32=False")
    dtype = head.weight.dtype
    head.float()

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., V) float32
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)

    head.forward, head._engine_fp32_head = forward, True
    embedding = base.get_input_embeddings()
    if embedding is not None and embedding.weight is head.weight and dtype != torch.float32:
        embedding.register_forward_hook(lambda module, args, output: output.to(dtype))
    return model
