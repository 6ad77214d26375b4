"""The TP=2 vocab-parallel LM-head set-up shared by tests/kernels/test_vocab_parallel.py (two-pass entries) and
tests/kernels/test_onepass_tp.py (one-pass): the padded head of 300 rows split in two shards, the two vocabulary
cases, one problem per case, each rank's shard, and the check of both ranks' results against the unsplit reference."""

from __future__ import annotations

import torch

from kernels.reference import build_lm_head_problem

F64 = torch.float64
TP, V_ROWS = 2, 300
V_LOCAL = V_ROWS // TP
CASES = {"padding_in_last_shard": (290, 0.8, 4.0), "last_shard_all_padding": (140, 1.3, None)}
"""name -> (vocab_size, temperature, final-logit soft-cap): real rows end inside shard 1, logits (std 6) soft-capped
at 4 on each shard; or inside shard 0 (shard 1 is all padding), no cap."""


def lm_head_case(case: str, num_rows: int, hidden: int):
    """(x, w, y, vocab_size, temperature, generator) of `case` in float64: the generator (seed 3) draws the caller's
    per-token loss inputs."""
    vocab_size, temperature, _ = CASES[case]
    x, w, y = build_lm_head_problem(num_rows, hidden, V_ROWS, vocab_size=vocab_size, logit_std=6.0, dtype=F64,
                                    seed=list(CASES).index(case), sampled_fraction=0.5)
    return x, w, y, vocab_size, temperature, torch.Generator().manual_seed(3)


def local_shard(w: torch.Tensor, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's rows [rank * V_LOCAL, (rank + 1) * V_LOCAL) of the head, a leaf that takes gradients."""
    return w[rank * V_LOCAL:(rank + 1) * V_LOCAL].to(dtype).clone().requires_grad_(True)


def assert_ranks_match_reference(ranks: list[dict], case: str, tolerances: dict[str, float], want: tuple,
                                 w_grad: torch.Tensor) -> None:
    """Every implementation's (lp, ent, dX, dW_local) of `case` on both ranks: log-probs, entropies and dX bitwise
    equal between the ranks and equal to `want` (the unsplit reference's), the dW shards stacked equal to `w_grad`."""
    for impl, tol in tolerances.items():
        got0, got1 = ranks[0][(case, impl)], ranks[1][(case, impl)]
        label = f"{case}/{impl}"
        for name, a0, a1, b in zip(("logprobs", "entropy", "dX"), got0, got1, want):
            assert torch.equal(a0, a1), f"{label}: {name} differs between TP ranks"
            torch.testing.assert_close(a0, b, rtol=tol, atol=tol, msg=lambda m, n=f"{label} {name}": f"{n}: {m}")
        torch.testing.assert_close(torch.cat([got0[3], got1[3]]), w_grad, rtol=tol, atol=tol,
                                   msg=lambda m, n=label: f"{n} dW: {m}")
