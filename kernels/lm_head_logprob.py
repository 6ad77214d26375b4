"""The LM-head log-prob kernel's autograd Function and entries: hidden states + LM-head shard -> per-token log-prob
and entropy, never materialising the (N, V_local) logits (Liger's order: tile primitives -> Function -> entry).

Owns: `TileOps` (the two tile primitives an implementation supplies: kernels/chunked_logprob.py in torch,
kernels/fused_logprob.py in Triton), the backward loop shared by both (`backward_tiles`: recomputed dz tiles, vocab
chunks outer, dX += dz W_slab in float32, dW_slab = dz^T X), `LogprobEntropyFunction` (TP: the (4, N) softmax state
all-gathered in the forward, dX all-reduced in the backward, kernels/softmax_stats.py), and the entries
`chunked_logprob_entropy`, `triton_logprob_entropy` and `lm_head_logprob_entropy` (`implementation`: "auto" = Triton
on CUDA, else chunked torch; "reference" materialises the logits, kernels/reference.py). The contract, the same
for every implementation, is `lm_head_logprob_entropy`'s docstring. Memory: the tile temporaries stay within
`workspace_mb` (`plan_tiles`); measured figures: benchmarks/bench_fused_logprob.py.

Must not: import engine/, read environment variables, or hold (N, V_local) logits outside implementation="reference".

Test: `pytest tests/kernels` (each implementation against kernels/reference.py, TP=2 on gloo, GRPO loss gradients).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from kernels.chunked_logprob import (
    TORCH_TEMPS_PER_ELEMENT,
    accumulation_dtype,
    matmul_acc,
    plan_tiles,
    torch_local_stats,
    torch_tile_dz,
)
from kernels.fused_logprob import TritonTiles, check_triton_operands, triton_local_stats, triton_tile_dz
from kernels.reference import reference_logprob_entropy
from kernels.softmax_stats import (
    VocabShard,
    all_reduce_hidden_grad,
    build_vocab_shard,
    empty_stats,
    finalize_stats,
    reduce_stats_over_tp,
)

Implementation = Literal["auto", "triton", "torch_chunked", "reference"]
IMPLEMENTATIONS = typing.get_args(Implementation)


# ---------------------------------------------------------------------------------------------------------------
# Tile primitives of each implementation
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileOps:
    """The two primitives an implementation supplies to `LogprobEntropyFunction`."""

    local_stats: Callable[..., torch.Tensor]
    """(hidden, weight_valid, local_ids, inv_temperature, workspace_bytes, softcap | None) -> (4, N) state."""
    tile_dz: Callable[..., torch.Tensor]
    """(x_rows, w_cols, tile_ids, lse, mean_logit, g_lp, g_H | None, inv_temperature, softcap | None) -> (rows, cols)
    dz."""
    dz_bytes_per_element: Callable[[torch.dtype], int]
    """Bytes of tile temporaries per logit element in the backward, given the input dtype."""


TORCH_TILE_OPS = TileOps(
    local_stats=torch_local_stats,
    tile_dz=torch_tile_dz,
    dz_bytes_per_element=lambda dtype: TORCH_TEMPS_PER_ELEMENT * accumulation_dtype(dtype).itemsize,
)


def build_triton_tile_ops(tiles: TritonTiles | None = None) -> TileOps:
    """The Triton primitives for `LogprobEntropyFunction`; the backward slab costs itemsize bytes per element."""
    return TileOps(
        local_stats=lambda *args: triton_local_stats(*args, tiles=tiles),
        tile_dz=lambda *args: triton_tile_dz(*args, tiles=tiles),
        dz_bytes_per_element=lambda dtype: dtype.itemsize,
    )


# ---------------------------------------------------------------------------------------------------------------
# Backward loop
# ---------------------------------------------------------------------------------------------------------------


def _add_matmul_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b, accumulated in out's dtype."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out.add_(matmul_acc(a, b, out.dtype))


def backward_tiles(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    shard: VocabShard,
    local_ids: torch.Tensor,
    lse: torch.Tensor,
    mean_logit: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    inv_temperature: float,
    softcap: float | None,
    workspace_bytes: int,
    ops: TileOps,
    needs_dx: bool,
    needs_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dX (N, H) and dW (V_local, H) (None where not needed) from recomputed dz tiles, vocab chunks outer.

    dX is this shard's partial sum (not yet reduced over TP); padded rows of dW are zero. lse, mean_logit and the
    upstream gradients are (N,) in the accumulation dtype; local_ids are relative to the shard's first row.
    """
    num_rows, num_cols = hidden.shape[0], shard.num_valid
    acc_dtype = lse.dtype
    plan = plan_tiles(num_rows, num_cols, workspace_bytes, ops.dz_bytes_per_element(hidden.dtype))
    dx_acc = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device) if needs_dx else None  # (N, H)
    dw = torch.zeros_like(weight) if needs_dw else None  # (V_local, H)
    is_one_row_chunk = plan.rows >= num_rows
    for c0 in range(0, num_cols, plan.cols):
        w_cols = weight[c0:min(c0 + plan.cols, num_cols)]  # (cols, H)
        dw_acc = None if (dw is None or is_one_row_chunk) else torch.zeros(w_cols.shape, dtype=acc_dtype,
                                                                           device=weight.device)  # (cols, H)
        for r0 in range(0, num_rows, plan.rows):
            r1 = min(r0 + plan.rows, num_rows)
            x_rows = hidden[r0:r1]  # (rows, H)
            g_ent = None if grad_entropy is None else grad_entropy[r0:r1]
            dz = ops.tile_dz(x_rows, w_cols, local_ids[r0:r1] - c0, lse[r0:r1], mean_logit[r0:r1],
                             grad_logprobs[r0:r1], g_ent, inv_temperature, softcap)  # (rows, cols)
            if dx_acc is not None:
                _add_matmul_(dx_acc[r0:r1], dz, w_cols)
            if dw_acc is not None:
                _add_matmul_(dw_acc, dz.T, x_rows)
            elif dw is not None:
                torch.mm(dz.T, x_rows, out=dw[c0:c0 + w_cols.shape[0]])  # all N rows in one GEMM: one rounding
            del dz
        if dw_acc is not None:
            dw[c0:c0 + w_cols.shape[0]] = dw_acc
    dx = None if dx_acc is None else dx_acc.to(hidden.dtype)
    return dx, dw


# ---------------------------------------------------------------------------------------------------------------
# Autograd Function and entries
# ---------------------------------------------------------------------------------------------------------------


def check_lm_head_inputs(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor,
                         temperature: float, softcap: float | None = None) -> None:
    """Shapes, dtypes and devices every implementation requires."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden (N, H) and weight (V_local, H); got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if token_ids.shape != hidden.shape[:1] or token_ids.dtype != torch.int64:
        raise ValueError(f"need token_ids (N,) = ({hidden.shape[0]},) int64; got {tuple(token_ids.shape)} "
                         f"{token_ids.dtype}")
    if hidden.dtype != weight.dtype or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden and weight must share a floating dtype; got {hidden.dtype} and {weight.dtype}")
    if not (hidden.device == weight.device == token_ids.device):
        raise ValueError(f"hidden, weight, token_ids on {hidden.device}, {weight.device}, {token_ids.device}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap (final_logit_softcapping) must be > 0 or None, got {softcap}")


class LogprobEntropyFunction(torch.autograd.Function):
    """(hidden, weight) -> (logprobs, entropy) with a recompute backward; tile primitives from `TileOps`.

    Backward returns dX summed over the TP group (every rank gets the same full d loss / d X, for the replicated
    X) and this shard's dW. The upstream gradients must be the same on every TP rank (the loss is computed
    redundantly from the replicated log-probs), as in Megatron.
    """

    @staticmethod
    def forward(ctx, hidden, weight, token_ids, shard: VocabShard, temperature: float, softcap: float | None,
                tp_group, workspace_bytes: int, ops: TileOps):
        ctx.set_materialize_grads(False)
        inv_temperature = 1.0 / temperature
        local_ids = token_ids - shard.vocab_start  # (N,)
        if shard.num_valid > 0:
            stats = ops.local_stats(hidden, weight[:shard.num_valid], local_ids, inv_temperature, workspace_bytes,
                                    softcap)
        else:
            stats = empty_stats(hidden.shape[0], accumulation_dtype(hidden.dtype), hidden.device)  # (4, N)
        result = finalize_stats(reduce_stats_over_tp(stats, tp_group), token_ids, shard.vocab_size)
        ctx.save_for_backward(hidden, weight, local_ids, result.lse, result.mean_logit)
        ctx.config = (shard, inv_temperature, softcap, tp_group, workspace_bytes, ops)
        return result.logprobs, result.entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local_ids, lse, mean_logit = ctx.saved_tensors
        shard, inv_temperature, softcap, tp_group, workspace_bytes, ops = ctx.config
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_logprobs = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.to(lse.dtype)
        grad_entropy = None if grad_entropy is None else grad_entropy.to(lse.dtype)
        dx, dw = None, None
        if shard.num_valid > 0:
            dx, dw = backward_tiles(hidden, weight, shard, local_ids, lse, mean_logit, grad_logprobs, grad_entropy,
                                    inv_temperature, softcap, workspace_bytes, ops, needs_dx, needs_dw)
        if needs_dx:
            dx = torch.zeros_like(hidden) if dx is None else dx
            all_reduce_hidden_grad(dx, tp_group)  # NOTE: every rank must reach this collective, padding-only too
        if needs_dw and dw is None:
            dw = torch.zeros_like(weight)
        return dx, dw, None, None, None, None, None, None, None


def resolve_kernel_implementation(implementation: str, device: torch.device, names: tuple[str, ...], on_cuda: str,
                                  what: str = "implementation") -> str:
    """"auto" -> `on_cuda` on CUDA, "torch_chunked" elsewhere; other names are checked against `names` (the entry's
    choices, `what` names them in the error) and returned. Shared by this entry and kernels/onepass_logprob.py."""
    if implementation not in names:
        raise ValueError(f"{what} must be one of {names}, got {implementation!r}")
    if implementation == "auto":
        return on_cuda if device.type == "cuda" else "torch_chunked"
    return implementation


def resolve_implementation(implementation: Implementation, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA, "torch_chunked" elsewhere; other names are checked and returned."""
    return resolve_kernel_implementation(implementation, device, IMPLEMENTATIONS, "triton")


def lm_head_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    workspace_mb: float,
    implementation: Implementation,
    temperature: float = 1.0,
    softcap: float | None = None,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    tiles: TritonTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob and entropy of the sampled tokens under softmax(X W^T / T), never materialising logits
    (soft-capped: softmax(cap tanh(X W^T / cap) / T)).

    Args:
        hidden: (..., H) last hidden states of the completion tokens (e.g. (N, H) or Megatron's (s, b, H)); the
            same on every rank of `tp_group`.
        weight: (V_local, H) this rank's LM-head shard (rows of the Megatron-padded vocabulary).
        token_ids: (...) int64 global ids of the sampled tokens, in [0, vocab_size).
        workspace_mb: bound on the extra (tile) memory, MiB (the torch tiles' temporaries; Triton: the backward dz
            slab and the forward partial states); ignored by "reference".
        implementation: "auto" (triton on CUDA, else torch_chunked), "triton" (CUDA tensors or the interpreter;
            float32 / bfloat16 / float16), "torch_chunked" or "reference".
        temperature: the sampling temperature T (the logits are divided by it).
        softcap: final-logit soft-capping (HF `final_logit_softcapping`, Gemma 2): logits -> cap tanh(logits / cap)
            before the temperature, as HF's model and vLLM's logits processor apply it; None = off (no cost).
        vocab_size: the real vocabulary; global rows >= it are padding, masked to -inf. None = no padding.
        tp_group: the TP group the vocabulary is split over; None = W is the whole head.
        vocab_start: global id of local row 0; None = tp_rank * V_local (Megatron's even split).
        tiles: Triton block sizes; None = `default_tiles(hidden.device, hidden.dtype)`.

    Returns:
        (logprobs, entropy), each shaped like token_ids, float32 (float64 for float64 inputs). Differentiable: the
        backward takes d loss / d logprobs and d loss / d entropy and returns dX summed over the TP group (X is
        replicated, Megatron's column-parallel convention) and the local dW. Under torch.no_grad (old / reference
        log-prob passes) nothing is saved. NaN log-prob for ids outside [0, vocab_size).
    """
    token_shape = token_ids.shape
    if hidden.shape[:-1] != token_shape:
        raise ValueError(f"hidden (..., H) must match token_ids (...): {tuple(hidden.shape)} vs {tuple(token_shape)}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    flat_ids = token_ids.reshape(-1)  # (N,)
    check_lm_head_inputs(flat_hidden, weight, flat_ids, temperature, softcap)
    chosen = resolve_implementation(implementation, hidden.device)
    if chosen == "reference":
        logprobs, entropy = reference_logprob_entropy(flat_hidden, weight, flat_ids, temperature=temperature,
                                                      softcap=softcap, vocab_size=vocab_size, tp_group=tp_group,
                                                      vocab_start=vocab_start)
    else:
        if chosen == "triton":
            check_triton_operands(flat_hidden, weight)
        ops = build_triton_tile_ops(tiles) if chosen == "triton" else TORCH_TILE_OPS
        shard = build_vocab_shard(weight.shape[0], vocab_size, tp_group, vocab_start)
        logprobs, entropy = LogprobEntropyFunction.apply(flat_hidden, weight, flat_ids, shard, temperature, softcap,
                                                         tp_group, int(workspace_mb * 2**20), ops)
    return logprobs.reshape(token_shape), entropy.reshape(token_shape)  # (...)


def chunked_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor,
                            **options) -> tuple[torch.Tensor, torch.Tensor]:
    """`lm_head_logprob_entropy` on the tiled plain-torch path (CPU, CI, float64 tests); same keyword arguments."""
    return lm_head_logprob_entropy(hidden, weight, token_ids, implementation="torch_chunked", **options)


def triton_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor,
                           **options) -> tuple[torch.Tensor, torch.Tensor]:
    """`lm_head_logprob_entropy` on the fused Triton kernels (GPU, or the interpreter); same keyword arguments."""
    return lm_head_logprob_entropy(hidden, weight, token_ids, implementation="triton", **options)
