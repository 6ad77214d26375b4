"""Cohere 2's layer parts that Megatron-core lacks, as the project's own modules on the local spec.

Owns: `CohereLayerNorm` (LayerNorm with a weight and no bias, computed in float32, exactly HF's Cohere2LayerNorm),
`Cohere2TransformerLayer` (one norm feeding attention and MLP in parallel: h = x + attn(ln(x)) + mlp(ln(x)); RoPE only
on the sliding-window layers), `cohere2_layer_spec` (the local spec with these and the windowed core attention of
engine/models/windowed_attention.py); its TransformerConfig settings are the family's (engine/models/cohere2/).

Why a layer subclass: Megatron's TransformerLayer is sequential (x + attn(ln1(x)), then + mlp(ln2(.))); its parallel
form needs the MLP to read the attention's norm output, which no spec swap gives. Megatron's LayerNorm choices have a
bias: the local spec's WrappedTorchNorm (megatron-core 0.16.1 transformer/torch_norm.py) builds torch.nn.LayerNorm with
its bias and asserts sequence parallelism off; TE's / apex's have one too. A frozen zero bias would still be a
parameter the optimizer, the export and the sync would have to skip, so the norm here has none.

Must not: read Megatron's global parallel state, import vLLM.

Test: tests/distributed/test_family_layouts.py (logits and kernel log-probs = HF at TP1 and TP2 + SP; export
byte-exact; GRPO step at TP2 + SP = TP1), tests/unit/test_families.py (CohereLayerNorm = HF's in bf16, bit for bit).
"""

from __future__ import annotations

import dataclasses

import torch


class CohereLayerNorm(torch.nn.Module):
    """HF's Cohere2LayerNorm: (x - mean) * rsqrt(var + eps) * w, all in float32, cast back to x's dtype; no bias.

    The weight is marked `sequence_parallel` as the local spec's other norms (engine/policy/model.py LocalRMSNorm says
    why)."""

    local_spec_norm = True
    """A norm of Megatron's local spec (engine/policy/model.py builds its blocks and fused swaps around it)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt(variance + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def _layer_class():
    from megatron.core import tensor_parallel
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.core.transformer.utils import is_layer_window_attention
    from megatron.core.utils import make_viewless_tensor

    class Cohere2TransformerLayer(TransformerLayer):
        """TransformerLayer with attention and MLP in parallel off the one input norm (HF's Cohere2DecoderLayer):
        out = (x + attn(ln(x))) + mlp(ln(x)), the residual adds in HF's order. The full-attention layers get no RoPE
        (HF applies it on the sliding layers only). `pre_mlp_layernorm` is Megatron's IdentityOp (unused)."""

        def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            self.sliding = is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                                     self.layer_number)
            if self.recompute_input_layernorm or self.recompute_pre_mlp_layernorm:
                raise ValueError("train.recompute_modules: 'layernorm' is not supported for cohere2 (its one norm "
                                 "feeds both branches)")

        def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                    padding_mask=None, **kwargs):
            kwargs.pop("dynamic_inference_decode_only", None)
            normed = self.input_layernorm(hidden_states)  # (s, b, H), s / tp tokens under SP
            attention = self.self_attention(normed, attention_mask=attention_mask,
                                            rotary_pos_emb=rotary_pos_emb if self.sliding else None, **kwargs)
            if self.recompute_mlp:
                mlp = tensor_parallel.checkpoint(self.mlp, False, normed)
            else:
                mlp = self.mlp(normed)
            with self.bias_dropout_add_exec_handler():
                hidden = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                    attention, hidden_states, self.hidden_dropout)
                hidden = self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
                    mlp, hidden, self.hidden_dropout)
            return make_viewless_tensor(inp=hidden, requires_grad=hidden.requires_grad, keep_graph=True), context

    return Cohere2TransformerLayer


def cohere2_layer_spec(spec):
    """Cohere 2's transformer layer from the local spec (engine/policy/model.py `_layer_spec`): the parallel layer,
    `CohereLayerNorm` as its one norm, no pre-MLP norm, the causal (or block-causal) mask AND the sliding window in the
    core attention (engine/models/windowed_attention.py `windowed_core_attention_class`, without soft-capping)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp

    from engine.models.windowed_attention import windowed_core_attention_class

    layer = spec.submodules
    attention = dataclasses.replace(
        layer.self_attention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=dataclasses.replace(layer.self_attention.submodules, core_attention=windowed_core_attention_class()))
    return dataclasses.replace(spec, module=_layer_class(), submodules=dataclasses.replace(
        layer, input_layernorm=CohereLayerNorm, pre_mlp_layernorm=IdentityOp, self_attention=attention))
