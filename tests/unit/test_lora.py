"""LoRA settings (engine/policy/lora.py, the `lora` section's validation, GRPOTrainer's peft_config): what is
accepted maps onto the right Megatron linears, and every bad input fails with a message naming the setting.
The adapters' numbers (PEFT equality, layouts, checkpoints) are tested in tests/distributed/test_lora_layouts.py."""

from types import SimpleNamespace

import pytest
from peft import LoraConfig as PeftLoraConfig

from engine.config import ConfigError, build_config
from engine.lora_settings import (
    lora_fields_from_peft,
    lora_settings_from_config,
    lora_settings_from_peft,
    refuse_expert_adapters,
    resolve_target_modules,
)
from engine.policy.lora import LoraAdapter
from engine.validation import validate


def test_target_modules_all_linear_and_names_in_model_order():
    assert resolve_target_modules("all-linear") == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj")
    assert resolve_target_modules(["v_proj", "q_proj"]) == ("q_proj", "v_proj")


@pytest.mark.parametrize("targets", [["lm_head"], ["q_proj", "qkv"], [], ".*proj"])
def test_target_modules_matching_nothing_are_refused_by_name(targets):
    with pytest.raises(ValueError, match=r"lora.target_modules: .* match no linear"):
        resolve_target_modules(targets)


def test_peft_config_maps_to_settings_and_config_fields():
    peft = PeftLoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "down_proj"],
                          use_rslora=True, task_type="CAUSAL_LM")
    settings = lora_settings_from_peft(peft)
    assert settings.target_modules == ("q_proj", "down_proj") and settings.r == 8
    assert settings.scaling == pytest.approx(16 / 8 ** 0.5)
    fields = lora_fields_from_peft(peft)
    cfg = build_config({"lora": fields})
    assert lora_settings_from_config(cfg.lora) == settings
    assert lora_settings_from_peft(PeftLoraConfig(r=4)).target_modules == ("q_proj", "v_proj"), "PEFT's default"
    assert lora_settings_from_peft(PeftLoraConfig(r=4, lora_alpha=8)).scaling == 2.0


@pytest.mark.parametrize("kwargs,name", [
    ({"modules_to_save": ["score"]}, "modules_to_save"), ({"bias": "all"}, "bias"), ({"use_dora": True}, "use_dora"),
    ({"layers_to_transform": [0]}, "layers_to_transform"), ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"init_lora_weights": "gaussian"}, "init_lora_weights"), ({"exclude_modules": ["k_proj"]}, "exclude_modules"),
])
def test_peft_options_the_engine_cannot_act_on_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=rf"peft_config.{name}="):
        lora_settings_from_peft(PeftLoraConfig(r=4, target_modules=["q_proj"], **kwargs))


def test_modules_to_save_lm_head_and_embeddings_are_taken_others_refused_by_name():
    both = PeftLoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head", "embed_tokens"])
    settings = lora_settings_from_peft(both)
    assert settings.modules_to_save == ("embed_tokens", "lm_head")
    cfg = build_config({"lora": lora_fields_from_peft(both)})
    assert cfg.lora.lora_modules_to_save == ["embed_tokens", "lm_head"]
    assert lora_settings_from_config(cfg.lora) == settings
    assert lora_settings_from_peft(PeftLoraConfig(r=4, modules_to_save=["lm_head"])).modules_to_save == ("lm_head",)
    with pytest.raises(ValueError, match=r"peft_config.modules_to_save=\['lm_head.weight'\]: .* cannot be trained"):
        lora_settings_from_peft(PeftLoraConfig(r=4, modules_to_save=["lm_head.weight"]))
    with pytest.raises(ConfigError, match=r"lora.lora_modules_to_save=\['norm'\]: \['norm'\] cannot be trained"):
        validate(build_config({"lora": {"use_peft": True, "lora_modules_to_save": ["norm"]}}), 1)


def test_modules_to_save_on_tied_embeddings_is_refused_naming_the_setting():
    import torch

    from engine.policy.lora import _train_saved_modules

    chunk = torch.nn.Module()
    chunk.share_embeddings_and_output_weights = True
    with pytest.raises(ValueError, match=r"lora.lora_modules_to_save .*=\['lm_head'\] on a model with tied"):
        _train_saved_modules(chunk, ("lm_head",))


def _megatron_config(**overrides):
    return SimpleNamespace(**({"num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 32, "hidden_size": 128,
                               "ffn_hidden_size": 256, "sequence_parallel": False, "params_dtype": None} | overrides))


def test_rank_larger_than_the_layer_is_refused():
    import torch

    ps = SimpleNamespace(tp_size=1, groups=SimpleNamespace(tp=None))
    settings = lora_settings_from_config(build_config({"lora": {"use_peft": True, "lora_r": 65,
                                                                "lora_target_modules": ["k_proj"]}}).lora)
    with pytest.raises(ValueError, match=r"lora.lora_r \(peft r\)=65 is larger than k_proj's smaller dimension "
                                         r"\(64 x 128\)"):
        LoraAdapter("self_attention.linear_qkv", ["k_proj"], settings, _megatron_config(params_dtype=torch.float32), ps)


def test_adapters_are_float32_on_a_bf16_base_unless_lora_adapter_dtype_is_model():
    """PEFT's default (`autocast_adapter_dtype=True`, what TRL's get_peft_model does): fp32 A and B whatever the base's
    dtype; `lora.lora_adapter_dtype=model` holds them in the model's dtype. A peft_config gets PEFT's default."""
    import torch

    ps = SimpleNamespace(tp_size=1, groups=SimpleNamespace(tp=None))
    bf16 = _megatron_config(params_dtype=torch.bfloat16)
    for dtype, expected in (("float32", torch.float32), ("model", torch.bfloat16)):
        settings = lora_settings_from_config(build_config({"lora": {"use_peft": True, "lora_adapter_dtype": dtype,
                                                                    "lora_target_modules": ["q_proj"]}}).lora)
        adapter = LoraAdapter("self_attention.linear_qkv", ["q_proj"], settings, bf16, ps)
        assert {p.dtype for p in adapter.parameters()} == {expected}, dtype
    assert lora_settings_from_peft(PeftLoraConfig(r=4)).adapter_dtype == "float32"


def test_mlp_adapters_on_an_moe_model_are_refused_naming_the_setting_the_experts_and_the_way_out():
    """At any ep_size: transformers 5 holds every MoE family's experts as 3-D tensors PEFT's target_modules do not
    match; attention targets pass, and a dense model keeps its MLP adapters."""
    all_linear = lora_settings_from_peft(PeftLoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match=r"lora.lora_target_modules \(peft_config.target_modules\) includes "
                                         r"\['gate_proj', 'up_proj', 'down_proj'\], but qwen3_moe routes its MLP through "
                                         r"128 experts: .*at any parallel.ep_size.*3-D tensors.*Set "
                                         r"lora.lora_target_modules=\['q_proj', 'k_proj', 'v_proj', 'o_proj'\]"):
        refuse_expert_adapters(all_linear, "qwen3_moe", 128)
    with pytest.raises(ValueError, match=r"includes \['down_proj'\].*Set lora.lora_target_modules=\['q_proj'\]"):
        refuse_expert_adapters(lora_settings_from_peft(PeftLoraConfig(r=4, target_modules=["q_proj", "down_proj"])),
                               "mixtral", 8)
    refuse_expert_adapters(lora_settings_from_peft(PeftLoraConfig(r=4)), "qwen3_moe", 128)  # q_proj, v_proj
    refuse_expert_adapters(all_linear, "qwen2", 0)


@pytest.mark.parametrize("lora,other,message", [
    ({"lora_r": 8}, {}, r"lora.lora_r=8: no effect without lora.use_peft=true"),
    ({"use_peft": True, "lora_r": 0}, {}, r"lora.lora_r=0: the rank must be >= 1"),
    ({"use_peft": True, "lora_dropout": 1.0}, {}, r"lora.lora_dropout=1.0: must be in \[0, 1\)"),
    ({"use_peft": True, "lora_target_modules": ["query"]}, {}, r"lora.lora_target_modules: \['query'\] match no"),
    ({"use_peft": True}, {"grpo": {"sync_ref_model": True}}, r"grpo.sync_ref_model with lora.use_peft"),
    ({"lora_weight_sync": "adapter"}, {}, r"lora.lora_weight_sync='adapter': no effect without lora.use_peft"),
    ({"lora_adapter_dtype": "model"}, {}, r"lora.lora_adapter_dtype='model': no effect without lora.use_peft"),
    ({"lora_modules_to_save": ["lm_head"]}, {}, r"lora.lora_modules_to_save=\['lm_head'\]: no effect without"),
    ({"use_peft": True, "lora_weight_sync": "adapter", "lora_modules_to_save": ["lm_head"]}, {},
     r"lora.lora_modules_to_save=\['lm_head'\] with lora.lora_weight_sync=adapter: vLLM's LoRA cannot carry"),
    ({"use_peft": True, "lora_weight_sync": "adapter", "lora_r": 1024, "lora_target_modules": ["q_proj"]}, {},
     r"lora.lora_r=1024 with lora.lora_weight_sync=adapter: vLLM's LoRA supports ranks up to 512"),
    ({"use_peft": True}, {"grpo": {"beta": 0.04}, "model": {"offload_reference": True}},
     r"model.offload_reference with lora.use_peft: the KL reference is the policy's frozen base"),
    ({"use_peft": True}, {"checkpoint": {"export_quantization": "source"}},
     r"checkpoint.export_quantization='source' with lora.use_peft: the export is a PEFT adapter .*lora_save_merged"),
])
def test_lora_config_validation_names_the_setting(lora, other, message):
    if "export_quantization" in str(other):  # with the merged export it acts
        validate(build_config({"lora": lora | {"lora_save_merged": True}, **other}), 1)
    with pytest.raises(ConfigError, match=message):
        validate(build_config({"lora": lora, **other}), 1)


@pytest.mark.parametrize("rollout", [{"vllm_mode": "server"}, {"vllm_tensor_parallel_size": 2},
                                     {"vllm_mode": "server", "vllm_tensor_parallel_size": 2}])
def test_adapter_sync_in_server_mode_and_at_engine_tp2_validates(rollout):
    validate(build_config({"lora": {"use_peft": True, "lora_weight_sync": "adapter"}, "rollout": rollout,
                           "parallel": {"tp_size": 2}}), 2)


def test_grpo_trainer_takes_peft_config(tmp_path):
    from datasets import Dataset

    from engine import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4)
    trainer = GRPOTrainer(model="builtin:tiny-qwen2", reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 4}),
                          peft_config=PeftLoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    lora = trainer._cfg.lora
    assert lora.use_peft and lora.lora_r == 8 and lora.lora_alpha == 32 and len(lora.lora_target_modules) == 7
    with pytest.raises(ValueError, match=r"peft_config.modules_to_save=\['score'\]: "):
        GRPOTrainer(model="builtin:tiny-qwen2", reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                    args=args, train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 4}),
                    peft_config=PeftLoraConfig(r=8, modules_to_save=["score"]))


def test_adapter_sync_starts_vllm_with_the_smallest_lora_rank_that_fits():
    from engine.rollout.vllm_lora import lora_engine_options

    assert lora_engine_options(4) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert lora_engine_options(16)["max_lora_rank"] == 16 and lora_engine_options(17)["max_lora_rank"] == 32
    with pytest.raises(ValueError, match=r"lora.lora_r=600 with lora.lora_weight_sync=adapter"):
        lora_engine_options(600)


def test_adapter_sync_refuses_a_rollout_server_without_lora_support_or_a_smaller_rank():
    from types import SimpleNamespace

    from engine.rollout.server_rollout import _check_lora_support
    from tests.helpers.lora import lora_settings

    def servers(*ranks):
        return SimpleNamespace(healths=[{"max_lora_rank": r} for r in ranks], describe=lambda i: f"http://node{i}:8000")

    settings = lora_settings(r=16)
    _check_lora_support(servers(16, 32), settings)
    with pytest.raises(ValueError, match=r"rollout server http://node1:8000 runs vLLM without LoRA support: start it "
                                         r"with the trainer's config \(lora.use_peft=true lora.lora_weight_sync=adapter "
                                         r"lora.lora_r=16\)"):
        _check_lora_support(servers(16, None), settings)
    with pytest.raises(ValueError, match=r"http://node0:8000 runs vLLM with max_lora_rank 8 < lora.lora_r=16"):
        _check_lora_support(servers(8), settings)


def test_adapters_on_nemotron_h_are_refused_by_name():
    """Its one-mixer layers have no linear_qkv / gated fc1 where HF_TARGETS would put q_proj / up_proj."""
    from engine.policy.lora import apply_lora

    settings = lora_settings_from_config(build_config({"lora": {"use_peft": True,
                                                                "lora_target_modules": ["q_proj"]}}).lora)
    chunk = SimpleNamespace(config=_megatron_config(gated_linear_unit=False))  # what nemotron_h's config sets
    with pytest.raises(ValueError, match="lora.use_peft with nemotron_h: adapters on its hybrid layers"):
        apply_lora([chunk], settings, SimpleNamespace(tp_size=1))


def test_peft_target_parameters_on_the_experts_map_to_settings_and_config_fields():
    """TRL's MoE PEFT test's config (target_parameters alone: PEFT then adapts no module) and PEFT's suffix matching
    (the parameter's name ends with "." + the entry); the config section round-trips; the exported LoraConfig names
    them again, target_modules empty."""
    from engine.policy.peft_adapter import peft_config_of

    peft = PeftLoraConfig(r=4, target_parameters=["mlp.experts.down_proj", "experts.gate_up_proj"])
    settings = lora_settings_from_peft(peft)
    assert settings.target_parameters == ("gate_up_proj", "down_proj") and settings.target_modules == ()
    assert lora_settings_from_config(build_config({"lora": lora_fields_from_peft(peft)}).lora) == settings
    both = lora_settings_from_peft(PeftLoraConfig(r=4, target_modules=["q_proj"], target_parameters=["down_proj"]))
    assert both.target_modules == ("q_proj",) and both.target_parameters == ("down_proj",)
    exported = peft_config_of(settings)
    assert sorted(exported.target_parameters) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert not exported.target_modules


@pytest.mark.parametrize("lora,message", [
    ({"lora_target_parameters": ["mlp.experts.up_proj"], "lora_dropout": 0.0},
     r"lora.lora_target_parameters: \['mlp.experts.up_proj'\] match no routed-expert tensor"),
    ({"lora_target_parameters": ["mlp.experts.down_proj"], "lora_dropout": 0.05},
     r"lora.lora_target_parameters=\['mlp.experts.down_proj'\] with lora.lora_dropout=0.05: .* set it to 0"),
    ({"lora_target_parameters": ["mlp.experts.down_proj"], "lora_dropout": 0.0, "lora_weight_sync": "adapter"},
     r"lora.lora_weight_sync=adapter: vLLM's LoRA on fused MoE experts is not supported"),
])
def test_bad_expert_target_parameters_are_refused_naming_the_setting(lora, message):
    with pytest.raises(ConfigError, match=message):
        validate(build_config({"lora": {"use_peft": True, **lora}}), 1)


def test_expert_adapters_are_refused_where_they_cannot_be_built():
    """On a dense model (nothing to match) and at expert_tp_size > 1; every MoE family passes."""
    settings = lora_settings_from_peft(PeftLoraConfig(r=4, target_parameters=["mlp.experts.gate_up_proj"]))
    with pytest.raises(ValueError, match=r"target_parameters\)=\['gate_up_proj'\]: qwen2 has no routed experts"):
        refuse_expert_adapters(settings, "qwen2", 0)
    with pytest.raises(ValueError, match=r"at parallel.expert_tp_size=2: .*expert_tp_size 1"):
        refuse_expert_adapters(settings, "qwen3_moe", 8, expert_tp_size=2)
    for family in ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss"):
        refuse_expert_adapters(settings, family, 8)
    with pytest.raises(ValueError, match=r"peft_config.target_parameters=.*lora_dropout=0.1"):
        lora_settings_from_peft(PeftLoraConfig(r=4, lora_dropout=0.1, target_parameters=["mlp.experts.down_proj"]))
