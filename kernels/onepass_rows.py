"""Row kernels of the one-pass LM-head loss: the softmax and gradient work between two cuBLAS GEMMs, in Triton.

The one-pass path (kernels/onepass_logprob.py) forms a chunk of rows' logits once, in a float32 workspace
(rows, V_local) written by cuBLAS. Two memory-bound kernels then do what torch would do in six or more passes:
`_workspace_stats_kernel` tempers (and soft-caps) the raw GEMM output in place and writes each row's online-softmax
state (m, s, q, t) (kernels/softmax_stats.py); `_workspace_dz_kernel` turns the tempered logits into
dz = [g_lp 1{v=y} - p (g_lp + g_H (z - E[z]))] / T (times the cap's derivative), written in the GEMM operands' dtype
(in place when that is float32). Both read each element once and write it once; no atomics, fixed order.

Must not: import engine/, run GEMMs (cuBLAS does), or run on CPU tensors without TRITON_INTERPRET=1.

Test: `pytest tests/kernels/test_onepass_logprob.py` (interpreter on CPU); compiled for sm_90 / sm_80 by
`python -m kernels.compile_check`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fused_logprob import KernelLaunch, _dz_tile, _fold_tile, _softcap_arg, _tanh
from kernels.softmax_stats import NUM_STATS


@dataclass(frozen=True)
class RowTiles:
    """Block sizes of the two row kernels (memory-bound: wide column blocks, few rows per program)."""

    stats_rows: int = 4
    """Rows per program of the statistics kernel (each program sweeps all its rows' columns)."""
    stats_cols: int = 1024
    """Columns per step of the statistics kernel."""
    dz_rows: int = 8
    dz_cols: int = 512
    num_warps: int = 4


INTERPRETER_ROW_TILES = RowTiles(stats_rows=4, stats_cols=64, dz_rows=4, dz_cols=64, num_warps=4)
"""Under the interpreter: several blocks on test shapes, few numpy steps."""


def default_row_tiles(device: torch.device, dtype: torch.dtype | None = None,
                      hidden_size: int | None = None) -> RowTiles:
    """On CUDA the measured row tiles of this device, dtype and H (kernels/tuned_tiles.py) where a table has them,
    else `RowTiles()`; `INTERPRETER_ROW_TILES` elsewhere."""
    if device.type != "cuda":
        return INTERPRETER_ROW_TILES
    if dtype is not None and hidden_size is not None:
        from kernels.tuned_tiles import device_lookup

        tuned = device_lookup("onepass_rows", device, dtype, hidden_size)
        if tuned is not None:
            return tuned
    return RowTiles()


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _workspace_stats_kernel(z_ptr, ids_ptr, stats_ptr, num_rows, num_cols, stride_z, inv_temperature, softcap,
                            HAS_SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Temper (and cap) BLOCK_R rows of raw logits in place; write their state to stats[:, rows] (4, num_rows)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    row_mask = rows < num_rows
    ids = tl.load(ids_ptr + rows, mask=row_mask, other=-1)
    # NOTE: a finite start for m keeps alpha = 0 and (m - m_new) * s = 0 on the first block (no -inf * 0).
    m = tl.full((BLOCK_R,), -1.0e30, dtype=tl.float32)
    s = tl.zeros((BLOCK_R,), dtype=tl.float32)
    q = tl.zeros((BLOCK_R,), dtype=tl.float32)
    t = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, num_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
        col_mask = (cols < num_cols)[None, :]
        ptrs = z_ptr + rows[:, None] * stride_z + cols[None, :]
        raw = tl.load(ptrs, mask=row_mask[:, None] & col_mask, other=0.0)
        if HAS_SOFTCAP:
            z = _tanh(raw * (1.0 / softcap)) * (softcap * inv_temperature)
        else:
            z = raw * inv_temperature
        tl.store(ptrs, z, mask=row_mask[:, None] & col_mask)
        m, s, q, t = _fold_tile(z, cols, col_mask, ids, m, s, q, t)
    tl.store(stats_ptr + rows, m, mask=row_mask)
    tl.store(stats_ptr + num_rows + rows, s, mask=row_mask)
    tl.store(stats_ptr + 2 * num_rows + rows, q, mask=row_mask)
    tl.store(stats_ptr + 3 * num_rows + rows, t, mask=row_mask)


@triton.jit
def _workspace_dz_kernel(z_ptr, dz_ptr, ids_ptr, lse_ptr, mean_ptr, grad_lp_ptr, grad_ent_ptr, num_rows, num_cols,
                         stride_z, stride_dz, inv_temperature, softcap, HAS_ENTROPY_GRAD: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dz of one (BLOCK_R, BLOCK_C) block of tempered logits; dz may alias z (each element read, then written, by
    the same program)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols < num_cols)[None, :]
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0)
    dz = _dz_tile(z, rows, cols, row_mask, ids_ptr, lse_ptr, mean_ptr, grad_lp_ptr, grad_ent_ptr, inv_temperature,
                  softcap, HAS_ENTROPY_GRAD, HAS_SOFTCAP)
    tl.store(dz_ptr + rows[:, None] * stride_dz + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


def check_workspace(z: torch.Tensor) -> None:
    """The workspace the row kernels read: float32, unit column stride, on CUDA or under the interpreter."""
    if not z.is_cuda and z.device.type != "meta" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the one-pass Triton row kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
                           "triton is imported); use implementation='torch_chunked' on the CPU")
    if z.dtype != torch.float32 or z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"need a float32 (rows, cols) workspace with unit column stride; got {z.dtype} "
                         f"{tuple(z.shape)} strides {z.stride()}")


def build_workspace_stats_launch(z: torch.Tensor, local_ids: torch.Tensor, inv_temperature: float,
                                 softcap: float | None, tiles: RowTiles) -> tuple[KernelLaunch, torch.Tensor]:
    """The statistics launch over the raw logits z (rows, cols) float32 and its (4, rows) float32 output."""
    check_workspace(z)
    num_rows, num_cols = z.shape
    stats = torch.empty(NUM_STATS, num_rows, dtype=torch.float32, device=z.device)
    launch = KernelLaunch(
        kernel=_workspace_stats_kernel, grid=(triton.cdiv(num_rows, tiles.stats_rows),),
        args=(z, local_ids, stats, num_rows, num_cols, z.stride(0), inv_temperature, _softcap_arg(softcap)),
        options=dict(HAS_SOFTCAP=softcap is not None, BLOCK_R=tiles.stats_rows, BLOCK_C=tiles.stats_cols,
                     num_warps=tiles.num_warps))
    return launch, stats


def build_workspace_dz_launch(z: torch.Tensor, dz: torch.Tensor, local_ids: torch.Tensor, lse: torch.Tensor,
                              mean_logit: torch.Tensor, grad_logprobs: torch.Tensor,
                              grad_entropy: torch.Tensor | None, inv_temperature: float, softcap: float | None,
                              tiles: RowTiles) -> KernelLaunch:
    """The dz launch: tempered logits z (rows, cols) float32 -> dz (rows, cols) (float32: may be z itself)."""
    check_workspace(z)
    num_rows, num_cols = z.shape
    if dz.shape != z.shape or dz.stride(1) != 1:
        raise ValueError(f"dz {tuple(dz.shape)} must match z {tuple(z.shape)} with unit column stride")
    return KernelLaunch(
        kernel=_workspace_dz_kernel,
        grid=(triton.cdiv(num_rows, tiles.dz_rows), triton.cdiv(num_cols, tiles.dz_cols)),
        args=(z, dz, local_ids, lse, mean_logit, grad_logprobs, grad_logprobs if grad_entropy is None else grad_entropy,
              num_rows, num_cols, z.stride(0), dz.stride(0), inv_temperature, _softcap_arg(softcap)),
        options=dict(HAS_ENTROPY_GRAD=grad_entropy is not None, HAS_SOFTCAP=softcap is not None,
                     BLOCK_R=tiles.dz_rows, BLOCK_C=tiles.dz_cols, num_warps=tiles.num_warps), report_arg=1)
