"""Fused RMSNorm in Triton: y = x * rsqrt(mean(x^2) + eps) * (w + offset), forward and backward.

Owns: the forward kernel (one program per row: the row's rstd in float32 and the output), the backward kernel
(programs over row blocks: dx per row, and a float32 partial dw per program summed afterwards in a fixed order),
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
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, x_stride, y_stride, eps, offset,
                         BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    valid = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=valid, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32) + offset
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * y_stride + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols, rows_per_program,
                         dy_stride, x_stride, dx_stride, offset, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    valid = cols < n_cols
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    first = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = (first + i).to(tl.int64)
        if row < n_rows:
            x = tl.load(x_ptr + row * x_stride + cols, mask=valid, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * dy_stride + cols, mask=valid, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            xhat = x * rstd
            dxhat = dy * w
            dot = tl.sum(dxhat * xhat, axis=0) / n_cols
            tl.store(dx_ptr + row * dx_stride + cols, (rstd * (dxhat - xhat * dot)).to(dx_ptr.dtype.element_ty),
                     mask=valid)
            dw += dy * xhat
    tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=valid)


def _block_and_warps(n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    return block, 4 if block <= 1024 else 8 if block <= 4096 else 16


def build_rms_norm_fwd_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
                              ) -> tuple[KernelLaunch, torch.Tensor, torch.Tensor]:
    """(launch, y, rstd) of the forward on a (N, H) tensor with a contiguous last dim (tensors may be on "meta")."""
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block, warps = _block_and_warps(n_cols)
    launch = KernelLaunch(kernel=_rms_norm_fwd_kernel, grid=(n_rows,),
                          args=(x, weight, y, rstd, n_cols, x.stride(0), y.stride(0), float(eps), float(offset)),
                          options=dict(BLOCK_H=block, num_warps=warps))
    return launch, y, rstd


def build_rms_norm_bwd_launch(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                              offset: float) -> tuple[KernelLaunch, torch.Tensor, torch.Tensor]:
    """(launch, dx, dw_partial) of the backward; dw = dw_partial.sum(0) (float32, one row per program)."""
    n_rows, n_cols = x.shape
    programs = max(1, min(BWD_PROGRAMS, n_rows))
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    dx = torch.empty_like(x)
    dw_part = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    block, warps = _block_and_warps(n_cols)
    launch = KernelLaunch(kernel=_rms_norm_bwd_kernel, grid=(programs,),
                          args=(dy, x, weight, rstd, dx, dw_part, n_rows, n_cols, rows_per_program, dy.stride(0),
                                x.stride(0), dx.stride(0), float(offset)),
                          options=dict(BLOCK_H=block, num_warps=warps))
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
