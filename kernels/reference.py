"""Plain-torch reference for the LM-head log-prob and entropy: materialises the (N, V_local) logits.

Owns `reference_logprob_entropy`, the same function and TP convention as the fused entries written the obvious way
with autograd: logits = X W^T / T (soft-capped first, cap tanh(X W^T / cap), when `softcap` is set) in float32
(float64 for float64 inputs; bf16/fp16 inputs: the GEMM in the input
dtype then copied to float32, the naive path RL trainers take (docs/kernels.md); the fused paths keep float32
logits, so tests compare bf16 kernels with it on upcast inputs), padded rows masked to -inf,
lse, target logit - lse, entropy = lse - E_p[z]; under TP Megatron's vocab-parallel recipe through its region
mappings (`copy_to_tp_region`, `reduce_from_tp_region`, `all_reduce_max`). Tests compare every implementation with
it; benchmarks use it as the baseline. Also `build_lm_head_problem`: seeded inputs (X, W, token ids) with a chosen
logit spread, shared by tests and benchmarks.

Must not: be used in training at scale (several (N, V_local) float32 tensors live at once), import Triton or engine/.

Test: `pytest tests/kernels/test_reference.py` (against torch.log_softmax on hand-built cases).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.softmax_stats import all_reduce_hidden_grad, build_vocab_shard


class _CopyToTPRegion(torch.autograd.Function):
    """Identity forward, all-reduce backward (Megatron `copy_to_tensor_model_parallel_region`)."""

    @staticmethod
    def forward(ctx, x, tp_group):
        ctx.tp_group = tp_group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_hidden_grad(grad.clone(), ctx.tp_group), None


class _ReduceFromTPRegion(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward (Megatron `reduce_from_tensor_model_parallel_region`): the
    result is replicated and every rank's downstream computes the same loss from it."""

    @staticmethod
    def forward(ctx, x, tp_group):
        out = x.clone()
        dist.all_reduce(out, group=tp_group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp_region(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """x itself; its gradient is summed over the TP group. Identity without a group."""
    return x if tp_group is None else _CopyToTPRegion.apply(x, tp_group)


def reduce_from_tp_region(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of x over the TP group, with the gradient passed through unchanged. Identity without a group."""
    return x if tp_group is None else _ReduceFromTPRegion.apply(x, tp_group)


def all_reduce_max(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Element-wise max over the TP group (no gradient). Identity without a group."""
    if tp_group is None:
        return x
    out = x.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=tp_group)
    return out


def reference_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob and entropy of the sampled tokens, through materialised logits.

    Args:
        hidden: (N, H) last hidden states of the completion tokens (replicated over the TP group).
        weight: (V_local, H) this rank's LM-head shard.
        token_ids: (N,) int64 global ids of the sampled tokens.
        temperature: the sampling temperature T; logits are divided by it.
        softcap: final-logit soft-capping: logits -> cap tanh(logits / cap) before the temperature; None = off.
        vocab_size: the real vocabulary; global rows >= it are padding (masked). None = no padding.
        tp_group: the TP group the vocabulary is split over; None = W is the whole head.
        vocab_start: global id of local row 0; None = tp_rank * V_local.

    Returns:
        (logprobs, entropy), each (N,) float32 (float64 for float64 inputs), differentiable w.r.t. hidden and
        weight. Log-probs of ids outside [0, vocab_size) are NaN.
    """
    shard = build_vocab_shard(weight.shape[0], vocab_size, tp_group, vocab_start)
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    hidden = copy_to_tp_region(hidden, tp_group)
    if hidden.dtype in (torch.bfloat16, torch.float16):  # the model's lm_head GEMM, then an fp32 copy (the naive path)
        logits = (hidden @ weight.T).to(acc_dtype)  # (N, V_local)
    else:
        logits = hidden.to(acc_dtype) @ weight.to(acc_dtype).T  # (N, V_local)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    is_padding = torch.arange(shard.num_local, device=weight.device) >= shard.num_valid  # (V_local,)
    logits = logits.masked_fill(is_padding, float("-inf"))  # (N, V_local)
    row_max = all_reduce_max(logits.detach().amax(-1), tp_group)  # (N,), a constant shift: no gradient
    exp_logits = torch.exp(logits - row_max[:, None])  # (N, V_local), 0 on padding
    local_ids = token_ids - shard.vocab_start  # (N,)
    is_owned = (local_ids >= 0) & (local_ids < shard.num_valid)
    picked = logits.gather(1, local_ids.clamp(0, shard.num_local - 1)[:, None])[:, 0]  # (N,)
    # NOTE: reduce the three per-rank sums first; everything after them is replicated, so the identity backward of
    # reduce_from_tp_region hands every rank the same (correct) gradient of each sum.
    sum_exp = reduce_from_tp_region(exp_logits.sum(-1), tp_group)  # (N,)
    sum_exp_logit = reduce_from_tp_region((exp_logits * logits.masked_fill(is_padding, 0.0)).sum(-1), tp_group)
    target = reduce_from_tp_region(torch.where(is_owned, picked, torch.zeros_like(picked)), tp_group)  # (N,)
    lse = row_max + torch.log(sum_exp)  # (N,)
    entropy = lse - sum_exp_logit / sum_exp  # lse - E_p[z]
    is_valid_id = (token_ids >= 0) & (token_ids < shard.vocab_size)
    logprobs = torch.where(is_valid_id, target - lse, torch.full_like(lse, float("nan")))
    return logprobs, entropy


def build_lm_head_problem(
    num_tokens: int,
    hidden_size: int,
    vocab_rows: int,
    *,
    vocab_size: int | None = None,
    logit_std: float = 3.0,
    max_abs_logit: float | None = None,
    sampled_fraction: float = 0.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded LM-head inputs with a chosen logit spread.

    Args:
        num_tokens: N.
        hidden_size: H.
        vocab_rows: rows of the (padded) LM head.
        vocab_size: real vocabulary (<= vocab_rows); token ids are drawn from it. None = vocab_rows.
        logit_std: standard deviation of the logits X W^T (small = flat softmax, large = peaked).
        max_abs_logit: if given, W is rescaled so that max |X W^T| over the real rows equals it exactly (this
            computes the logits once: small shapes only).
        sampled_fraction: the first round(fraction * N) ids are sampled from softmax(X W^T) over the real rows
            (computes the logits: small shapes only), the rest drawn uniformly; sampled ids sit where p is large.
        dtype: of X and W.
        device: where the tensors live.
        seed: the seed of a generator on `device` (values differ between devices).

    Returns:
        (hidden (N, H), weight (vocab_rows, H), token_ids (N,) int64 in [0, vocab_size)).
    """
    vocab_size = vocab_rows if vocab_size is None else vocab_size
    gen_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, dtype=gen_dtype, device=device)  # (N, H)
    weight = torch.randn(vocab_rows, hidden_size, generator=gen, dtype=gen_dtype, device=device)  # (V, H)
    weight *= logit_std / hidden_size**0.5
    if max_abs_logit is not None:
        weight *= max_abs_logit / (hidden @ weight[:vocab_size].T).abs().max()
    token_ids = torch.randint(0, vocab_size, (num_tokens,), generator=gen, device=device)  # (N,)
    num_sampled = round(sampled_fraction * num_tokens)
    if num_sampled:
        probs = torch.softmax(hidden[:num_sampled] @ weight[:vocab_size].T, dim=-1)  # (num_sampled, vocab_size)
        token_ids[:num_sampled] = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return hidden.to(dtype), weight.to(dtype), token_ids
