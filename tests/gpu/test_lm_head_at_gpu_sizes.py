"""The fused LM-head log-prob kernel at the sizes a GPU trains at (gpu-marked: `make test-gpu`, or part a of
`benchmarks/gpu/run.sh` on the lent machine).

tests/kernels/ checks every implementation on small shapes (the Triton interpreter on CPU); these check what only
real sizes show, on CUDA with compiled Triton: Qwen's vocabulary (151936 rows, 151643 real: Megatron-style padding),
thousands of tokens, bf16 (TRL's default) as well as fp32, and
- forward and gradients equal to the materialised-logits reference (fp32: the tolerances of tests/kernels; bf16:
  against the reference on the same bf16 inputs upcast to fp32, since the kernel accumulates in fp32);
- bitwise-deterministic forward (the on-policy ratio must be exactly 1) and backward;
- the memory contract: no (N, V) logits: the kernel's extra memory over a forward + backward stays below a quarter
  of what one fp32 logits tensor would take, while the reference needs several.

The checks are plain functions of (device, sizes), so they can be smoke-run on CPU at tiny sizes under
TRITON_INTERPRET=1 (`python -m tests.gpu.test_lm_head_at_gpu_sizes`), which is how they were written without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from kernels import triton_logprob_entropy
from kernels.reference import build_lm_head_problem, reference_logprob_entropy

pytestmark = pytest.mark.gpu

QWEN_VOCAB_ROWS, QWEN_VOCAB = 151936, 151643
"""Qwen2.5's LM head: 151936 rows, of which the tokenizer's 151643 are real (the rest is padding)."""
WORKSPACE_MB = 128.0
"""The kernel's backward dz slab bound (a 16K-row x 4K-column bf16 slab)."""


def _run(fn, hidden, weight, ids, vocab_size, seed=0):
    """Forward, then a backward of a fixed random combination of log-probs and entropies: (lp, ent, dX, dW)."""
    x = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    workspace = dict(workspace_mb=WORKSPACE_MB) if fn is triton_logprob_entropy else {}
    lp, ent = fn(x, w, ids, temperature=0.9, vocab_size=vocab_size, **workspace)
    gen = torch.Generator(device=hidden.device).manual_seed(seed)
    g_lp = torch.randn(lp.shape, generator=gen, device=hidden.device)  # (N,)
    g_ent = torch.randn(ent.shape, generator=gen, device=hidden.device)  # (N,)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), x.grad, w.grad


def check_matches_reference(device, num_tokens: int, hidden_size: int, vocab_rows: int, vocab_size: int,
                            dtype: torch.dtype) -> None:
    """The kernel's log-probs, entropies and both gradients against the reference (fp32 maths on the same inputs)."""
    x, w, ids = build_lm_head_problem(num_tokens, hidden_size, vocab_rows, vocab_size=vocab_size, logit_std=4.0,
                                      dtype=dtype, device=device, seed=1)
    lp, ent, dx, dw = _run(triton_logprob_entropy, x, w, ids, vocab_size)
    ref = _run(reference_logprob_entropy, x.float(), w.float(), ids, vocab_size)
    exact = dtype == torch.float32
    tol = dict(rtol=1e-4, atol=2e-4) if exact else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lp, ref[0], **tol)
    torch.testing.assert_close(ent, ref[1], **tol)
    grad_tol = dict(rtol=1e-4, atol=2e-4) if exact else dict(rtol=2e-2, atol=2e-2)  # dz rounded to bf16 for the GEMMs
    torch.testing.assert_close(dx.float(), ref[2], **grad_tol)
    torch.testing.assert_close(dw.float(), ref[3], **grad_tol)


def check_deterministic(device, num_tokens: int, hidden_size: int, vocab_rows: int, vocab_size: int,
                        dtype: torch.dtype) -> None:
    """Two forwards and two backwards on the same inputs are bitwise equal."""
    x, w, ids = build_lm_head_problem(num_tokens, hidden_size, vocab_rows, vocab_size=vocab_size, dtype=dtype,
                                      device=device, seed=2)
    first, second = (_run(triton_logprob_entropy, x, w, ids, vocab_size) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def check_memory_bound(device, num_tokens: int, hidden_size: int, vocab_rows: int, vocab_size: int,
                       dtype: torch.dtype) -> tuple[int, int]:
    """Peak CUDA memory over the inputs during a forward + backward: the kernel's stays under a quarter of one fp32
    (N, V) logits tensor; the reference's exceeds one. Returns (kernel extra bytes, reference extra bytes)."""
    x, w, ids = build_lm_head_problem(num_tokens, hidden_size, vocab_rows, vocab_size=vocab_size, dtype=dtype,
                                      device=device, seed=3)
    logits_bytes = num_tokens * vocab_rows * 4
    extra = []
    for fn in (triton_logprob_entropy, reference_logprob_entropy):
        _run(fn, x, w, ids, vocab_size)  # warm-up: compiles, cuBLAS workspaces
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = _run(fn, x, w, ids, vocab_size)
        torch.cuda.synchronize(device)
        gradients = sum(t.numel() * t.element_size() for t in result[2:])  # dX, dW: outputs, not workspace
        extra.append(torch.cuda.max_memory_allocated(device) - base - gradients)
        del result
    kernel, reference = extra
    assert kernel < logits_bytes / 4, f"kernel extra {kernel / 2**20:.0f} MiB vs logits {logits_bytes / 2**20:.0f} MiB"
    assert reference > logits_bytes, f"reference extra {reference / 2**20:.0f} MiB: the bound proves nothing"
    return kernel, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_kernel_matches_the_reference_at_qwen_vocab(dtype):
    check_matches_reference("cuda", 2048, 1536, QWEN_VOCAB_ROWS, QWEN_VOCAB, dtype)


def test_fused_kernel_is_bitwise_deterministic_at_qwen_vocab():
    check_deterministic("cuda", 4096, 2048, QWEN_VOCAB_ROWS, QWEN_VOCAB, torch.bfloat16)


def test_fused_kernel_never_holds_the_logits():
    check_memory_bound(torch.device("cuda"), 8192, 2048, QWEN_VOCAB_ROWS, QWEN_VOCAB, torch.bfloat16)


if __name__ == "__main__":  # CPU smoke of the checks at tiny sizes (TRITON_INTERPRET=1 before triton is imported)
    check_matches_reference("cpu", 24, 32, 136, 130, torch.float32)
    check_matches_reference("cpu", 24, 32, 136, 130, torch.bfloat16)
    check_deterministic("cpu", 24, 32, 136, 130, torch.bfloat16)
    print("CPU smoke of the GPU checks: ok (the memory bound needs CUDA)")
