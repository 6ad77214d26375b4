"""The LM-head log-prob's tile primitives in plain torch: the CPU fallback, and the tile plan both paths share.

What a tile computes (docs/kernels.md): a (rows x cols) block of the logits z = X W^T / T (with a
final-logit soft-cap: z = cap tanh(X W^T / cap) / T, and dz gains the factor 1 - tanh^2), reduced
in the forward to the per-token state (m, s, q, t) of kernels/softmax_stats.py (`torch_local_stats`: row chunks
outer, vocab chunks inner, merged in a fixed order) and recomputed in the backward into
dz = [g_lp 1{v=y} - p (g_lp + g_H (z - E_p[z]))] / T (`torch_tile_dz`). `plan_tiles` sizes the tiles so that their
temporaries stay within the workspace (at least `MIN_TILE_COLS` columns, one row). Dtypes: float32, float64 (tests),
bfloat16 / float16 (upcast per tile on the CPU: slow); statistics in float32 (float64 for float64 inputs).
Deterministic: fixed loop order, no atomics. The autograd Function, the backward loop and the entries:
kernels/lm_head_logprob.py; measured memory: benchmarks/bench_fused_logprob.py.

Must not: import Triton or engine/, hold a (N, V_local) tensor, choose an implementation.

Test: `pytest tests/kernels/test_chunked_logprob.py tests/kernels/test_vocab_parallel.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.softmax_stats import NUM_STATS, merge_stats

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


def _tile_logits(x_rows: torch.Tensor, w_cols: torch.Tensor, inv_temperature: float, softcap: float | None,
                 acc_dtype: torch.dtype) -> torch.Tensor:
    """(rows, cols) tempered logits x w^T / T, soft-capped first (cap tanh(x w^T / cap) / T) when softcap is set;
    in place on the GEMM's result (one temporary)."""
    z = matmul_acc(x_rows, w_cols.T, acc_dtype)  # (rows, cols)
    if softcap is None:
        return z.mul_(inv_temperature)
    return z.div_(softcap).tanh_().mul_(softcap * inv_temperature)


def _torch_tile_stats(x_rows: torch.Tensor, w_cols: torch.Tensor, tile_ids: torch.Tensor,
                      inv_temperature: float, softcap: float | None) -> torch.Tensor:
    """(4, rows) state of one logits tile; tile_ids are ids relative to the tile's first column."""
    z = _tile_logits(x_rows, w_cols, inv_temperature, softcap, accumulation_dtype(x_rows.dtype))  # (rows, cols)
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
                      inv_temperature: float, workspace_bytes: int, softcap: float | None = None) -> torch.Tensor:
    """(4, N) state of this shard's real rows, tile by tile (rows outer, vocab inner, fixed order).

    Args:
        hidden: (N, H).
        weight_valid: (num_valid, H) the real rows of the shard (num_valid >= 1).
        local_ids: (N,) token ids relative to the shard's first row.
        inv_temperature: 1 / T.
        workspace_bytes: bound on the tile temporaries.
        softcap: final-logit soft-capping cap (cap tanh(logits / cap), before the temperature); None = off.
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
                                     inv_temperature, softcap)  # (4, rows)
            running = tile if running is None else merge_stats(torch.stack([running, tile]))  # (4, rows)
        stats[:, r0:r0 + plan.rows] = running
    return stats


def dz_from_logp(logp: torch.Tensor, probs_out: torch.Tensor | None, ids: torch.Tensor, lse: torch.Tensor,
                 mean_logit: torch.Tensor, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None,
                 inv_temperature: float, cap_grad: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """d loss / d (x w^T), (rows, cols) in out_dtype, from the log-probs `logp` = z - lse of a tile or chunk
    (consumed in place; `probs_out` a same-shape buffer for exp(logp), None = a new one): dz = [g_lp 1{v=y} - p (g_lp
    + g_H (z - E[z]))] x `cap_grad` (the soft-cap's 1 - tanh^2, None = no cap) / T; `ids` relative to the first
    column (outside it: no hit). Shared by the two-pass tiles (`torch_tile_dz`) and kernels/onepass_logprob.py."""
    probs = torch.exp(logp) if probs_out is None else torch.exp(logp, out=probs_out)  # (rows, cols)
    if grad_entropy is None:
        coef = grad_logprobs[:, None]  # (rows, 1)
    else:
        coef = logp.add_((lse - mean_logit)[:, None]).mul_(grad_entropy[:, None]).add_(grad_logprobs[:, None])  # z - E[z]
    dz = probs.mul_(coef).neg_()  # (rows, cols): -p (g_lp + g_H (z - E[z]))
    is_hit = (ids >= 0) & (ids < dz.shape[1])
    hit_grad = torch.where(is_hit, grad_logprobs, torch.zeros_like(grad_logprobs))  # (rows,)
    dz.scatter_add_(1, ids.clamp(0, dz.shape[1] - 1)[:, None], hit_grad[:, None])
    del logp, coef
    if cap_grad is not None:
        dz.mul_(cap_grad)  # d cap tanh(u / cap) / du = 1 - tanh^2
    return dz.mul_(inv_temperature).to(out_dtype)


def torch_tile_dz(x_rows: torch.Tensor, w_cols: torch.Tensor, tile_ids: torch.Tensor, lse: torch.Tensor,
                  mean_logit: torch.Tensor, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None,
                  inv_temperature: float, softcap: float | None = None) -> torch.Tensor:
    """d loss / d (x w^T) of one tile, (rows, cols) in x's dtype; tile_ids relative to the tile's first column.
    Soft-capped: d loss / d z times the cap's derivative 1 - tanh^2(x w^T / cap), at most three live temporaries."""
    cap_grad = None
    if softcap is None:
        z = matmul_acc(x_rows, w_cols.T, lse.dtype).mul_(inv_temperature)  # (rows, cols)
    else:
        tanh = matmul_acc(x_rows, w_cols.T, lse.dtype).div_(softcap).tanh_()  # (rows, cols)
        z = tanh * (softcap * inv_temperature)
        cap_grad = tanh.square_().neg_().add_(1.0)  # in tanh's buffer
    z.sub_(lse[:, None])  # log p
    return dz_from_logp(z, None, tile_ids, lse, mean_logit, grad_logprobs, grad_entropy, inv_temperature, cap_grad,
                        x_rows.dtype)
