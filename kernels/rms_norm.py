"""Fused RMSNorm in Triton: y = x * rsqrt(mean(x^2) + eps) * (w + offset), forward and backward.

Owns: the forward kernel (one program per block of rows, `_block_and_warps`: each row's rstd in float32 and the
output), the backward kernel (programs over row ranges, a block of rows at a time: dx per row, and a float32 partial dw
per program summed afterwards in a fixed order),
their launch builders (`build_rms_norm_fwd_launch`, `build_rms_norm_bwd_launch`: what kernels/compile_check.py
compiles) and `rms_norm` (the autograd function).

Numbers: everything is computed in float32 and rounded once to x's dtype, as `torch.nn.RMSNorm` (offset 0: Llama /
Qwen norms) and HF's Gemma RMSNorm (offset 1: the (1 + w) weight) do. Only the order of the row sum differs.

Must not: import engine/ (torch and Triton only), or run on CPU tensors without TRITON_INTERPRET=1.

Test: tests/kernels/test_layer_kernels.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fused_logprob import KernelLaunch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BWD_PROGRAMS = 512
"""Upper bound on the backward's programs (each sums its rows' dw into one float32 row of the partial buffer)."""


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, x_stride, y_stride, eps, offset,
                         BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    valid = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols, rows_per_program,
                         dy_stride, x_stride, dx_stride, offset, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    first = pid * rows_per_program
    for i in range(0, rows_per_program, BLOCK_M):
        block = i + tl.arange(0, BLOCK_M)
        rows = (first + block).to(tl.int64)
        row_ok = (rows < n_rows) & (block < rows_per_program)
        valid = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=valid, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_stride + cols[None, :], mask=valid, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        dxhat = dy * w[None, :]
        dot = tl.sum(dxhat * xhat, axis=1) / n_cols
        dx = rstd[:, None] * (dxhat - xhat * dot[:, None])
        tl.store(dx_ptr + rows[:, None] * dx_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=valid)
        dw += dy * xhat
    tl.store(dw_part_ptr + pid * n_cols + cols, tl.sum(dw, axis=0), mask=col_ok)


ROW_BLOCK_ELEMENTS = 1024
"""Rows per program: as many as fit `ROW_BLOCK_ELEMENTS` columns (at most 16), one for H >= 1024. A per-head q/k norm
(H = head_dim, rows = tokens x heads) runs 8 rows of 128 per program instead of one program per 128 elements."""


def _block_and_warps(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_H columns, warps) of a program."""
    block = triton.next_power_of_2(n_cols)
    return max(1, min(16, ROW_BLOCK_ELEMENTS // block)), block, 4 if block <= 1024 else 8 if block <= 4096 else 16


def build_rms_norm_fwd_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
                              ) -> tuple[KernelLaunch, torch.Tensor, torch.Tensor]:
    """(launch, y, rstd) of the forward on a (N, H) tensor with a contiguous last dim (tensors may be on "meta")."""
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rows, block, warps = _block_and_warps(n_cols)
    launch = KernelLaunch(kernel=_rms_norm_fwd_kernel, grid=(triton.cdiv(n_rows, rows),),
                          args=(x, weight, y, rstd, n_rows, n_cols, x.stride(0), y.stride(0), float(eps),
                                float(offset)),
                          options=dict(BLOCK_M=rows, BLOCK_H=block, num_warps=warps))
    return launch, y, rstd


def build_rms_norm_bwd_launch(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                              offset: float) -> tuple[KernelLaunch, torch.Tensor, torch.Tensor]:
    """(launch, dx, dw_partial) of the backward; dw = dw_partial.sum(0) (float32, one row per program)."""
    n_rows, n_cols = x.shape
    rows, block, warps = _block_and_warps(n_cols)
    # Whole row blocks per program, so that no program runs a block of masked rows: at most BWD_PROGRAMS programs,
    # and fewer when there are fewer blocks than that.
    blocks = max(1, triton.cdiv(n_rows, rows))
    rows_per_program = rows * triton.cdiv(blocks, BWD_PROGRAMS)
    programs = max(1, triton.cdiv(n_rows, rows_per_program))
    dx = torch.empty_like(x)
    dw_part = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    launch = KernelLaunch(kernel=_rms_norm_bwd_kernel, grid=(programs,),
                          args=(dy, x, weight, rstd, dx, dw_part, n_rows, n_cols, rows_per_program, dy.stride(0),
                                x.stride(0), dx.stride(0), float(offset)),
                          options=dict(BLOCK_M=rows, BLOCK_H=block, num_warps=warps))
    return launch, dx, dw_part


def check_operands(*tensors: torch.Tensor) -> None:
    """Device and dtype the kernels need (shared by kernels/glu.py and kernels/rope.py)."""
    for t in tensors:
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the Triton layer kernels need CUDA tensors (or TRITON_INTERPRET=1 set before triton "
                               "is imported)")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"the Triton layer kernels support {SUPPORTED_DTYPES}, got {t.dtype}")


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        launch, y, rstd = build_rms_norm_fwd_launch(x2, weight.contiguous(), eps, offset)
        launch.run()
        ctx.save_for_backward(x2, weight, rstd)
        ctx.offset = offset
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dy2 = dy.reshape(-1, x2.shape[-1]).contiguous()
        launch, dx, dw_part = build_rms_norm_bwd_launch(dy2, x2, weight.contiguous(), rstd, ctx.offset)
        launch.run()
        return dx.view(dy.shape), dw_part.sum(0).to(weight.dtype), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape) with weight (H,): x * rsqrt(mean(x^2) + eps) * (w + offset),
    in float32, rounded once to x's dtype. The weight gradient comes back in the weight's dtype."""
    check_operands(x, weight)
    return _RMSNorm.apply(x, weight, eps, offset)
