"""kernels/lm_head_logprob.py: the public entry picks the implementation from its argument and keeps token shapes."""

from __future__ import annotations

import pytest
import torch

from kernels import IMPLEMENTATIONS, chunked_logprob_entropy, lm_head_logprob_entropy
from kernels.lm_head_logprob import resolve_implementation
from kernels.reference import build_lm_head_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_auto_is_triton_on_cuda_and_chunked_torch_elsewhere():
    assert resolve_implementation("auto", torch.device("cuda")) == "triton"
    assert resolve_implementation("auto", torch.device("cpu")) == "torch_chunked"
    assert resolve_implementation("reference", torch.device("cuda")) == "reference"
    with pytest.raises(ValueError, match="implementation must be one of"):
        resolve_implementation("liger", torch.device("cpu"))


def test_auto_on_cpu_gives_exactly_the_chunked_result():
    x, w, y = build_lm_head_problem(24, 16, 100, vocab_size=97, seed=1)
    got = lm_head_logprob_entropy(x, w, y, vocab_size=97, temperature=0.8, workspace_mb=1.0, implementation="auto")
    want = chunked_logprob_entropy(x, w, y, vocab_size=97, temperature=0.8, workspace_mb=1.0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("implementation", [i for i in IMPLEMENTATIONS if i != "auto"])
def test_every_implementation_keeps_the_token_shape_and_agrees(implementation):
    x, w, y = build_lm_head_problem(3 * 8, 16, 100, vocab_size=97, logit_std=5.0, seed=2)
    hidden, ids = x.reshape(3, 8, 16).to(DEVICE), y.reshape(3, 8).to(DEVICE)  # (B, T, H), (B, T)
    lp, ent = lm_head_logprob_entropy(hidden, w.to(DEVICE), ids, vocab_size=97, workspace_mb=1.0,
                                      implementation=implementation)
    assert lp.shape == ent.shape == (3, 8) and lp.dtype == ent.dtype == torch.float32
    lp_flat, ent_flat = lm_head_logprob_entropy(x, w, y, vocab_size=97, workspace_mb=1.0, implementation="reference")
    torch.testing.assert_close(lp.cpu().reshape(-1), lp_flat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.cpu().reshape(-1), ent_flat, rtol=1e-5, atol=1e-5)


def test_mismatched_token_shape_is_refused():
    x, w, y = build_lm_head_problem(8, 16, 100, seed=3)
    with pytest.raises(ValueError, match="must match token_ids"):
        lm_head_logprob_entropy(x, w, y[:4], workspace_mb=1.0, implementation="auto")


@pytest.mark.parametrize("implementation", [i for i in IMPLEMENTATIONS if i not in ("auto", "reference")])
def test_bf16_inputs_give_float32_logits_what_cast_lm_head_to_fp32_asks_for(implementation):
    """TRL's `cast_lm_head_to_fp32` (ScaleRL) is named in the no-effect warning because the kernel already computes
    the logits of bf16 hidden states and a bf16 LM head in float32: equal to the float32 computation of the same
    values, and unlike bf16-rounded logits."""
    x, w, y = build_lm_head_problem(32, 64, 200, vocab_size=193, logit_std=8.0, seed=3)
    x16, w16 = x.to(torch.bfloat16), w.to(torch.bfloat16)
    lp, _ = lm_head_logprob_entropy(x16.to(DEVICE), w16.to(DEVICE), y.to(DEVICE), vocab_size=193, workspace_mb=1.0,
                                    implementation=implementation)
    logits32 = (x16.double() @ w16.double().T)[:, :193]  # (N, V): the bf16 values, exactly multiplied
    want = torch.log_softmax(logits32, -1).gather(1, y[:, None]).squeeze(1)
    rounded = torch.log_softmax(logits32.to(torch.bfloat16).double(), -1).gather(1, y[:, None]).squeeze(1)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.cpu().double(), want, rtol=0, atol=2e-5)
    assert (rounded - want).abs().max() > 1e-3  # bf16 logits would be visibly off: the check can tell them apart


SOFTCAP = 20.0
"""Final-logit soft-cap of the softcap tests: the logits reach |50|, so tanh bends them strongly (Gemma 2 ships 30)."""


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("implementation", ["torch_chunked", "triton"])
def test_softcap_matches_float64_reference_of_the_capped_logits(implementation, dtype, with_entropy):
    """Gemma 2's final-logit soft-capping, cap tanh(z / cap) before the temperature: forward and both gradients equal
    the float64 reference on the same (rounded) inputs, with and without the entropy gradient; uncapped differs."""
    x, w, y = build_lm_head_problem(64, 48, 300, vocab_size=290, max_abs_logit=50.0, sampled_fraction=0.5,
                                    dtype=torch.float64, seed=4)
    x, w = x.to(dtype).double(), w.to(dtype).double()  # the reference sees exactly the kernel's input values
    gen = torch.Generator().manual_seed(5)
    g_lp, g_ent = torch.randn(64, generator=gen, dtype=torch.float64), torch.randn(64, generator=gen,
                                                                                  dtype=torch.float64)
    common = dict(temperature=0.7, softcap=SOFTCAP, vocab_size=290, workspace_mb=16 * 128 * 4 / 2**20)

    def run(xx, ww, implementation, **extra):
        xx, ww = xx.clone().requires_grad_(True), ww.clone().requires_grad_(True)
        lp, ent = lm_head_logprob_entropy(xx, ww, y.to(xx.device), implementation=implementation, **common, **extra)
        loss = (lp.double().cpu() * g_lp).sum() + ((ent.double().cpu() * g_ent).sum() if with_entropy else 0.0)
        loss.backward()
        return [t.detach().cpu().double() for t in (lp, ent, xx.grad, ww.grad)]

    got = run(x.to(DEVICE, dtype), w.to(DEVICE, dtype), implementation)
    want = run(x, w, "reference")
    lp_tol = dict(rtol=1e-4, atol=2e-4)
    grad_rtol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: dz is rounded to bf16 before the gradient GEMMs
    for name, a, b in zip(("logprobs", "entropy"), got, want):
        torch.testing.assert_close(a, b, **lp_tol, msg=lambda m, n=name: f"{n}: {m}")
    for name, a, b in zip(("dX", "dW"), got[2:], want[2:]):
        torch.testing.assert_close(a, b, rtol=grad_rtol, atol=grad_rtol * b.abs().max().item(),
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert torch.count_nonzero(got[3][290:]) == 0
    lp_uncapped, _ = lm_head_logprob_entropy(x, w, y, implementation="reference",
                                             **{**common, "softcap": None})
    assert (lp_uncapped - want[0]).abs().max() > 1.0  # the cap changes the answer: the check can tell


@pytest.mark.parametrize("softcap", [0.0, -30.0])
def test_non_positive_softcap_is_refused(softcap):
    x, w, y = build_lm_head_problem(8, 16, 100, seed=3)
    with pytest.raises(ValueError, match=r"softcap \(final_logit_softcapping\) must be > 0"):
        lm_head_logprob_entropy(x, w, y, softcap=softcap, workspace_mb=1.0, implementation="torch_chunked")
