"""The registry of model families: one `FamilySpec` per folder under engine/models/, looked up by HF `model_type`.

Owns: `FAMILIES` (every family the engine builds, in the order the tiny models and error messages list them),
`family_spec` (a model_type's spec), `SUPPORTED_MODEL_TYPES` / `MOE_MODEL_TYPES`, the refusal of any other family
(`check_model_type`, naming the supported ones and, for a family labs post-train, what the translation lacks:
`MISSING_FEATURES`), the check of a quantised checkpoint of any family (`check_quantization`: block-wise
FP8 and MXFP4 load, any other is refused naming the method and the conversion to run), and the MoE facts the
policy, the converter and the planner read under one name whatever the family calls them (`moe_shape`,
`dense_layers`, `shared_expert_width`, `has_routed_experts`) and the attention's (`has_qkv_bias`, `has_qk_norm`).
What differs per family is its folder's `SPEC` (engine/models/family_spec.py says what a spec holds); nothing here
names a family.

Adding a family: a folder `engine/models/<family>/` whose `__init__` exports `SPEC`, listed in `FAMILIES`, with its
tests.

Must not: import torch, Megatron or vLLM (the planner runs on a login node); translate anything itself.

Test: tests/unit/test_families.py (refusals name the cause; moe_shape of each MoE family; the planner's MoE shapes
give the published parameter counts).
"""

from __future__ import annotations

from engine.models import (
    cohere2,
    deepseek_v3,
    gemma,
    glm4_moe,
    gpt_oss,
    llama,
    mixtral,
    nemotron_h,
    qwen2,
    qwen3,
    qwen3_moe,
)
from engine.models.family_spec import FamilySpec

FAMILIES: tuple[FamilySpec, ...] = tuple(module.SPEC for module in (
    qwen2, llama, qwen3, qwen3_moe, mixtral, glm4_moe, gpt_oss, gemma, deepseek_v3, cohere2, nemotron_h))
"""Every family the engine builds, one folder each."""

_BY_MODEL_TYPE = {model_type: spec for spec in FAMILIES for model_type in spec.model_types}

SUPPORTED_MODEL_TYPES = tuple(_BY_MODEL_TYPE)
MOE_MODEL_TYPES = tuple(t for spec in FAMILIES if spec.moe_fields is not None for t in spec.model_types)
"""Families with routed-expert MLPs in every layer (except dense first `dense_layers`)."""

INTERLEAVED_GATE_UP = tuple(t for spec in FAMILIES if spec.interleaved_gate_up for t in spec.model_types)
"""MoE families whose stacked `mlp.experts.gate_up_proj` interleaves gate and up (the others hold [gate; up] /
(E, h, f), Megatron's fc1 / fc2 row for row): an exported expert adapter's lora_B rows follow."""

NON_GATED_FAMILIES = ", ".join(t for spec in FAMILIES if not spec.gated_mlp for t in spec.model_types)
"""The model_types whose MLPs are not gated (their spec's `gated_mlp`): LoRA adapters on them are refused naming
these (engine/policy/lora.py)."""

MISSING_FEATURES: dict[str, str] = {}
"""Families the engine does not build yet, with what the translation lacks: named when one is refused."""


def family_spec(model_type: str) -> FamilySpec:
    """The spec of a supported model_type (KeyError for another: `check_model_type` refuses those first)."""
    return _BY_MODEL_TYPE[model_type]


def spec_or_default(model_type: str | None) -> FamilySpec:
    """The spec of `model_type`, or the Llama-shaped defaults for one the registry does not know (the planner sizes
    any config.json)."""
    return _BY_MODEL_TYPE.get(model_type) or FamilySpec(name="", model_types=())


def check_model_type(hf_config) -> None:
    """Refuse a model family the engine does not build, naming the ones it does and, for a known family, what is
    missing; refuse a quantised checkpoint the loader does not read (`check_quantization`); then the family's own
    refusals (its spec's `check`). `hf_config` is a transformers config (or anything with its attributes).

    Raises:
        ValueError naming `model.name_or_path`, the model_type and the cause.
    """
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        missing = f" (missing: {MISSING_FEATURES[model_type]})" if model_type in MISSING_FEATURES else ""
        raise ValueError(f"model.name_or_path: model_type {model_type!r} ({type(hf_config).__name__}) is not "
                         f"supported{missing}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    check_quantization(hf_config)
    family_spec(model_type).check(hf_config)


FP8_BLOCK = (128, 128)
"""The FP8 block layout the loader reads (DeepSeek-V3 / R1, Kimi-K2, the Qwen3 -FP8 releases; vLLM's block-wise FP8)."""

_DEQUANTIZE = ("load it in transformers with its dequantising option (or take the unquantised release) and "
               "save_pretrained a bf16 copy without quantization_config")


def _describe(quant: dict) -> str:
    """The method of a quantization_config and what distinguishes it (NVFP4 hides under modelopt's `quant_algo` or
    compressed-tensors' `format`; FP8 under its scales)."""
    method = str(getattr(quant.get("quant_method"), "value", quant.get("quant_method")))
    extra = [f"{key}={quant[key]!r}" for key in ("quant_algo", "format", "bits", "weight_block_size", "scale_fmt")
             if quant.get(key) is not None]
    return f"{method}: {', '.join(extra)}" if extra else method


def check_quantization(hf_config) -> None:
    """Accept the quantised checkpoints the loader dequantises (engine/policy/quantized_checkpoint.py): block-wise FP8
    in 128 x 128 blocks with float32 `weight_scale_inv` (`quant_method: fp8`, `weight_block_size: [128, 128]`) and
    GPT-OSS's MXFP4 (`quant_method: mxfp4`); refuse any other (FP8 of another block size, per-tensor or per-channel,
    ue8m0 scales, NVFP4, AWQ, GPTQ, bitsandbytes, ...), whatever the family, naming the method and what to do.

    Raises:
        ValueError naming `model.name_or_path`, the model_type, the quant_method and the conversion to run.
    """
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = str(getattr(quant.get("quant_method"), "value", quant.get("quant_method")))
    block = quant.get("weight_block_size")
    if method == "mxfp4" or (method == "fp8" and block and tuple(int(v) for v in block) == FP8_BLOCK
                             and quant.get("scale_fmt") in (None, "float32")):
        return
    if method == "fp8" and not block:
        cause = "FP8 without weight_block_size (per-tensor or per-channel scales) is not read"
    elif method == "fp8" and quant.get("scale_fmt") not in (None, "float32"):
        cause = f"FP8 with scale_fmt {quant['scale_fmt']!r} is not read (only float32 weight_scale_inv)"
    elif method == "fp8":
        cause = f"FP8 in {list(block)} blocks is not read (only 128 x 128 blocks)"
    else:
        cause = "the loader dequantises block-wise FP8 (128 x 128) and MXFP4 only"
    raise ValueError(f"model.name_or_path: {hf_config.model_type} with quantization_config ({_describe(quant)}): "
                     f"{cause}; {_DEQUANTIZE}")


def has_qkv_bias(hf_config) -> bool:
    """A bias on the q / k / v projections: the config's `attention_bias`, else the family's default (a config
    without the field: its spec's `qkv_bias_default`)."""
    spec = _BY_MODEL_TYPE.get(hf_config.model_type)
    return bool(getattr(hf_config, "attention_bias", spec is not None and spec.qkv_bias_default))


def has_qk_norm(hf_config) -> bool:
    """A per-head RMSNorm on queries and keys before RoPE (HF `q_norm` / `k_norm`; Megatron's `qk_layernorm`, norms
    over kv_channels = head_dim): the family's spec says so for its model_type (`qk_norm_types`), or the config does
    (`use_qk_norm`: GLM-4.5 true, GLM-4.5-Air false)."""
    spec = _BY_MODEL_TYPE.get(hf_config.model_type)
    return (spec is not None and hf_config.model_type in spec.qk_norm_types) or bool(getattr(hf_config, "use_qk_norm",
                                                                                                  False))


def dense_layers(hf_config) -> int:
    """How many first decoder layers of an MoE family are dense (GLM-4.5's `first_k_dense_replace`; 0 otherwise)."""
    spec = _BY_MODEL_TYPE.get(hf_config.model_type)
    return spec.dense_layers(hf_config) if spec else 0


def shared_expert_width(hf_config) -> int:
    """The always-on shared expert's MLP width (GLM-4.5: n_shared_experts x moe_intermediate_size; 0 = none)."""
    spec = _BY_MODEL_TYPE.get(hf_config.model_type)
    return spec.shared_expert_width(hf_config) if spec else 0


def has_routed_experts(values: dict) -> bool:
    """Whether a config.json (a dict; a multimodal one's `text_config`) names routed experts (the engine's rollout
    then returns the routes: engine/rollout/vllm_engine.py); a family may say so by its layer kinds instead."""
    values = values.get("text_config", values)
    spec = _BY_MODEL_TYPE.get(values.get("model_type"))
    if spec is not None and spec.has_routed_experts is not None:
        return spec.has_routed_experts(values)
    return any(values.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def moe_shape(hf_config) -> tuple[int, int, int]:
    """(routed experts per layer, experts per token, each expert's MLP width) of an MoE family's HF config, (0, 0, 0)
    for a dense one, read under the family's own field names (its spec's `moe_fields`, or its `moe_shape` hook).
    `hf_config` is a config object or anything with those attributes (the planner passes a namespace over
    config.json)."""
    spec = _BY_MODEL_TYPE.get(hf_config.model_type)
    if spec is None or not spec.is_moe:
        return 0, 0, 0
    if spec.moe_shape is not None:
        return spec.moe_shape(hf_config)
    experts, width = spec.moe_fields
    return int(getattr(hf_config, experts)), int(hf_config.num_experts_per_tok), int(getattr(hf_config, width))
