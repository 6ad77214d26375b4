"""Qwen3-MoE (HF `qwen3_moe`): Qwen3's attention, every layer's MLP routed softmax top-k SwiGLU experts.

Owns: `SPEC`, the family's facts for the registry (engine/models/families.py): its MoE field names
(num_experts / moe_intermediate_size) and tiny config.

Test: tests/unit/test_families.py (moe_shape), tests/unit/test_tiny_model.py.
"""

from __future__ import annotations

from engine.models.family_spec import (
    TINY_MOE_EXPERTS,
    TINY_MOE_FFN,
    TINY_MOE_TOP_K,
    TINY_QWEN3_HEAD_DIM,
    FamilySpec,
    planner_shape,
    switched_sliding_window_dims,
)
from engine.models.tensor_map import TensorMap


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """The tiny Qwen3-MoE: Qwen3's tiny attention; every layer `TINY_MOE_EXPERTS` experts of width `TINY_MOE_FFN`,
    top-`TINY_MOE_TOP_K`, probabilities renormalised."""
    return dict(head_dim=TINY_QWEN3_HEAD_DIM, attention_bias=False, use_sliding_window=False,
                num_experts=TINY_MOE_EXPERTS, num_experts_per_tok=TINY_MOE_TOP_K, moe_intermediate_size=TINY_MOE_FFN,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001, **common)


MOE_TENSORS = (
    TensorMap("decoder.layers.{i}.mlp.router.weight", ("model.layers.{i}.mlp.gate.weight",), "replicated"),
    TensorMap("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight",
              ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
               "model.layers.{i}.mlp.experts.{e}.up_proj.weight"), "gate_up"),
    TensorMap("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight",
              ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",), "row"),
)
"""The MoE MLP's HF <-> Megatron names: the router `mlp.gate`, each expert's gate / up / down projections."""


def _shape(h, layers, heads, kv, ffn, vocab, experts, top_k, moe_ffn):
    return planner_shape(h, layers, heads, kv, ffn, vocab, tie_word_embeddings=False, qkv_bias=False, head_dim=128,
                         qk_norm=True, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_ffn)


_SIZES = {
    "30b-a3b": _shape(2048, 48, 32, 4, 6144, 151936, 128, 8, 768),
    "235b-a22b": _shape(4096, 94, 64, 4, 12288, 151936, 128, 8, 1536),
}

PLANNER_MODELS = {
    **{f"qwen/qwen3-{size}{suffix}": dims for size, dims in _SIZES.items() for suffix in ("", "-base")},
    "qwen/qwen3-30b-a3b-instruct-2507": _SIZES["30b-a3b"],
    "qwen/qwen3-235b-a22b-instruct-2507": _SIZES["235b-a22b"],
    "builtin:tiny-qwen3_moe": planner_shape(128, 4, 4, 2, 352, 400, False, False, head_dim=64, qk_norm=True,
                                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
}
"""The planner's shapes of Qwen3-30B-A3B and Qwen3-235B-A22B (from each config.json) and the tiny Qwen3-MoE."""


SPEC = FamilySpec(planner_models=PLANNER_MODELS, name="qwen3_moe", model_types=("qwen3_moe",), moe_fields=("num_experts", "moe_intermediate_size"),
                  qk_norm_types=("qwen3_moe",), moe_tensors=MOE_TENSORS,
                  planner_dims=switched_sliding_window_dims, tiny_config=tiny_config)
