"""Fused rotary position embedding in Triton, Megatron's layout: t (s, b, heads, head_dim) rotated by freqs
(s, 1 or b, 1, rot_dim), forward and backward.

Owns: the kernel (one program per token: every head of it, the cos / sin row loaded once), its launch builder
(`build_rope_launch`: what kernels/compile_check.py compiles) and `apply_rope` (the autograd function).

What it computes is Megatron's unfused `_apply_rotary_pos_emb_bshd` (megatron-core 0.16.1 rope_utils), for the
variants the families use: the first `rot_dim` channels of each head are rotated, the rest pass through (partial
RoPE, GLM-4.5's `rotary_percent`); pairs are (i, i + rot_dim / 2) ("rotate half", Llama / Qwen) or (2i, 2i + 1)
(`interleaved`, Cohere 2). out = t * cos + rotate(t) * sin, cos / sin rounded to t's dtype first (as Megatron),
the rest in float32, rounded once. The backward is the transposed rotation, the same kernel (BACKWARD constexpr).

Must not: import engine/ (torch and Triton only).

Test: tests/kernels/test_layer_kernels.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_logprob import KernelLaunch
from kernels.rms_norm import check_operands


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, batch, n_heads, head_dim, rot_dim, cs_stride_s, cs_stride_b,
                 INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    s = token // batch
    b = token % batch
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    half = rot_dim // 2
    if INTERLEAVED:
        partner = cols + 1 - 2 * (cols % 2)
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    rotated = cols < rot_dim
    in_head = (heads < n_heads) & (cols < head_dim)
    base = token * n_heads * head_dim + heads * head_dim
    x = tl.load(x_ptr + base + cols, mask=in_head, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + base + partner, mask=in_head & rotated, other=0.0).to(tl.float32)
    cs_base = s * cs_stride_s + b * cs_stride_b
    c = tl.load(cos_ptr + cs_base + cols, mask=rotated, other=1.0).to(tl.float32)
    if BACKWARD:
        sn = tl.load(sin_ptr + cs_base + partner, mask=rotated, other=0.0).to(tl.float32)
        sign = -sign
    else:
        sn = tl.load(sin_ptr + cs_base + cols, mask=rotated, other=0.0).to(tl.float32)
    y = tl.where(rotated, x * c + sign * xp * sn, x)
    tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=in_head)


def build_rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool
                      ) -> tuple[KernelLaunch, torch.Tensor]:
    """(launch, y) for a contiguous (s, b, heads, head_dim) x and (s, 1 or b, rot_dim) cos / sin with a contiguous
    last dim (tensors may be on "meta")."""
    seq, batch, n_heads, head_dim = x.shape
    rot_dim = cos.shape[-1]
    y = torch.empty_like(x)
    block_heads, block_d = triton.next_power_of_2(n_heads), triton.next_power_of_2(head_dim)
    launch = KernelLaunch(kernel=_rope_kernel, grid=(seq * batch,),
                          args=(x, cos, sin, y, batch, n_heads, head_dim, rot_dim, cos.stride(0),
                                cos.stride(1) if cos.shape[1] > 1 else 0),
                          options=dict(INTERLEAVED=interleaved, BACKWARD=backward, BLOCK_HEADS=block_heads,
                                       BLOCK_D=block_d, num_warps=4 if block_heads * block_d <= 4096 else 8))
    return launch, y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        launch, y = build_rope_launch(x.contiguous(), cos, sin, interleaved, False)
        launch.run()
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return y

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        launch, dx = build_rope_launch(dy.contiguous(), cos, sin, ctx.interleaved, True)
        launch.run()
        return dx, None, None, None


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """t (s, b, heads, head_dim) rotated by freqs (s, 1 or b, 1, rot_dim), rot_dim even and <= head_dim; the result
    is contiguous, in t's dtype."""
    check_operands(t)
    seq, batch, _, head_dim = t.shape
    rot_dim = freqs.shape[-1]
    if freqs.dim() != 4 or freqs.shape[0] != seq or freqs.shape[1] not in (1, batch) or rot_dim % 2 or \
            rot_dim > head_dim:
        raise ValueError(f"RoPE: freqs {tuple(freqs.shape)} do not fit t {tuple(t.shape)} (s, 1 or b, 1, even "
                         "rot_dim <= head_dim)")
    freqs = freqs[:, :, 0, :]
    cos, sin = torch.cos(freqs).to(t.dtype).contiguous(), torch.sin(freqs).to(t.dtype).contiguous()
    return _Rope.apply(t, cos, sin, interleaved)
