"""What one model family tells the shared machinery: `FamilySpec`, the record each `engine/models/<family>/` folder
exports as `SPEC`, and the refusals several families share (`check_sigmoid_router`).

Owns: the fields a family may set: its HF model_types and refusals; its MoE shape (field names or a hook), dense
first layers and shared expert; its attention facts (norm epsilon field, QKV-bias default, q/k norms); its entries of
the converter's map (engine/models/tensor_map.py) and shape facts (`converter_dims`, a hybrid stack's
`layer_tensors`); its TransformerConfig hooks (override keywords, the finishing step, RoPE, the sigmoid router's MoE
layers); the modules the fused kernels replace; its planner shape and the planner's table of its published models
(`planner_models`, built with `planner_shape`); its tiny test config and the weights the tiny model draws at random. Every field
has a default that is the Llama-shaped answer, so a family states only what differs; what several families share
(the sigmoid router's refusals, dense layers, shared expert and planner fields; the sliding-window planner fields;
the tiny models' shared MoE shapes; the sigmoid router's MoE layers; the warning about unbuilt multi-token
prediction layers) is here too. The registry (which families exist, lookup by `model_type`) is
engine/models/families.py.

Must not: import torch, transformers, Megatron or vLLM at module level (the planner reads the specs on a login
node), or name a family: what differs per family lives in that family's folder.

Test: tests/unit/test_families.py (every family's refusals and MoE shape through the registry),
tests/unit/test_tiny_model.py (every family's tiny config), tests/unit/test_architecture.py (no module outside a
family's folder names it).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable


def _accept(hf_config) -> None:
    """The default refusal hook: nothing beyond the shared checks."""


def _none(hf_config) -> int:
    """The default count hooks: no dense first layers, no shared expert."""
    return 0


def _no_settings(hf_config) -> dict:
    """The default TransformerConfig hook: the Llama-shaped translation as it is."""
    return {}


def _unchanged(config, hf_config, tp_size: int, pp_size: int):
    """The default finishing hook: the TransformerConfig as built."""
    return config


def _chunk_as_built(chunk, hf_config) -> None:
    """The default policy-chunk hook: the GPTModel chunk as built."""


def _rope_fusable(hf_config) -> bool:
    """The default: the fused RoPE kernel computes the family's RoPE."""
    return True


def _no_random_inits(model) -> None:
    """The default tiny-model hook: HF's own initialisation is kept."""


def sliding_window_dims(values: dict, sliding_layers: int | None = None) -> dict:
    """The planner's sliding-window fields of a config.json: the window and how many layers use it (`layer_types`,
    else `sliding_layers`, else Cohere 2's older `sliding_window_pattern`, else every layer); {} without a window."""
    window, layers = values.get("sliding_window") or 0, values["num_hidden_layers"]
    if not window:
        return {}
    types = values.get("layer_types")
    if types:
        sliding = sum(t == "sliding_attention" for t in types)
    elif sliding_layers is not None:
        sliding = sliding_layers
    else:
        pattern = values.get("sliding_window_pattern") or 0
        sliding = sum((i + 1) % pattern != 0 for i in range(layers)) if pattern else layers
    return dict(sliding_window=int(window), sliding_layers=sliding)


def switched_sliding_window_dims(values: dict) -> dict:
    """`sliding_window_dims` for a family whose window acts only with `use_sliding_window` (Qwen2's, Qwen3's)."""
    return sliding_window_dims(values) if values.get("use_sliding_window") else {}


def planner_shape(hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                  vocab_size: int, tie_word_embeddings: bool, qkv_bias: bool, **fields) -> dict:
    """The keywords of engine/planning/shapes.py `ModelDims` for a known model (its first eight fields in their order,
    the rest by name): a family's `planner_models` hold these, the planner builds its table from them."""
    return dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                intermediate_size=intermediate_size, vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings,
                qkv_bias=qkv_bias, **fields)


@dataclass(frozen=True)
class FamilySpec:
    """Everything the shared code reads about one family, as data or a small hook; defaults are Llama's answers."""

    name: str
    """The family's folder under engine/models/."""
    model_types: tuple[str, ...]
    """The HF `model_type` values the family covers, in the order the tiny models and error messages list them."""
    check: Callable = _accept
    """Refuse the family's settings the translation would not reproduce: `check(hf_config)` raises ValueError naming
    `model.name_or_path`, the setting and the cause (the quantisation refusal runs first, for every family)."""
    moe_fields: tuple[str, str] | None = None
    """(routed-expert count, expert MLP width) HF field names of an MoE family; None = dense (every MoE family names
    its experts-per-token `num_experts_per_tok`)."""
    moe_shape: Callable | None = None
    """A family whose MoE layers are optional: `moe_shape(hf_config)` -> (experts, top-k, width), (0, 0, 0) without
    MoE layers; None = read `moe_fields`."""
    has_routed_experts: Callable | None = None
    """Whether a config.json (a dict) has routed experts, for a family where the expert count alone does not say;
    None = any of the expert-count fields is set."""
    moe_tensors: tuple = ()
    """The MoE MLP's entries of the converter's map (engine/models/tensor_map.py `TensorMap`s; `{e}` = expert index),
    replacing the dense MLP's; () = dense."""
    interleaved_gate_up: bool = False
    """Whether the checkpoint's stacked `mlp.experts.gate_up_proj` interleaves gate and up (columns g0, u0, g1, ...):
    an exported expert adapter's lora_B rows are interleaved to match (Megatron's fc1 is [gate; up])."""
    attention_tensors: tuple = ()
    """The attention's entries beyond Llama's (`TensorMap`s), for an MoE family."""
    dense_layers: Callable = _none
    """How many first decoder layers of an MoE family are dense: `dense_layers(hf_config)` -> int."""
    shared_expert_width: Callable = _none
    """The always-on shared expert's MLP width (0 = none): `shared_expert_width(hf_config)` -> int."""
    norm_eps_field: str = "rms_norm_eps"
    """The HF field holding the norms' epsilon."""
    qkv_bias_default: bool = False
    """The QKV bias when the HF config has no `attention_bias` field (Qwen2's config has none and always has one)."""
    qk_norm_types: tuple[str, ...] = ()
    """The model_types whose every layer has a per-head RMSNorm on queries and keys (besides a config's own
    `use_qk_norm`)."""
    transformer_settings: Callable = _no_settings
    """TransformerConfig keywords that override the Llama-shaped translation's (`transformer_settings(hf_config)` ->
    dict); `multi_latent_attention=True` among them builds Megatron's MLATransformerConfig."""
    finish_transformer_config: Callable = _unchanged
    """The built TransformerConfig, finished (`finish_transformer_config(config, hf_config, tp_size, pp_size)` ->
    config): what needs torch or Megatron (an activation function, attributes Megatron reads with getattr) or the
    layout (a TP size the family's layers cannot split)."""
    rope_settings: Callable | None = None
    """GPTModel's position-embedding keywords (`rope_settings(hf_config)` -> dict, or None for the Llama-shaped RoPE
    of the config's `rope_parameters`); None = always the Llama-shaped RoPE."""
    layer_spec: Callable | None = None
    """The family's layer spec from Megatron's (`layer_spec(spec, row_parallel, hf_config)` -> spec, before the
    attention choice; `row_parallel` is the policy's RowParallelLinear class): its own norms, layers or attention
    pieces; None = Megatron's as built."""
    local_layer_specs: Callable | None = None
    """On the local spec, after the attention choice: `local_layer_specs(spec, dense_spec, row_parallel, hf_config)`
    -> (spec, dense_spec, per-layer specs or None) (MLA's core attention keywords, a hybrid stack's one mixer per
    layer); None = unchanged."""
    local_spec_only: str = ""
    """Why the family is built on Megatron's local spec only (its project modules), refused on Transformer Engine's
    spec naming this; "" = any spec."""
    rope_fusable: Callable = _rope_fusable
    """Whether the fused RoPE kernel (engine/policy/fused_layers.py) computes the family's RoPE:
    `rope_fusable(hf_config)` -> bool."""
    finish_policy_chunk: Callable = _chunk_as_built
    """The built GPTModel chunk, finished in place (`finish_policy_chunk(chunk, hf_config)`, before its parameters are
    cast): an embedding scale, the LM head's `logit_scale`."""
    planner_dims: Callable = sliding_window_dims
    """What the planner's shape of a config.json (a dict) takes from the family beyond the shared fields:
    `planner_dims(values)` -> engine/planning/shapes.py `ModelDims` keywords (norms per layer, biases, sinks, the
    expert-score bias, the layers a sliding window acts on)."""
    planner_models: dict = field(default_factory=dict, hash=False)
    """The planner's shapes of the family's published models, keyed by lower-case hub name, and of its builtin tiny
    models (`builtin:tiny-<model_type>`): name -> `planner_shape(...)`, from each model's config.json on the hub
    (the planner never downloads)."""
    planner_refusal: str = ""
    """Why the planner cannot size the family yet ("" = it can)."""
    ties_embeddings_by_default: bool = False
    """Whether the family's transformers config ties the embeddings by default (a config.json may leave it out)."""
    vllm_engine_kwargs: Callable | None = None
    """vLLM's engine keywords the family needs (`vllm_engine_kwargs(model_dir, dtype, on_gpu)` -> dict, e.g.
    `hf_overrides`, an attention backend); None = none."""
    check_vllm_cpu: Callable | None = None
    """Refuse, before vLLM starts on a machine without a GPU, a config.json (a dict) vLLM's CPU backend cannot serve
    (`check_vllm_cpu(values)` raises ValueError naming the cause); None = it serves every one."""
    vllm_hf_names: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    """(vLLM model class, ((vLLM's module name, the checkpoint's), ...)) for a family whose vLLM class renames modules
    (substring replacements, the inverse of its `hf_to_vllm_mapper`): the weight digests are keyed by HF names."""
    vllm_receiver: str = ""
    """"module:Class" of a mixin of vLLM's worker extension (engine/rollout/vllm_engine.py
    `WeightReceiverExtension`) holding the family's reload fix-ups; "" = none. A path, imported only where vLLM runs."""
    vllm_module_parts: tuple[str, str] = ()
    """(vLLM module class, "module:function") for a family whose vLLM module fuses its HF tensors in a layout of its
    own: `function(prefix, module, param, tensor)` -> [(HF name, view)] for the weight digests; () = none."""
    vllm_warning: str = ""
    """"module:function" giving the warning logged when vLLM starts on a checkpoint it runs differently from the
    trainer (`function(model_dir)` -> message, "" = none); "" = no such check."""
    tiny_config: Callable = field(default=lambda model_type, common, moe_layers: dict(common))
    """The tiny test model's HF config keywords: `tiny_config(model_type, common, moe_layers)` -> kwargs of
    `AutoConfig.for_model(model_type, ...)`; `common` holds the shapes every tiny model shares
    (engine/models/tiny_model.py), `moe_layers` asks for a family's optional MoE layers."""
    has_moe_layer_variant: bool = False
    """Whether the tiny model has a variant with MoE layers (`tiny_config`'s `moe_layers`)."""
    randomise_tiny_inits: Callable = _no_random_inits
    """Draw at random, in place, the tiny model's tensors HF initialises to constants that tests must see
    (`randomise_tiny_inits(model)`, under the build's seeded RNG)."""

    converter_dims: Callable = _no_settings
    """The converter's shape facts beyond the shared ones (`converter_dims(hf_config)` -> engine/policy/hf_map.py
    `ModelDims` keywords: four norms per layer, one norm per layer, multi-latent attention's ranks, a hybrid stack's
    layer kinds)."""
    layer_tensors: Callable | None = None
    """A hybrid stack's map (one mixer per layer): `layer_tensors(dims, kind)` -> the `TensorMap`s of a layer of
    `kind` (one of `ModelDims.layer_kinds`, or "moe"), `layer_tensors(dims, None)` -> those outside the layers (the LM
    head excepted); None = the Llama-shaped map. `converter_dims` names the family in `ModelDims.layer_map`."""
    moe_layer_freq: Callable | None = None
    """The sigmoid group-limited router (engine/policy/moe_config.py `sigmoid_router_settings`): which layers are MoE
    layers (`moe_layer_freq(hf_config)` -> a 0 / 1 per layer); None = the softmax router on every layer."""
    warn_unbuilt_layers: Callable = _accept
    """Warn, when the router is configured, about checkpoint layers the policy does not build (`warn_unbuilt_layers(
    hf_config)`: multi-token prediction)."""
    fused_modules: Callable | None = None
    """The family's own torch modules the fused layer kernels replace (engine/policy/fused_layers.py):
    `fused_modules()` -> {"offset_norms": (RMSNorm classes computing (1 + w),), "attention": (SelfAttention
    subclasses, a `layer_rotary_pos_emb` read where they have one),}, imported when called; None = none."""
    gated_mlp: bool = True
    """Whether the MLPs are gated (gate / up / down): LoRA's HF targets assume so, and adapters on a non-gated
    family's layers are refused naming it (engine/policy/lora.py)."""

    @property
    def is_moe(self) -> bool:
        """Whether the family has routed-expert MLPs (in some or all of its layers)."""
        return self.moe_fields is not None or self.moe_shape is not None


def check_sigmoid_router(hf_config) -> None:
    """Refuse the sigmoid group-limited router settings (GLM-4.5 MoE, DeepSeek-V3, Nemotron-H's MoE layers) that
    Megatron's sigmoid router computes differently: it always renormalises the top-k weights (HF only with
    `norm_topk_prob`), and it scores an expert group by the sum of its top (top-k / topk_group) experts where HF sums
    the group's top 2 (GLM-4.5's n_group=1 makes both moot; DeepSeek-V3's 8 of 256 experts, 4 of 8 groups: both take
    the top 2)."""
    top_k, groups, group_top_k = hf_config.num_experts_per_tok, hf_config.n_group, hf_config.topk_group
    if not hf_config.norm_topk_prob and top_k > 1:
        raise ValueError(f"model.name_or_path: {hf_config.model_type} with norm_topk_prob=false: Megatron's sigmoid "
                         "router always renormalises the top-k weights; only norm_topk_prob true (GLM-4.5's and "
                         "DeepSeek-V3's own) is supported")
    if groups > 1 and top_k // group_top_k != 2:
        raise ValueError(f"model.name_or_path: {hf_config.model_type} with n_group={groups}, topk_group="
                         f"{group_top_k}, num_experts_per_tok={top_k}: Megatron scores a group by its top num_experts_per_tok // "
                         f"topk_group = {top_k // group_top_k} experts, HF by its top 2; only n_group 1 or "
                         "num_experts_per_tok = 2 x topk_group is supported")


def sigmoid_router_dense_layers(hf_config) -> int:
    """The dense first layers of a sigmoid-router MoE family (`first_k_dense_replace`)."""
    return int(getattr(hf_config, "first_k_dense_replace", 0) or 0)


def sigmoid_router_shared_expert_width(hf_config) -> int:
    """The shared expert's width of a sigmoid-router MoE family: n_shared_experts x moe_intermediate_size."""
    return int(getattr(hf_config, "n_shared_experts", 0) or 0) * int(hf_config.moe_intermediate_size)


def sigmoid_router_planner_dims(values: dict) -> dict:
    """The planner's shape of a sigmoid-router MoE family: the float32 expert-score bias, the window if any."""
    return {"expert_bias": True, **sliding_window_dims(values)}


def sigmoid_router_layer_freq(hf_config) -> list[int]:
    """The MoE layers of a sigmoid-router MoE family: dense first layers (`first_k_dense_replace`), then MoE."""
    first_dense, layers = sigmoid_router_dense_layers(hf_config), int(hf_config.num_hidden_layers)
    return [0] * first_dense + [1] * (layers - first_dense)


@functools.cache
def warn_mtp_not_trained(model_type: str, mtp: int, layers: int) -> None:
    """Warn (once per process) that a checkpoint's multi-token-prediction layers are neither built nor trained, and
    what an export does with them."""
    logging.getLogger(__name__).warning(
        "%s with num_nextn_predict_layers=%d: the multi-token-prediction layers (model.layers.%d.* on) are not built "
        "or trained (the GRPO loss reads the main head's next-token log-probs only; vLLM skips them without "
        "speculative decoding); an HF export copies their weights unchanged from the source checkpoint (the draft "
        "head of vLLM's MTP speculative decoding), or drops them (num_nextn_predict_layers=0) where it has none",
        model_type, mtp, layers)


def warn_mtp_layers(hf_config) -> None:
    """`warn_mtp_not_trained` for a config with `num_nextn_predict_layers` > 0."""
    if mtp := int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0):
        warn_mtp_not_trained(hf_config.model_type, mtp, int(hf_config.num_hidden_layers))


def randomise_expert_score_bias(model) -> None:
    """Draw the sigmoid router's expert-score correction bias, N(0, 0.05^2) where HF initialises zeros."""
    import torch

    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * torch.randn(tensor.shape))


TINY_MOE_EXPERTS, TINY_MOE_TOP_K, TINY_MOE_FFN = 4, 2, 64
"""The tiny MoE families' experts (engine/models/tiny_model.py): 4 routed experts per layer, 2 per token, expert MLP
width 64."""

TINY_QWEN3_HEAD_DIM = 64
"""Qwen3's head_dim is a config field, not hidden / heads (Qwen3-0.6B: 16 heads x 128 = 2048 != hidden 1024): the tiny
Qwen3 models take 4 x 64 = 256 != hidden 128, so a conversion that assumes hidden / heads fails their tests."""

TINY_SIGMOID_ROUTER = dict(n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
"""The tiny sigmoid-router families' routing: experts in 2 groups, 1 group per token (group-limited top-k, which
GLM-4.5's own n_group=1 leaves unused, so that a test sees it), routed weights renormalised and scaled by 2.5
(GLM-4.5's routed_scaling_factor)."""

TINY_DENSE_LAYERS = 1
"""The tiny sigmoid-router families' dense first layers (GLM-4.5-Air: first_k_dense_replace=1)."""
