"""Model families (issue #30), pure: an unsupported model_type is refused naming the supported families and, for the
families labs post-train (the TRL yardstick's gemma2 / cohere2 / glm4_moe / gpt_oss / nemotron_h, DeepSeek-V3, Gemma
3), what the translation lacks; Mixtral's settings the engine would not reproduce are refused; `moe_shape` reads each
MoE family's own field names (the policy, the converter and the planner agree on them); the planner's Mixtral shapes
give the published parameter count and a saved tiny Mixtral's config.json the builtin table's shape."""

from types import SimpleNamespace

import pytest
from transformers import AutoConfig, MixtralConfig

from engine.models.families import MISSING_FEATURES, check_model_type, moe_shape
from engine.models.tiny_model import tiny_model_config
from engine.policy.hf_convert import ModelDims


@pytest.mark.parametrize("model_type", ["gemma2", "cohere2", "glm4_moe", "gpt_oss", "nemotron_h", "deepseek_v3",
                                        "gemma3_text"])
def test_yardstick_families_are_refused_naming_what_is_missing_and_what_is_supported(model_type):
    config = AutoConfig.for_model(model_type)
    with pytest.raises(ValueError, match=rf"model_type '{model_type}' .*not supported \(missing: ") as error:
        check_model_type(config)
    assert MISSING_FEATURES[model_type] in str(error.value)
    assert "supported: qwen2, llama, qwen3, qwen3_moe, mixtral" in str(error.value)


def test_unknown_family_is_refused_with_the_supported_list_only():
    with pytest.raises(ValueError, match=r"model_type 'gpt2' \(GPT2Config\) is not supported; supported: qwen2,"):
        check_model_type(AutoConfig.for_model("gpt2"))


@pytest.mark.parametrize("change,cause", [({"sliding_window": 512}, "sliding_window=512 < max_position_embeddings"),
                                          ({"router_jitter_noise": 0.01}, "router_jitter_noise=0.01")])
def test_mixtral_settings_the_engine_would_not_reproduce_are_refused(change, cause):
    config = tiny_model_config("mixtral")
    check_model_type(config)  # the tiny model's own settings pass
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=cause):
        check_model_type(config)


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
