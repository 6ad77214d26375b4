"""Fused gated activations in Triton: out = act(gate) * up, forward and backward, act = SiLU (SwiGLU) or tanh-GELU
(GeGLU, Gemma's `gelu_pytorch_tanh`).

Owns: the forward and backward kernels over a (N, 2F) input whose first F columns are the gate and last F the up
projection (Megatron's fused fc1 output, per TP rank), their launch builders (`build_glu_fwd_launch`,
`build_glu_bwd_launch`: what kernels/compile_check.py compiles), `ACTIVATIONS` and `gated_activation` (the autograd
function).

Why: the unfused path runs act, the product and their backward as separate element-wise passes over (N, F) and keeps
act's output for the backward; here each direction is one pass and only the (N, 2F) input is kept.

Numbers: float32 inside, rounded once to the input's dtype (the unfused bf16 path rounds act(gate) before the
product: results may differ by one bf16 rounding).

Must not: import engine/ (torch and Triton only).

Test: tests/kernels/test_layer_kernels.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_logprob import KernelLaunch
from kernels.rms_norm import check_operands

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
"""The gate activations, by name, and the kernels' ACT constexpr."""
BLOCK_F = 1024
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in float32."""
    if ACT == 0:
        s = tl.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    else:
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        grad = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * g * g)
        return 0.5 * g * (1.0 + t), grad


@triton.jit
def _glu_fwd_kernel(x_ptr, y_ptr, n_cols, x_stride, y_stride, ACT: tl.constexpr, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    valid = cols < n_cols
    g = tl.load(x_ptr + row * x_stride + cols, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=valid, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(y_ptr + row * y_stride + cols, (a * u).to(y_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _glu_bwd_kernel(dy_ptr, x_ptr, dx_ptr, n_cols, dy_stride, x_stride, dx_stride, ACT: tl.constexpr,
                    BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    valid = cols < n_cols
    g = tl.load(x_ptr + row * x_stride + cols, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=valid, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * dy_stride + cols, mask=valid, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT)
    out_ty = dx_ptr.dtype.element_ty
    tl.store(dx_ptr + row * dx_stride + cols, (dy * u * da).to(out_ty), mask=valid)
    tl.store(dx_ptr + row * dx_stride + n_cols + cols, (dy * a).to(out_ty), mask=valid)


def _grid(n_rows: int, n_cols: int, block: int) -> tuple[int, int]:
    return n_rows, triton.cdiv(n_cols, block)


def build_glu_fwd_launch(x: torch.Tensor, activation: str) -> tuple[KernelLaunch, torch.Tensor]:
    """(launch, y) of the forward on a (N, 2F) tensor with a contiguous last dim (tensors may be on "meta")."""
    n_rows, n_cols = x.shape[0], x.shape[1] // 2
    y = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    block = min(BLOCK_F, triton.next_power_of_2(n_cols))
    launch = KernelLaunch(kernel=_glu_fwd_kernel, grid=_grid(n_rows, n_cols, block),
                          args=(x, y, n_cols, x.stride(0), y.stride(0)),
                          options=dict(ACT=ACTIVATIONS[activation], BLOCK_F=block, num_warps=4))
    return launch, y


def build_glu_bwd_launch(dy: torch.Tensor, x: torch.Tensor, activation: str) -> tuple[KernelLaunch, torch.Tensor]:
    """(launch, dx) of the backward: dx = [dy * up * act'(gate), dy * act(gate)], (N, 2F) in x's dtype."""
    n_rows, n_cols = dy.shape
    dx = torch.empty_like(x)
    block = min(BLOCK_F, triton.next_power_of_2(n_cols))
    launch = KernelLaunch(kernel=_glu_bwd_kernel, grid=_grid(n_rows, n_cols, block),
                          args=(dy, x, dx, n_cols, dy.stride(0), x.stride(0), dx.stride(0)),
                          options=dict(ACT=ACTIVATIONS[activation], BLOCK_F=block, num_warps=4))
    return launch, dx


class _GatedActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, activation):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        launch, y = build_glu_fwd_launch(x2, activation)
        launch.run()
        ctx.save_for_backward(x2)
        ctx.activation = activation
        return y.view(*shape[:-1], shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        launch, dx = build_glu_bwd_launch(dy.reshape(-1, dy.shape[-1]).contiguous(), x2, ctx.activation)
        launch.run()
        return dx.view(*dy.shape[:-1], x2.shape[-1]), None


def gated_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(x[..., :F]) * x[..., F:] for x (..., 2F); activation in `ACTIVATIONS`."""
    check_operands(x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated activation {activation!r}: one of {sorted(ACTIVATIONS)}")
    if x.shape[-1] % 2:
        raise ValueError(f"a gated activation needs an even last dim (gate and up halves), got {x.shape[-1]}")
    return _GatedActivation.apply(x, activation)
