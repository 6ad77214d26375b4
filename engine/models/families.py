"""The model families the engine builds, and the per-family names of their Hugging Face config fields.

Owns: `SUPPORTED_MODEL_TYPES` (what engine/policy/model.py translates), `MOE_MODEL_TYPES`, the refusal of any other
family (`check_model_type`, naming the supported ones and, for a family labs post-train, what the translation lacks:
`MISSING_FEATURES`) and of the Mixtral settings it would not reproduce, and `moe_shape` (expert count, top-k and
expert width under each family's own field names). The policy, the converter and the planner all read these.

Must not: import torch, Megatron or vLLM (the planner runs on a login node); translate anything itself.

Test: tests/unit/test_families.py (refusals name the cause; moe_shape of each MoE family; the planner's Mixtral
shapes give the published parameter count).
"""

from __future__ import annotations

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
"""Families whose MLP is routed experts in every layer."""

MISSING_FEATURES = {
    "gemma2": "sliding-window / global layer alternation, attention-logit and final-logit soft-capping, the "
              "post-attention / post-feedforward norms, sqrt(hidden)-scaled embeddings and Gemma's (1 + w) RMSNorm",
    "gemma3_text": "sliding-window / global layer alternation with two RoPE bases, the post-attention / "
                   "post-feedforward norms, sqrt(hidden)-scaled embeddings and Gemma's (1 + w) RMSNorm",
    "cohere2": "parallel attention + MLP blocks, LayerNorm without bias, logit scaling and sliding-window layers",
    "glm4_moe": "shared experts, sigmoid routing with the expert-score correction bias, dense first layers and "
                "partial rotary embeddings",
    "deepseek_v3": "multi-latent attention (MLA), shared experts, sigmoid group-limited routing with the expert "
                   "bias and dense first layers",
    "gpt_oss": "attention sinks, alternating sliding-window layers, the clamped SwiGLU and expert biases",
    "nemotron_h": "Mamba-2 (hybrid state-space) layers",
}
"""Families the engine does not build yet, with what the translation lacks (issue #30): named when one is refused."""

_MOE_FIELDS = {"qwen3_moe": ("num_experts", "moe_intermediate_size"),
               "mixtral": ("num_local_experts", "intermediate_size")}


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


def moe_shape(hf_config) -> tuple[int, int, int]:
    """(routed experts per layer, experts per token, each expert's MLP width) of an MoE family's HF config, (0, 0, 0)
    for a dense one. Qwen3-MoE names them num_experts / num_experts_per_tok / moe_intermediate_size; Mixtral
    num_local_experts / num_experts_per_tok / intermediate_size (its only MLP width). `hf_config` is a config object
    or anything with those attributes (the planner passes a namespace over config.json)."""
    if hf_config.model_type not in _MOE_FIELDS:
        return 0, 0, 0
    experts, width = _MOE_FIELDS[hf_config.model_type]
    return int(getattr(hf_config, experts)), int(hf_config.num_experts_per_tok), int(getattr(hf_config, width))
