"""The one-pass LM-head loss at TP=2 on gloo: each rank holds half of the padded head; the per-chunk statistics are
all-gathered, the loss derivatives taken on each rank from the merged (bitwise equal) log-probs, dX summed over the
group in the forward. Checked against the unsplit float64 reference: log-probs, entropies, dX on both ranks (bitwise
equal between them), the stacked dW shards; both implementations (cublas_triton under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import build_lm_head_problem, reference_logprob_entropy
from tests.distributed.launcher import run_distributed

F64 = torch.float64
TP, N, H, V_ROWS = 2, 29, 24, 300
V_LOCAL = V_ROWS // TP
CASES = {"padding_in_last_shard": (290, 0.8, 4.0), "last_shard_all_padding": (140, 1.3, None)}
IMPLEMENTATIONS = {"torch_chunked": (F64, 1e-10)}
if not torch.cuda.is_available():
    # The interpreter runs the row kernels on CPU tensors, which gloo can exchange; on a GPU machine they need CUDA
    # tensors and NCCL: that check belongs to a multi-GPU test.
    IMPLEMENTATIONS["cublas_triton"] = (torch.float32, 2e-4)
WORKSPACE_MB = 7 * V_LOCAL * 8 / 2**20  # a few rows per chunk: several chunks, each with its own all-gather


def _problem(case: str):
    vocab_size, temperature, _ = CASES[case]
    x, w, y = build_lm_head_problem(N, H, V_ROWS, vocab_size=vocab_size, logit_std=6.0, dtype=F64,
                                    seed=list(CASES).index(case), sampled_fraction=0.5)
    gen = torch.Generator().manual_seed(3)
    return x, w, y, vocab_size, temperature, torch.randn(N, generator=gen, dtype=F64), -torch.rand(
        N, generator=gen, dtype=F64) * 3


def _token_loss(lp, ent, adv, old):
    """Token-local and non-linear in the log-prob: a clipped ratio surrogate and an entropy bonus."""
    ratio = torch.exp(lp - old.to(lp.dtype))
    return -torch.minimum(ratio * adv.to(lp.dtype), ratio.clamp(0.8, 1.2) * adv.to(lp.dtype)) - 0.05 * ent


def _tp_worker() -> dict:
    import torch.distributed as dist

    from kernels.onepass_logprob import onepass_logprob_entropy

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for case in CASES:
        x, w, y, vocab_size, temperature, adv, old = _problem(case)
        for impl, (dtype, _) in IMPLEMENTATIONS.items():
            def grads(r0, r1, lp, ent):
                lp, ent = lp.detach().requires_grad_(True), ent.detach().requires_grad_(True)
                return torch.autograd.grad(_token_loss(lp, ent, adv[r0:r1], old[r0:r1]).sum(), (lp, ent))

            xx = x.to(dtype).clone().requires_grad_(True)
            ww = w[rank * V_LOCAL:(rank + 1) * V_LOCAL].to(dtype).clone().requires_grad_(True)
            lp, ent, anchor = onepass_logprob_entropy(xx, ww, y, grads, workspace_mb=WORKSPACE_MB,
                                                      implementation=impl, temperature=temperature,
                                                      softcap=CASES[case][2], vocab_size=vocab_size,
                                                      tp_group=dist.group.WORLD)
            (_token_loss(lp, ent, adv, old).sum().detach() + anchor).backward()
            results[(case, impl)] = tuple(t.detach().to(F64) for t in (lp, ent, xx.grad, ww.grad))
    return results


@pytest.mark.slow
def test_tp2_onepass_matches_unsplit_reference_with_summed_hidden_grad():
    ranks = run_distributed(_tp_worker, TP)
    for case in CASES:
        x, w, y, vocab_size, temperature, adv, old = _problem(case)
        x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = reference_logprob_entropy(x, w, y, temperature=temperature, softcap=CASES[case][2],
                                            vocab_size=vocab_size)
        _token_loss(lp, ent, adv, old).sum().backward()
        want = (lp.detach(), ent.detach(), x.grad)
        for impl, (_, tol) in IMPLEMENTATIONS.items():
            got0, got1 = ranks[0][(case, impl)], ranks[1][(case, impl)]
            label = f"{case}/{impl}"
            for name, a0, a1, b in zip(("logprobs", "entropy", "dX"), got0, got1, want):
                assert torch.equal(a0, a1), f"{label}: {name} differs between TP ranks"
                torch.testing.assert_close(a0, b, rtol=tol, atol=tol, msg=lambda m, n=f"{label} {name}": f"{n}: {m}")
            torch.testing.assert_close(torch.cat([got0[3], got1[3]]), w.grad, rtol=tol, atol=tol,
                                       msg=lambda m, n=label: f"{n} dW: {m}")
