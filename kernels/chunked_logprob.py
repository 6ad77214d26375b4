"""Chunked LM-head log-prob and entropy in plain torch: the fallback without a GPU, and the shared autograd Function.

What it computes: per token, the log-prob of the sampled token and the entropy of softmax(X W^T / T) over the real
vocabulary (anchors/kernels.md §2), with gradients for X and W, without ever holding the (N, V_local) logits.

How (design D1, anchors/kernels.md §11.1-11.4):
- Forward: tiles of (rows x cols) of the logits, row chunks outer, vocab chunks inner; each tile is reduced to the
  per-token state (m, s, q, t) of kernels/softmax_stats.py and merged into the running state in a fixed order.
  Under TP the (4, N) state is all-gathered and merged (4 floats per token), never the logits. Saved for the
  backward: X, W, the ids and two floats per token (lse, E_p[z]).
- Backward: recompute each tile and form d loss / d z = [g_lp 1{v=y} - p (g_lp + g_H (z - E_p[z]))] / T from the
  per-token upstream gradients g_lp, g_H; vocab chunks outer (each W slab is read once), row chunks inner;
  dX += dz W_slab into a float32 accumulator, dW_slab = dz^T X (one GEMM over all N rows when a slab holds every
  row, else accumulated in float32 over row chunks). Under TP, dX is all-reduced over the group (see
  `LogprobEntropyFunction`); dW stays local. Padded vocab rows are never computed and get a zero gradient.
- The Triton path (kernels/fused_logprob.py) reuses this Function and loop and swaps in two fused tile
  primitives (`TileOps`): the forward statistics and the dz recompute.

Memory: the tile temporaries are bounded by `workspace_mb` (`plan_tiles`: rows x cols x bytes-per-element <=
workspace; a tile is at least `MIN_TILE_COLS` columns wide, one row high). Beyond it: O(N) statistics; for
bf16/fp16 inputs a float32 (N, H) dX accumulator and one float32 (rows, H) slab product (on CUDA,
`torch.mm(out_dtype=float32)`); a float32 (cols, H) dW accumulator when rows are split; the gradients themselves.
Dtypes: float32, float64 (tests), bfloat16/float16 (upcast per tile on the CPU: slow). Results are float32
(float64 for float64 inputs). Deterministic: fixed loop order, no atomics.
Measured (benchmarks/results/fused_logprob.csv; 2-core Xeon dev machine; N=4096, H=512, V=32000, float32, default
workspace): extra peak memory 86 MiB vs 1999 MiB for the reference in the forward (1/23), 157 vs 2501 MiB for
forward + backward (1/16), 156 vs 1500 MiB for the backward alone (1/9.6; dW itself is 62.5 MiB of that).

Must not: import Triton or engine/, choose an implementation (kernels/lm_head_logprob.py does).

Test: `pytest tests/kernels/test_chunked_logprob.py tests/kernels/test_vocab_parallel.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.softmax_stats import (
    NUM_STATS,
    VocabShard,
    all_reduce_hidden_grad,
    build_vocab_shard,
    empty_stats,
    finalize_stats,
    merge_stats,
    reduce_stats_over_tp,
)

DEFAULT_WORKSPACE_MB = 128.0
"""Bound on per-tile temporaries. 128 MiB = a 16K-row x 4K-column bf16 dz slab on GPU."""
MIN_TILE_COLS = 128
"""Narrowest vocabulary tile: narrower ones re-read X too often for too little work."""
TORCH_TEMPS_PER_ELEMENT = 3
"""Live (rows, cols) temporaries per tile in the torch path: the logits, their exponentials, the cast dz."""


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs (tests), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class TilePlan:
    """Tile shape of the chunked loops."""

    rows: int
    """Tokens per tile (N when the workspace allows)."""
    cols: int
    """Vocabulary columns per tile."""


def plan_tiles(num_rows: int, num_cols: int, workspace_bytes: int, bytes_per_element: int) -> TilePlan:
    """Largest tiles within the workspace: as many columns as fit with all rows, else `MIN_TILE_COLS` columns and
    as many rows as fit (at least one).

    Args:
        num_rows: N.
        num_cols: real vocabulary columns of the shard.
        workspace_bytes: bound on rows * cols * bytes_per_element.
        bytes_per_element: temporaries per logit element, in bytes.

    Returns:
        `TilePlan`; rows * cols * bytes_per_element <= max(workspace_bytes, MIN_TILE_COLS * bytes_per_element).
    """
    elements = max(workspace_bytes // bytes_per_element, 1)
    cols = max(min(num_cols, max(MIN_TILE_COLS, elements // max(num_rows, 1))), 1)
    rows = max(min(num_rows, elements // cols), 1)
    return TilePlan(rows=rows, cols=cols)


def matmul_acc(a: torch.Tensor, b: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    """a @ b with an `acc_dtype` result: cuBLAS accumulates in float32 and writes float32 for bf16/fp16 on CUDA;
    elsewhere the operands are upcast (a tile-sized copy)."""
    if a.dtype == acc_dtype and b.dtype == acc_dtype:
        return a @ b
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=acc_dtype)
    return a.to(acc_dtype) @ b.to(acc_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Torch tile primitives
# ---------------------------------------------------------------------------------------------------------------


def _torch_tile_stats(x_rows: torch.Tensor, w_cols: torch.Tensor, tile_ids: torch.Tensor,
                      inv_temperature: float) -> torch.Tensor:
    """(4, rows) state of one logits tile; tile_ids are ids relative to the tile's first column."""
    z = matmul_acc(x_rows, w_cols.T, accumulation_dtype(x_rows.dtype)).mul_(inv_temperature)  # (rows, cols)
    is_hit = (tile_ids >= 0) & (tile_ids < z.shape[1])  # (rows,)
    picked = z.gather(1, tile_ids.clamp(0, z.shape[1] - 1)[:, None])[:, 0]  # (rows,)
    target = torch.where(is_hit, picked, torch.zeros_like(picked))
    row_max = z.amax(1)  # (rows,)
    z.sub_(row_max[:, None])  # z - m
    e = torch.exp(z)  # (rows, cols)
    sum_exp = e.sum(1)
    q = e.mul_(z).sum(1)
    return torch.stack([row_max, sum_exp, q, target])  # (4, rows)


def torch_local_stats(hidden: torch.Tensor, weight_valid: torch.Tensor, local_ids: torch.Tensor,
                      inv_temperature: float, workspace_bytes: int) -> torch.Tensor:
    """(4, N) state of this shard's real rows, tile by tile (rows outer, vocab inner, fixed order).

    Args:
        hidden: (N, H).
        weight_valid: (num_valid, H) the real rows of the shard (num_valid >= 1).
        local_ids: (N,) token ids relative to the shard's first row.
        inv_temperature: 1 / T.
        workspace_bytes: bound on the tile temporaries.
    """
    num_rows, num_cols = hidden.shape[0], weight_valid.shape[0]
    acc_dtype = accumulation_dtype(hidden.dtype)
    plan = plan_tiles(num_rows, num_cols, workspace_bytes, TORCH_TEMPS_PER_ELEMENT * acc_dtype.itemsize)
    stats = torch.empty(NUM_STATS, num_rows, dtype=acc_dtype, device=hidden.device)  # (4, N)
    for r0 in range(0, num_rows, plan.rows):
        x_rows = hidden[r0:r0 + plan.rows]  # (rows, H)
        running = None
        for c0 in range(0, num_cols, plan.cols):
            tile = _torch_tile_stats(x_rows, weight_valid[c0:c0 + plan.cols], local_ids[r0:r0 + plan.rows] - c0,
                                     inv_temperature)  # (4, rows)
            running = tile if running is None else merge_stats(torch.stack([running, tile]))  # (4, rows)
        stats[:, r0:r0 + plan.rows] = running
    return stats


def torch_tile_dz(x_rows: torch.Tensor, w_cols: torch.Tensor, tile_ids: torch.Tensor, lse: torch.Tensor,
                  mean_logit: torch.Tensor, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None,
                  inv_temperature: float) -> torch.Tensor:
    """d loss / d (x w^T) of one tile, (rows, cols) in x's dtype; tile_ids relative to the tile's first column."""
    z = matmul_acc(x_rows, w_cols.T, lse.dtype).mul_(inv_temperature)  # (rows, cols)
    z.sub_(lse[:, None])  # log p
    probs = torch.exp(z)  # (rows, cols)
    if grad_entropy is None:
        coef = grad_logprobs[:, None]  # (rows, 1)
    else:
        coef = z.add_((lse - mean_logit)[:, None]).mul_(grad_entropy[:, None]).add_(grad_logprobs[:, None])  # z - E[z]
    dz = probs.mul_(coef).neg_()  # (rows, cols): -p (g_lp + g_H (z - E[z]))
    is_hit = (tile_ids >= 0) & (tile_ids < dz.shape[1])
    hit_grad = torch.where(is_hit, grad_logprobs, torch.zeros_like(grad_logprobs))  # (rows,)
    dz.scatter_add_(1, tile_ids.clamp(0, dz.shape[1] - 1)[:, None], hit_grad[:, None])
    return dz.mul_(inv_temperature).to(x_rows.dtype)


@dataclass(frozen=True)
class TileOps:
    """The two primitives an implementation supplies to `LogprobEntropyFunction`."""

    local_stats: Callable[..., torch.Tensor]
    """(hidden, weight_valid, local_ids, inv_temperature, workspace_bytes) -> (4, N) state of the shard."""
    tile_dz: Callable[..., torch.Tensor]
    """(x_rows, w_cols, tile_ids, lse, mean_logit, g_lp, g_H | None, inv_temperature) -> (rows, cols) dz."""
    dz_bytes_per_element: Callable[[torch.dtype], int]
    """Bytes of tile temporaries per logit element in the backward, given the input dtype."""


TORCH_TILE_OPS = TileOps(
    local_stats=torch_local_stats,
    tile_dz=torch_tile_dz,
    dz_bytes_per_element=lambda dtype: TORCH_TEMPS_PER_ELEMENT * accumulation_dtype(dtype).itemsize,
)


# ---------------------------------------------------------------------------------------------------------------
# Backward loop (shared with the Triton path)
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
                             grad_logprobs[r0:r1], g_ent, inv_temperature)  # (rows, cols)
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
# Autograd Function and functional entry
# ---------------------------------------------------------------------------------------------------------------


def check_lm_head_inputs(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor,
                         temperature: float) -> None:
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


class LogprobEntropyFunction(torch.autograd.Function):
    """(hidden, weight) -> (logprobs, entropy) with a recompute backward; tile primitives from `TileOps`.

    Backward returns dX summed over the TP group (every rank gets the same full d loss / d X, for the replicated
    X) and this shard's dW. The upstream gradients must be the same on every TP rank (the loss is computed
    redundantly from the replicated log-probs), as in Megatron.
    """

    @staticmethod
    def forward(ctx, hidden, weight, token_ids, shard: VocabShard, temperature: float, tp_group,
                workspace_bytes: int, ops: TileOps):
        ctx.set_materialize_grads(False)
        inv_temperature = 1.0 / temperature
        local_ids = token_ids - shard.vocab_start  # (N,)
        if shard.num_valid > 0:
            stats = ops.local_stats(hidden, weight[:shard.num_valid], local_ids, inv_temperature, workspace_bytes)
        else:
            stats = empty_stats(hidden.shape[0], accumulation_dtype(hidden.dtype), hidden.device)  # (4, N)
        result = finalize_stats(reduce_stats_over_tp(stats, tp_group), token_ids, shard.vocab_size)
        ctx.save_for_backward(hidden, weight, local_ids, result.lse, result.mean_logit)
        ctx.config = (shard, inv_temperature, tp_group, workspace_bytes, ops)
        return result.logprobs, result.entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local_ids, lse, mean_logit = ctx.saved_tensors
        shard, inv_temperature, tp_group, workspace_bytes, ops = ctx.config
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_logprobs = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.to(lse.dtype)
        grad_entropy = None if grad_entropy is None else grad_entropy.to(lse.dtype)
        dx, dw = None, None
        if shard.num_valid > 0:
            dx, dw = backward_tiles(hidden, weight, shard, local_ids, lse, mean_logit, grad_logprobs, grad_entropy,
                                    inv_temperature, workspace_bytes, ops, needs_dx, needs_dw)
        if needs_dx:
            dx = torch.zeros_like(hidden) if dx is None else dx
            all_reduce_hidden_grad(dx, tp_group)  # NOTE: every rank must reach this collective, padding-only too
        if needs_dw and dw is None:
            dw = torch.zeros_like(weight)
        return dx, dw, None, None, None, None, None, None


def chunked_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    workspace_mb: float = DEFAULT_WORKSPACE_MB,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob and entropy of the sampled tokens, tile by tile in plain torch (no (N, V) tensor).

    Args:
        hidden: (N, H) last hidden states of the completion tokens; the same on every TP rank.
        weight: (V_local, H) this rank's LM-head shard.
        token_ids: (N,) int64 global ids of the sampled tokens, in [0, vocab_size).
        temperature: the sampling temperature T (logits are divided by it).
        vocab_size: the real vocabulary; global rows >= it are Megatron padding, masked. None = no padding.
        tp_group: the TP group the vocabulary is split over; None = W is the whole head.
        vocab_start: global id of local row 0; None = tp_rank * V_local.
        workspace_mb: bound on the tile temporaries, MiB.

    Returns:
        (logprobs, entropy), each (N,) float32 (float64 for float64 inputs). Differentiable: the backward takes
        d loss / d logprobs and d loss / d entropy and returns dX summed over the TP group and the local dW.
        Under torch.no_grad (old / reference passes) nothing is kept. NaN log-prob for ids outside the vocabulary.
    """
    check_lm_head_inputs(hidden, weight, token_ids, temperature)
    shard = build_vocab_shard(weight.shape[0], vocab_size, tp_group, vocab_start)
    return LogprobEntropyFunction.apply(hidden, weight, token_ids, shard, temperature, tp_group,
                                        int(workspace_mb * 2**20), TORCH_TILE_OPS)
