"""Hugging Face <-> Megatron names: the declarative map of each model family, without torch.

Owns: `ModelDims` (the shape facts a map and a conversion need) and the map of a model (`family_map` /
`layer_entries`: `TensorMap` entries, engine/models/tensor_map.py: Megatron global name, HF names, layout kind) for
the Llama-shaped families (Qwen2's QKV bias, Qwen3's per-head q/k RMSNorm: Megatron's `q_layernorm` / `k_layernorm`,
replicated, (head_dim,)), with each MoE family's MLP table (`MOE_MAPS`, gathered from the family folders'
`moe_tensors`; tied embeddings: `family_map`; dense first layers: `layer_entries`) and extra attention tensors
(`ATTENTION_MAPS`: GPT-OSS's sinks and o_proj bias), GPT-OSS's stacked expert tensors (the `stacked_*` kinds);
Gemma's four norms per layer: `ModelDims.sandwich_norms`; Cohere 2's one norm per layer: `ModelDims.parallel_block`;
Nemotron-H's per-kind layers under `backbone.` names: `ModelDims.layer_kinds`, engine/models/nemotron_h/); and the
name lookups (`find_entry`, `expert_index`, `hf_names`). engine/policy/hf_convert.py moves the tensors by these maps; the weight-sync plan and the planner read
them as they are.

Must not: import torch (`grpo-engine plan` and `train --dry-run` run on a login node in about a second), read files
or touch process groups.

Test: tests/unit/test_hf_convert.py; tests/unit/test_planner_imports.py (no torch on the planning path).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.models.families import (
    FAMILIES,
    dense_layers,
    has_qk_norm,
    has_qkv_bias,
    moe_shape,
    shared_expert_width,
    spec_or_default,
)
from engine.models.latent_attention import MLA_TENSORS
from engine.models.tensor_map import SANDWICH_NORM_NAMES, TensorMap


@dataclass(frozen=True)
class ModelDims:
    """The shape facts the conversions need."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False
    """Qwen3: per-head RMSNorm of queries and keys (HF q_norm / k_norm, (head_dim,) each)."""
    num_experts: int = 0
    """MoE: routed experts per layer (0 = dense MLP)."""
    moe_ffn_hidden_size: int = 0
    """MoE: each expert's MLP width (HF moe_intermediate_size)."""
    moe_map: str = ""
    """MoE: the key of the expert table in `MOE_MAPS` (the HF model_type)."""
    dense_layers: int = 0
    """MoE: the first layers whose MLP is dense (GLM-4.5's first_k_dense_replace)."""
    shared_expert_ffn: int = 0
    """MoE: the always-on shared expert's MLP width (GLM-4.5; 0 = none)."""
    sandwich_norms: bool = False
    """Gemma: four norms per layer (engine/models/tensor_map.py SANDWICH_NORM_NAMES)."""
    q_lora_rank: int = 0
    """DeepSeek-V3's multi-latent attention (MLA; 0 = none): the query latent's width (HF q_lora_rank)."""
    kv_lora_rank: int = 0
    """MLA: the key / value latent's width (HF kv_lora_rank); > 0 means MLA's tensors replace q/k/v/o."""
    qk_nope_head_dim: int = 0
    """MLA: each head's query / key dims without RoPE."""
    qk_rope_head_dim: int = 0
    """MLA: each head's query / key dims with RoPE (the key's are shared by every head)."""
    v_head_dim: int = 0
    """MLA: each head's value dims."""

    @property
    def mla(self) -> bool:
        """DeepSeek-V3's multi-latent attention (engine/models/deepseek_v3/ MLA_TENSORS) instead of q/k/v/o."""
        return self.kv_lora_rank > 0
    parallel_block: bool = False
    """Cohere 2: one norm per layer feeding attention and MLP (no pre-MLP norm: engine/models/cohere2/)."""
    layer_kinds: tuple[str, ...] = ()
    """Nemotron-H: each layer's one mixer, "mamba" / "attention" / "mlp" (engine/models/nemotron_h/); () = other."""
    mamba_blocks: tuple[int, ...] = ()
    """Nemotron-H: the Mamba-2 in_proj's global row blocks (z, x, B, C, dt)."""
    mamba_conv_bias: bool = False
    """Nemotron-H: the Mamba-2 conv has a bias (HF use_conv_bias)."""
    mamba_conv_kernel: int = 0
    """Nemotron-H: the Mamba-2 depthwise conv's kernel width (HF conv_kernel)."""
    layer_map: str = ""
    """A hybrid stack (`layer_kinds`): the family (its spec's name) whose `layer_tensors` map each kind of layer."""

    @classmethod
    def from_hf(cls, hf_config, padded_vocab: int) -> ModelDims:
        heads = hf_config.num_attention_heads
        model_type = hf_config.model_type
        experts, _, expert_ffn = moe_shape(hf_config)
        return cls(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_heads=heads,
            num_groups=hf_config.num_key_value_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            vocab_size=hf_config.vocab_size,
            padded_vocab=padded_vocab,
            tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            qkv_bias=has_qkv_bias(hf_config),
            qk_norm=has_qk_norm(hf_config),
            num_experts=experts,
            moe_ffn_hidden_size=expert_ffn,
            moe_map=model_type if experts else "",
            dense_layers=dense_layers(hf_config),
            shared_expert_ffn=shared_expert_width(hf_config),
            **spec_or_default(model_type).converter_dims(hf_config),
        )


MOE_MAPS: dict[str, tuple[TensorMap, ...]] = {model_type: spec.moe_tensors for spec in FAMILIES if spec.moe_tensors
                                              for model_type in spec.model_types}
"""The MoE MLP of each MoE family (its folder's `moe_tensors`), replacing the dense `linear_fc1` / `linear_fc2`
entries; `{e}` = expert index. Keyed by model_type (`ModelDims.moe_map`)."""

ATTENTION_MAPS: dict[str, tuple[TensorMap, ...]] = {model_type: spec.attention_tensors for spec in FAMILIES
                                                    if spec.attention_tensors for model_type in spec.model_types}
"""The attention tensors an MoE family has beyond Llama's (its folder's `attention_tensors`), keyed as `MOE_MAPS`."""

FLOAT32_TENSORS = ("e_score_correction_bias",)
"""HF tensors kept in float32 whatever the model's dtype (transformers' `_keep_in_fp32_modules_strict` for GLM-4.5's
expert bias; Megatron's router keeps it float32 too): an export in bf16 does not round them."""


def family_map(dims: ModelDims) -> list[TensorMap]:
    """The map of the Qwen2 / Llama / Qwen3 family (identical names; Qwen2 adds the QKV bias, Qwen3 the q/k norms;
    MoE families swap the dense MLP for their `MOE_MAPS` table; GLM-4.5, with dense first layers, has both: which
    entries a given layer has is `layer_entries`).

    Tied embeddings: HF stores one `model.embed_tokens.weight`; Megatron's last stage holds a copy as
    `output_layer.weight` (kept equal by Megatron's embedding group), which is loaded from it and never exported."""
    if dims.layer_kinds:
        return _hybrid_map(dims)
    attn = "model.layers.{i}.self_attn"
    entries = [
        TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
        TensorMap("decoder.layers.{i}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "replicated"),
        TensorMap(
            "decoder.layers.{i}.self_attention.linear_qkv.weight",
            (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"), "qkv",
        ),
        TensorMap("decoder.layers.{i}.self_attention.linear_proj.weight", (f"{attn}.o_proj.weight",), "row"),
        TensorMap(
            "decoder.layers.{i}.pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",),
            "replicated",
        ),
    ]
    if dims.num_experts:
        entries += MOE_MAPS[dims.moe_map]
    entries += ATTENTION_MAPS.get(dims.moe_map, ())
    if not dims.num_experts or dims.dense_layers:
        entries += [
            TensorMap(
                "decoder.layers.{i}.mlp.linear_fc1.weight",
                ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), "gate_up",
            ),
            TensorMap("decoder.layers.{i}.mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",), "row"),
        ]
    entries.append(TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if dims.qk_norm:
        entries += [
            TensorMap("decoder.layers.{i}.self_attention.q_layernorm.weight", (f"{attn}.q_norm.weight",), "replicated"),
            TensorMap("decoder.layers.{i}.self_attention.k_layernorm.weight", (f"{attn}.k_norm.weight",), "replicated"),
        ]
    if dims.qkv_bias:
        entries.append(
            TensorMap(
                "decoder.layers.{i}.self_attention.linear_qkv.bias",
                (f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"), "qkv",
            )
        )
    head = "model.embed_tokens.weight" if dims.tie_word_embeddings else "lm_head.weight"
    entries.append(TensorMap("output_layer.weight", (head,), "vocab"))
    if dims.mla:  # DeepSeek-V3: MLA's projections and latent norms instead of q/k/v/o
        entries = [e for e in entries if ".self_attention.linear_" not in e.megatron]
        entries += [TensorMap(f"decoder.layers.{{i}}.{megatron}", (f"model.layers.{{i}}.{hf}",), kind)
                    for megatron, hf, kind in MLA_TENSORS]
    if dims.sandwich_norms:  # Gemma: its own names for the two norms above, and the two post-norms
        entries = [e for e in entries if e.megatron not in SANDWICH_NORM_NAMES]
        entries += [TensorMap(megatron, (hf,), "replicated") for megatron, hf in SANDWICH_NORM_NAMES.items()]
    if dims.parallel_block:  # Cohere 2: the MLP reads the input norm; there is no pre-MLP norm
        entries = [e for e in entries if e.megatron != "decoder.layers.{i}.pre_mlp_layernorm.weight"]
    return entries


def _hybrid_map(dims: ModelDims) -> list[TensorMap]:
    """A hybrid stack's map (its family's `layer_tensors`, e.g. engine/models/nemotron_h/): the entries outside the
    layers, every layer kind's entries once each, the LM head (the embedding's HF name when tied)."""
    layer_tensors = spec_or_default(dims.layer_map).layer_tensors
    if layer_tensors is None:
        raise ValueError(f"ModelDims with layer_kinds {sorted(set(dims.layer_kinds))} and layer_map "
                         f"{dims.layer_map!r}: no family of that name maps a hybrid stack's layers (set layer_map to "
                         "the name of a family whose spec has layer_tensors)")
    entries = layer_tensors(dims, None)
    for kind in ("mamba", "attention", "mlp", "moe"):
        entries += [e for e in layer_tensors(dims, kind) if e not in entries]
    embedding = next(e.hf[0] for e in entries if e.megatron == "embedding.word_embeddings.weight")
    head = embedding if dims.tie_word_embeddings else "lm_head.weight"
    return entries + [TensorMap("output_layer.weight", (head,), "vocab")]


def layer_entries(dims: ModelDims, layer: int) -> list[TensorMap]:
    """The `family_map` entries decoder layer `layer` has: a dense first layer (`dims.dense_layers`) no MoE entries,
    an MoE layer no dense MLP; a Nemotron-H layer its kind's."""
    if dims.layer_kinds:
        return spec_or_default(dims.layer_map).layer_tensors(dims, dims.layer_kinds[layer])
    dense = not dims.num_experts or layer < dims.dense_layers
    return [e for e in family_map(dims) if "{i}" in e.megatron
            and (".mlp." not in e.megatron or (".mlp.linear_fc" in e.megatron) == dense)]


# Transformer Engine's layer spec fuses the norms into the next linear layer.
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def find_entry(entries: list[TensorMap], megatron_name: str) -> tuple[TensorMap, int | None]:
    """The entry of a global Megatron parameter name and its layer index (None outside the layers); an expert
    tensor's global expert index is `expert_index(megatron_name)`."""
    for local, te in TE_NAMES.items():
        megatron_name = megatron_name.replace(te, local)
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", megatron_name)
    layer = int(match.group(1)) if match else None
    key = f"decoder.layers.{{i}}.{match.group(2)}" if match else megatron_name
    key = _EXPERT.sub(r"\1{e}\3", key)
    for entry in entries:
        if entry.megatron == key:
            return entry, layer
    raise KeyError(f"no Hugging Face mapping for Megatron parameter {megatron_name!r}")


_EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..+)")


def expert_index(megatron_name: str) -> int | None:
    """The global expert index in a global Megatron name (`...local_experts.<e>...`), None for other tensors."""
    match = _EXPERT.fullmatch(megatron_name)
    return int(match.group(2)) if match else None


def hf_names(entry: TensorMap, layer: int | None, expert: int | None = None) -> list[str]:
    return [name.format(i=layer, e=expert) for name in entry.hf]


def _qkv_sizes(dims: ModelDims) -> tuple[int, int]:
    """(rows of q per query group, rows of k or v per group)."""
    return dims.num_heads // dims.num_groups * dims.head_dim, dims.head_dim
