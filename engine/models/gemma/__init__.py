"""Gemma 3 (text) and Gemma 2: what the engine needs to know about their HF configs, without torch or Megatron.

Owns, for `GEMMA_MODEL_TYPES` (HF `gemma3_text`, Gemma3ForCausalLM; `gemma2`): `check_gemma` (the settings refused,
each naming the cause: a non-positive final-logit soft-cap, Gemma 3's attention soft-capping, bidirectional attention, attention
bias, RoPE other than default on the sliding layers / default or linear on the global ones), `gemma_transformer_settings` (TransformerConfig fields: the softmax
scale `query_pre_attn_scalar` ** -0.5, the sliding window and which layers use it), `gemma_rope_settings` (the global
layers' RoPE), its converter facts (four norms per layer: `ModelDims.sandwich_norms`, named by
engine/models/tensor_map.py `SANDWICH_NORM_NAMES`) and the planner's shapes of its models (`PLANNER_MODELS`). The
Megatron modules are in engine/models/gemma/layers.py.

Must not: import torch, Megatron or vLLM (engine/models/families.py, read by the planner, calls `check_gemma`).

Test: tests/unit/test_families.py (refusals), tests/distributed/test_family_layouts.py (logits = HF at TP1, TP2 + SP
and PP2; export byte-exact; GRPO step TP2 = TP1).
"""

from __future__ import annotations

from engine.models.family_spec import FamilySpec, planner_shape, sliding_window_dims

GEMMA_MODEL_TYPES = ("gemma3_text", "gemma2")
"""Gemma families the policy builds. Gemma 2 = Gemma 3's layer without q/k norms, with one RoPE base and
attention-logit soft-capping; its final-logit soft-capping (`final_logit_softcapping`, 30.0 in every checkpoint) is
applied by the LM-head loss kernel (kernels/, `softcap`), passed from the policy model (engine/policy/model.py)."""

LOCAL_SPEC_REASON = "its norms, layer and sliding-window attention are project modules"
"""Why Gemma is built on Megatron's local spec only (the spec's `local_spec_only`)."""


def check_gemma(hf_config) -> None:
    """Refuse the Gemma settings the translation would not reproduce.

    Raises:
        ValueError naming `model.name_or_path`, the setting and its value.
    """
    final_cap = getattr(hf_config, "final_logit_softcapping", None)
    if final_cap is not None and not final_cap > 0:
        raise ValueError(f"model.name_or_path: {hf_config.model_type} with final_logit_softcapping={final_cap}: the "
                         "cap must be > 0 (logits -> cap tanh(logits / cap)) or null (Gemma 2's checkpoints ship 30.0)")
    if hf_config.model_type == "gemma3_text" and getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"model.name_or_path: gemma3_text with attn_logit_softcapping="
                         f"{hf_config.attn_logit_softcapping}: attention-logit soft-capping is translated for gemma2 "
                         "only (Gemma 3's checkpoints ship null)")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError(f"model.name_or_path: {hf_config.model_type} with use_bidirectional_attention=true: only "
                         "causal attention is supported")
    if getattr(hf_config, "attention_bias", False):
        raise ValueError(f"model.name_or_path: {hf_config.model_type} with attention_bias=true: not translated "
                         "(Gemma 3's checkpoints have no attention bias)")
    if set(hf_config.layer_types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"model.name_or_path: {hf_config.model_type} layer_types {sorted(set(hf_config.layer_types))}"
                         ": only sliding_attention and full_attention are supported")
    local = rope_params(hf_config, "sliding_attention")
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"model.name_or_path: {hf_config.model_type} sliding-layer RoPE {local}: only the default "
                         "RoPE is supported there")
    glob = rope_params(hf_config, "full_attention")
    if glob.get("rope_type", "default") not in ("default", "linear"):
        raise ValueError(f"model.name_or_path: {hf_config.model_type} global-layer RoPE {glob}: only the default and "
                         "linear RoPE are supported")


def rope_params(hf_config, layer_type: str) -> dict:
    """The RoPE dict of one layer type ("sliding_attention" / "full_attention"): transformers 5 keeps one RoPE dict
    per layer type in Gemma 3's `rope_parameters`, one for every layer in Gemma 2's."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    return dict(params.get(layer_type) or {}) if layer_type in params else params


def gemma_rope_settings(hf_config) -> dict:
    """GPTModel's RoPE keywords: the global (full-attention) layers' base and linear scaling factor."""
    glob = rope_params(hf_config, "full_attention")
    settings = {"rotary_base": float(glob["rope_theta"])}
    if glob.get("rope_type") == "linear":  # HF divides inv_freq by the factor; Megatron the positions: the same angles
        settings["seq_len_interpolation_factor"] = float(glob["factor"])
    return settings


def gemma_transformer_settings(hf_config) -> dict:
    """TransformerConfig fields that differ for Gemma: the gelu-tanh gated MLP (no fused bias-activation: Megatron
    fuses only gelu / swiglu), the softmax scale `query_pre_attn_scalar` ** -0.5, and the sliding window of
    `sliding_window` tokens (HF: a query sees the keys less than `sliding_window` positions back, Megatron's
    `window_size` (sliding_window - 1, 0)) on the layers `layer_types` names `sliding_attention`
    (`window_attn_skip_freq` as a per-layer 0 / 1 list)."""
    return dict(
        bias_activation_fusion=False,
        softmax_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        window_size=(int(hf_config.sliding_window) - 1, 0),
        window_attn_skip_freq=[int(t == "sliding_attention") for t in hf_config.layer_types],
    )




TINY_GEMMA_WINDOW, TINY_GEMMA_QUERY_SCALAR = 4, 48
"""The tiny Gemma 3: a sliding window of 4 tokens (shorter than the tests' 12-token rows, so the window masks) and
the attention scale 48 ** -0.5 (not head_dim 32's, so a scale taken from head_dim fails the tests)."""

TINY_GEMMA2_ATTN_SOFTCAP, TINY_GEMMA2_FINAL_SOFTCAP = 0.2, 0.5
"""The tiny Gemma 2's attention-logit and final-logit soft-capping (Gemma 2's own: 50 and 30): small enough to bend
the tiny model's scores and its logits (|logits| up to ~1 uncapped, so tanh(logit / 0.5) is far from linear)."""


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """Gemma 3's text architecture at the tiny shapes: layers sliding, full, sliding, full (so each PP2 stage holds
    one of each), RoPE bases 1e4 (sliding) and 1e6 (full), q/k norms, the four (1 + w) norms per layer, gelu-tanh MLP,
    embeddings x sqrt(128), tied embeddings (Gemma's own; `tie_word_embeddings` is ignored). Gemma 2: the same
    without q/k norms, one RoPE base (1e4), attention logits soft-capped at `TINY_GEMMA2_ATTN_SOFTCAP`, final logits at
    `TINY_GEMMA2_FINAL_SOFTCAP`."""
    common = {k: v for k, v in common.items() if k not in ("rope_theta", "hidden_act", "tie_word_embeddings")}
    shared = dict(**common, head_dim=common["hidden_size"] // common["num_attention_heads"],
                  hidden_activation="gelu_pytorch_tanh", sliding_window=TINY_GEMMA_WINDOW,
                  query_pre_attn_scalar=TINY_GEMMA_QUERY_SCALAR, tie_word_embeddings=True,
                  layer_types=["sliding_attention", "full_attention"] * 2, attention_bias=False)
    if model_type == "gemma2":
        return dict(**shared, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                    attn_logit_softcapping=TINY_GEMMA2_ATTN_SOFTCAP, final_logit_softcapping=TINY_GEMMA2_FINAL_SOFTCAP)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    return dict(**shared, rope_parameters=rope)


def randomise_tiny_inits(model) -> None:
    """The (1 + w) norm weights N(0, 0.1^2), where HF initialises zeros."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.1 * torch.randn(param.shape))


def finish_transformer_config(config, hf_config, tp_size: int, pp_size: int):
    """`gemma_transformer_settings` and the gelu-tanh gated MLP (engine/models/activations.py)."""
    import dataclasses

    from engine.models.activations import gelu_tanh

    return dataclasses.replace(config, activation_func=gelu_tanh, **gemma_transformer_settings(hf_config))


def layer_spec(spec, row_parallel, hf_config):
    """Gemma's layer spec (engine/models/gemma/layers.py `gemma_layer_spec`)."""
    from engine.models.gemma.layers import gemma_layer_spec

    return gemma_layer_spec(spec, row_parallel, hf_config)


def finish_policy_chunk(chunk, hf_config) -> None:
    """sqrt(hidden) embedding scaling (engine/models/gemma/layers.py `scale_embeddings`)."""
    from engine.models.gemma.layers import scale_embeddings

    scale_embeddings(chunk, hf_config.hidden_size)


def planner_dims(values: dict) -> dict:
    """The planner's shape: four norms per layer, the window (Gemma 2's config.json alternates without naming the
    layers: its even layers slide) and Gemma 2's attention-logit soft-capping."""
    window = sliding_window_dims(values, (values["num_hidden_layers"] + 1) // 2 if values.get("model_type") == "gemma2"
                                 else None)
    if window:
        window["attention_softcap"] = (values.get("attn_logit_softcapping") is not None
                                       and values.get("model_type") == "gemma2")
    return {"norms_per_layer": 4, **window}


def fused_modules() -> dict:
    """Its norms and attention the fused kernels replace (engine/models/gemma/layers.py `fused_modules`)."""
    from engine.models.gemma.layers import fused_modules as modules

    return modules()


def _shape(h, layers, heads, kv, ffn, vocab, qk_norm, window, sliding, softcap, head_dim=128):
    return planner_shape(h, layers, heads, kv, ffn, vocab, True, False, head_dim=head_dim, qk_norm=qk_norm,
                         norms_per_layer=4, sliding_window=window, sliding_layers=sliding, attention_softcap=softcap)


_GEMMA2_27B = _shape(4608, 46, 32, 16, 36864, 256000, False, 4096, 23, True)
"""Gemma-2-27B from its config.json (hidden 4608, 46 layers alternating sliding (4096) / global, 32 heads of 128, 16 KV
heads, MLP 36864, vocabulary 256,000, tied, four norms per layer): 27,227,128,320 parameters, the model card's 27.2B."""
_GEMMA3_27B = _shape(5376, 62, 32, 16, 21504, 262208, True, 1024, 52, False)
"""Gemma-3-27B's text decoder (Gemma3ForCausalLM; `text_config` of the multimodal checkpoint: hidden 5376, 62 layers,
5 sliding (1024) per global one, 32 heads of 128, 16 KV heads, q/k norms, MLP 21504, the 262,208 vocabulary, tied):
27,009,346,304 parameters; the checkpoint's 27.4B adds the SigLIP vision tower and projector (not built)."""

PLANNER_MODELS = {
    **{f"google/gemma-2-27b{suffix}": _GEMMA2_27B for suffix in ("", "-it")},
    **{f"google/gemma-3-27b-{suffix}": _GEMMA3_27B for suffix in ("it", "pt")},
    # engine/models/tiny_model.py: layers sliding (window 4) and full alternating, head_dim 32 = 128 / 4
    "builtin:tiny-gemma2": _shape(128, 4, 4, 2, 352, 400, False, 4, 2, True, head_dim=0),
    "builtin:tiny-gemma3_text": _shape(128, 4, 4, 2, 352, 400, True, 4, 2, False, head_dim=0),
}
"""The planner's shapes of Gemma-2-27B, Gemma-3-27B and the tiny Gemmas."""


SPEC = FamilySpec(planner_models=PLANNER_MODELS, name="gemma", model_types=GEMMA_MODEL_TYPES, check=check_gemma, qk_norm_types=("gemma3_text",),
                  finish_transformer_config=finish_transformer_config, rope_settings=gemma_rope_settings,
                  layer_spec=layer_spec, local_spec_only=LOCAL_SPEC_REASON, finish_policy_chunk=finish_policy_chunk,
                  planner_dims=planner_dims, ties_embeddings_by_default=True,
                  converter_dims=lambda hf_config: {"sandwich_norms": True}, fused_modules=fused_modules,
                  tiny_config=tiny_config, randomise_tiny_inits=randomise_tiny_inits)
