"""kernels/rms_norm.py, kernels/glu.py, kernels/rope.py (Triton interpreter) against the unfused torch path:
forward and gradients, float32 and bfloat16, the variants the families use (Gemma's (1 + w) norm, GeGLU, partial and
interleaved RoPE)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.glu import gated_activation
from kernels.rms_norm import rms_norm
from kernels.rope import apply_rope

DTYPES = (torch.float32, torch.bfloat16)


def _tol(dtype):
    """float32: reduction order only; bfloat16: one rounding of the output (the unfused path rounds more often)."""
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)


def _grads(fn, *inputs, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(dy)
    return out.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_equals_torch(dtype, offset):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=gen).to(dtype)  # H = 48: not a power of two (masked columns)
    w = (0.1 * torch.randn(48, generator=gen) + (0.0 if offset else 1.0)).to(dtype)
    dy = torch.randn(3, 5, 48, generator=gen).to(dtype)

    def plain(x, w):  # torch.nn.RMSNorm (offset 0) / HF's Gemma RMSNorm (offset 1): float32, rounded once
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + w.float())).to(x.dtype)

    out, (dx, dw) = _grads(lambda x, w: rms_norm(x, w, 1e-6, offset), x, w, dy=dy)
    ref, (rdx, rdw) = _grads(plain, x, w, dy=dy)
    assert out.dtype == dtype and dw.dtype == dtype
    torch.testing.assert_close(out, ref, **_tol(dtype))
    torch.testing.assert_close(dx, rdx, **_tol(dtype))
    torch.testing.assert_close(dw, rdw, **_tol(dtype))
    if offset == 0.0:
        norm = torch.nn.RMSNorm(48, eps=1e-6).to(dtype)
        norm.weight.data.copy_(w)
        torch.testing.assert_close(out, norm(x), **_tol(dtype))


@pytest.mark.parametrize("programs", [4, 2])
def test_rms_norm_backward_sums_weight_grads_over_many_programs(programs):
    """Each backward program sums the dw of whole blocks of 16 rows (H = 16), the last program's block partial: 37
    rows are 3 blocks, so at most 2 programs run 2 blocks and 1 partial block, and at most 4 run 3 programs of one
    block (as the forward's 3 programs do)."""
    from kernels import rms_norm as module

    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(37, 16, generator=gen), torch.randn(37, 16, generator=gen)
    w = torch.randn(16, generator=gen)
    saved = module.BWD_PROGRAMS
    module.BWD_PROGRAMS = programs
    try:
        _, (dx, dw) = _grads(lambda x, w: rms_norm(x, w, 1e-5), x, w, dy=dy)
    finally:
        module.BWD_PROGRAMS = saved
    assert module._block_and_warps(16)[0] == 16
    # fewer blocks than BWD_PROGRAMS: one program per block, none of them all masked rows
    assert module.build_rms_norm_bwd_launch(dy, x, w, torch.ones(37), 0.0)[0].grid == (3,)
    _, (rdx, rdw) = _grads(lambda x, w: F.rms_norm(x, (16,), w, 1e-5), x, w, dy=dy)
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-5)


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation,act", [("silu", F.silu), ("gelu_tanh", _gelu_tanh)])
def test_gated_activation_equals_megatron_glu(dtype, activation, act):
    gen = torch.Generator().manual_seed(2)
    x = (2 * torch.randn(2, 3, 2 * 40, generator=gen)).to(dtype)  # F = 40: masked columns
    dy = torch.randn(2, 3, 40, generator=gen).to(dtype)

    def plain(x):  # Megatron's MLP glu: chunk, act(gate) * up
        gate, up = torch.chunk(x, 2, dim=-1)
        return act(gate) * up

    out, (dx,) = _grads(lambda x: gated_activation(x, activation), x, dy=dy)
    ref, (rdx,) = _grads(plain, x, dy=dy)
    ref32, (rdx32,) = _grads(plain, x.float(), dy=dy.float())
    torch.testing.assert_close(out, ref, **_tol(dtype))
    torch.testing.assert_close(dx, rdx, **_tol(dtype))
    # The fused result is the float32 one rounded once: within one bfloat16 step of it (the interpreter's float32 ->
    # bfloat16 conversion truncates; a GPU's rounds to nearest, half a step).
    rtol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref32, rtol=rtol, atol=1e-5)
    torch.testing.assert_close(dx.float(), rdx32, rtol=rtol, atol=1e-5)


def _megatron_rope(t, freqs, interleaved):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved,rot_dim,freq_batch", [(False, 16, 1), (True, 16, 1), (False, 8, 1),
                                                            (False, 16, 2)])
def test_rope_equals_megatron_unfused(dtype, interleaved, rot_dim, freq_batch):
    """Full, interleaved (Cohere 2), partial (GLM-4.5's half) RoPE, and per-row freqs (b > 1)."""
    gen = torch.Generator().manual_seed(3)
    seq, batch, heads, head_dim = 6, 2, 3, 16
    t = torch.randn(seq, batch, heads, head_dim, generator=gen).to(dtype)
    dy = torch.randn(seq, batch, heads, head_dim, generator=gen).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    pos = torch.arange(seq).float()[:, None, None] + 3.0 * torch.arange(freq_batch).float()[None, :, None]
    f = pos * inv  # (s, fb, rot_dim / 2)
    freqs = (torch.stack([f, f], -1).flatten(-2) if interleaved else torch.cat([f, f], -1))[:, :, None, :]
    out, (dx,) = _grads(lambda t: apply_rope(t, freqs, interleaved), t, dy=dy)
    ref, (rdx,) = _grads(lambda t: _megatron_rope(t, freqs, interleaved), t, dy=dy)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    torch.testing.assert_close(dx, rdx, **_tol(dtype))
    if rot_dim < head_dim:
        assert torch.equal(out[..., rot_dim:], t[..., rot_dim:])


def test_rope_refuses_freqs_that_do_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        apply_rope(torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 10))
