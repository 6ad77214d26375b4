"""kernels/fused_logprob.py: the Triton kernels (interpreter on CPU, real on a GPU) against the float64 reference.

Tolerances: the kernels compute in float32; at |logits| <= 50 / T the fp32 rounding of one logit is about
|z| * 2^-24 * sqrt(H) ~ 3e-5, so log-probs, entropies and gradients are compared at atol 2e-4, rtol 1e-4.
bfloat16 inputs are compared with the reference on the same rounded inputs (fp32 accumulation, dz rounded to bf16
for the gradient GEMMs: rtol 2e-2 on gradients).
"""

from __future__ import annotations

import pytest
import torch

from kernels.chunked_logprob import torch_tile_dz
from kernels.fused_logprob import TritonTiles, triton_tile_dz
from kernels.lm_head_logprob import triton_logprob_entropy
from kernels.reference import build_lm_head_problem, reference_logprob_entropy

F64 = torch.float64
N, H, V_ROWS = 64, 48, 300
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    "peaked_abs50_padded_t0.7": (dict(vocab_size=290, max_abs_logit=50.0, sampled_fraction=0.5), 0.7),
    "flat_t1": (dict(vocab_size=300, logit_std=0.01), 1.0),
    "moderate_padded_t1.6": (dict(vocab_size=257, logit_std=4.0, sampled_fraction=0.25), 1.6),
}
# Default interpreter tiles (32 x 64 x 32, one split), and small tiles with 16-wide K steps (H = 48: 3 steps),
# 16-row blocks and several 64-column vocabulary splits in the forward (300 = 4 * 64 + 44: a ragged last tile).
TILES = {
    "default": None,
    "small_split": TritonTiles(block_n=16, block_v=32, block_h=16, group_n=3, num_warps=4, num_stages=1,
                               split_cols=64),
}
TOL = dict(rtol=1e-4, atol=2e-4)
WORKSPACE_MB = 128.0
"""Where a test does not choose the slabs: one backward slab holds the whole (64 x 300) problem."""


def _case(name: str):
    kwargs, temperature = CASES[name]
    x, w, y = build_lm_head_problem(N, H, V_ROWS, dtype=F64, seed=list(CASES).index(name), **kwargs)
    return x, w, y, kwargs["vocab_size"], temperature


def _upstream(n: int):
    gen = torch.Generator().manual_seed(7)
    return torch.randn(n, generator=gen, dtype=F64), torch.randn(n, generator=gen, dtype=F64)


def _run(fn, x, w, y, g_lp, g_ent, **kwargs):
    """(logprobs, entropy, dX, dW) in float64 on the CPU for loss = sum(g_lp * lp) + sum(g_ent * ent)."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    lp, ent = fn(x, w, y, **kwargs)
    ((lp * g_lp.to(lp)).sum() + (ent * g_ent.to(ent)).sum()).backward()
    return tuple(t.detach().to("cpu", F64) for t in (lp, ent, x.grad, w.grad))


def _to_device(dtype, *tensors):
    return tuple(t.to(DEVICE, dtype) if t.is_floating_point() else t.to(DEVICE) for t in tensors)


@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference_forward_and_gradients(case, tiles):
    x, w, y, vocab_size, temperature = _case(case)
    g_lp, g_ent = _upstream(N)
    common = dict(temperature=temperature, vocab_size=vocab_size)
    got = _run(triton_logprob_entropy, *_to_device(torch.float32, x, w, y), g_lp, g_ent, tiles=TILES[tiles],
               workspace_mb=16 * 128 * 4 / 2**20, **common)  # fp32 dz slabs of 16 x 128 in the backward
    want = _run(reference_logprob_entropy, x, w, y, g_lp, g_ent, **common)
    for name, a, b in zip(("logprobs", "entropy", "dX", "dW"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.count_nonzero(got[3][vocab_size:]) == 0


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("with_entropy_grad", [True, False])
def test_triton_dz_tile_matches_torch_dz_tile(with_entropy_grad, softcap):
    x, w, y, vocab_size, temperature = _case("moderate_padded_t1.6")
    x, w = x.float(), w.float()
    logits = x.double() @ w[:vocab_size].double().T  # (N, vocab_size)
    logits = (logits if softcap is None else softcap * torch.tanh(logits / softcap)) / temperature
    lse = torch.logsumexp(logits, -1).float()
    mean = (torch.softmax(logits, -1) * logits).sum(-1).float()
    g_lp, g_ent = (g.float() for g in _upstream(N))
    rows, c0, c1 = slice(5, 50), 70, 250  # an interior slab: ids below, inside and above its columns
    args = (x[rows], w[c0:c1], y[rows] - c0, lse[rows], mean[rows], g_lp[rows],
            g_ent[rows] if with_entropy_grad else None)
    got = triton_tile_dz(*(None if a is None else a.to(DEVICE) for a in args), 1.0 / temperature, softcap).cpu()
    want = torch_tile_dz(*args, 1.0 / temperature, softcap)
    assert got.shape == (45, 180)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_triton_two_passes_are_bitwise_equal_forward_and_backward():
    x, w, y, vocab_size, temperature = _case("peaked_abs50_padded_t0.7")
    g_lp, g_ent = _upstream(N)
    kwargs = dict(temperature=temperature, vocab_size=vocab_size, tiles=TILES["small_split"], workspace_mb=WORKSPACE_MB)
    first = _run(triton_logprob_entropy, *_to_device(torch.float32, x, w, y), g_lp, g_ent, **kwargs)
    second = _run(triton_logprob_entropy, *_to_device(torch.float32, x, w, y), g_lp, g_ent, **kwargs)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_triton_bfloat16_matches_reference_on_the_same_rounded_inputs():
    x, w, y, vocab_size, temperature = _case("moderate_padded_t1.6")
    xb, wb = x.bfloat16(), w.bfloat16()
    g_lp, g_ent = _upstream(N)
    got = _run(triton_logprob_entropy, *_to_device(torch.bfloat16, xb, wb, y), g_lp, g_ent,
               temperature=temperature, vocab_size=vocab_size, workspace_mb=WORKSPACE_MB)
    want = _run(reference_logprob_entropy, xb.double(), wb.double(), y, g_lp, g_ent, temperature=temperature,
                vocab_size=vocab_size)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)
    for a, b in zip(got[2:], want[2:]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_triton_no_grad_mode_returns_the_same_values_and_keeps_no_graph():
    x, w, y, vocab_size, temperature = _case("flat_t1")
    x, w, y = _to_device(torch.float32, x, w, y)
    x.requires_grad_(True)
    kwargs = dict(temperature=temperature, vocab_size=vocab_size, workspace_mb=WORKSPACE_MB)
    lp, ent = triton_logprob_entropy(x, w, y, **kwargs)
    with torch.no_grad():
        lp_ng, ent_ng = triton_logprob_entropy(x, w, y, **kwargs)
    assert lp.grad_fn is not None and lp_ng.grad_fn is None
    assert torch.equal(lp.detach(), lp_ng) and torch.equal(ent.detach(), ent_ng)


def test_triton_refuses_float64_and_points_to_the_chunked_path():
    x, w, y, _, _ = _case("flat_t1")
    with pytest.raises(TypeError, match="torch_chunked"):
        triton_logprob_entropy(*_to_device(F64, x, w, y), workspace_mb=WORKSPACE_MB)



def test_triton_ids_outside_the_real_vocab_give_nan_not_a_wrong_value():
    x, w, y, vocab_size, _ = _case("peaked_abs50_padded_t0.7")
    y = y.clone()
    y[:2] = torch.tensor([vocab_size, -1])  # a padding row id (inside the padded shard) and a negative id
    lp, ent = triton_logprob_entropy(*_to_device(torch.float32, x, w, y), vocab_size=vocab_size,
                                     workspace_mb=WORKSPACE_MB)
    assert lp[:2].isnan().all() and not lp[2:].isnan().any() and not ent.isnan().any()
