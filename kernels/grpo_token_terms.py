"""The per-token GRPO terms in one Triton kernel: importance ratio, surrogate, KL, masks, and d loss / d log-prob.

Given the per-token log-probs of the fused LM-head kernel (kernels/fused_logprob.py), one elementwise pass computes,
per token, everything engine/grpo/policy_loss.py's torch code computes between the log-probs and the normaliser
(that torch code is the reference), with the derivatives, so the backward is one multiply by the upstream gradient.

Owns: `TokenTermParams`, the kernel and its launcher, `_TokenTermsFunction` and the entry `grpo_token_terms` (the
formulas, the kinks, inputs and dtypes, and why it is its own kernel: there). Whether it pays (measured):
benchmarks/bench_grpo_token_terms.py.

Must not: import engine/ (the caller maps its config onto `TokenTermParams`), normalise (the normalisers stay in
engine/grpo/policy_loss.py), reduce over a sequence (GSPO's w_i, VESPO's phi_i and the off-policy mask arrive as
inputs: `_TokenTermsFunction`), or keep tensors beyond the two gradient coefficients.

Test: `pytest tests/kernels/test_grpo_token_terms.py` (interpreter on CPU, or real on a GPU; equal to the torch terms
to fp32 rounding for every loss type, both importance-sampling levels, forward and backward).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SURROGATES = ("clipped", "cispo", "sapo", "vespo")
KL_ESTIMATORS = ("k1", "k2", "k3")
BLOCK_TOKENS = 1024
"""Tokens per program (elementwise: 4 warps, 8 per thread)."""


@dataclass(frozen=True, kw_only=True)
class TokenTermParams:
    """The loss hyperparameters the per-token terms read (TRL's names; engine/grpo/fused_terms.py fills them)."""

    surrogate: str = "clipped"
    """`clipped` (grpo, bnpo, dr_grpo, dapo, luspo), `cispo`, `sapo` or `vespo`."""
    is_sequence_level: bool = False
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    """Upper clip (1 + epsilon_high); for cispo the cap on the ratio itself."""
    delta: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05

    def __post_init__(self) -> None:
        if self.surrogate not in SURROGATES:
            raise ValueError(f"surrogate must be one of {SURROGATES}, got {self.surrogate!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")


# ---------------------------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _clipped_surrogate(ratio, adv, lo, hi, delta, HAS_DELTA: tl.constexpr):
    """(-min(min(r, delta) A, clamp(r, lo, hi) A), d/dr, the ratio after the delta cap)."""
    clipped = tl.minimum(tl.maximum(ratio, lo), hi)
    capped = ratio
    cap_pass = ratio == ratio  # all true
    if HAS_DELTA:
        capped = tl.minimum(ratio, delta)
        cap_pass = ratio <= delta
    a = capped * adv
    b = clipped * adv
    clip_pass = (ratio >= lo) & (ratio <= hi)
    w_a = tl.where(a < b, 1.0, tl.where(a == b, 0.5, 0.0))  # torch.minimum: a tie splits the gradient
    w_b = tl.where(a > b, 1.0, tl.where(a == b, 0.5, 0.0))
    d_ratio = -(tl.where(cap_pass, w_a * adv, 0.0) + tl.where(clip_pass, w_b * adv, 0.0))
    return -tl.minimum(a, b), d_ratio, capped


@triton.jit
def _kl_estimate(lp, ref, KL: tl.constexpr):
    """(KL estimate, d/dl) of d = l_ref - l: k1 = -d, k2 = d^2 / 2, k3 = e^d - d - 1."""
    d = ref - lp
    if KL == 3:
        e = tl.exp(d)
        return e - d - 1.0, 1.0 - e
    elif KL == 2:
        return 0.5 * d * d, -d
    else:
        return -d, tl.full(d.shape, 1.0, d.dtype)


@triton.jit
def _grpo_token_terms_kernel(
    lp_ptr, old_ptr, seq_w_ptr, adv_ptr, ref_ptr, off_ptr, ent_ptr, is_ptr, phi_ptr,
    loss_ptr, ratio_ptr, kl_ptr, g_lp_ptr, g_w_ptr,
    num_tokens, seq_len, lo, hi, delta, beta, tau_pos, tau_neg,
    SEQUENCE_LEVEL: tl.constexpr, SURROGATE: tl.constexpr, HAS_DELTA: tl.constexpr, KL: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr, ADV_PER_ROW: tl.constexpr, HAS_OFF: tl.constexpr, OFF_PER_ROW: tl.constexpr,
    HAS_ENT: tl.constexpr,
    HAS_IS: tl.constexpr, IS_PER_ROW: tl.constexpr, PHI_PER_ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per-token loss, ratio (after delta), KL and d loss / d l, d loss / d w of BLOCK flattened (B, T) tokens."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < num_tokens
    row = offs // seq_len
    lp = tl.load(lp_ptr + offs, mask=mask, other=0.0)
    adv = tl.load(adv_ptr + (row if ADV_PER_ROW else offs), mask=mask, other=0.0)
    if SEQUENCE_LEVEL:
        log_w = tl.load(seq_w_ptr + row, mask=mask, other=0.0)
    else:
        log_w = lp - tl.load(old_ptr + offs, mask=mask, other=0.0)
    ratio = tl.exp(log_w)
    d_lp = tl.zeros_like(lp)
    if SURROGATE == 0:  # clipped
        loss, d_ratio, ratio_out = _clipped_surrogate(ratio, adv, lo, hi, delta, HAS_DELTA)
    elif SURROGATE == 1:  # cispo
        cap = tl.minimum(ratio, hi)
        loss = -cap * adv * lp
        d_lp = -cap * adv
        d_ratio = tl.zeros_like(lp)
        ratio_out = ratio
    elif SURROGATE == 2:  # sapo
        tau = tl.where(adv > 0, tau_pos, tau_neg).to(lp.dtype)
        s = 1.0 / (1.0 + tl.exp(-(tau * (ratio - 1.0))))
        loss = -(s * 4.0 / tau) * adv
        d_ratio = -adv * 4.0 / tau * (s * (1.0 - s)) * tau
        ratio_out = ratio
    else:  # vespo
        phi = tl.load(phi_ptr + (row if PHI_PER_ROW else offs), mask=mask, other=0.0)
        loss = -phi * adv * lp
        d_lp = -phi * adv
        d_ratio = tl.zeros_like(lp)
        ratio_out = ratio
    factor = tl.full(lp.shape, 1.0, lp.dtype)
    if HAS_OFF:
        off = tl.load(off_ptr + (row if OFF_PER_ROW else offs), mask=mask, other=0.0)
        loss = loss * off
        factor = factor * off
    if HAS_ENT:
        ent = tl.load(ent_ptr + offs, mask=mask, other=0).to(lp.dtype)
        loss = loss * ent
        factor = factor * ent
    if HAS_IS:
        rho = tl.load(is_ptr + (row if IS_PER_ROW else offs), mask=mask, other=0.0)
        loss = loss * rho
        factor = factor * rho
    d_lp = d_lp * factor
    d_ratio = d_ratio * factor
    if KL != 0:
        kl, d_kl = _kl_estimate(lp, tl.load(ref_ptr + offs, mask=mask, other=0.0), KL)
        if BIAS_CORRECTION:
            d_ratio += beta * kl
            d_kl = d_kl * ratio
            kl = kl * ratio
        loss = loss + beta * kl
        d_lp += beta * d_kl
        tl.store(kl_ptr + offs, kl, mask=mask)
    d_log_w = d_ratio * ratio
    if SEQUENCE_LEVEL:
        tl.store(g_w_ptr + offs, d_log_w, mask=mask)
    else:
        d_lp += d_log_w
    tl.store(loss_ptr + offs, loss, mask=mask)
    tl.store(ratio_ptr + offs, ratio_out, mask=mask)
    tl.store(g_lp_ptr + offs, d_lp, mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launcher, autograd Function, functional entry
# ---------------------------------------------------------------------------------------------------------------


def _flat(values: torch.Tensor | None, shape: torch.Size,
          dtype: torch.dtype | None) -> tuple[torch.Tensor | None, bool]:
    """(contiguous flat values, whether they are per row) of a (B, T), (B, 1) or (B,) input; dtype None = keep."""
    if values is None:
        return None, False
    values = values.detach()
    is_per_row = values.dim() == 1 or (values.dim() == 2 and values.shape[1] == 1 and shape[1] != 1)
    want = (shape[0],) if is_per_row else tuple(shape)
    if values.numel() != (want[0] if is_per_row else shape.numel()):
        raise ValueError(f"need a (B, T) = {tuple(shape)}, (B, 1) or (B,) tensor; got {tuple(values.shape)}")
    values = values.reshape(-1) if dtype is None else values.reshape(-1).to(dtype)
    return values.contiguous(), is_per_row


def build_token_terms_launch(logprobs: torch.Tensor, old_logprobs: torch.Tensor | None,
                             seq_log_weights: torch.Tensor | None, advantages: torch.Tensor,
                             ref_logprobs: torch.Tensor | None, off_policy_mask: torch.Tensor | None,
                             entropy_mask: torch.Tensor | None, importance_sampling_ratio: torch.Tensor | None,
                             phi: torch.Tensor | None, params: TokenTermParams):
    """(KernelLaunch, outputs dict) of one call; tensors may be on "meta" (kernels/compile_check.py)."""
    from kernels.fused_logprob import KernelLaunch

    shape, dtype = logprobs.shape, logprobs.dtype
    num_tokens = logprobs.numel()
    flat = {name: _flat(t, shape, dtype) for name, t in dict(
        old=old_logprobs, seq_w=seq_log_weights, adv=advantages, ref=ref_logprobs, off=off_policy_mask,
        isr=importance_sampling_ratio, phi=phi).items()}
    ent, _ = _flat(entropy_mask, shape, None)
    lp = logprobs.detach().reshape(-1).contiguous()
    out = {name: torch.empty(num_tokens, dtype=dtype, device=lp.device) for name in ("loss", "ratio", "g_lp")}
    out["kl"] = torch.empty(num_tokens if params.beta != 0.0 else 0, dtype=dtype, device=lp.device)
    out["g_w"] = torch.empty(num_tokens if params.is_sequence_level else 0, dtype=dtype, device=lp.device)
    def ptr(name):
        return lp if flat[name][0] is None else flat[name][0]
    kl_code = 0 if params.beta == 0.0 else KL_ESTIMATORS.index(params.kl_estimator) + 1
    launch = KernelLaunch(
        kernel=_grpo_token_terms_kernel,
        grid=(triton.cdiv(num_tokens, BLOCK_TOKENS),),
        args=(lp, ptr("old"), ptr("seq_w"), ptr("adv"), ptr("ref"), ptr("off"), lp if ent is None else ent,
              ptr("isr"), ptr("phi"), out["loss"], out["ratio"], out["kl"] if kl_code else lp, out["g_lp"],
              out["g_w"] if params.is_sequence_level else lp, num_tokens, shape[-1] if len(shape) else 1,
              1.0 - params.epsilon_low, 1.0 + params.epsilon_high if params.surrogate == "clipped"
              else params.epsilon_high, 0.0 if params.delta is None else params.delta, params.beta,
              params.sapo_temperature_pos, params.sapo_temperature_neg),
        options=dict(SEQUENCE_LEVEL=params.is_sequence_level, SURROGATE=SURROGATES.index(params.surrogate),
                     HAS_DELTA=params.delta is not None and params.surrogate == "clipped", KL=kl_code,
                     BIAS_CORRECTION=params.use_bias_correction_kl and kl_code != 0,
                     ADV_PER_ROW=flat["adv"][1], HAS_OFF=flat["off"][0] is not None, OFF_PER_ROW=flat["off"][1],
                     HAS_ENT=ent is not None, HAS_IS=flat["isr"][0] is not None, IS_PER_ROW=flat["isr"][1],
                     PHI_PER_ROW=flat["phi"][1],
                     BLOCK=BLOCK_TOKENS, num_warps=4),
    )
    return launch, out


class _TokenTermsFunction(torch.autograd.Function):
    """(logprobs, seq_log_weights) -> (per-token loss, ratio, KL); the backward is grad x the saved derivatives.

    Where the sequence-level reduction lives: in torch, before the kernel. GSPO's w_i = sum_t m (l - l_old) /
    max(sum_t m, 1), VESPO's phi_i and the off-policy mask (a per-sequence mean KL) each need a whole row before any
    of that row's tokens can be finished: a grid-wide dependency, so a Triton version is a second launch in any case,
    and torch's masked row sum is one launch already. The kernel reads the per-sequence values (B,) by row; autograd
    carries d loss / d w_i back through torch's reduction (the row sum of d loss_t / d w_i, done in `backward`).
    """

    @staticmethod
    def forward(ctx, logprobs, seq_log_weights, inputs: dict, params: TokenTermParams):
        launch, out = build_token_terms_launch(logprobs, seq_log_weights=seq_log_weights, params=params, **inputs)
        launch.run()
        shape = logprobs.shape
        ctx.save_for_backward(out["g_lp"], out["g_w"])
        ctx.shapes = (shape, None if seq_log_weights is None else seq_log_weights.shape)
        kl = out["kl"].view(shape) if params.beta != 0.0 else out["kl"]
        ctx.mark_non_differentiable(out["ratio"], kl)
        return out["loss"].view(shape), out["ratio"].view(shape), kl

    @staticmethod
    def backward(ctx, grad_loss, _grad_ratio, _grad_kl):
        g_lp, g_w = ctx.saved_tensors
        shape, w_shape = ctx.shapes
        grad_lp = grad_loss * g_lp.view(shape)
        grad_w = None
        if w_shape is not None:
            grad_w = (grad_loss * g_w.view(shape)).sum(-1).reshape(w_shape)  # (B,) or (B, 1)
        return grad_lp, grad_w, None, None


def grpo_token_terms(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    params: TokenTermParams,
    *,
    old_logprobs: torch.Tensor | None = None,
    seq_log_weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    off_policy_mask: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    phi: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The unnormalised per-token GRPO loss, with the ratio and KL the metrics read, in one fused kernel.

    Per token (l = logprobs):

        r = exp(l - l_old) (token level) or exp(w_i) (sequence level: w_i given, `_TokenTermsFunction`)
        surrogate  clipped (grpo, bnpo, dr_grpo, dapo, luspo): -min(min(r, delta) A, clamp(r, 1 - eps, 1 + eps_high) A)
                   cispo: -min(r, eps_high) A l (the cap without gradient);  sapo: -sigmoid(tau (r - 1)) 4 / tau A
                   vespo: -phi A l (phi per sequence and sign of A, without gradient)
        loss_t   = surrogate x off-policy mask x top-entropy mask x vLLM IS ratio (each optional, in TRL's order)
                   + beta KL, KL = k1 / k2 / k3 of d = l_ref - l (x r with `use_bias_correction_kl`)

    and, in the same pass, the derivatives d loss_t / d l and (sequence level) d loss_t / d w_i, with autograd's
    conventions at the kinks (min: a tie splits the gradient in halves; clamp passes it on the closed interval), so
    the backward is one multiply by the upstream gradient: no second pass over the GRPO maths and no saved
    intermediates.

    Why not inside `_stats_fwd_kernel`'s epilogue: a token's log-prob exists only after the vocabulary splits (and
    the TP ranks) are merged (`softmax_stats.merge_stats` / `reduce_stats_over_tp`); the statistics kernel sees one
    split. This kernel is the epilogue of that merge, on (B, T) log-probs.

    Inputs and dtypes: (B, T) float32 log-prob tensors (bf16 / fp16 per-token inputs are upcast to the log-probs'
    dtype first, as torch's type promotion does); per-sequence inputs as (B,) / (B, 1). NaN handling at the kinks
    follows IEEE min/max, not torch's NaN propagation (NaN log-probs are an error upstream: kernels/softmax_stats.py).

    Args:
        logprobs: (B, T) float32 current log-probs (autograd: receives d loss / d logprobs).
        advantages: (B,), (B, 1) or (B, T).
        params: hyperparameters.
        old_logprobs: (B, T) token level: the ratio is exp(logprobs - old_logprobs) (no gradient to old).
        seq_log_weights: (B, 1) sequence level: log of the sequence ratio (autograd: receives its gradient).
        ref_logprobs: (B, T), required iff params.beta != 0.
        off_policy_mask, importance_sampling_ratio: (B, 1) or (B, T) multipliers (no gradient); IS is the vLLM
            correction (not for vespo: the caller leaves it out).
        entropy_mask: (B, T) bool top-entropy mask.
        phi: (B, 1) or (B, T) (per-token advantages) VESPO weights (vespo only).

    Returns:
        (per-token loss (B, T), ratio (B, T) after the delta cap, per-token KL (B, T) or None), in logprobs' dtype;
        only the loss is differentiable.
    """
    _check_token_terms_inputs(logprobs, old_logprobs, seq_log_weights, ref_logprobs, phi, params)
    inputs = dict(old_logprobs=old_logprobs, advantages=advantages, ref_logprobs=ref_logprobs,
                  off_policy_mask=off_policy_mask, entropy_mask=entropy_mask,
                  importance_sampling_ratio=importance_sampling_ratio, phi=phi)
    loss, ratio, kl = _TokenTermsFunction.apply(logprobs, seq_log_weights, inputs, params)
    return loss, ratio, kl if params.beta != 0.0 else None


def _check_token_terms_inputs(logprobs, old_logprobs, seq_log_weights, ref_logprobs, phi, params) -> None:
    """Device, dtype and the inputs each setting needs."""
    if not logprobs.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton GRPO terms need CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
                           "imported); use the torch terms on the CPU")
    if logprobs.dtype != torch.float32 or logprobs.dim() != 2:
        raise TypeError(f"need (B, T) float32 log-probs (the fused LM-head kernel's output); got "
                        f"{tuple(logprobs.shape)} {logprobs.dtype}")
    if params.is_sequence_level != (seq_log_weights is not None) or (old_logprobs is None) != params.is_sequence_level:
        raise ValueError("token level needs old_logprobs and no seq_log_weights; sequence level the reverse")
    if (params.beta != 0.0) != (ref_logprobs is not None):
        raise ValueError(f"beta = {params.beta} needs ref_logprobs iff beta != 0")
    if (params.surrogate == "vespo") != (phi is not None):
        raise ValueError("phi is given iff the surrogate is vespo")
