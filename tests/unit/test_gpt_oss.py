"""GPT-OSS's pure pieces (engine/models/gpt_oss.py): the stacked expert tensors (HF: every expert of a layer in one
tensor, x @ W, gate / up interleaved) to Megatron's per-expert fc1 / fc2 shards and back, at TP1 and TP2, and the
pieces re-stacked by the export; the sliding-window mask (HF's window of w keys, the query's own included, is
Megatron's (w - 1, 0)); the TransformerConfig keywords read from the tiny model's config. The whole model against HF
(logits at four layouts, export, GRPO step): tests/distributed/test_family_layouts.py."""

import pytest
import torch

from engine.models.gpt_oss import (
    EXPERT_PIECE,
    gpt_oss_settings,
    read_stacked_expert,
    sliding_window_mask,
    stack_expert_pieces,
    stacked_expert_to_hf,
    yarn_rope_settings,
)
from engine.models.tiny_model import tiny_model_config

E, H, F = 3, 4, 6


def _hf() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"gate_up_proj": torch.randn(E, H, 2 * F, generator=gen), "gate_up_proj_bias": torch.randn(E, 2 * F, generator=gen),
            "down_proj": torch.randn(E, F, H, generator=gen), "down_proj_bias": torch.randn(E, H, generator=gen)}


KINDS = {"gate_up_proj": "stacked_gate_up", "gate_up_proj_bias": "stacked_gate_up", "down_proj": "stacked_row",
         "down_proj_bias": "stacked_replicated"}


def test_an_expert_s_megatron_fc1_computes_hf_s_gate_and_up_and_fc2_its_down():
    hf, x = _hf(), torch.randn(5, H)  # (tokens, H)
    for e in range(E):
        fc1 = read_stacked_expert("stacked_gate_up", "w", hf["gate_up_proj"][e], 0, 1)  # (2F, H) = [gate; up]
        fc1_bias = read_stacked_expert("stacked_gate_up", "b", hf["gate_up_proj_bias"][e], 0, 1)  # (2F,)
        gate_up = x @ hf["gate_up_proj"][e] + hf["gate_up_proj_bias"][e]  # (5, 2F), interleaved
        gate, up = (x @ fc1.t() + fc1_bias).chunk(2, dim=-1)
        torch.testing.assert_close(gate, gate_up[:, 0::2], rtol=0, atol=1e-6)
        torch.testing.assert_close(up, gate_up[:, 1::2], rtol=0, atol=1e-6)
        y = torch.randn(5, F)
        fc2 = read_stacked_expert("stacked_row", "w", hf["down_proj"][e], 0, 1)  # (H, F)
        torch.testing.assert_close(y @ fc2.t(), y @ hf["down_proj"][e], rtol=0, atol=1e-6)


@pytest.mark.parametrize("tp", [1, 2])
def test_stacked_experts_round_trip_through_megatron_shards_bit_for_bit(tp):
    """Per expert: TP shards ([gate_r; up_r] for fc1, columns for fc2) merged as Megatron merges them, back to HF
    pieces, re-stacked: every HF tensor equal bit for bit."""
    from types import SimpleNamespace

    from engine.policy.model import merge_tp_shards

    hf, pieces = _hf(), {}
    for name, kind in KINDS.items():
        split = kind != "stacked_replicated"
        param = SimpleNamespace(tensor_model_parallel=split, partition_dim=1 if kind == "stacked_row" else 0,
                                partition_stride=2 if kind == "stacked_gate_up" else 1)
        for e in range(E):
            shards = [read_stacked_expert(kind, name, hf[name][e], r, tp) for r in range(tp)]
            if not split:
                assert all(torch.equal(s, shards[0]) for s in shards)
            pieces |= stacked_expert_to_hf(kind, name, e, merge_tp_shards(shards, param))
    assert all(EXPERT_PIECE in key for key in pieces) and len(pieces) == 4 * E
    restacked = stack_expert_pieces(pieces | {"other": torch.ones(1)})
    assert sorted(restacked) == sorted([*hf, "other"])
    for name, tensor in hf.items():
        assert torch.equal(restacked[name], tensor), name


def test_missing_expert_pieces_are_refused():
    with pytest.raises(ValueError, match=r"w: expert pieces \[0, 2\] are not 0..E-1"):
        stack_expert_pieces({f"w{EXPERT_PIECE}0": torch.ones(1), f"w{EXPERT_PIECE}2": torch.ones(1)})


def test_sliding_window_mask_keeps_the_query_and_the_window_minus_one_keys_before_it():
    """Megatron's window (w - 1, 0) is HF's sliding_window w: query q sees keys q - w + 1 .. q (w keys)."""
    mask = sliding_window_mask(6, 6, 4 - 1)  # (6, 6), True = masked
    seen = [[k for k in range(6) if not mask[q, k]] for q in range(6)]
    assert seen == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]]
    assert sliding_window_mask(2, 6, 3).tolist() == sliding_window_mask(6, 6, 3)[4:].tolist()  # queries of the tail


def test_tiny_gpt_oss_settings_follow_its_config():
    config = tiny_model_config("gpt_oss")
    settings = gpt_oss_settings(config)
    assert settings["window_size"] == (config.sliding_window - 1, 0) == (3, 0)
    assert settings["window_attn_skip_freq"] == [1, 0, 1, 0]  # layer_types: sliding, full, sliding, full
    assert (settings["softmax_type"], settings["glu_linear_offset"], settings["activation_func_clamp_value"]) == (
        "learnable", 1.0, 0.2)
    x = torch.linspace(-3, 3, 7)
    torch.testing.assert_close(settings["activation_func"](x), x * torch.sigmoid(1.702 * x))
    gpt_model, attributes = yarn_rope_settings(config)
    assert gpt_model == {"position_embedding_type": "yarn", "rotary_base": 10000.0}
    assert (attributes["yarn_rotary_scaling_factor"], attributes["yarn_original_max_position_embeddings"],
            attributes["yarn_correction_range_round_to_int"]) == (16.0, 64, False)
    assert gpt_oss_settings(tiny_model_config("mixtral")) == {} and yarn_rope_settings(tiny_model_config("qwen2")) is None


def test_engine_warns_when_vllm_would_ignore_the_configs_clamp_or_norm_eps(tmp_path):
    """vLLM 0.32's GptOssForCausalLM hard-codes GPT-OSS's clamp 7.0 and norm eps 1e-5 (engine/models/gpt_oss/vllm.py
    VLLM_GPT_OSS_CONSTANTS): the tiny model's 0.2 / 1e-6 are named; GPT-OSS's own values and other families pass."""
    import json

    from engine.models.gpt_oss.vllm import gpt_oss_engine_mismatch

    config = tiny_model_config("gpt_oss").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = gpt_oss_engine_mismatch(tmp_path)
    assert "swiglu_limit=0.2 (vLLM uses 7.0)" in message and "rms_norm_eps=1e-06 (vLLM uses 1e-05)" in message
    (tmp_path / "config.json").write_text(json.dumps(config | {"swiglu_limit": 7.0, "rms_norm_eps": 1e-5}))
    assert gpt_oss_engine_mismatch(tmp_path) == ""
    (tmp_path / "config.json").write_text(json.dumps(tiny_model_config("qwen3_moe").to_dict()))
    assert gpt_oss_engine_mismatch(tmp_path) == ""
