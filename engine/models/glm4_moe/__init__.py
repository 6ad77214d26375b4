"""GLM-4.5 MoE (HF `glm4_moe`): dense first layers, then routed experts under the sigmoid group-limited router with
the expert-score correction bias, plus one always-on shared expert; QKV bias, optional q/k norms, partial RoPE.

Owns: `SPEC`, the family's facts for the registry (engine/models/families.py): its MoE field names, the router
settings refused (engine/models/family_spec.py `check_sigmoid_router`), its dense first layers and shared expert,
its tiny config.

Test: tests/unit/test_families.py (refusals, moe_shape, dense layers, shared expert), tests/unit/test_tiny_model.py.
"""

from __future__ import annotations

from engine.models.family_spec import (
    TINY_DENSE_LAYERS,
    TINY_MOE_EXPERTS,
    TINY_MOE_FFN,
    TINY_MOE_TOP_K,
    TINY_SIGMOID_ROUTER,
    FamilySpec,
    check_sigmoid_router,
    planner_shape,
    randomise_expert_score_bias,
    sigmoid_router_dense_layers,
    sigmoid_router_layer_freq,
    sigmoid_router_planner_dims,
    sigmoid_router_shared_expert_width,
    warn_mtp_layers,
)
from engine.models.tensor_map import SIGMOID_ROUTER_MOE_TENSORS


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """GLM-4.5's architecture at the tiny shapes: QKV bias and per-head q/k RMSNorm (GLM-4.5's `use_qk_norm`), RoPE
    on half of each head (`partial_rotary_factor` 0.5), a dense first layer of width 352, then MoE layers of 4
    sigmoid-routed experts (top-2 of the group-limited scores + the expert-score correction bias, renormalised,
    x 2.5: `TINY_SIGMOID_ROUTER`) plus one always-on shared expert."""
    rope = {"rope_type": "default", "rope_theta": common["rope_theta"], "partial_rotary_factor": 0.5}
    common = {k: v for k, v in common.items() if k != "rope_theta"}
    return dict(
        **common, head_dim=common["hidden_size"] // common["num_attention_heads"], attention_bias=True,
        use_qk_norm=True, rope_parameters=rope, partial_rotary_factor=0.5, moe_intermediate_size=TINY_MOE_FFN,
        n_routed_experts=TINY_MOE_EXPERTS, num_experts_per_tok=TINY_MOE_TOP_K, n_shared_experts=1,
        **TINY_SIGMOID_ROUTER, first_k_dense_replace=TINY_DENSE_LAYERS, num_nextn_predict_layers=0,
    )


def _shape(h, layers, ffn, experts, moe_ffn, dense, qk_norm):
    return planner_shape(h, layers, 96, 8, ffn, 151552, False, True, head_dim=128, qk_norm=qk_norm,
                         num_experts=experts, num_experts_per_tok=8, moe_intermediate_size=moe_ffn, dense_layers=dense,
                         shared_expert_size=moe_ffn, expert_bias=True)


_GLM45 = _shape(5120, 92, 12288, 160, 1536, 3, True)
_GLM45_AIR = _shape(4096, 46, 10944, 128, 1408, 1, False)
"""GLM-4.5 (355B-A32B) and GLM-4.5-Air (106B-A12B), from their config.json; their one multi-token-prediction layer
(`num_nextn_predict_layers`) is neither built by the engine nor by transformers, so not counted (an export copies its
weights from the source checkpoint, on disk only: engine/policy/mtp_layers.py)."""

PLANNER_MODELS = {
    **{f"zai-org/glm-4.5{suffix}": _GLM45 for suffix in ("", "-base")},
    **{f"zai-org/glm-4.5-air{suffix}": _GLM45_AIR for suffix in ("", "-base")},
    "builtin:tiny-glm4_moe": planner_shape(128, 4, 4, 2, 352, 400, False, True, qk_norm=True, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=64, dense_layers=1,
                                           shared_expert_size=64, expert_bias=True),
}
"""The planner's shapes of GLM-4.5 and GLM-4.5-Air and the tiny GLM-4.5 MoE."""


SPEC = FamilySpec(planner_models=PLANNER_MODELS, name="glm4_moe", model_types=("glm4_moe",), check=check_sigmoid_router,
                  moe_fields=("n_routed_experts", "moe_intermediate_size"), moe_tensors=SIGMOID_ROUTER_MOE_TENSORS,
                  dense_layers=sigmoid_router_dense_layers,
                  shared_expert_width=sigmoid_router_shared_expert_width, planner_dims=sigmoid_router_planner_dims,
                  moe_layer_freq=sigmoid_router_layer_freq, warn_unbuilt_layers=warn_mtp_layers,
                  tiny_config=tiny_config,
                  randomise_tiny_inits=randomise_expert_score_bias)
