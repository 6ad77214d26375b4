"""GPT-OSS's torch pieces (its spec, refusals and tiny config: engine/models/gpt_oss/__init__.py): what the family
needs beyond the Llama-shaped translation of engine/policy/model.py.

Owns: GPT-OSS's TransformerConfig
keywords (`gpt_oss_settings`: q/k/v/o and expert biases, the router bias, learned per-head attention sinks, the
alternating sliding-window / full layers of `layer_types`, the clamped SwiGLU with the (up + 1) form, YaRN RoPE and
its attention factor: `yarn_rope_settings`); the layer-spec pieces it swaps into Megatron's local spec (`gpt_oss_spec`:
`WindowedDotProductAttention`, the experts' `CopiedOutputRowParallel`). Its stacked expert tensors (HF stores all
experts of a layer in one tensor, transposed, gate and up interleaved) are a layout kind of the shared converter:
engine/models/stacked_experts.py.

Must not: import Megatron at module level (the planner and the converter import this module), read Megatron's
global parallel state, or know vLLM's layout.

Test: tests/distributed/test_family_layouts.py (logits = HF at EP1 / EP2 / TP2 x EP2 / PP2, export byte-exact, GRPO
step at EP2 = EP1), tests/unit/test_gpt_oss.py (conversions round trip; refusals; the sliding-window mask).
"""

from __future__ import annotations

import functools

import torch

from engine.models.gpt_oss import check_gpt_oss


def alpha_swish(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """GPT-OSS's gate activation x * sigmoid(alpha * x) (alpha 1.702: Megatron's quick_gelu)."""
    return x * torch.sigmoid(alpha * x)


def gpt_oss_settings(hf_config) -> dict:
    """TransformerConfig keywords for GPT-OSS ({} for other families); they override the Llama-shaped ones.

    Biases on q / k / v / o, the router and both expert linears (`add_bias_linear`: GPT-OSS has no dense MLP);
    learned per-head sinks (`softmax_type="learnable"`: a sink logit joins each row's softmax and is dropped, as HF's
    `sinks`); sliding-window attention on the `layer_types` "sliding_attention" layers (HF's window of `sliding_window`
    keys, the query's own included, is Megatron's (sliding_window - 1, 0)); the clamped SwiGLU: gate clamped above at
    `swiglu_limit`, up clamped to +-limit, gate * sigmoid(`swiglu_alpha` * gate) * (up + 1) (Megatron's
    `activation_func_clamp_value` and `glu_linear_offset`, computed by its unfused GLU: bias-activation fusion off);
    YaRN RoPE: `yarn_rope_settings`.
    """
    if hf_config.model_type != "gpt_oss":
        return {}
    check_gpt_oss(hf_config)  # engine/models/gpt_oss/__init__.py: the settings not translated
    window = [int(kind == "sliding_attention") for kind in hf_config.layer_types]
    settings = dict(
        add_bias_linear=True,
        add_qkv_bias=True,
        softmax_type="learnable",
        activation_func=functools.partial(alpha_swish, alpha=float(hf_config.swiglu_alpha)),
        activation_func_clamp_value=float(hf_config.swiglu_limit),
        glu_linear_offset=1.0,
        bias_activation_fusion=False,
    )
    if any(window) and hf_config.sliding_window:
        settings |= dict(window_size=(int(hf_config.sliding_window) - 1, 0), window_attn_skip_freq=window)
    return settings


def yarn_rope_settings(hf_config) -> dict | None:
    """GPTModel's keywords and the config attributes its YarnRotaryEmbedding and attention read, for a GPT-OSS YaRN
    config (None otherwise): ({"position_embedding_type": "yarn", "rotary_base": theta}, {"yarn_rotary_scaling_factor": ...}).

    The frequencies are HF's (the same ramp between `beta_fast` and `beta_slow` rotations over the original
    positions); HF's `truncate` (default true) is Megatron's `correction_range_round_to_int`. The attention factor
    HF multiplies cos and sin by, 0.1 ln(factor) + 1 (or the mscale / mscale_all_dim ratio), is what megatron-core
    0.16.1's attention applies from these attributes (`_yarn_get_concentration_factor_from_config`: mscale None =
    from the factor alone); an explicit `attention_factor` is refused (engine/models/gpt_oss/__init__.py check_gpt_oss)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if hf_config.model_type != "gpt_oss" or params.get("rope_type") != "yarn":
        return None  # YaRN is translated (and compared with HF) for GPT-OSS only
    original = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or hf_config.max_position_embeddings / original)
    attributes = dict(yarn_rotary_scaling_factor=factor, yarn_original_max_position_embeddings=original,
                      yarn_beta_fast=float(params.get("beta_fast") or 32), yarn_beta_slow=float(params.get("beta_slow")
                                                                                             or 1),
                      yarn_mscale=params.get("mscale"), yarn_mscale_all_dim=params.get("mscale_all_dim"),
                      yarn_correction_range_round_to_int=bool(params.get("truncate", True)))
    return {"position_embedding_type": "yarn", "rotary_base": float(params["rope_theta"])}, attributes


def sliding_window_mask(sq: int, sk: int, window: int, device=None) -> torch.Tensor:
    """(sq, sk) bool, True = masked: query q (aligned to the last key) sees keys k with q - window <= k <= q."""
    q = torch.arange(sq, device=device)[:, None] + (sk - sq)  # (sq, 1)
    k = torch.arange(sk, device=device)[None, :]  # (1, sk)
    return (k > q) | (k < q - window)


@functools.cache
def windowed_attention_class():
    """Megatron's DotProductAttention whose sliding window combines with the mask it is given, and whose sinks are
    marked as split over TP by head.

    NOTE: megatron-core 0.16.1's FusedScaleMaskSoftmax replaces the attention mask by the sliding-window causal mask
    in a windowed layer (`forward_torch_softmax`: `if self.window_size is not None: mask = ...`), so packed rows
    (engine/policy/packing.py's block-diagonal mask) would attend across sequences there. This class keeps the
    window out of the softmax and ORs it into the mask instead. Its learnable `softmax_offset` (the sinks, one per
    local head) carries no TP attributes in Megatron, so the gradient norm, the converter and the init would take it
    for a replicated tensor: it is marked split along dim 0.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class WindowedDotProductAttention(DotProductAttention):
        """DotProductAttention with the sliding window applied on top of the given mask (see the factory)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.window = self.scale_mask_softmax.window_size
            self.scale_mask_softmax.window_size = None
            if isinstance(self.softmax_offset, torch.nn.Parameter):
                self.softmax_offset.tensor_model_parallel = True
                self.softmax_offset.partition_dim, self.softmax_offset.partition_stride = 0, 1

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            if self.window is not None:
                window = sliding_window_mask(query.size(0), key.size(0), self.window[0], query.device)  # (sq, sk)
                attention_mask = window if attention_mask is None else attention_mask | window
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return WindowedDotProductAttention


@functools.cache
def copied_output_row_parallel_class(base):
    """`base` (a RowParallelLinear) returning a fresh output tensor when it also returns a bias.

    NOTE: megatron-core 0.16.1's MLP adds an expert's fc2 bias in place (`output += output_bias * probs`, mlp.py);
    at TP1 the row-parallel reduction returns its input as a view, which autograd refuses to modify in place
    ("a view ... is being modified inplace"): expert biases (GPT-OSS) failed in the backward
    (benchmarks/megatron_features.py). The copy costs one (tokens, H) tensor per expert.

    NOTE: megatron-core 0.16.1's RowParallelLinear marks its bias `sequence_parallel` under SP, experts' too, so
    `finalize_model_grads` sums an expert's fc2-bias gradient over the attention's TP group: at TP2 x EP2 that adds
    another rank's expert's gradient to it (the GRPO step's grad norm was 0.16% off EP1). An expert's tokens all
    reach its own rank through the dispatcher, so its bias gradient is whole: the mark is removed for experts.
    """

    class CopiedOutputRowParallel(base):
        """See `copied_output_row_parallel_class`."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.bias is not None and self.is_expert:
                self.bias.sequence_parallel = False

        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            return (output.clone() if bias is not None else output), bias

    return CopiedOutputRowParallel


def gpt_oss_spec(spec, row_parallel):
    """The local MoE layer spec with GPT-OSS's pieces: `WindowedDotProductAttention` as the core attention, the
    experts' fc2 returning a copied output (`copied_output_row_parallel_class(row_parallel)`)."""
    import dataclasses

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    layer = spec.submodules
    if layer.self_attention.submodules.core_attention is not DotProductAttention:
        raise ValueError("gpt_oss is built on Megatron's local spec only (its sinks, window and expert biases are "
                         "wired there): set model.transformer_impl: local")
    attention = dataclasses.replace(layer.self_attention, submodules=dataclasses.replace(
        layer.self_attention.submodules, core_attention=windowed_attention_class()))
    experts = layer.mlp.submodules.experts
    experts = dataclasses.replace(experts, submodules=dataclasses.replace(
        experts.submodules, linear_fc2=copied_output_row_parallel_class(row_parallel)))
    mlp = dataclasses.replace(layer.mlp, submodules=dataclasses.replace(layer.mlp.submodules, experts=experts))
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer, self_attention=attention, mlp=mlp))
