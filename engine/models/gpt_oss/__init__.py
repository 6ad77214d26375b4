"""GPT-OSS (HF `gpt_oss`): alternating sliding-window / full attention with learned sinks and biases, YaRN RoPE,
routed experts with biases and a clamped SwiGLU, its experts stacked in one HF tensor per layer.

Owns: `SPEC`, the family's facts for the registry (engine/models/families.py): the settings refused (`check_gpt_oss`;
its MXFP4 checkpoint loads: engine/policy/quantized_checkpoint.py), its MoE field names, its tiny config and the
tiny model's random biases and sinks. The torch pieces (TransformerConfig keywords, the layer-spec swaps, the stacked
expert conversions: engine/models/stacked_experts.py) are engine/models/gpt_oss/layers.py, re-exported here on first
use so that this module stays free of torch (the planner imports it).

Must not: import torch, Megatron or vLLM at module level.

Test: tests/unit/test_gpt_oss.py (refusals, conversions), tests/unit/test_families.py, tests/unit/test_tiny_model.py.
"""

from __future__ import annotations

import importlib

from engine.models.family_spec import (
    TINY_MOE_EXPERTS,
    TINY_MOE_FFN,
    TINY_MOE_TOP_K,
    FamilySpec,
    planner_shape,
    sliding_window_dims,
)
from engine.models.tensor_map import TensorMap

_TORCH_PIECES = {
    **dict.fromkeys(("alpha_swish", "gpt_oss_settings", "yarn_rope_settings", "sliding_window_mask",
                     "windowed_attention_class", "copied_output_row_parallel_class", "gpt_oss_spec"),
                    f"{__name__}.layers"),
    **dict.fromkeys(("EXPERT_PIECE", "STACKED_KINDS", "read_stacked_expert", "stacked_expert_to_hf",
                     "stack_expert_pieces"), "engine.models.stacked_experts"),
}
"""The torch pieces this package hands out -> the module that holds them (imported on first use, so this module
stays free of torch)."""


def __getattr__(name: str):
    """The torch pieces of `_TORCH_PIECES`, imported on first use (PEP 562)."""
    if name in _TORCH_PIECES:
        return getattr(importlib.import_module(_TORCH_PIECES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_gpt_oss(hf_config) -> None:
    """Refuse GPT-OSS settings the translation would not reproduce: layer types other than sliding / full attention,
    a RoPE other than default or YaRN, an explicit YaRN attention_factor (its MXFP4 checkpoint loads, dequantised:
    engine/policy/quantized_checkpoint.py).

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


TINY_GPT_OSS_WINDOW, TINY_GPT_OSS_LIMIT = 4, 0.2
"""The tiny GPT-OSS's sliding window (4 keys: the tests' 12-token rows cross it) and SwiGLU clamp (GPT-OSS's is 7.0;
the tiny model's gate / up values are ~0.2, so 0.2 clamps a part of them and a test sees the clamp)."""


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """GPT-OSS's architecture at the tiny shapes: q/k/v/o biases, learned sinks, sliding-window attention
    (`TINY_GPT_OSS_WINDOW`) on even layers and full attention on odd ones (GPT-OSS's `layer_types`), YaRN RoPE
    (factor 16 over 64 original positions), 4 experts of width 64, top-2, with router and expert biases and the
    clamped SwiGLU (alpha 1.702, limit `TINY_GPT_OSS_LIMIT`)."""
    rope = {"rope_type": "yarn", "rope_theta": common["rope_theta"], "factor": 16.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
    common = {k: v for k, v in common.items() if k not in ("rope_theta", "hidden_act")}
    return dict(**{**common, "intermediate_size": TINY_MOE_FFN},
                head_dim=common["hidden_size"] // common["num_attention_heads"], num_local_experts=TINY_MOE_EXPERTS,
                num_experts_per_tok=TINY_MOE_TOP_K, sliding_window=TINY_GPT_OSS_WINDOW, rope_parameters=rope,
                attention_bias=True, swiglu_limit=TINY_GPT_OSS_LIMIT, router_aux_loss_coef=0.001)


def randomise_tiny_inits(model) -> None:
    """The expert biases N(0, 0.1^2) and the attention sinks N(0, 1), where HF initialises zeros."""
    import torch

    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                tensor.copy_(0.1 * torch.randn(tensor.shape))
            elif name.endswith("self_attn.sinks"):
                tensor.copy_(torch.randn(tensor.shape))


MOE_TENSORS = (
    TensorMap("decoder.layers.{i}.mlp.router.weight", ("model.layers.{i}.mlp.router.weight",), "replicated"),
    TensorMap("decoder.layers.{i}.mlp.router.bias", ("model.layers.{i}.mlp.router.bias",), "replicated"),
    TensorMap("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight",
              ("model.layers.{i}.mlp.experts.gate_up_proj",), "stacked_gate_up"),
    TensorMap("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.bias",
              ("model.layers.{i}.mlp.experts.gate_up_proj_bias",), "stacked_gate_up"),
    TensorMap("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight",
              ("model.layers.{i}.mlp.experts.down_proj",), "stacked_row"),
    TensorMap("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.bias",
              ("model.layers.{i}.mlp.experts.down_proj_bias",), "stacked_replicated"),
)
"""The MoE MLP's HF <-> Megatron names: a router with a bias; every expert's tensors stacked in one HF tensor per
layer (`stacked_*` kinds: engine/models/gpt_oss/layers.py), with biases on both expert linears."""

ATTENTION_TENSORS = (
    TensorMap("decoder.layers.{i}.self_attention.linear_proj.bias", ("model.layers.{i}.self_attn.o_proj.bias",),
              "replicated"),
    TensorMap("decoder.layers.{i}.self_attention.core_attention.softmax_offset", ("model.layers.{i}.self_attn.sinks",),
              "column"),
)
"""The attention beyond Llama's: the output projection's bias and the learned per-head sinks (Megatron's
`softmax_offset`, split over TP by head)."""


def transformer_settings(hf_config) -> dict:
    """layers.py `gpt_oss_settings`: biases, sinks, sliding windows, the clamped SwiGLU."""
    from engine.models.gpt_oss.layers import gpt_oss_settings

    return gpt_oss_settings(hf_config)


def rope_settings(hf_config) -> dict | None:
    """YaRN's GPTModel keywords (layers.py `yarn_rope_settings`); None (the Llama-shaped RoPE) without YaRN."""
    from engine.models.gpt_oss.layers import yarn_rope_settings

    yarn = yarn_rope_settings(hf_config)
    return None if yarn is None else yarn[0]


def finish_transformer_config(config, hf_config, tp_size: int, pp_size: int):
    """The YaRN attributes GPTModel's YarnRotaryEmbedding and attention read with getattr (not config fields)."""
    from engine.models.gpt_oss.layers import yarn_rope_settings

    for name, value in (yarn_rope_settings(hf_config) or ({}, {}))[1].items():
        setattr(config, name, value)
    return config


def layer_spec(spec, row_parallel, hf_config):
    """GPT-OSS's attention and expert pieces swapped in (engine/models/gpt_oss/layers.py `gpt_oss_spec`)."""
    from engine.models.gpt_oss.layers import gpt_oss_spec

    return gpt_oss_spec(spec, row_parallel)


def rope_fusable(hf_config) -> bool:
    """The fused RoPE kernel computes the default RoPE, not YaRN."""
    from engine.models.gpt_oss.layers import yarn_rope_settings

    return yarn_rope_settings(hf_config) is None


def _shape(layers, experts):
    return planner_shape(2880, layers, 64, 8, 2880, 201088, False, True, head_dim=64, num_experts=experts,
                         num_experts_per_tok=4, moe_intermediate_size=2880, linear_bias=True, sinks=True,
                         sliding_window=128, sliding_layers=layers // 2)


PLANNER_MODELS = {
    "openai/gpt-oss-120b": _shape(36, 128),
    "openai/gpt-oss-20b": _shape(24, 32),
    "builtin:tiny-gpt_oss": planner_shape(128, 4, 4, 2, 64, 400, False, True, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=64, linear_bias=True, sinks=True, sliding_window=4,
                                          sliding_layers=2),
}
"""The planner's shapes of gpt-oss-120b and gpt-oss-20b from their config.json (hidden 2880, 64 heads of 64, 8 KV
heads, experts of width 2880, top-4, vocabulary 201,088): 116,829,156,672 and 20,914,757,184 parameters, the model
card's 116.83B / 20.91B (its MXFP4 checkpoint stores the same counts quantised); and the tiny GPT-OSS."""


SPEC = FamilySpec(planner_models=PLANNER_MODELS, name="gpt_oss", model_types=("gpt_oss",), check=check_gpt_oss,
                  moe_fields=("num_local_experts", "intermediate_size"), moe_tensors=MOE_TENSORS,
                  attention_tensors=ATTENTION_TENSORS, interleaved_gate_up=True,
                  transformer_settings=transformer_settings, finish_transformer_config=finish_transformer_config,
                  rope_settings=rope_settings, layer_spec=layer_spec, rope_fusable=rope_fusable,
                  planner_dims=lambda values: {"linear_bias": True, "sinks": True, **sliding_window_dims(values)},
                  vllm_hf_names=(("GptOssForCausalLM", ((".attn.", ".self_attn."),
                                                        ("model.embedding.", "model.embed_tokens."))),),
                  vllm_receiver=f"{__name__}.vllm:GptOssReceiver",
                  vllm_module_parts=("GptOssRoutedExperts", f"{__name__}.vllm:gpt_oss_expert_parts"),
                  vllm_warning=f"{__name__}.vllm:gpt_oss_engine_mismatch",
                  tiny_config=tiny_config,
                  randomise_tiny_inits=randomise_tiny_inits)
