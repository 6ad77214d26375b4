"""Multi-latent attention (MLA) as a kind of attention the converter and the sync plan know, whichever family uses it
(DeepSeek-V3's: engine/models/deepseek_v3/): the HF <-> Megatron names of its tensors and their HF shapes.

Owns: `MLA_TENSORS` (read by engine/policy/hf_map.py) and `mla_hf_shape` (read by engine/rollout/sync_plan.py).

Must not: import torch, Megatron or vLLM (the planner imports the converter's map), or name a family.

Test: tests/distributed/test_family_layouts.py (an MLA model's logits = HF, export byte-exact),
tests/unit/test_sync_plan.py (the plan's shapes).
"""

from __future__ import annotations

MLA_TENSORS = (
    ("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight", "replicated"),
    ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight", "replicated"),
    ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight", "column"),
    ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "replicated"),
    ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight", "replicated"),
    ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight", "column"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", "row"),
)
"""(Megatron name in layer {i}, HF name in model.layers.{i}, layout kind) of MLA's tensors. No permutation: HF's
`rope_interleave` (the rope dims of q_b_proj / kv_a_proj_with_mqa hold interleaved pairs) is what Megatron's MLA
RoPE reads (rope_utils `_apply_rotary_pos_emb_bshd(multi_latent_attention=True)` de-interleaves x[0::2], x[1::2]
as HF's `apply_rotary_pos_emb_interleave` does). The down projections are whole on every TP rank (here:
`mla_attention_spec`; vLLM: its fused_qkv_a_proj is replicated too); the up projections split by head."""


def mla_hf_shape(megatron: str, dims) -> tuple[int, ...]:
    """The HF shape of MLA tensor `megatron` (a global name ending in one of `MLA_TENSORS`) of a model of `dims`
    (engine/policy/hf_map.py ModelDims)."""
    hidden, heads, q_lora, kv_lora = dims.hidden_size, dims.num_heads, dims.q_lora_rank, dims.kv_lora_rank
    qk_head = dims.qk_nope_head_dim + dims.qk_rope_head_dim
    shapes = {"linear_q_down_proj.weight": (q_lora, hidden), "q_layernorm.weight": (q_lora,),
              "linear_q_up_proj.weight": (heads * qk_head, q_lora),
              "linear_kv_down_proj.weight": (kv_lora + dims.qk_rope_head_dim, hidden),
              "kv_layernorm.weight": (kv_lora,),
              "linear_kv_up_proj.weight": (heads * (dims.qk_nope_head_dim + dims.v_head_dim), kv_lora),
              "linear_proj.weight": (hidden, heads * dims.v_head_dim)}
    return shapes[megatron.rpartition(".self_attention.")[2]]
