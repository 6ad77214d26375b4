"""The public entry of the LM-head log-prob kernel: one contract, an explicit choice of implementation.

Owns: `lm_head_logprob_entropy`, which flattens leading token dims, picks the implementation from its
`implementation` argument ("auto" = Triton when X is on CUDA, else the chunked torch path; never an environment
variable) and restores the token shape of the results. The contract, identical for every implementation:

    (X (..., H) completion tokens, W (V_local, H) the local LM-head shard, sampled global token ids (...),
     temperature T, real vocab size, optional TP group + vocab_start)
    -> (logprobs (...), entropy (...)) float32 (float64 for float64 inputs), of softmax(X W^T / T) restricted to
       the real vocabulary; differentiable: the backward consumes d loss / d logprobs and d loss / d entropy and
       returns dX (summed over the TP group: X is replicated, Megatron's column-parallel convention) and the
       local dW. The GRPO maths is not here: engine/grpo/policy_loss.py (the torch reference) and the fused
       per-token terms kernel after it (kernels/grpo_token_terms.py).

Under sequence parallelism, pass the all-gathered X (as Megatron's output layer does); the returned dX is then the
full sum for all N rows, and each rank keeps its own rows (an all-reduce where Megatron would reduce-scatter).

Must not: import engine/, read environment variables, or hold (N, V_local) logits outside implementation="reference".

Test: `pytest tests/kernels` (each implementation against kernels/reference.py, TP=2 on gloo, GRPO loss gradients).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from kernels.chunked_logprob import DEFAULT_WORKSPACE_MB, check_lm_head_inputs, chunked_logprob_entropy
from kernels.fused_logprob import triton_logprob_entropy
from kernels.reference import reference_logprob_entropy

Implementation = Literal["auto", "triton", "torch_chunked", "reference"]
IMPLEMENTATIONS = ("auto", "triton", "torch_chunked", "reference")


def resolve_implementation(implementation: Implementation, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA, "torch_chunked" elsewhere; other names are checked and returned."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "auto":
        return "triton" if device.type == "cuda" else "torch_chunked"
    return implementation


def lm_head_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    workspace_mb: float = DEFAULT_WORKSPACE_MB,
    implementation: Implementation = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob and entropy of the sampled tokens under softmax(X W^T / T), never materialising logits.

    Args:
        hidden: (..., H) last hidden states of the completion tokens (e.g. (N, H) or Megatron's (s, b, H)); the
            same on every rank of `tp_group`.
        weight: (V_local, H) this rank's LM-head shard (rows of the Megatron-padded vocabulary).
        token_ids: (...) int64 global ids of the sampled tokens, in [0, vocab_size).
        temperature: the sampling temperature T.
        vocab_size: the real vocabulary; global rows >= it are padding, masked to -inf. None = no padding.
        tp_group: the TP group the vocabulary is split over; None = W is the whole head.
        vocab_start: global id of local row 0; None = tp_rank * V_local (Megatron's even split).
        workspace_mb: bound on the extra (tile) memory, MiB; ignored by "reference".
        implementation: "auto" (triton on CUDA, else torch_chunked), "triton", "torch_chunked" or "reference".

    Returns:
        (logprobs, entropy), each shaped like token_ids, float32 (float64 for float64 inputs). Under
        torch.no_grad (old / reference log-prob passes) nothing is saved. NaN log-prob for ids outside
        [0, vocab_size).
    """
    token_shape = token_ids.shape
    if hidden.shape[:-1] != token_shape:
        raise ValueError(f"hidden (..., H) must match token_ids (...): {tuple(hidden.shape)} vs {tuple(token_shape)}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    flat_ids = token_ids.reshape(-1)  # (N,)
    check_lm_head_inputs(flat_hidden, weight, flat_ids, temperature)
    common = dict(temperature=temperature, vocab_size=vocab_size, tp_group=tp_group, vocab_start=vocab_start)
    chosen = resolve_implementation(implementation, hidden.device)
    if chosen == "triton":
        logprobs, entropy = triton_logprob_entropy(flat_hidden, weight, flat_ids, workspace_mb=workspace_mb, **common)
    elif chosen == "torch_chunked":
        logprobs, entropy = chunked_logprob_entropy(flat_hidden, weight, flat_ids, workspace_mb=workspace_mb, **common)
    else:
        logprobs, entropy = reference_logprob_entropy(flat_hidden, weight, flat_ids, **common)
    return logprobs.reshape(token_shape), entropy.reshape(token_shape)  # (...)
