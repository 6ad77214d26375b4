"""The GRPO policy loss, per token, for every `loss_type`, and its normalisation.

Owns: the importance ratio (token level, or sequence level = GSPO), the surrogate of each `loss_type` (grpo, bnpo,
dr_grpo, dapo, cispo, sapo, luspo, vespo), epsilon / epsilon_high / delta clipping, the k1 / k2 / k3 KL, the masks
(off-policy, top-entropy, vLLM importance sampling, truncated completions), the entropy bonus (fixed and adaptive)
and the normalisers (`LossNormalizer`: ours, layout-independent; `TRLNormalizer`: TRL 1.16's, for comparison). The
torch code here is the reference of the maths; the fused per-token terms kernel (engine/grpo/fused_terms.py) is held
equal to it. The order of operations, the papers and where we differ from TRL: `compute_policy_loss`.

Must not: run a model, compute logits, talk to process groups, read the config tree or log. Anything that needs
every rank (the global token count, the entropy quantile) is computed by the caller and passed in.

Test: `pytest tests/unit/test_policy_loss.py` (hand-computed edge cases, layout independence) and
`pytest tests/unit/test_trl_parity.py` (equality with TRL 1.16 `_compute_loss`, loss and gradients, in float64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.grpo.fused_terms import fused_per_token_loss, resolve_terms_implementation
from engine.grpo.loss_statistics import CLIPPED_LOSS_TYPES, compute_loss_statistics
from engine.grpo.settings import IS_MODES, KL_ESTIMATORS, ISMode, KLEstimator, PolicyLossConfig


@dataclass(frozen=True, kw_only=True)
class LossNormalizer:
    """Layout-independent denominators (the default): counted once per generation batch over the sequences one
    optimizer step covers, on every rank.

    TRL normalises grpo / sapo / bnpo / dr_grpo / luspo per micro-batch (its own token or sequence count) and divides
    by the gradient-accumulation steps; the gradient then depends on how the generation batch is cut into
    micro-batches, accumulation steps and data-parallel ranks (a micro-batch of short completions weighs as much as
    one of long completions). dapo / cispo / vespo divide by the token count of the whole generation batch, which
    does not depend on the layout. Ours makes *every* loss type layout-independent: each micro-batch's loss is its
    share of the whole-batch loss,
        grpo, sapo:      sum_i [sum_t m L / max(sum_t m, 1)] / num_sequences     (per-sequence mean, batch mean)
        bnpo, dapo, cispo, vespo:  sum m L / num_tokens                       (bnpo == dapo once its batch is global)
        dr_grpo:         sum m L / (num_sequences * max_completion_length)
        luspo:           sum_i sum_t m L / num_sequences
        entropy bonus:   sum H m_eff / num_tokens
    so the sum of the per-micro-batch losses over any split (micro-batch size x accumulation steps x DP ranks)
    equals the whole-batch loss, and so does the gradient. The trainer must therefore SUM gradients over
    micro-batches and DP ranks (a DDP wrapper that averages over dp_size must be compensated by scaling the loss by
    dp_size). The entropy-mask threshold is a statistic of whatever entropies are given (TRL: the micro-batch on all
    ranks); pass `entropy_threshold` computed once over the generation batch to make the masked loss
    layout-independent too.
    """

    num_tokens: float
    """Loss-mask tokens (after truncation masking) of the optimizer step's sequences, all ranks."""
    num_sequences: float
    """Sequences of the optimizer step, all ranks (fully masked ones included, as TRL's batch means do)."""


@dataclass(frozen=True, kw_only=True)
class TRLNormalizer:
    """TRL 1.16's per-micro-batch normalisation, reproduced for comparison (layout-dependent; `LossNormalizer`).

    The same per-micro-batch arithmetic, GA division, and dapo's num_items_in_batch / num_processes * GA /
    steps_per_generation. With one micro-batch, one rank and GA = 1 the two agree for every loss type, except that
    with `top_entropy_quantile < 1` TRL's entropy bonus is a mean over the kept tokens (a count only known per
    micro-batch) and ours divides by `num_tokens`. TRL 1.16 (the pinned test dependency) differs from the 1.10
    TRL 1.16 source: dapo / cispo / vespo divide by num_items_in_batch / num_processes * GA /
    steps_per_generation (1.10: no GA / steps_per_generation factor), and the entropy bonus is a mean over its tokens
    / GA for every loss type (1.10: the dapo normaliser for dapo / cispo / vespo).
    """

    num_items_in_batch: float
    """Loss-mask tokens of the whole generation batch, all ranks (dapo / cispo / vespo)."""
    num_processes: int = 1
    gradient_accumulation_steps: int = 1
    """TRL's `current_gradient_accumulation_steps` (1 in eval)."""
    steps_per_generation: int = 1
    """1 in eval."""


@dataclass(frozen=True, kw_only=True)
class PolicyLossBatch:
    """The per-token inputs of one micro-batch besides the autograd log-probs. B sequences, T completion tokens."""

    mask: torch.Tensor
    """(B, T) loss mask: completion mask x tool mask, truncated rows zeroed (`mask_truncated_completions`)."""
    advantages: torch.Tensor
    """(B,) or (B, T)."""
    old_logprobs: torch.Tensor | None = None
    """(B, T) log-probs of the policy that sampled (trainer side); None = on-policy, i.e. logprobs.detach()."""
    ref_logprobs: torch.Tensor | None = None
    """(B, T) reference-model log-probs; required iff beta != 0."""
    sampling_logprobs: torch.Tensor | None = None
    """(B, T) the inference engine's (vLLM) log-probs; the off-policy mask prefers them over old_logprobs."""
    importance_sampling_ratio: torch.Tensor | None = None
    """(B, T) or (B, 1) from `compute_vllm_importance_sampling_ratio`; None = no correction."""


@dataclass(frozen=True)
class PolicyLossOutput:
    """The loss of one micro-batch and what the metrics need (all detached except `loss`)."""

    loss: torch.Tensor
    """0-dim, differentiable: this micro-batch's share of the optimizer-step loss."""
    policy_loss: torch.Tensor
    """0-dim: the loss before the entropy bonus (TRL's `policy_loss` metric)."""
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """metric name -> (2,) [sum, count]; the metric is sum / max(count, 1) after summing over micro-batches/ranks."""
    seq_min: dict[str, torch.Tensor] = field(default_factory=dict)
    """metric name -> (B,) per-sequence values (NaN for empty sequences); the metric is their nanmin."""
    seq_max: dict[str, torch.Tensor] = field(default_factory=dict)
    """metric name -> (B,) per-sequence values; the metric is their nanmax."""
    entropy_window: torch.Tensor | None = None
    """(2,) [sum H m_eff, sum m_eff] when the entropy bonus is on: the adaptive controller's input."""


def build_loss_normalizer(mask: torch.Tensor) -> LossNormalizer:
    """The layout-independent normaliser of one optimizer step.

    Args:
        mask: (B, T) loss mask of every sequence the optimizer step covers (gathered over ranks).

    Returns:
        `LossNormalizer(num_tokens=sum(mask), num_sequences=B)`.
    """
    return LossNormalizer(num_tokens=float(mask.sum().item()), num_sequences=float(mask.shape[0]))


def find_truncated_completions(last_token_ids: torch.Tensor, stop_token_ids: list[int]) -> torch.Tensor:
    """Completions that never stopped: the last token is neither an EOS nor the pad token (TRL's test).

    Args:
        last_token_ids: (B,) int, the last *generated* token of each completion (before padding).
        stop_token_ids: the EOS ids and the pad id.

    Returns:
        (B,) bool.
    """
    stops = torch.as_tensor(stop_token_ids, device=last_token_ids.device)
    return ~torch.isin(last_token_ids, stops)


def mask_truncated_completions(mask: torch.Tensor, is_truncated: torch.Tensor) -> torch.Tensor:
    """DAPO overlong filtering: zero the loss mask of truncated completions (arXiv:2503.14476 §3.4).

    Args:
        mask: (B, T) completion (or loss) mask.
        is_truncated: (B,) bool.

    Returns:
        (B, T) mask of mask's dtype.
    """
    return mask * (~is_truncated).unsqueeze(1).to(mask.dtype)  # (B, T)


def compute_vllm_importance_sampling_ratio(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    vllm_importance_sampling_mode: ISMode,
    vllm_importance_sampling_clip_min: float | None,
    vllm_importance_sampling_clip_max: float | None,
) -> torch.Tensor:
    """Importance weight between the trainer's and the inference engine's sampling distribution (once per generation).

    TIS / MIS (IcePop): rho = exp(l_old - l_vllm) per token, or exp(sum_t (l_old - l_vllm)) per sequence (a sum, not a
    mean); `*_truncate` clamps rho to [C_min, C_max], `*_mask` sets rho to 0 outside it (a missing bound is +-inf).
    Tokens vLLM could not score (NaN) contribute a zero log difference.

    Args:
        old_logprobs: (B, T) trainer log-probs at generation time.
        sampling_logprobs: (B, T) vLLM log-probs (NaN = unavailable).
        mask: (B, T) loss mask.
        vllm_importance_sampling_mode: `token_truncate`, `token_mask`, `sequence_truncate` or `sequence_mask`.
        vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max: C_min, C_max (None = no bound).

    Returns:
        (B, T) for token modes, (B, 1) for sequence modes.
    """
    mode = vllm_importance_sampling_mode
    low, high = vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {IS_MODES}, got {mode!r}")
    log_diff = torch.nan_to_num((old_logprobs - sampling_logprobs) * mask, nan=0.0)  # (B, T)
    if mode.startswith("sequence"):
        log_diff = log_diff.sum(dim=-1, keepdim=True)  # (B, 1)
    ratio = torch.exp(log_diff)
    if mode.endswith("truncate"):
        if low is None and high is None:
            raise ValueError(f"vllm_importance_sampling_mode={mode!r} needs a clip_min or a clip_max")
        return torch.clamp(ratio, min=low, max=high)
    low = -math.inf if low is None else low
    high = math.inf if high is None else high
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def compute_off_policy_mask(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    off_policy_mask_threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2 off-policy sequence mask: drop a sequence iff A < 0 and its mean KL(sampler || current) > delta.

    Args:
        advantages: (B, 1) or (B, T).
        logprobs: (B, T) current log-probs (detached here).
        sampling_logprobs: (B, T) the sampler's log-probs (vLLM's, else old_logprobs); NaN = unscorable, counts 0.
        mask: (B, T) loss mask.
        off_policy_mask_threshold: delta (nats).

    Returns:
        (B, 1) (or advantages' shape) mask of mask's float dtype: 1 keep, 0 drop.
    """
    kl = torch.nan_to_num(sampling_logprobs - logprobs.detach(), nan=0.0)  # (B, T)
    mean_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (B, 1)
    return ((advantages >= 0) | (mean_kl <= off_policy_mask_threshold)).to(mask.dtype)


def compute_entropy_threshold(
    entropy: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float
) -> torch.Tensor | None:
    """The entropy above which a token is among the top `top_entropy_quantile` of the masked tokens.

    The caller decides the population: TRL uses the micro-batch of every rank; computing it once per generation
    batch makes the masked loss layout-independent.

    Args:
        entropy: (B, T) (or (N,) already-selected) per-token entropies.
        mask: same shape, 1 = a loss token.
        top_entropy_quantile: rho in [0, 1].

    Returns:
        0-dim tensor (torch.quantile at 1 - rho, linear interpolation), or None when no token is unmasked.
    """
    values = entropy.detach()[mask.bool()]  # (N,)
    if values.dtype != torch.float64:
        values = values.float()
    if values.numel() == 0:
        return None
    return torch.quantile(values, 1.0 - top_entropy_quantile)


def select_high_entropy_tokens(
    entropy: torch.Tensor, mask: torch.Tensor, threshold: torch.Tensor | float | None
) -> torch.Tensor:
    """Tokens whose entropy is at least `threshold` (arXiv:2506.01939); padding is never selected.

    Args:
        entropy: (B, T).
        mask: (B, T).
        threshold: from `compute_entropy_threshold`; None = nothing selected.

    Returns:
        (B, T) bool.
    """
    if threshold is None:
        return torch.zeros_like(mask, dtype=torch.bool)
    return ((entropy.detach() * mask) >= threshold) & mask.bool()


def estimate_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi (Schulman's k1 / k2 / k3).

    With d = l_ref - l_theta: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (TRL's, unbiased and >= 0).

    Args:
        logprobs: (B, T) current log-probs (differentiable).
        ref_logprobs: (B, T).
        estimator: `k1`, `k2` or `k3`.

    Returns:
        (B, T).
    """
    d = ref_logprobs - logprobs  # (B, T)
    if estimator == "k3":
        return torch.exp(d) - d - 1
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k1":
        return -d
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def compute_vespo_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    importance_sampling_ratio: torch.Tensor | None,
    config: PolicyLossConfig,
) -> torch.Tensor:
    """VESPO's gamma weight phi(W) = exp(lambda + k log W - lambda W) of the sequence ratio W (no gradient).

    log W = clamp(sum_t clamp(log r_t, -20, 20) m + sum_t clamp(log rho_t, log 1e-8, 20), log 1e-8, 20), k and lambda
    picked by the sign of A (A >= 0: the `_pos` pair); phi(1) = 1 and non-finite phi becomes 0 (TRL get_gamma_weights).

    Args:
        advantages: (B, 1).
        log_ratio: (B, T) l_theta - l_old.
        mask: (B, T).
        importance_sampling_ratio: (B, T) vLLM IS ratio or None.
        config: the vespo_* fields.

    Returns:
        (B, 1) detached.
    """
    with torch.no_grad():
        lower = math.log(1e-8)
        log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(dim=-1, keepdim=True)  # (B, 1)
        if importance_sampling_ratio is not None:
            log_w = log_w + torch.clamp(torch.log(importance_sampling_ratio), lower, 20.0).sum(dim=-1, keepdim=True)
        log_w = torch.clamp(log_w, lower, 20.0)  # (B, 1)
        is_nonneg = advantages >= 0
        k = torch.where(is_nonneg, log_w.new_tensor(config.vespo_k_pos), log_w.new_tensor(config.vespo_k_neg))
        lam_pos, lam_neg = log_w.new_tensor(config.vespo_lambda_pos), log_w.new_tensor(config.vespo_lambda_neg)
        lam = torch.where(is_nonneg, lam_pos, lam_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def entropy_coef_to_apply(entropy_coef: float, last_world_entropy: float, entropy_target: float) -> float:
    """Adaptive entropy (Skywork-OR1): the bonus applies only while the last step's entropy is <= the target.

    Args:
        entropy_coef: the controller's current coefficient.
        last_world_entropy: token-mean entropy of the previous optimizer step (inf before the first one, as TRL).
        entropy_target: nats.

    Returns:
        The coefficient to pass to `compute_policy_loss` for every micro-batch of this step.
    """
    return entropy_coef if last_world_entropy <= entropy_target else 0.0


def update_entropy_coef(
    entropy_coef: float,
    world_entropy: float,
    *,
    entropy_target: float,
    entropy_coef_delta: float,
    entropy_coef_min: float,
    entropy_coef_max: float,
) -> float:
    """The adaptive controller's step at an optimizer-step boundary: +delta below the target, -delta above.

    Args:
        entropy_coef: current coefficient.
        world_entropy: sum(H m_eff) / max(sum(m_eff), 1) over the step's micro-batches and ranks
            (from `PolicyLossOutput.entropy_window`).
        entropy_target, entropy_coef_delta, entropy_coef_min, entropy_coef_max: the config fields.

    Returns:
        The new coefficient, clamped to [entropy_coef_min, entropy_coef_max].
    """
    if world_entropy <= entropy_target:
        return min(entropy_coef + entropy_coef_delta, entropy_coef_max)
    return max(entropy_coef - entropy_coef_delta, entropy_coef_min)


def compute_policy_loss(
    logprobs: torch.Tensor,
    batch: PolicyLossBatch,
    config: PolicyLossConfig,
    normalizer: LossNormalizer | TRLNormalizer,
    *,
    entropy: torch.Tensor | None = None,
    entropy_coef: float | None = None,
    entropy_threshold: torch.Tensor | float | None = None,
    terms_implementation: str,
) -> PolicyLossOutput:
    """The GRPO loss of one micro-batch.

    Order of operations (TRL 1.16 `GRPOTrainer._compute_loss`): ratio -> surrogate ->
    x off-policy mask -> x entropy mask -> x vLLM IS ratio (not for vespo) -> + beta * KL -> normalise -> - entropy
    bonus. The KL is added after the masks, so they do not apply to it (TRL's choice, kept). The per-token terms take
    `logprobs` (and `entropy`, when an entropy term is on) as autograd tensors: the fused LM-head kernel's backward
    consumes d loss / d logprobs and d loss / d entropy. Float32 (or float64 in tests, torch terms only).

    Papers: GRPO arXiv:2402.03300; DAPO 2503.14476; Dr. GRPO 2503.20783; GSPO 2507.18071 (sequence ratio = mean
    log-ratio); CISPO 2506.13585; SAPO 2511.20347; LUSPO 2602.05261; VESPO 2602.10693; two-sided clipping 2505.07291;
    top-entropy tokens 2506.01939; adaptive entropy 2505.22312; off-policy mask, bias-corrected KL 2512.02556. Ours
    only: k1 / k2 (joschu.net/blog/kl-approx.html), a float64 entropy quantile, SAPO / VESPO constants in the inputs'
    dtype (TRL rounds them to float32); normalisation: `LossNormalizer` (ours), `TRLNormalizer` (TRL's).

    Args:
        logprobs: (B, T) per-token log-probs of the sampled tokens under the current policy (autograd; from the
            fused kernel or a plain log_softmax), float32 or float64.
        batch: the masks, advantages and reference tensors of the micro-batch.
        config: loss hyperparameters.
        normalizer: `LossNormalizer` (default, layout-independent) or `TRLNormalizer` (TRL 1.16 arithmetic).
        entropy: (B, T) per-token entropies; required for top_entropy_quantile < 1 and the entropy bonus (then it
            receives a gradient), otherwise used for the `entropy` metric only.
        entropy_coef: the bonus coefficient for this micro-batch; None = config.entropy_coef (adaptive mode: pass
            `entropy_coef_to_apply(...)`).
        entropy_threshold: a precomputed entropy-mask threshold; None = computed from this micro-batch.
        terms_implementation: per-token terms in "torch", "triton" (kernels/grpo_token_terms.py) or "auto" (triton
            on CUDA, else torch); `kernels.loss_terms_implementation`.

    Returns:
        `PolicyLossOutput`.
    """
    mask = batch.mask.to(logprobs.dtype)  # (B, T)
    advantages = batch.advantages.unsqueeze(1) if batch.advantages.dim() == 1 else batch.advantages  # (B, 1)|(B, T)
    old_logprobs = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs
    entropy_mask = _entropy_mask(entropy, mask, config, entropy_threshold)  # (B, T) bool or None
    log_ratio = logprobs - old_logprobs  # (B, T)
    if config.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    else:
        log_weights = log_ratio  # (B, T)
    if config.beta != 0.0 and batch.ref_logprobs is None:
        raise ValueError("beta != 0 needs batch.ref_logprobs")
    off_policy_mask = None  # (B, 1) or advantages' shape
    if config.off_policy_mask_threshold is not None:
        sampling = batch.sampling_logprobs if batch.sampling_logprobs is not None else old_logprobs
        threshold = config.off_policy_mask_threshold
        off_policy_mask = compute_off_policy_mask(advantages, logprobs, sampling, mask, threshold)
    phi = None if config.loss_type != "vespo" else compute_vespo_weights(
        advantages, log_ratio, mask, batch.importance_sampling_ratio, config)  # (B, 1)
    terms = (logprobs, old_logprobs, log_weights, advantages, off_policy_mask, entropy_mask, phi, batch, config)
    if resolve_terms_implementation(terms_implementation, logprobs.device) == "triton":
        per_token_loss, ratio, per_token_kl = fused_per_token_loss(*terms)
    else:
        per_token_loss, ratio, per_token_kl = _per_token_loss(*terms)
    loss, policy_loss = _normalize(per_token_loss, mask, config, normalizer)
    entropy_window = None
    if config.is_entropy_bonus_enabled:
        if entropy is None:
            raise ValueError("the entropy bonus (entropy_coef != 0 or use_adaptive_entropy) needs `entropy`")
        effective_mask = mask if entropy_mask is None else mask * entropy_mask  # (B, T)
        coef = config.entropy_coef if entropy_coef is None else entropy_coef
        loss = loss - coef * _entropy_term(entropy, effective_mask, normalizer)
        entropy_window = torch.stack([(entropy * effective_mask).sum(), effective_mask.sum()]).detach()  # (2,)
    sums, seq_min, seq_max = compute_loss_statistics(
        ratio=ratio, advantages=advantages, mask=mask, per_token_kl=per_token_kl, entropy=entropy, phi=phi,
        loss_type=config.loss_type, epsilon_low=config.epsilon_low, epsilon_high=config.resolved_epsilon_high,
    )
    return PolicyLossOutput(loss, policy_loss, sums, seq_min, seq_max, entropy_window)


def _per_token_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, log_weights: torch.Tensor, advantages: torch.Tensor,
    off_policy_mask: torch.Tensor | None, entropy_mask: torch.Tensor | None, phi: torch.Tensor | None,
    batch: PolicyLossBatch, config: PolicyLossConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(unnormalised per-token loss, the ratio the metrics see, per-token KL or None): the reference torch terms."""
    ratio = torch.exp(log_weights)  # (B, T) or (B, 1)
    per_token_kl = None
    if config.beta != 0.0:
        per_token_kl = estimate_kl(logprobs, batch.ref_logprobs, config.kl_estimator)  # (B, T)
        if config.use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio
    per_token_loss, ratio = _surrogate(logprobs, ratio, advantages, phi, config)
    if off_policy_mask is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if batch.importance_sampling_ratio is not None and config.loss_type != "vespo":
        per_token_loss = per_token_loss * batch.importance_sampling_ratio
    if per_token_kl is not None:
        per_token_loss = per_token_loss + config.beta * per_token_kl
    return per_token_loss, ratio, per_token_kl


def _entropy_mask(
    entropy: torch.Tensor | None, mask: torch.Tensor, config: PolicyLossConfig, threshold: torch.Tensor | float | None
) -> torch.Tensor | None:
    """(B, T) bool top-entropy mask, or None when top_entropy_quantile == 1."""
    if config.top_entropy_quantile >= 1.0:
        return None
    if entropy is None:
        raise ValueError("top_entropy_quantile < 1 needs `entropy`")
    if threshold is None:
        threshold = compute_entropy_threshold(entropy, mask, config.top_entropy_quantile)
    return select_high_entropy_tokens(entropy, mask, threshold)


def _surrogate(
    logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, phi: torch.Tensor | None,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, the ratio the clip metrics see (after delta)) for config.loss_type; vespo's phi given."""
    eps_high = config.resolved_epsilon_high
    if config.loss_type == "cispo":
        capped = torch.clamp(ratio, max=eps_high).detach()
        return -capped * advantages * logprobs, ratio  # (B, T)
    if config.loss_type in CLIPPED_LOSS_TYPES:
        clipped = torch.clamp(ratio, 1 - config.epsilon_low, 1 + eps_high)
        if config.delta is not None:
            ratio = torch.clamp(ratio, max=config.delta)
        return -torch.min(ratio * advantages, clipped * advantages), ratio
    if config.loss_type == "sapo":
        pos, neg = (advantages.new_tensor(t) for t in (config.sapo_temperature_pos, config.sapo_temperature_neg))
        temperature = torch.where(advantages > 0, pos, neg)  # in A's dtype (TRL's python scalars give float32)
        gate = torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature
        return -gate * advantages, ratio
    return -phi * advantages * logprobs, ratio  # (B, T)


def _normalize(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    normalizer: LossNormalizer | TRLNormalizer,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, policy_loss metric) of the masked per-token loss; see the module docstring for each normaliser."""
    masked = per_token_loss * mask  # (B, T)
    loss_type = config.loss_type
    if isinstance(normalizer, LossNormalizer):
        if loss_type in ("grpo", "sapo"):
            loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / max(normalizer.num_sequences, 1.0)
        elif loss_type == "dr_grpo":
            loss = masked.sum() / max(normalizer.num_sequences * config.max_completion_length, 1.0)
        elif loss_type == "luspo":
            loss = masked.sum() / max(normalizer.num_sequences, 1.0)
        else:  # bnpo, dapo, cispo, vespo
            loss = masked.sum() / max(normalizer.num_tokens, 1.0)
        return loss, loss.detach()
    accumulation = normalizer.gradient_accumulation_steps
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (per_token_loss.size(0) * config.max_completion_length)
    elif loss_type == "luspo":
        loss = masked.sum(-1).mean()
    else:  # dapo, cispo, vespo: the generation-batch token count, rescaled to one accumulation window per rank
        tokens = max(normalizer.num_items_in_batch, 1.0) / normalizer.num_processes
        loss = masked.sum() / (tokens * accumulation / normalizer.steps_per_generation)
        return loss, loss.detach()
    return loss / accumulation, loss.detach()


def _entropy_term(
    entropy: torch.Tensor, effective_mask: torch.Tensor, normalizer: LossNormalizer | TRLNormalizer
) -> torch.Tensor:
    """The entropy the bonus maximises: global token share (ours) or TRL's micro-batch mean / GA."""
    total = (entropy * effective_mask).sum()
    if isinstance(normalizer, LossNormalizer):
        return total / max(normalizer.num_tokens, 1.0)
    return total / effective_mask.sum().clamp(min=1.0) / normalizer.gradient_accumulation_steps
