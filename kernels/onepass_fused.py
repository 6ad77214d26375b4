"""Triton GEMMs of the one-pass LM-head loss with the softmax and gradient work fused into them ("triton_fused").

The one-pass path (kernels/onepass_logprob.py) forms a chunk of rows' logits once. Here three Triton GEMM kernels do
all of it, with no separate row pass:
- `_fused_logits_stats_kernel`: z = x W^T / T (soft-capped first: cap tanh(x W^T / cap) / T) tile by tile; the
  epilogue writes the tempered tile once, float32, into the bounded (rows, V_local) workspace and folds it into each
  row's online-softmax state (m, s, q, t) (kernels/softmax_stats.py), one partial state per vocabulary split, merged
  in split order (no atomics);
- `_fused_dx_kernel`: dX = dz W over the vocabulary, dz formed in the prologue of each K step from the saved tile and
  the row's (lse, E[z], g_lp, g_H): dz = [g_lp 1{v=y} - p (g_lp + g_H (z - E[z]))] / T (times the cap's 1 - tanh^2),
  the maths of kernels/chunked_logprob.py `dz_from_logp`, cast to the operands' dtype before the dot;
- `_fused_dw_kernel`: dW (+)= dz^T X over the chunk's rows, the same prologue; each program owns its (cols, H) output
  block and adds the previous chunks' sum to it (fixed order, no atomics).
No logits GEMM runs twice: the forward's product is kept (the workspace) rather than recomputed, so the GEMM work is
the model's 6NHV; dz is never stored (each of the two backward GEMMs recomputes it from the workspace: element-wise
work, no GEMM). Memory: the float32 workspace, 4 B per logit element of the chunk, nothing for dz.

Must not: import engine/, hold (N, V_local) logits, or run on CPU tensors without TRITON_INTERPRET=1. NOTE: triton
3.9's interpreter computes `tl.dot` of bf16 operands wrongly, so under the interpreter the operands are upcast to
float32 before each dot (kernels/fused_logprob.py `_dot_settings`).

Test: `pytest tests/kernels/test_onepass_logprob.py tests/kernels/test_onepass_tp.py` (interpreter on CPU); compiled
for sm_90 / sm_80 by `python -m kernels.compile_check`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fused_logprob import (
    PROGRAMS_PER_SM,
    KernelLaunch,
    _dot_settings,
    _dz_tile,
    _fold_tile,
    _grouped_tile,
    _logits_tile,
    _num_sms,
    _softcap_arg,
    check_triton_operands,
)
from kernels.softmax_stats import NUM_STATS, merge_stats


@dataclass(frozen=True)
class FusedTiles:
    """Block sizes of the three fused GEMMs. The forward's output tile is block_m x block_v (K step block_h), dX's
    block_m x block_h (K step block_v), dW's block_v x block_h (K step block_m); the dz prologue holds a block_m x
    block_v float32 tile. Measured per device, dtype and H by the GPU suite's sweep (benchmarks/gpu/lm_head.py ->
    kernels/tuned/, read by `default_fused_tiles`). Compiled for sm_90 and sm_80 at every launch point of `python -m
    kernels.compile_check` (Triton 3.9): these defaults (64 x 64 x 64, 8 warps, 3 stages: bfloat16 / float16) and
    `FP32_FUSED_TILES` (32 x 32 x 32, 8 warps, 3 stages: float32) compile all three kernels without register
    spills. Larger float32 tiles spill a few bytes (4-32 B) on sm_80 or sm_90: 64 x 64 x 32 and 64 x 64 x 16 (dX),
    32 x 64 x 32 (dW; with 4 warps or 2 stages also the forward and dX)."""

    block_m: int = 64
    """Rows (tokens) per tile."""
    block_v: int = 64
    """Vocabulary columns per tile."""
    block_h: int = 64
    """Hidden columns per tile."""
    group_m: int = 8
    """Row blocks that sweep the vocabulary together in the forward (L2 reuse of W)."""
    num_warps: int = 8
    num_stages: int = 3


FP32_FUSED_TILES = FusedTiles(block_m=32, block_v=32, block_h=32)
"""float32 on CUDA (IEEE dot, no tensor cores: twice the registers per operand of bf16): every tile dimension 32: of the
sets tried, the one the compile check finds free of spills (`FusedTiles`)."""
INTERPRETER_FUSED_TILES = FusedTiles(block_m=16, block_v=32, block_h=16, group_m=2, num_warps=4, num_stages=1)
"""Under the interpreter: several tiles on test shapes (tl.dot needs 16 or more per dim), few numpy steps."""
STATS_BYTES_PER_ELEMENT = 1
"""The partial states and their merge per logit element, rounded up: 16 B per row per split of >= block_v columns,
about three times that while merging."""


def default_fused_tiles(device: torch.device, dtype: torch.dtype, hidden_size: int | None = None) -> FusedTiles:
    """On CUDA the measured tiles of this device, dtype and H (kernels/tuned_tiles.py, kind "onepass_fused") where a
    table has them, else `FP32_FUSED_TILES` for float32 and `FusedTiles()` otherwise; `INTERPRETER_FUSED_TILES`
    elsewhere."""
    if device.type != "cuda":
        return INTERPRETER_FUSED_TILES
    if hidden_size is not None:
        from kernels.tuned_tiles import device_lookup

        tuned = device_lookup("onepass_fused", device, dtype, hidden_size)
        if tuned is not None:
            return tuned
    return FP32_FUSED_TILES if dtype == torch.float32 else FusedTiles()


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _fused_logits_stats_kernel(x_ptr, w_ptr, ids_ptr, z_ptr, parts_ptr, num_rows, num_cols, hidden_size, split_cols,
                               num_splits, stride_x, stride_w, stride_z, inv_temperature, softcap,
                               BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                               GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                               HAS_SOFTCAP: tl.constexpr):
    """BLOCK_M rows over one vocabulary split: each logits tile stored once to z, folded into the rows' partial
    state -> parts[split, :, rows]."""
    pid = tl.program_id(0).to(tl.int64)
    row_block, split = _grouped_tile(pid, tl.cdiv(num_rows, BLOCK_M), num_splits, GROUP_M)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_mask = rows < num_rows
    ids = tl.load(ids_ptr + rows, mask=row_mask, other=-1)
    # NOTE: a finite start for m keeps alpha = 0 and (m - m_new) * s = 0 on the first tile (no -inf * 0).
    m = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    q = tl.zeros((BLOCK_M,), dtype=tl.float32)
    t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    col_start = split * split_cols
    col_end = tl.minimum(col_start + split_cols, num_cols)
    for c0 in range(col_start, col_end, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_mask = (cols < col_end)[None, :]
        z = _logits_tile(x_ptr, w_ptr, rows, cols, num_rows, num_cols, hidden_size, stride_x, stride_w,
                         inv_temperature, softcap, BLOCK_M, BLOCK_V, BLOCK_H, DOT_FP32, INPUT_PRECISION, HAS_SOFTCAP)
        tl.store(z_ptr + rows[:, None] * stride_z + cols[None, :], z, mask=row_mask[:, None] & col_mask)
        m, s, q, t = _fold_tile(z, cols, col_mask, ids, m, s, q, t)
    out = parts_ptr + split * 4 * num_rows + rows
    tl.store(out, m, mask=row_mask)
    tl.store(out + num_rows, s, mask=row_mask)
    tl.store(out + 2 * num_rows, q, mask=row_mask)
    tl.store(out + 3 * num_rows, t, mask=row_mask)


@triton.jit
def _dz_prologue(z_ptr, ids_ptr, lse_ptr, mean_ptr, grad_lp_ptr, grad_ent_ptr, rows, cols, num_rows, num_cols,
                 stride_z, inv_temperature, softcap, HAS_ENTROPY_GRAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """float32 dz of the (rows, cols) block of the tempered-logits workspace; 0 outside [0, num_rows) x
    [0, num_cols)."""
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols < num_cols)[None, :]
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0)
    dz = _dz_tile(z, rows, cols, row_mask, ids_ptr, lse_ptr, mean_ptr, grad_lp_ptr, grad_ent_ptr, inv_temperature,
                  softcap, HAS_ENTROPY_GRAD, HAS_SOFTCAP)
    return tl.where(mask, dz, 0.0)


@triton.jit
def _fused_dx_kernel(z_ptr, w_ptr, ids_ptr, lse_ptr, mean_ptr, grad_lp_ptr, grad_ent_ptr, dx_ptr, num_rows, num_cols,
                     hidden_size, stride_z, stride_w, stride_dx, inv_temperature, softcap,
                     HAS_ENTROPY_GRAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_FP32: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr):
    """dx[rows, hs] = sum over the vocabulary of dz[rows, v] W[v, hs], float32; dz from the workspace per K step."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    hs = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    h_mask = hs < hidden_size
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for v0 in range(0, num_cols, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        dz = _dz_prologue(z_ptr, ids_ptr, lse_ptr, mean_ptr, grad_lp_ptr, grad_ent_ptr, rows, cols, num_rows,
                          num_cols, stride_z, inv_temperature, softcap, HAS_ENTROPY_GRAD, HAS_SOFTCAP)
        w = tl.load(w_ptr + cols[:, None] * stride_w + hs[None, :], mask=(cols < num_cols)[:, None] & h_mask[None, :],
                    other=0.0)
        dz = dz.to(w_ptr.dtype.element_ty)  # the GEMM operands' dtype, as a stored dz would be
        if DOT_FP32:
            dz = dz.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(dz, w, acc, input_precision=INPUT_PRECISION)
    tl.store(dx_ptr + rows[:, None] * stride_dx + hs[None, :], acc, mask=(rows < num_rows)[:, None] & h_mask[None, :])


@triton.jit
def _fused_dw_kernel(z_ptr, x_ptr, ids_ptr, lse_ptr, mean_ptr, grad_lp_ptr, grad_ent_ptr, dw_ptr, num_rows, num_cols,
                     hidden_size, stride_z, stride_x, stride_dw, inv_temperature, softcap,
                     HAS_ENTROPY_GRAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ACCUMULATE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_FP32: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr):
    """dw[cols, hs] (+)= sum over the chunk's rows of dz[r, cols] x[r, hs], float32; dz from the workspace per K
    step; ACCUMULATE adds the previous chunks' sum (read once, by the program that writes it)."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    hs = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    h_mask = hs < hidden_size
    acc = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32)
    for r0 in range(0, num_rows, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M).to(tl.int64)
        dz = _dz_prologue(z_ptr, ids_ptr, lse_ptr, mean_ptr, grad_lp_ptr, grad_ent_ptr, rows, cols, num_rows,
                          num_cols, stride_z, inv_temperature, softcap, HAS_ENTROPY_GRAD, HAS_SOFTCAP)
        x = tl.load(x_ptr + rows[:, None] * stride_x + hs[None, :], mask=(rows < num_rows)[:, None] & h_mask[None, :],
                    other=0.0)
        dz = dz.to(x_ptr.dtype.element_ty)
        if DOT_FP32:
            dz = dz.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(tl.trans(dz), x, acc, input_precision=INPUT_PRECISION)
    out = dw_ptr + cols[:, None] * stride_dw + hs[None, :]
    mask = (cols < num_cols)[:, None] & h_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0)
    tl.store(out, acc, mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


def _check_fused_operands(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """Device, dtype and layout: those of kernels/fused_logprob.py, and one dtype for both operands."""
    check_triton_operands(hidden, weight)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"triton_fused needs hidden and weight in one dtype; got {hidden.dtype} and {weight.dtype}")


def build_fused_stats_launch(x_rows: torch.Tensor, w_valid: torch.Tensor, local_ids: torch.Tensor, z: torch.Tensor,
                             inv_temperature: float, softcap: float | None, tiles: FusedTiles, num_sms: int,
                             is_gpu: bool) -> tuple[KernelLaunch, torch.Tensor]:
    """The forward launch (logits into the float32 workspace z (rows, cols), partial states out) and its
    (num_splits, 4, rows) float32 partial-state buffer (tensors may be on "meta")."""
    num_rows, hidden_size = x_rows.shape
    num_cols = w_valid.shape[0]
    col_blocks = triton.cdiv(num_cols, tiles.block_v)
    num_splits = max(min(triton.cdiv(PROGRAMS_PER_SM * num_sms, triton.cdiv(num_rows, tiles.block_m)), col_blocks), 1)
    split_cols = triton.cdiv(col_blocks, num_splits) * tiles.block_v
    num_splits = triton.cdiv(num_cols, split_cols)
    parts = torch.empty(num_splits, NUM_STATS, num_rows, dtype=torch.float32, device=x_rows.device)  # (K, 4, rows)
    launch = KernelLaunch(
        kernel=_fused_logits_stats_kernel, grid=(triton.cdiv(num_rows, tiles.block_m) * num_splits,),
        args=(x_rows, w_valid, local_ids, z, parts, num_rows, num_cols, hidden_size, split_cols, num_splits,
              x_rows.stride(0), w_valid.stride(0), z.stride(0), inv_temperature, _softcap_arg(softcap)),
        options=dict(BLOCK_M=tiles.block_m, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, GROUP_M=tiles.group_m,
                     num_warps=tiles.num_warps, num_stages=tiles.num_stages, HAS_SOFTCAP=softcap is not None,
                     **_dot_settings(x_rows.dtype, is_gpu)))
    return launch, parts


def build_fused_grad_launches(z: torch.Tensor, x_rows: torch.Tensor, w_valid: torch.Tensor, local_ids: torch.Tensor,
                              lse: torch.Tensor, mean_logit: torch.Tensor, grad_logprobs: torch.Tensor,
                              grad_entropy: torch.Tensor | None, inv_temperature: float, softcap: float | None,
                              dx: torch.Tensor | None, dw: torch.Tensor | None, accumulate: bool,
                              tiles: FusedTiles, is_gpu: bool) -> list[KernelLaunch]:
    """The dX launch (into dx (rows, H) float32) and the dW launch (into dw (cols, H) float32, added to it when
    `accumulate`), each skipped when its output is None (tensors may be on "meta")."""
    num_rows, hidden_size = x_rows.shape
    num_cols = w_valid.shape[0]
    per_row = (local_ids, lse, mean_logit, grad_logprobs, lse if grad_entropy is None else grad_entropy)
    flags = dict(HAS_ENTROPY_GRAD=grad_entropy is not None, HAS_SOFTCAP=softcap is not None, BLOCK_M=tiles.block_m,
                 BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, num_warps=tiles.num_warps,
                 num_stages=tiles.num_stages, **_dot_settings(x_rows.dtype, is_gpu))
    h_blocks = triton.cdiv(hidden_size, tiles.block_h)
    launches = []
    if dx is not None:
        launches.append(KernelLaunch(
            kernel=_fused_dx_kernel, grid=(triton.cdiv(num_rows, tiles.block_m), h_blocks),
            args=(z, w_valid, *per_row, dx, num_rows, num_cols, hidden_size, z.stride(0), w_valid.stride(0),
                  dx.stride(0), inv_temperature, _softcap_arg(softcap)), options=flags, report_arg=1))
    if dw is not None:
        launches.append(KernelLaunch(
            kernel=_fused_dw_kernel, grid=(triton.cdiv(num_cols, tiles.block_v), h_blocks),
            args=(z, x_rows, *per_row, dw, num_rows, num_cols, hidden_size, z.stride(0), x_rows.stride(0),
                  dw.stride(0), inv_temperature, _softcap_arg(softcap)), options=dict(flags, ACCUMULATE=accumulate),
            report_arg=1))
    return launches


def fused_chunk_stats(x_rows: torch.Tensor, w_valid: torch.Tensor, local_ids: torch.Tensor, inv_temperature: float,
                      softcap: float | None, tiles: FusedTiles) -> tuple[torch.Tensor, torch.Tensor]:
    """(tempered logits workspace (rows, cols) float32, (4, rows) float32 state) of one row chunk: one fused GEMM."""
    _check_fused_operands(x_rows, w_valid)
    z = torch.empty(x_rows.shape[0], w_valid.shape[0], dtype=torch.float32, device=x_rows.device)
    launch, parts = build_fused_stats_launch(x_rows, w_valid, local_ids.contiguous(), z, inv_temperature, softcap,
                                             tiles, _num_sms(x_rows.device), x_rows.is_cuda)
    launch.run()
    return z, merge_stats(parts)


def fused_chunk_grads(z: torch.Tensor, x_rows: torch.Tensor, w_valid: torch.Tensor, local_ids: torch.Tensor,
                      lse: torch.Tensor, mean_logit: torch.Tensor, grad_logprobs: torch.Tensor,
                      grad_entropy: torch.Tensor | None, inv_temperature: float, softcap: float | None,
                      dx: torch.Tensor | None, dw: torch.Tensor | None, accumulate: bool, tiles: FusedTiles) -> None:
    """dx = dz W and dw (+)= dz^T x of one row chunk, dz formed inside both GEMMs from the workspace z.

    Args:
        z: (rows, cols) float32 tempered logits from `fused_chunk_stats`.
        x_rows, w_valid: the chunk's (rows, H) hidden rows and the shard's (cols, H) real rows.
        local_ids: (rows,) int64 ids relative to the shard's first row.
        lse, mean_logit, grad_logprobs: (rows,) float32; grad_entropy the same or None (its term skipped).
        dx: (rows, H) float32 output (a view with unit column stride), or None.
        dw: (cols, H) float32 output, or None; `accumulate` adds this chunk to it.
    """
    for out in (dx, dw):
        if out is not None and (out.dtype != torch.float32 or out.stride(1) != 1):
            raise ValueError(f"dX / dW outputs must be float32 with unit column stride; got {out.dtype} "
                             f"strides {out.stride()}")
    contiguous = [t.contiguous() for t in (local_ids, lse, mean_logit, grad_logprobs)]
    for launch in build_fused_grad_launches(z, x_rows, w_valid, *contiguous,
                                            None if grad_entropy is None else grad_entropy.contiguous(),
                                            inv_temperature, softcap, dx, dw, accumulate, tiles, x_rows.is_cuda):
        launch.run()
