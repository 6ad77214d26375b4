"""The model families the engine builds, and the per-family names of their Hugging Face config fields.

Owns: `SUPPORTED_MODEL_TYPES` (what engine/policy/model.py translates), `MOE_MODEL_TYPES`, the refusal of any other
family (`check_model_type`, naming the supported ones and, for a family labs post-train, what the translation lacks:
`MISSING_FEATURES`) and of the Mixtral / GLM-4.5 settings it would not reproduce, and `moe_shape` (expert count, top-k
and expert width under each family's own field names), `dense_layers` and `shared_expert_width` (GLM-4.5). The
policy, the converter and the planner all read these.

Must not: import torch, Megatron or vLLM (the planner runs on a login node); translate anything itself.

Test: tests/unit/test_families.py (refusals name the cause; moe_shape of each MoE family; the planner's Mixtral and
GLM-4.5 shapes give the published parameter counts).
"""

from __future__ import annotations

from engine.models.gemma import GEMMA_MODEL_TYPES, check_gemma

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe", "mixtral", "glm4_moe") + GEMMA_MODEL_TYPES
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "glm4_moe")
"""Families with routed-expert MLPs: in every layer, except GLM-4.5's dense first `first_k_dense_replace` layers."""

MISSING_FEATURES = {
    "cohere2": "parallel attention + MLP blocks, LayerNorm without bias, logit scaling and sliding-window layers",
    "deepseek_v3": "multi-latent attention (MLA), shared experts, sigmoid group-limited routing with the expert "
                   "bias and dense first layers",
    "gpt_oss": "attention sinks, alternating sliding-window layers, the clamped SwiGLU and expert biases",
    "nemotron_h": "Mamba-2 (hybrid state-space) layers",
}
"""Families the engine does not build yet, with what the translation lacks (issue #30): named when one is refused."""

_MOE_FIELDS = {"qwen3_moe": ("num_experts", "moe_intermediate_size"),
               "mixtral": ("num_local_experts", "intermediate_size"),
               "glm4_moe": ("n_routed_experts", "moe_intermediate_size")}


def check_model_type(hf_config) -> None:
    """Refuse a model family the engine does not build, naming the ones it does and, for a known family, what is
    missing; and refuse the Mixtral settings it would not reproduce (a sliding window shorter than the context, the
    training-time router jitter). `hf_config` is a transformers config (or anything with its attributes).

    Raises:
        ValueError naming `model.name_or_path`, the model_type and the cause.
    """
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        missing = f" (missing: {MISSING_FEATURES[model_type]})" if model_type in MISSING_FEATURES else ""
        raise ValueError(f"model.name_or_path: model_type {model_type!r} ({type(hf_config).__name__}) is not "
                         f"supported{missing}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "glm4_moe":
        _check_glm4_moe(hf_config)
    if model_type in GEMMA_MODEL_TYPES:
        check_gemma(hf_config)
    if model_type != "mixtral":
        return
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and window < hf_config.max_position_embeddings:
        raise ValueError(f"model.name_or_path: mixtral with sliding_window={window} < max_position_embeddings="
                         f"{hf_config.max_position_embeddings}: sliding-window attention is not translated; only "
                         "sliding_window null (Mixtral-8x7B's and 8x22B's own) is supported")
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise ValueError(f"model.name_or_path: mixtral with router_jitter_noise={hf_config.router_jitter_noise}: "
                         "Megatron's router has no multiplicative input jitter; set it to 0 (Mixtral's checkpoints "
                         "ship 0)")


def _check_glm4_moe(hf_config) -> None:
    """Refuse the GLM-4.5 MoE router settings Megatron's sigmoid router computes differently: it always renormalises
    the top-k weights (HF only with `norm_topk_prob`), and it scores an expert group by the sum of its top
    (top-k / topk_group) experts where HF sums the group's top 2 (GLM-4.5's n_group=1 makes both moot)."""
    top_k, groups, group_top_k = hf_config.num_experts_per_tok, hf_config.n_group, hf_config.topk_group
    if not hf_config.norm_topk_prob and top_k > 1:
        raise ValueError("model.name_or_path: glm4_moe with norm_topk_prob=false: Megatron's sigmoid router always "
                         "renormalises the top-k weights; only norm_topk_prob true (GLM-4.5's own) is supported")
    if groups > 1 and top_k // group_top_k != 2:
        raise ValueError(f"model.name_or_path: glm4_moe with n_group={groups}, topk_group={group_top_k}, "
                         f"num_experts_per_tok={top_k}: Megatron scores a group by its top num_experts_per_tok // "
                         f"topk_group = {top_k // group_top_k} experts, HF by its top 2; only n_group 1 or "
                         "num_experts_per_tok = 2 x topk_group is supported")


def dense_layers(hf_config) -> int:
    """How many first decoder layers of an MoE family are dense (GLM-4.5's `first_k_dense_replace`; 0 otherwise)."""
    return int(getattr(hf_config, "first_k_dense_replace", 0) or 0) if hf_config.model_type == "glm4_moe" else 0


def shared_expert_width(hf_config) -> int:
    """The always-on shared expert's MLP width (GLM-4.5: n_shared_experts x moe_intermediate_size; 0 = none)."""
    if hf_config.model_type != "glm4_moe":
        return 0
    return int(getattr(hf_config, "n_shared_experts", 0) or 0) * int(hf_config.moe_intermediate_size)


def moe_shape(hf_config) -> tuple[int, int, int]:
    """(routed experts per layer, experts per token, each expert's MLP width) of an MoE family's HF config, (0, 0, 0)
    for a dense one. Qwen3-MoE names them num_experts / num_experts_per_tok / moe_intermediate_size; Mixtral
    num_local_experts / num_experts_per_tok / intermediate_size (its only MLP width); GLM-4.5 n_routed_experts /
    num_experts_per_tok / moe_intermediate_size. `hf_config` is a config object
    or anything with those attributes (the planner passes a namespace over config.json)."""
    if hf_config.model_type not in _MOE_FIELDS:
        return 0, 0, 0
    experts, width = _MOE_FIELDS[hf_config.model_type]
    return int(getattr(hf_config, experts)), int(hf_config.num_experts_per_tok), int(getattr(hf_config, width))
