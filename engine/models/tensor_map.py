"""One Megatron parameter and its Hugging Face tensors (`TensorMap`), how it splits over TP (`Kind`), and the MoE
tables several families share (`SIGMOID_ROUTER_MOE_TENSORS`), the sandwich-norm layer's norm names
(`SANDWICH_NORM_NAMES`), and the stacked expert kinds (`STACKED_KINDS`, `EXPERT_PIECE`; converted by
engine/models/stacked_experts.py).

Owns the vocabulary of the converter's maps: engine/policy/hf_map.py builds a model's map from these entries and
engine/policy/hf_convert.py converts with them; each family's folder declares its own entries (its `SPEC.moe_tensors`, `attention_tensors`).

Must not: import torch, Megatron or vLLM (the family specs, read by the planner, hold these entries).

Test: tests/unit/test_hf_convert.py, tests/unit/test_qwen3_conversion.py (every MoE table round trips).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["replicated", "column", "row", "vocab", "qkv", "gate_up", "stacked_gate_up", "stacked_row",
               "stacked_replicated", "mamba_in", "mamba_conv"]
"""How a tensor is split over TP. Layout kinds are where frameworks have had silent bugs (fused QKV
with GQA, gate/up, vocabulary padding), so each is explicit:
  replicated  norms: same on every TP rank;
  column      split along dim 0;   row  split along dim 1;
  vocab       split along dim 0 after padding the vocabulary to `padded_vocab` rows (zeros; never sampled);
  qkv         Megatron's fused QKV: per query group g, [q heads of g; k_g; v_g] (GQA-interleaved), TP splits whole
              groups, so rank r holds groups [r*G/tp, (r+1)*G/tp);
  gate_up     Megatron's fused SwiGLU fc1 = [gate; up]; TP rank r holds [gate_r; up_r] (partition_stride 2);
  stacked_*   one expert's slice of a GPT-OSS tensor that stacks every expert (engine/models/stacked_experts.py STACKED_KINDS);
  mamba_in    Nemotron-H's Mamba-2 in_proj rows [z; x; B; C; dt] (`ModelDims.mamba_blocks`), each block split over TP:
              rank r holds [z_r; x_r; B_r; C_r; dt_r]; mamba_conv: its depthwise conv's channels [x; B; C] likewise.
"""


@dataclass(frozen=True)
class TensorMap:
    """One Megatron parameter and its HF tensors.

    Experts: a name with `{e}` is one expert's tensor; Megatron's global name carries the global expert index (a rank
    holds experts [ep_rank*E/ep, (ep_rank+1)*E/ep) as `local_experts.0..`; engine/policy/model.py
    `global_param_names` renames them), and its TP split is over the expert-TP group (`is_expert`), not the
    attention's TP group. The router (`mlp.router.weight`, (E, H)) is replicated.
    """

    megatron: str
    """Global Megatron name; `{i}` stands for the layer index, `{e}` for the (global) expert index."""
    hf: tuple[str, ...]
    kind: Kind

    @property
    def is_expert(self) -> bool:
        """One expert's tensor: split over the expert-TP group and held by one expert-parallel rank."""
        return "{e}" in self.megatron


SIGMOID_ROUTER_MOE_TENSORS = (
    TensorMap("decoder.layers.{i}.mlp.router.weight", ("model.layers.{i}.mlp.gate.weight",), "replicated"),
    TensorMap("decoder.layers.{i}.mlp.router.expert_bias", ("model.layers.{i}.mlp.gate.e_score_correction_bias",),
              "replicated"),
    TensorMap("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight",
              ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
               "model.layers.{i}.mlp.experts.{e}.up_proj.weight"), "gate_up"),
    TensorMap("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight",
              ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",), "row"),
    TensorMap("decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight",
              ("model.layers.{i}.mlp.shared_experts.gate_proj.weight",
               "model.layers.{i}.mlp.shared_experts.up_proj.weight"), "gate_up"),
    TensorMap("decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight",
              ("model.layers.{i}.mlp.shared_experts.down_proj.weight",), "row"),
)
"""The MoE MLP of the sigmoid-router families (GLM-4.5 MoE, DeepSeek-V3: the same checkpoint names): Qwen3-MoE's
expert names, the router's float32 expert-score correction bias (Megatron: a buffer, see engine/policy/model.py
WEIGHT_BUFFERS) and one shared expert, a dense SwiGLU MLP split over the attention's TP."""


SANDWICH_NORM_NAMES = {
    "decoder.layers.{i}.input_layernorm.weight": "model.layers.{i}.input_layernorm.weight",
    "decoder.layers.{i}.self_attention.linear_proj.post_layernorm.weight":
        "model.layers.{i}.post_attention_layernorm.weight",
    "decoder.layers.{i}.pre_mlp_layernorm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "decoder.layers.{i}.mlp.linear_fc2.post_layernorm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
"""Megatron global name -> HF name of the four norms of a sandwich-norm layer (Gemma's: a norm before and after
attention and before and after the MLP; HF's `post_attention_layernorm` is the norm AFTER attention, not Llama's
pre-MLP norm). A model with `ModelDims.sandwich_norms` maps these instead of Llama's two."""


EXPERT_PIECE = "#expert="
"""Suffix of the HF name of one expert's slice of a stacked expert tensor (`stacked_expert_to_hf`); the
export stacks the pieces of every expert into the one HF tensor (`stack_expert_pieces`)."""

STACKED_KINDS = ("stacked_gate_up", "stacked_row", "stacked_replicated")
"""Layout kinds of stacked expert tensors (engine/models/tensor_map.py `Kind`; GPT-OSS's layout):
  stacked_gate_up     HF (E, H, 2I) weight / (E, 2I) bias, x @ W, gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...;
                      Megatron's fc1 (2I, H) / (2I,) = [gate; up] (TP rank r: [gate_r; up_r]);
  stacked_row         HF (E, I, H), x @ W; Megatron's fc2 (H, I), TP splits I;
  stacked_replicated  HF (E, H) fc2 bias; Megatron's (H,), the same on every TP rank."""
