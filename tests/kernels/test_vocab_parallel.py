"""Vocab-parallel LM-head log-probs at TP=2 on gloo: every implementation against the unsplit reference.

One spawn of two ranks runs every (case, implementation); each rank holds half of the padded LM head (rows
[rank * 150, rank * 150 + 150) of 300) and the same X and token ids. Checked: log-probs and entropies equal the
unsplit reference and are bitwise equal on both ranks (one all-gather, merged in rank order); dX comes back summed
over the TP group (the full gradient, bitwise equal on both ranks); the local dW shards stack to the full dW.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fused_logprob import TritonTiles
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

N, H = 48, 32
# implementation -> (dtype, extra kwargs, rtol/atol vs the float64 reference)
IMPLEMENTATIONS = {
    "reference": (F64, dict(workspace_mb=8 * 128 * 24 / 2**20), 1e-10),  # ignored by the reference
    "torch_chunked": (F64, dict(workspace_mb=8 * 128 * 24 / 2**20), 1e-10),  # 8 x 128 tiles
}
if not torch.cuda.is_available():
    # The interpreter runs Triton on CPU tensors, which gloo can exchange. On a GPU machine the Triton path needs
    # CUDA tensors and NCCL (gloo has no CUDA all-gather): that check belongs to a multi-GPU test.
    IMPLEMENTATIONS["triton"] = (torch.float32, dict(workspace_mb=16 * 128 * 4 / 2**20), 2e-4)
SMALL_TILES = TritonTiles(block_n=16, block_v=32, block_h=16, group_n=2, num_warps=4, num_stages=1, split_cols=64)


def _problem(case: str):
    x, w, y, vocab_size, temperature, gen = lm_head_case(case, N, H)
    return x, w, y, vocab_size, temperature, torch.randn(N, generator=gen, dtype=F64), torch.randn(N, generator=gen,
                                                                                                   dtype=F64)


def _tp_worker() -> dict:
    """On each rank: every (case, implementation) on this rank's shard -> (lp, ent, dX, dW_local)."""
    import torch.distributed as dist

    from kernels import lm_head_logprob_entropy, triton_logprob_entropy

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    rank = dist.get_rank()
    results = {}
    for case in CASES:
        x, w, y, vocab_size, temperature, g_lp, g_ent = _problem(case)
        for impl, (dtype, extra, _) in IMPLEMENTATIONS.items():
            xx = x.to(dtype).clone().requires_grad_(True)
            ww = local_shard(w, rank, dtype)
            common = dict(temperature=temperature, softcap=CASES[case][2], vocab_size=vocab_size, tp_group=group,
                          **extra)
            if impl == "triton":
                lp, ent = triton_logprob_entropy(xx, ww, y, tiles=SMALL_TILES, **common)
            else:
                lp, ent = lm_head_logprob_entropy(xx, ww, y, implementation=impl, **common)
            ((lp * g_lp.to(dtype)).sum() + (ent * g_ent.to(dtype)).sum()).backward()
            results[(case, impl)] = tuple(t.detach().to(F64) for t in (lp, ent, xx.grad, ww.grad))
    return results


@pytest.mark.slow
def test_tp2_every_implementation_matches_unsplit_reference_with_summed_hidden_grad():
    ranks = run_distributed(_tp_worker, TP)
    for case in CASES:
        x, w, y, vocab_size, temperature, g_lp, g_ent = _problem(case)
        owner = y // V_LOCAL
        if vocab_size > V_LOCAL:
            assert (owner == 0).any() and (owner == 1).any()  # targets on both shards
        x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = reference_logprob_entropy(x, w, y, temperature=temperature, softcap=CASES[case][2],
                                            vocab_size=vocab_size)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        want = (lp.detach(), ent.detach(), x.grad)
        tolerances = {impl: tol for impl, (_, _, tol) in IMPLEMENTATIONS.items()}
        assert_ranks_match_reference(ranks, case, tolerances, want, w.grad)
