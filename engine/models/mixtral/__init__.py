"""Mixtral (HF `mixtral`): Llama's attention, every layer's MLP routed softmax top-k SwiGLU experts.

Owns: `SPEC`, the family's facts for the registry (engine/models/families.py): its MoE field names
(num_local_experts / intermediate_size, its only MLP width), the settings it would not reproduce (`check_mixtral`)
and its tiny config.

Test: tests/unit/test_families.py (refusals, moe_shape), tests/unit/test_tiny_model.py.
"""

from __future__ import annotations

from engine.models.family_spec import TINY_MOE_EXPERTS, TINY_MOE_FFN, TINY_MOE_TOP_K, FamilySpec, planner_shape
from engine.models.tensor_map import TensorMap


def check_mixtral(hf_config) -> None:
    """Refuse the Mixtral settings the translation would not reproduce: a sliding window shorter than the context,
    the training-time router jitter.

    Raises:
        ValueError naming `model.name_or_path`, the setting and the cause.
    """
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and window < hf_config.max_position_embeddings:
        raise ValueError(f"model.name_or_path: mixtral with sliding_window={window} < max_position_embeddings="
                         f"{hf_config.max_position_embeddings}: sliding-window attention is not translated; only "
                         "sliding_window null (Mixtral-8x7B's and 8x22B's own) is supported")
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise ValueError(f"model.name_or_path: mixtral with router_jitter_noise={hf_config.router_jitter_noise}: "
                         "Megatron's router has no multiplicative input jitter; set it to 0 (Mixtral's checkpoints "
                         "ship 0)")


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """The tiny Mixtral: Llama's tiny attention (head_dim 32, no bias); its one MLP width is the experts'."""
    return dict(**{**common, "intermediate_size": TINY_MOE_FFN}, num_local_experts=TINY_MOE_EXPERTS,
                num_experts_per_tok=TINY_MOE_TOP_K, sliding_window=None, router_jitter_noise=0.0,
                router_aux_loss_coef=0.001)


MOE_TENSORS = (
    TensorMap("decoder.layers.{i}.mlp.router.weight", ("model.layers.{i}.block_sparse_moe.gate.weight",),
              "replicated"),
    TensorMap("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight",
              ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
               "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"), "gate_up"),
    TensorMap("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight",
              ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",), "row"),
)
"""The MoE MLP's HF <-> Megatron names: Mixtral's checkpoint names for Qwen3-MoE's three Megatron tensors (w1 = gate,
w3 = up, w2 = down)."""


_MIXTRAL_8X7B = planner_shape(4096, 32, 32, 8, 14336, 32000, False, False, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=14336)

PLANNER_MODELS = {
    **{f"mistralai/mixtral-8x7b{suffix}": _MIXTRAL_8X7B for suffix in ("-v0.1", "-instruct-v0.1")},
    "builtin:tiny-mixtral": planner_shape(128, 4, 4, 2, 64, 400, False, False, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=64),
}
"""The planner's shapes of Mixtral-8x7B (from its config.json) and the tiny Mixtral."""


SPEC = FamilySpec(planner_models=PLANNER_MODELS, name="mixtral", model_types=("mixtral",), check=check_mixtral,
                  moe_fields=("num_local_experts", "intermediate_size"), moe_tensors=MOE_TENSORS,
                  tiny_config=tiny_config)
