"""Gemma 3's layer parts that Megatron-core lacks, as the project's own modules on the local spec.

Owns: `GemmaRMSNorm` ((1 + w), computed in float32, exactly HF's Gemma3RMSNorm), the post-attention /
post-feedforward norms as `post_layernorm` children of the output projections (`_post_norm_class`),
`GemmaSelfAttention` (the sliding layers' own RoPE base, `rope_local_base_freq`), `gemma_layer_spec` (the local spec
with all of these and the soft-capped windowed core attention of engine/models/windowed_attention.py),
`fused_modules` (the modules engine/policy/fused_layers.py may swap for its fused twins) and `scale_embeddings`
(sqrt(hidden), cast to the model dtype first, as HF); its TransformerConfig settings and activation are the family's
(engine/models/gemma/).

Must not: read Megatron's global parallel state (RoPE takes the attention's context-parallel group), import vLLM.

Test: tests/distributed/test_family_layouts.py (logits = HF at TP1, TP2 + SP and PP2; export byte-exact; GRPO step at
TP2 = TP1), tests/unit/test_families.py (GemmaRMSNorm = HF's Gemma3RMSNorm in bf16).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from engine.models.gemma import rope_params
from engine.models.windowed_attention import windowed_core_attention_class


def is_gemma3(hf_config) -> bool:
    """Gemma 3 has per-head q/k norms; Gemma 2 has not."""
    return hf_config.model_type == "gemma3_text"


class GemmaRMSNorm(torch.nn.Module):
    """HF's Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32, cast back to x's dtype at the end.

    Megatron's `layernorm_zero_centered_gamma` is only in Transformer Engine's / apex's norms (its torch norm
    asserts it off) and they multiply in the input dtype. The weight is marked `sequence_parallel` as the local
    spec's other norms (engine/policy/model.py LocalRMSNorm says why)."""

    local_spec_norm = True
    """A norm of Megatron's local spec (engine/policy/model.py builds its blocks and fused swaps around it)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def _post_norm_class(row_parallel):
    """`row_parallel` (the project's RowParallelLinear) followed by a `GemmaRMSNorm` of its output (`post_layernorm`):
    Gemma's post-attention / post-feedforward norm, inside the residual branch. Under sequence parallelism the output
    is this rank's s / tp tokens, normalised per token like every other norm."""

    class PostNormRowParallelLinear(row_parallel):
        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_layernorm = GemmaRMSNorm(config, output_size, config.layernorm_epsilon)

        def forward(self, x, *args, **kwargs):
            out, bias = super().forward(x, *args, **kwargs)
            if bias is not None:
                raise ValueError("Gemma's post-norms follow a projection without bias")
            return self.post_layernorm(out), None

    return PostNormRowParallelLinear


@functools.cache
def self_attention_class():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.utils import is_layer_window_attention

    class GemmaSelfAttention(SelfAttention):
        """SelfAttention whose sliding-window layers rotate queries and keys with their own RoPE base
        (`local_rotary_base`: HF's `rope_parameters["sliding_attention"]`); the full layers keep GPTModel's."""

        def __init__(self, config, submodules, layer_number, *args, local_rotary_base: float, **kwargs):
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            self.local_rope = None
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
                self.local_rope = RotaryEmbedding(
                    kv_channels=config.kv_channels, rotary_percent=1.0, rotary_base=local_rotary_base,
                    use_cpu_initialization=config.use_cpu_initialization,
                    cp_group=getattr(self.pg_collection, "cp", None))

        def layer_rotary_pos_emb(self, rotary_pos_emb):
            """This layer's RoPE frequencies: the sliding layers' own base at the same positions (s, 1, 1, head_dim),
            GPTModel's otherwise (engine/policy/fused_layers.py reads them too)."""
            if self.local_rope is not None and rotary_pos_emb is not None:
                return self.local_rope(rotary_pos_emb.shape[0])
            return rotary_pos_emb

        def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
            return super().forward(hidden_states, attention_mask, *args,
                                   rotary_pos_emb=self.layer_rotary_pos_emb(rotary_pos_emb), **kwargs)

    return GemmaSelfAttention


def gemma_layer_spec(spec, row_parallel, hf_config):
    """Gemma's transformer layer from the local spec (engine/policy/model.py `_layer_spec`; Gemma 3 with q/k norms):
    every norm a `GemmaRMSNorm`, the output projections with their post-norms, Gemma's attention modules (Gemma 2's
    attention-logit soft-capping in the core attention)."""
    from megatron.core.transformer.enums import AttnMaskType

    layer = spec.submodules
    post_norm = _post_norm_class(row_parallel)
    local_base = float(rope_params(hf_config, "sliding_attention")["rope_theta"])
    core = functools.partial(windowed_core_attention_class(), softcap=getattr(hf_config, "attn_logit_softcapping", None))
    qk_norms = {"q_layernorm": GemmaRMSNorm, "k_layernorm": GemmaRMSNorm} if is_gemma3(hf_config) else {}
    attention = dataclasses.replace(
        layer.self_attention, module=self_attention_class(),
        params={"attn_mask_type": AttnMaskType.causal, "local_rotary_base": local_base},
        submodules=dataclasses.replace(layer.self_attention.submodules, linear_proj=post_norm, core_attention=core,
                                       **qk_norms))
    mlp = dataclasses.replace(layer.mlp, submodules=dataclasses.replace(layer.mlp.submodules, linear_fc2=post_norm))
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        layer, input_layernorm=GemmaRMSNorm, pre_mlp_layernorm=GemmaRMSNorm, self_attention=attention, mlp=mlp))


def scale_embeddings(chunk: torch.nn.Module, hidden_size: int) -> None:
    """Multiply the chunk's embedding output by sqrt(hidden_size), the multiplier cast to the output's dtype first
    (HF: `embed_scale.to(weight.dtype)`, so bf16 multiplies by bf16(sqrt(H))). A forward hook on the first stage's
    `embedding`; the tied LM head reads the unscaled weight, as HF's."""
    if getattr(chunk, "embedding", None) is None:
        return
    scale = math.sqrt(hidden_size)

    def hook(_module, _inputs, output):
        return output * torch.tensor(scale, dtype=torch.float32).to(output.dtype)

    chunk.embedding.register_forward_hook(hook)


def fused_modules() -> dict:
    """The family's modules the fused layer kernels replace (engine/policy/fused_layers.py `fused_layer_specs`): its
    (1 + w) RMSNorm and its SelfAttention subclass (the sliding layers' own RoPE, read through
    `layer_rotary_pos_emb`)."""
    return {"offset_norms": (GemmaRMSNorm,), "attention": (self_attention_class(),)}
