"""The model families the engine builds, and the per-family names of their Hugging Face config fields.

Owns: `SUPPORTED_MODEL_TYPES` (what engine/policy/model.py translates), `MOE_MODEL_TYPES`, the refusal of any other
family (`check_model_type`, naming the supported ones and, for a family labs post-train, what the translation lacks:
`MISSING_FEATURES`) and of the Mixtral / GLM-4.5 / GPT-OSS settings it would not reproduce (`check_gpt_oss`),
the refusal of a quantised checkpoint of any family (`check_quantization`, naming the method and the conversion to
run), and `moe_shape` (expert count, top-k and expert width under each family's own field names), `dense_layers` and
`shared_expert_width` (GLM-4.5 and DeepSeek-V3; DeepSeek-V3's MLA refusals: engine/models/deepseek_v3.py). The policy,
the converter and the planner all read these; GPT-OSS's own translation is engine/models/gpt_oss.py, Gemma's
engine/models/gemma.py, Cohere 2's engine/models/cohere2.py, Nemotron-H's engine/models/nemotron_h.py.

Must not: import torch, Megatron or vLLM (the planner runs on a login node); translate anything itself.

Test: tests/unit/test_families.py (refusals name the cause; moe_shape of each MoE family; the planner's Mixtral,
GLM-4.5, GPT-OSS and DeepSeek-V3 shapes give the published parameter counts).
"""

from __future__ import annotations

from engine.models.cohere2 import COHERE2_MODEL_TYPES, check_cohere2
from engine.models.deepseek_v3 import check_deepseek_v3
from engine.models.gemma import GEMMA_MODEL_TYPES, check_gemma
from engine.models.nemotron_h import NEMOTRON_H_MODEL_TYPES, check_nemotron_h, has_moe_layers

SUPPORTED_MODEL_TYPES = (("qwen2", "llama", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "gpt_oss") + GEMMA_MODEL_TYPES
                         + COHERE2_MODEL_TYPES + ("deepseek_v3",) + NEMOTRON_H_MODEL_TYPES)
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "deepseek_v3")
"""Families with routed-expert MLPs: in every layer, except GLM-4.5's dense first `first_k_dense_replace` layers."""

MISSING_FEATURES: dict[str, str] = {}
"""Families the engine does not build yet, with what the translation lacks (issue #30): named when one is refused."""

_MOE_FIELDS = {"qwen3_moe": ("num_experts", "moe_intermediate_size"),
               "mixtral": ("num_local_experts", "intermediate_size"),
               "glm4_moe": ("n_routed_experts", "moe_intermediate_size"),
               "gpt_oss": ("num_local_experts", "intermediate_size"),
               "deepseek_v3": ("n_routed_experts", "moe_intermediate_size")}


def check_model_type(hf_config) -> None:
    """Refuse a model family the engine does not build, naming the ones it does and, for a known family, what is
    missing; refuse a quantised checkpoint (`check_quantization`); and refuse the Mixtral settings it would not
    reproduce (a sliding window shorter than the context, the training-time router jitter). `hf_config` is a transformers config (or anything with its attributes).

    Raises:
        ValueError naming `model.name_or_path`, the model_type and the cause.
    """
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        missing = f" (missing: {MISSING_FEATURES[model_type]})" if model_type in MISSING_FEATURES else ""
        raise ValueError(f"model.name_or_path: model_type {model_type!r} ({type(hf_config).__name__}) is not "
                         f"supported{missing}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    check_quantization(hf_config)
    if model_type in _GLM_LIKE:
        _check_glm4_moe(hf_config)
    if model_type == "deepseek_v3":
        check_deepseek_v3(hf_config)
    if model_type == "gpt_oss":
        check_gpt_oss(hf_config)
    if model_type in GEMMA_MODEL_TYPES:
        check_gemma(hf_config)
    if model_type in COHERE2_MODEL_TYPES:
        check_cohere2(hf_config)
    if model_type in NEMOTRON_H_MODEL_TYPES:
        check_nemotron_h(hf_config)
        if moe_shape(hf_config)[0]:  # its MoE layers' router is GLM-4.5's
            _check_glm4_moe(hf_config)
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


_DEQUANTIZE_ADVICE = {
    "fp8": ("its float8_e4m3fn weights come in 128 x 128 blocks with a `weight_scale_inv` tensor beside each "
            "(DeepSeek-V3 / R1, Kimi K2, the -FP8 releases), which the engine's loader does not dequantise; convert "
            "it to bf16 first with DeepSeek's inference/fp8_cast_bf16.py (github.com/deepseek-ai/DeepSeek-V3; a GPU "
            "Triton kernel), then delete quantization_config from the copied config.json, or use a published bf16 "
            "conversion. NOTE: transformers 5.19's FineGrainedFP8Config(dequantize=True) refuses DeepSeek-V3's "
            "kv_a_proj_with_mqa (576 rows in ceil(576 / 128) = 5 scale blocks); it works where every weight "
            "dimension is a multiple of 128"),
    "mxfp4": ("the MXFP4 expert blocks are not loaded; dequantise the checkpoint to bf16 first (transformers: "
              "Mxfp4Config(dequantize=True), then save_pretrained)"),
}
"""What to do instead, per `quant_method`, for the quantised checkpoints labs post-train (DeepSeek-V3's FP8, GPT-OSS's
MXFP4); any other method gets the generic advice of `check_quantization`."""


def check_quantization(hf_config) -> None:
    """Refuse a quantised checkpoint (a config with a `quantization_config`), whatever the family: the engine loads,
    trains and exports unquantised weights only (its loader would otherwise read packed blocks or float8 values as
    weights, or fail on a missing name). The message names the family, the method and what to do instead.

    Raises:
        ValueError naming `model.name_or_path`, the model_type, the quant_method and the conversion to run.
    """
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    advice = _DEQUANTIZE_ADVICE.get(str(method), (
        f"the engine loads unquantised weights only and does not dequantise {method} checkpoints; load it in "
        "transformers with its dequantising option (or take the unquantised release) and save_pretrained a bf16 "
        "copy without quantization_config"))
    raise ValueError(f"model.name_or_path: {hf_config.model_type} with quantization_config ({method}): {advice}")


def _check_glm4_moe(hf_config) -> None:
    """Refuse the GLM-4.5 MoE (and DeepSeek-V3) router settings Megatron's sigmoid router computes differently: it
    always renormalises the top-k weights (HF only with `norm_topk_prob`), and it scores an expert group by the sum
    of its top (top-k / topk_group) experts where HF sums the group's top 2 (GLM-4.5's n_group=1 makes both moot;
    DeepSeek-V3's 8 of 256 experts, 4 of 8 groups: both take the top 2)."""
    top_k, groups, group_top_k = hf_config.num_experts_per_tok, hf_config.n_group, hf_config.topk_group
    if not hf_config.norm_topk_prob and top_k > 1:
        raise ValueError(f"model.name_or_path: {hf_config.model_type} with norm_topk_prob=false: Megatron's sigmoid "
                         "router always renormalises the top-k weights; only norm_topk_prob true (GLM-4.5's and "
                         "DeepSeek-V3's own) is supported")
    if groups > 1 and top_k // group_top_k != 2:
        raise ValueError(f"model.name_or_path: {hf_config.model_type} with n_group={groups}, topk_group="
                         f"{group_top_k}, num_experts_per_tok={top_k}: Megatron scores a group by its top num_experts_per_tok // "
                         f"topk_group = {top_k // group_top_k} experts, HF by its top 2; only n_group 1 or "
                         "num_experts_per_tok = 2 x topk_group is supported")


def check_gpt_oss(hf_config) -> None:
    """Refuse GPT-OSS settings the translation would not reproduce: layer types other than sliding / full attention,
    a RoPE other than default or YaRN, an explicit YaRN attention_factor (its MXFP4 checkpoint: `check_quantization`).

    Raises:
        ValueError naming `model.name_or_path`, the setting and the cause.
    """
    kinds = set(hf_config.layer_types)
    if not kinds <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"model.name_or_path: gpt_oss with layer_types {sorted(kinds)}: only sliding_attention and "
                         "full_attention are translated")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope.get("attention_factor") is not None:
        raise ValueError(f"model.name_or_path: gpt_oss with rope_parameters.attention_factor="
                         f"{rope['attention_factor']}: Megatron derives YaRN's attention factor from the factor (and "
                         "mscale / mscale_all_dim); an explicit one is not translated")
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"model.name_or_path: gpt_oss with rope_type {rope_type!r}: only yarn (GPT-OSS's own) and "
                         "default are translated")


def dense_layers(hf_config) -> int:
    """How many first decoder layers of an MoE family are dense (GLM-4.5's `first_k_dense_replace`; 0 otherwise)."""
    return int(getattr(hf_config, "first_k_dense_replace", 0) or 0) if hf_config.model_type in _GLM_LIKE else 0


def shared_expert_width(hf_config) -> int:
    """The always-on shared expert's MLP width (GLM-4.5: n_shared_experts x moe_intermediate_size; 0 = none)."""
    if hf_config.model_type in NEMOTRON_H_MODEL_TYPES:  # one shared expert of its own width (n_shared_experts unread)
        return int(hf_config.moe_shared_expert_intermediate_size) if moe_shape(hf_config)[0] else 0
    if hf_config.model_type not in _GLM_LIKE:
        return 0
    return int(getattr(hf_config, "n_shared_experts", 0) or 0) * int(hf_config.moe_intermediate_size)


_GLM_LIKE = ("glm4_moe", "deepseek_v3")
"""Families with dense first layers, a shared expert and GLM-4.5's sigmoid group-limited router (DeepSeek-V3's MLA:
engine/models/deepseek_v3.py)."""


def has_routed_experts(values: dict) -> bool:
    """Whether a config.json (a dict; a multimodal one's `text_config`) names routed experts (the engine's rollout
    then returns the routes: engine/rollout/vllm_engine.py); Nemotron-H by its layer kinds."""
    values = values.get("text_config", values)
    if values.get("model_type") in NEMOTRON_H_MODEL_TYPES:
        return has_moe_layers(values)
    return any(values.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def moe_shape(hf_config) -> tuple[int, int, int]:
    """(routed experts per layer, experts per token, each expert's MLP width) of an MoE family's HF config, (0, 0, 0)
    for a dense one. Qwen3-MoE names them num_experts / num_experts_per_tok / moe_intermediate_size; Mixtral
    num_local_experts / num_experts_per_tok / intermediate_size (its only MLP width); GLM-4.5 n_routed_experts /
    num_experts_per_tok / moe_intermediate_size. `hf_config` is a config object
    or anything with those attributes (the planner passes a namespace over config.json)."""
    if hf_config.model_type in NEMOTRON_H_MODEL_TYPES:  # n_routed_experts is set (8) even without MoE layers
        if "moe" not in (getattr(hf_config, "layers_block_type", None) or []):
            return 0, 0, 0
        return (int(hf_config.n_routed_experts), int(hf_config.num_experts_per_tok),
                int(hf_config.moe_intermediate_size))
    if hf_config.model_type not in _MOE_FIELDS:
        return 0, 0, 0
    experts, width = _MOE_FIELDS[hf_config.model_type]
    return int(getattr(hf_config, experts)), int(hf_config.num_experts_per_tok), int(getattr(hf_config, width))
