"""Activation recompute settings (`train.gradient_checkpointing`, `train.recompute_*`): what Megatron is given
(engine.recompute.resolve_recompute, used by engine/policy/model.py and the planner alike), every refusal with the
setting's dotted name and the arithmetic, Megatron's own TransformerConfig accepting what we pass, and TRL's
`gradient_checkpointing_kwargs`. That recompute really runs and changes no number is tested in tests/distributed
(test_grpo_step_layouts.py, test_qwen3_layouts.py, test_routing_replay.py)."""

import warnings

import pytest

from engine.config import ConfigError, TrainConfig, build_config
from engine.recompute import Recompute, resolve_recompute
from engine.validation import validate


def test_default_is_trl_gradient_checkpointing_as_megatron_full_uniform_one_layer():
    rc = resolve_recompute(TrainConfig(), num_layers=80, num_chunks=4, is_moe=False)
    assert rc == Recompute("full", "uniform", 1)
    assert rc.megatron_kwargs() == {"recompute_granularity": "full", "recompute_method": "uniform",
                                    "recompute_num_layers": 1, "recompute_modules": None}
    assert resolve_recompute(TrainConfig(gradient_checkpointing=False), 80, 4, False).megatron_kwargs() == {
        "recompute_granularity": None}


@pytest.mark.parametrize("train,chunks,expected", [
    ({"recompute_num_layers": 4}, 4, Recompute("full", "uniform", 4)),
    ({"recompute_method": "block"}, 8, Recompute("full", "block", 10)),  # every layer of an 80 / 8 chunk
    ({"recompute_method": "block", "recompute_num_layers": 3}, 4, Recompute("full", "block", 3)),
    ({"recompute_granularity": "selective"}, 4, Recompute("selective", modules=("core_attn",))),
    ({"recompute_granularity": "selective", "recompute_modules": ["mlp", "core_attn"]}, 1,
     Recompute("selective", modules=("mlp", "core_attn"))),
])
def test_settings_resolve_to_megatron_fields(train, chunks, expected):
    assert resolve_recompute(TrainConfig(**train), 80, chunks, is_moe=False) == expected


@pytest.mark.parametrize("train,layers,chunks,is_moe,message", [
    ({"recompute_num_layers": 3}, 80, 4, False,
     r"train.recompute_num_layers=3 must divide the layers of a model chunk for the uniform method: 80 layers / 4 "
     r"chunk\(s\) \(pp_size x virtual_pipeline_size\) = 20, 20 % 3 = 2"),
    ({"recompute_method": "block", "recompute_num_layers": 21}, 80, 4, False,
     r"train.recompute_num_layers=21 > the layers of a model chunk for the block method: 80 layers / 4 chunk\(s\).* = 20"),
    ({"recompute_method": "block"}, 48, 1, True, r"train.recompute_method=block is refused for MoE models"),
    ({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, 48, 1, True,
     r"'mlp' would recompute nothing: an MoE model has no dense MLP \(use 'moe'\)"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, 80, 1, False,
     r"'moe' would recompute nothing: a dense model has no MoE layer"),
])
def test_settings_that_cannot_act_on_the_model_are_refused_with_the_arithmetic(train, layers, chunks, is_moe, message):
    with pytest.raises(ConfigError, match=message):
        resolve_recompute(TrainConfig(**train), layers, chunks, is_moe)


@pytest.mark.parametrize("train,message", [
    ({"gradient_checkpointing": False, "recompute_method": "block"},
     r"train.recompute_method='block': no effect with train.gradient_checkpointing=false"),
    ({"gradient_checkpointing": False, "recompute_granularity": "selective"},
     r"train.recompute_granularity='selective': no effect"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 2},
     r"train.recompute_num_layers apply to train.recompute_granularity=full only"),
    ({"recompute_modules": ["core_attn"]}, r"train.recompute_modules=\['core_attn'\] applies to "
                                           r"train.recompute_granularity=selective only"),
    ({"recompute_num_layers": 0}, r"train.recompute_num_layers must be >= 1 or null, got 0"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe_act"]},
     r"train.recompute_modules: 'moe_act' recomputes the grouped-GEMM experts' activation only"),
    ({"recompute_granularity": "selective", "recompute_modules": ["shared_experts"]}, r"'shared_experts' recomputes"),
    ({"recompute_granularity": "selective", "recompute_modules": ["attn"]}, r"unknown module 'attn'; available"),
    ({"recompute_granularity": "selective", "recompute_modules": []}, r"train.recompute_modules=\[\] recomputes nothing"),
])
def test_nonsense_combinations_are_refused_by_validation(train, message):
    with pytest.raises(ConfigError, match=message):
        validate(build_config({"train": train}), 1)


def test_megatron_transformer_config_accepts_every_resolved_setting():
    """Megatron's own checks (TransformerConfig.__post_init__) pass for what we hand it, and it keeps it."""
    from megatron.core.transformer import TransformerConfig

    for train in ({}, {"recompute_num_layers": 2}, {"recompute_method": "block", "recompute_num_layers": 1},
                  {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
                  {"gradient_checkpointing": False}):
        rc = resolve_recompute(TrainConfig(**train), 4, 1, is_moe=False)
        config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                                   **rc.megatron_kwargs())
        assert config.recompute_granularity == rc.granularity
        assert config.recompute_method == rc.method and config.recompute_num_layers == rc.num_layers


def test_build_policy_refuses_layernorm_recompute_without_transformer_engine():
    from transformers import Qwen2Config

    from engine.config import ModelConfig
    from engine.policy.model import build_transformer_config
    from engine.policy.parallel import ParallelState

    hf = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)
    ps = ParallelState(world_size=1, rank=0, tp_size=1, pp_size=1, dp_size=1, vpp_size=None, tp_rank=0, pp_rank=0,
                       dp_rank=0, sequence_parallel=False, groups=None, device=None)
    train = TrainConfig(recompute_granularity="selective", recompute_modules=["layernorm"])
    with pytest.raises(ValueError, match=r"train.recompute_modules: 'layernorm' needs Transformer Engine"):
        build_transformer_config(hf, ModelConfig(transformer_impl="local"), ps, train)
    config = build_transformer_config(hf, ModelConfig(transformer_impl="local"), ps, TrainConfig(recompute_num_layers=2))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "uniform", 2)


def test_trl_gradient_checkpointing_kwargs_are_named_or_refused():
    from engine.api.trl_config import GRPOConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = GRPOConfig(gradient_checkpointing_kwargs={"use_reentrant": False})
    [warning] = [str(w.message) for w in caught if "no effect" in str(w.message)]
    assert "gradient_checkpointing_kwargs['use_reentrant']=False" in warning and "CheckpointFunction" in warning
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args.to_engine_config().train.gradient_checkpointing
    with pytest.raises(ValueError, match=r"gradient_checkpointing_kwargs=\{'context_fn': ...\}\): 'context_fn' is a "
                                         r"torch.utils.checkpoint option with no counterpart"):
        GRPOConfig(gradient_checkpointing_kwargs={"context_fn": None})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOConfig(gradient_checkpointing=False, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert any("gradient_checkpointing=False: nothing is recomputed" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOConfig(gradient_checkpointing_kwargs=None)
    assert not [w for w in caught if "gradient_checkpointing" in str(w.message)]
