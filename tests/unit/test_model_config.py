"""engine/policy/model.py's pure parts: vocabulary padding and the RoPE settings read from an HF config."""

import pytest
from transformers import LlamaConfig, Qwen2Config

from engine.policy.model import padded_vocab_size, rope_settings


def test_padded_vocab_follows_megatron_rule():
    assert padded_vocab_size(400, 128, 1) == 512
    assert padded_vocab_size(400, 128, 8) == 1024
    assert padded_vocab_size(151936, 128, 1) == 151936  # Qwen2.5: 128 * 1187
    assert padded_vocab_size(151936, 128, 8) == 152576  # next multiple of 1024


def test_rope_theta_read_from_rope_parameters():
    # transformers 5 has no `rope_theta` attribute; Qwen2.5's 1e6 must not become Megatron's default 1e4.
    assert rope_settings(Qwen2Config(rope_theta=1e6)) == {"rotary_base": 1e6}


def test_rope_llama3_scaling_maps_to_megatron():
    cfg = LlamaConfig(rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    assert rope_settings(cfg) == {"rotary_base": 5e5, "rope_scaling": True, "rope_scaling_factor": 8.0}


def test_rope_unsupported_scaling_is_refused():
    cfg = LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
    with pytest.raises(ValueError, match="is not supported"):
        rope_settings(cfg)



def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    """Megatron's MoELayer refuses to train at TP > 1 without sequence parallelism, at the first forward and with a
    message about performance: refused when the model is built, naming the setting."""
    from types import SimpleNamespace

    from transformers import Qwen3MoeConfig

    from engine.config import ModelConfig
    from engine.policy.moe_config import moe_settings

    ps = SimpleNamespace(tp_size=2, sequence_parallel=False, ep_size=2, etp_size=1)
    with pytest.raises(ValueError, match="tp_size=2 needs parallel.sequence_parallel=true"):
        moe_settings(Qwen3MoeConfig(num_experts=4), ModelConfig(), ps)
    settings = moe_settings(Qwen3MoeConfig(num_experts=4), ModelConfig(), SimpleNamespace(**{**vars(ps),
                                                                                           "sequence_parallel": True}))
    assert settings["num_moe_experts"] == 4 and settings["expert_model_parallel_size"] == 2
    # the load-balancing coefficient follows the HF config's router_aux_loss_coef by default (TRL's default)
    sp = SimpleNamespace(**{**vars(ps), "sequence_parallel": True})
    for given, expected in ((None, 0.003), (0.0, 0.0), (0.02, 0.02)):
        settings = moe_settings(Qwen3MoeConfig(num_experts=4, router_aux_loss_coef=0.003),
                                ModelConfig(moe_aux_loss_coeff=given), sp)
        assert settings["moe_aux_loss_coeff"] == expected
        assert settings["moe_router_load_balancing_type"] == ("aux_loss" if expected else "none")
    assert ModelConfig().moe_aux_loss_coeff is None


def test_moe_aux_loss_on_a_dense_model_is_refused_and_dropout_follows_the_switch():
    """TRL refuses router_aux_loss_coef on a non-MoE model; dropout comes from the HF config unless disabled."""
    from types import SimpleNamespace

    from engine.config import ModelConfig
    from engine.policy.model import dropout_settings
    from engine.policy.moe_config import moe_settings

    ps = SimpleNamespace(tp_size=1, sequence_parallel=False, ep_size=1)
    with pytest.raises(ValueError, match=r"model.moe_aux_loss_coeff=0.01 \(TRL's router_aux_loss_coef\)"):
        moe_settings(Qwen2Config(), ModelConfig(moe_aux_loss_coeff=0.01), ps)
    assert moe_settings(Qwen2Config(), ModelConfig(), ps) == {}
    noisy = Qwen2Config(attention_dropout=0.1)
    assert dropout_settings(noisy, ModelConfig()) == {"hidden_dropout": 0.0, "attention_dropout": 0.1}
    assert dropout_settings(noisy, ModelConfig(disable_dropout=True)) == {"hidden_dropout": 0.0, "attention_dropout": 0.0}
