"""kernels/onepass_logprob.py: the one-pass loss gradient equals autograd through the materialised reference and the
two-pass kernel, for every implementation (cublas_triton and triton_fused under the interpreter on CPU), fp32 / bf16 / fp64, odd
shapes, padded vocabulary, temperature and soft-cap, several row chunks; the backward only scales; bitwise
deterministic."""

from __future__ import annotations

import pytest
import torch

from kernels import lm_head_logprob_entropy
from kernels.onepass_logprob import (
    ONEPASS_IMPLEMENTATIONS,
    onepass_logprob_entropy,
    plan_chunk_rows,
    resolve_onepass_implementation,
    workspace_bytes_per_element,
)
from kernels.reference import build_lm_head_problem, reference_logprob_entropy

F64 = torch.float64
N, H, V_ROWS, VOCAB = 37, 24, 203, 197  # odd shapes; the last 6 rows are Megatron padding
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""cublas_triton runs on CUDA tensors (or the interpreter on CPU, tests/conftest.py); the references on the CPU."""


def _loss_inputs(n: int, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    return dict(adv=torch.randn(n, generator=gen, dtype=F64), old=-torch.rand(n, generator=gen, dtype=F64) * 4,
                ent_w=torch.rand(n, generator=gen, dtype=F64) * 0.1)


def _token_loss(lp, ent, inputs, rows=slice(None)):
    """A token-local, non-linear loss per token: clipped-ratio surrogate minus an entropy bonus (torch maths)."""
    adv, old, ent_w = (inputs[k][rows].to(lp.dtype) for k in ("adv", "old", "ent_w"))
    ratio = torch.exp(lp - old)
    surrogate = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
    return surrogate - ent_w * ent


def _token_grads(inputs):
    def grads(r0, r1, lp, ent):
        lp_leaf, ent_leaf = lp.detach().requires_grad_(True), ent.detach().requires_grad_(True)
        loss = _token_loss(lp_leaf, ent_leaf, inputs, slice(r0, r1)).sum()
        return torch.autograd.grad(loss, (lp_leaf, ent_leaf))
    return grads


def _problem(dtype, seed=0):
    x, w, y = build_lm_head_problem(N, H, V_ROWS, vocab_size=VOCAB, logit_std=5.0, dtype=F64, seed=seed,
                                    sampled_fraction=0.5)
    return x.to(dtype), w.to(dtype), y


def _reference(x, w, y, inputs, temperature, softcap, scale):
    x, w = x.to(F64).clone().requires_grad_(True), w.to(F64).clone().requires_grad_(True)
    lp, ent = reference_logprob_entropy(x, w, y, temperature=temperature, softcap=softcap, vocab_size=VOCAB)
    (scale * _token_loss(lp, ent, inputs).sum()).backward()
    return lp.detach(), ent.detach(), x.grad, w.grad


def _onepass(x, w, y, inputs, implementation, temperature, softcap, scale, workspace_mb):
    device = DEVICE if implementation in TRITON_IMPLEMENTATIONS else "cpu"
    inputs = {k: v.to(device) for k, v in inputs.items()}
    x, w = x.to(device).clone().requires_grad_(True), w.to(device).clone().requires_grad_(True)
    lp, ent, anchor = onepass_logprob_entropy(x, w, y.to(device), _token_grads(inputs), workspace_mb=workspace_mb,
                                              implementation=implementation, temperature=temperature,
                                              softcap=softcap, vocab_size=VOCAB)
    assert not lp.requires_grad and not ent.requires_grad and anchor.requires_grad and anchor.item() == 0.0
    loss = _token_loss(lp, ent, inputs).sum().detach() + anchor  # the value from the detached log-probs
    (scale * loss).backward()
    return tuple(t.cpu() for t in (lp, ent, x.grad, w.grad))


SMALL_WS = 40 * V_ROWS * 16 / 2**20  # a few rows per chunk (several chunks, a short last one)
CASES = [  # (implementation, dtype, tolerance vs the float64 reference)
    ("torch_chunked", F64, 1e-10),
    ("torch_chunked", torch.float32, 2e-4),
    ("torch_chunked", torch.bfloat16, 3e-2),
    ("cublas_triton", torch.float32, 2e-4),
    ("cublas_triton", torch.bfloat16, 3e-2),
    ("triton_fused", torch.float32, 2e-4),
    ("triton_fused", torch.bfloat16, 3e-2),
]
TRITON_IMPLEMENTATIONS = ("cublas_triton", "triton_fused")


@pytest.mark.parametrize("implementation,dtype,tol", CASES)
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, 4.0)])
def test_onepass_matches_the_float64_reference_forward_and_every_gradient(implementation, dtype, tol, temperature,
                                                                          softcap):
    x, w, y = _problem(dtype)
    inputs = _loss_inputs(N)
    want = _reference(x, w, y, inputs, temperature, softcap, scale=0.37)
    got = _onepass(x, w, y, inputs, implementation, temperature, softcap, 0.37, workspace_mb=SMALL_WS / 5)
    for name, a, b in zip(("logprobs", "entropy", "dX", "dW"), got, want):
        assert a.dtype == (b.dtype if name in ("logprobs", "entropy") and dtype == F64 else a.dtype)
        torch.testing.assert_close(a.to(F64), b, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")
    assert got[2].dtype == dtype and got[3].dtype == dtype
    assert torch.count_nonzero(got[3][VOCAB:]) == 0  # padding rows get no gradient


@pytest.mark.parametrize("implementation", ["torch_chunked", *TRITON_IMPLEMENTATIONS])
def test_onepass_equals_the_two_pass_kernel(implementation):
    """Same loss, the two-pass path (forward statistics, recomputed backward) vs the one-pass path, float32."""
    dtype = torch.float32
    x, w, y = _problem(dtype, seed=3)
    inputs = _loss_inputs(N, seed=7)
    got = _onepass(x, w, y, inputs, implementation, 0.9, None, 1.0, workspace_mb=SMALL_WS)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = lm_head_logprob_entropy(xr, wr, y, workspace_mb=SMALL_WS, implementation="torch_chunked",
                                      temperature=0.9, vocab_size=VOCAB)
    _token_loss(lp, ent, inputs).sum().backward()
    two_pass = (lp.detach(), ent.detach(), xr.grad, wr.grad)
    exact = _reference(x, w, y, inputs, 0.9, None, 1.0)
    for name, a, b, ref in zip(("logprobs", "entropy", "dX", "dW"), got, two_pass, exact):
        if implementation != "triton_fused":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            continue
        # triton_fused forms the logits in its own Triton GEMM, K summed tile by tile, where the other two share
        # torch's GEMM with the two-pass path: its log-probs differ from theirs by float32 rounding of logits of
        # size ~20 (a few ulps), which the non-linear loss derivative (the ratio exp(logp - old)) carries into dz,
        # and dX / dW sum ~V such terms with cancellation. No summation order makes a Triton dot match torch's CPU
        # GEMM bit for bit, so the bound is the float64 truth: triton_fused is no further from it than the two-pass
        # path is (then the two differ by at most 2.5 times the two-pass path's own error). A real difference (a
        # lost term, a wrong scale) is orders of magnitude above float32 rounding.
        two_pass_error = (b.to(F64) - ref).abs().max().item()
        fused_error = (a.to(F64) - ref).abs().max().item()
        assert fused_error <= 1.5 * two_pass_error, f"{name}: {fused_error:.2e} from float64, two-pass {two_pass_error:.2e}"


def test_the_backward_only_scales_and_chunking_does_not_change_the_result():
    x, w, y = _problem(F64, seed=4)
    inputs = _loss_inputs(N, seed=2)
    one_chunk = _onepass(x, w, y, inputs, "torch_chunked", 1.0, None, 1.0, workspace_mb=64.0)
    chunked = _onepass(x, w, y, inputs, "torch_chunked", 1.0, None, 1.0, workspace_mb=SMALL_WS / 7)
    scaled = _onepass(x, w, y, inputs, "torch_chunked", 1.0, None, 2.5, workspace_mb=64.0)
    assert plan_chunk_rows(N, V_ROWS, int(SMALL_WS / 7 * 2**20), workspace_bytes_per_element(
        "torch_chunked", F64, None)) < N // 4  # several chunks really ran
    for a, b in zip(one_chunk, chunked):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(one_chunk[2:], scaled[2:]):
        torch.testing.assert_close(a * 2.5, b, rtol=1e-14, atol=0.0)


@pytest.mark.parametrize("implementation", ["torch_chunked", *TRITON_IMPLEMENTATIONS])
def test_onepass_is_bitwise_deterministic(implementation):
    x, w, y = _problem(torch.bfloat16, seed=6)
    inputs = _loss_inputs(N, seed=1)
    first = _onepass(x, w, y, inputs, implementation, 1.0, 3.0, 1.0, workspace_mb=SMALL_WS / 3)
    second = _onepass(x, w, y, inputs, implementation, 1.0, 3.0, 1.0, workspace_mb=SMALL_WS / 3)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_no_gradient_needed_skips_the_loss_and_returns_statistics():
    x, w, y = _problem(torch.float32, seed=8)
    calls = []
    with torch.no_grad():
        lp, ent, _ = onepass_logprob_entropy(x, w, y, lambda *a: calls.append(a), workspace_mb=1.0,
                                             implementation="torch_chunked", vocab_size=VOCAB)
    want_lp, want_ent = reference_logprob_entropy(x, w, y, vocab_size=VOCAB)
    assert not calls
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)


def test_implementation_names():
    assert resolve_onepass_implementation("auto", torch.device("cuda")) == "cublas_triton"
    assert resolve_onepass_implementation("auto", torch.device("cpu")) == "torch_chunked"
    assert set(ONEPASS_IMPLEMENTATIONS) == {"auto", "torch_chunked", "cublas_triton", "triton_fused"}
    with pytest.raises(ValueError, match="one-pass implementation"):
        resolve_onepass_implementation("triton_epilogue", torch.device("cpu"))


def test_the_engine_setting_offers_every_implementation():
    import typing

    from engine.config import KernelsConfig

    assert typing.get_args(typing.get_type_hints(KernelsConfig)["onepass_implementation"]) == ONEPASS_IMPLEMENTATIONS


def test_tiles_of_the_wrong_implementation_are_refused():
    from kernels.onepass_rows import RowTiles

    x, w, y = _problem(torch.float32, seed=9)
    with pytest.raises(TypeError, match="row_tiles for triton_fused must be FusedTiles"):
        onepass_logprob_entropy(x, w, y, lambda *a: None, workspace_mb=1.0, implementation="triton_fused",
                                row_tiles=RowTiles(), vocab_size=VOCAB)
