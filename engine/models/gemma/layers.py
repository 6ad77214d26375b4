"""Gemma 3's layer parts that Megatron-core lacks, as the project's own modules on the local spec.

Owns: `GemmaRMSNorm` ((1 + w), computed in float32, exactly HF's Gemma3RMSNorm), the post-attention /
post-feedforward norms as `post_layernorm` children of the output projections (`_post_norm_class`),
`GemmaSelfAttention` (the sliding layers' own RoPE base, `rope_local_base_freq`), `GemmaCoreAttention` (the causal or
block-causal mask AND the sliding window; `core_attention_class`, Cohere 2's too), `gemma_layer_spec` (the local spec
with all of these) and `scale_embeddings` (sqrt(hidden), cast to the model dtype first, as HF); its TransformerConfig
settings and activation are the family's (engine/models/gemma/).

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


def core_attention_class():
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.utils import is_layer_window_attention

    class GemmaCoreAttention(DotProductAttention):
        """Dot-product attention that applies the sliding window AND the given mask (Megatron's local softmax
        replaces a given mask by the window mask, so packed rows would attend across sequences), in HF's eager
        order: scores in the input dtype x scale, soft-capped (Gemma 2: tanh(s / softcap) x softcap), masked,
        softmax in float32, cast back."""

        def __init__(self, config, layer_number, *args, softcap: float | None = None, **kwargs):
            super().__init__(config, layer_number, *args, **kwargs)
            self.softcap = softcap
            sliding = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            self.window = config.window_size[0] + 1 if sliding else None

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("Gemma's core attention takes neither packed_seq_params (THD) nor an attention bias")
            repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            q = query.permute(1, 2, 0, 3)  # (b, np, sq, hn)
            k = key.repeat_interleave(repeat, dim=2).permute(1, 2, 0, 3)  # (b, np, sk, hn)
            v = value.repeat_interleave(repeat, dim=2).permute(1, 2, 0, 3)
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale  # (b, np, sq, sk)
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            sq, sk = scores.shape[-2:]
            rows = torch.arange(sq, device=scores.device)[:, None] + (sk - sq)
            cols = torch.arange(sk, device=scores.device)[None, :]
            masked = cols > rows  # (sq, sk) causal
            if self.window is not None:
                masked = masked | (rows - cols >= self.window)
            if attention_mask is not None:
                masked = masked | attention_mask  # (b, 1, sq, sk), True = masked
            scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            if self.config.sequence_parallel:
                probs = self.attention_dropout(probs)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
            context = torch.matmul(probs, v)  # (b, np, sq, hn)
            return context.permute(2, 0, 1, 3).reshape(sq, q.shape[0], self.hidden_size_per_partition)

    return GemmaCoreAttention


def gemma_layer_spec(spec, row_parallel, hf_config):
    """Gemma's transformer layer from the local spec (engine/policy/model.py `_layer_spec`; Gemma 3 with q/k norms):
    every norm a `GemmaRMSNorm`, the output projections with their post-norms, Gemma's attention modules (Gemma 2's
    attention-logit soft-capping in the core attention)."""
    from megatron.core.transformer.enums import AttnMaskType

    layer = spec.submodules
    post_norm = _post_norm_class(row_parallel)
    local_base = float(rope_params(hf_config, "sliding_attention")["rope_theta"])
    core = functools.partial(core_attention_class(), softcap=getattr(hf_config, "attn_logit_softcapping", None))
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

