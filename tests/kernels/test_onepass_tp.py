"""The one-pass LM-head loss at TP=2 on gloo: each rank holds half of the padded head; the per-chunk statistics are
all-gathered, the loss derivatives taken on each rank from the merged (bitwise equal) log-probs, dX summed over the
group in the forward. Checked against the unsplit float64 reference: log-probs, entropies, dX on both ranks (bitwise
equal between them), the stacked dW shards; every implementation (cublas_triton and triton_fused under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import reference_logprob_entropy
from tests.distributed.launcher import run_distributed
from tests.helpers.vocab_parallel import (
    CASES,
    F64,
    TP,
    V_LOCAL,
    assert_ranks_match_reference,
    lm_head_case,
    local_shard,
)

N, H = 29, 24
IMPLEMENTATIONS = {"torch_chunked": (F64, 1e-10)}
if not torch.cuda.is_available():
    # The interpreter runs the row kernels on CPU tensors, which gloo can exchange; on a GPU machine they need CUDA
    # tensors and NCCL: that check belongs to a multi-GPU test.
    IMPLEMENTATIONS["cublas_triton"] = (torch.float32, 2e-4)
    IMPLEMENTATIONS["triton_fused"] = (torch.float32, 2e-4)
WORKSPACE_MB = 7 * V_LOCAL * 8 / 2**20  # a few rows per chunk: several chunks, each with its own all-gather


def _problem(case: str):
    x, w, y, vocab_size, temperature, gen = lm_head_case(case, N, H)
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
            ww = local_shard(w, rank, dtype)
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
        assert_ranks_match_reference(ranks, case, {impl: tol for impl, (_, tol) in IMPLEMENTATIONS.items()}, want, w.grad)
