"""The exact weight digests (engine/rollout/weight_digest.py), their comparison's message (engine/rollout/
sync_check.py `check_digests`), and the removed log-prob tolerance settings' error (engine/config.py)."""

import pytest
import torch

from engine.rollout.sync_check import check_digests
from engine.rollout.weight_digest import box_digest, tensor_digest

INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_flipped_bit_of_any_element_changes_the_digest(dtype):
    values = (torch.randn(7, 5, generator=torch.Generator().manual_seed(0)) * 1e3).to(dtype)
    digest = tensor_digest(values)
    for index in range(values.numel()):
        for bit in (0, 7, 15):
            flipped = values.clone()
            flipped.view(INT[dtype]).view(-1)[index] ^= 1 << bit
            assert tensor_digest(flipped) != digest, (index, bit)


def test_negative_zero_and_moved_elements_change_the_digest():
    zeros = torch.zeros(4)
    negative = zeros.clone()
    negative[2] = -0.0
    assert tensor_digest(negative) != tensor_digest(zeros)
    values = torch.arange(12.0).view(3, 4)
    assert tensor_digest(values[[1, 0, 2]]) != tensor_digest(values)  # two rows swapped
    assert tensor_digest(values.reshape(4, 3)) != tensor_digest(values)  # another layout of the same elements


def test_pieces_of_a_box_sum_to_its_digest_whatever_their_strides():
    values = torch.randn(6, 10).bfloat16()
    pieces = box_digest(values[:2], (0, 0), (6, 10)) + box_digest(values[2:, :3], (2, 0), (6, 10)) \
        + box_digest(values[2:, 3:], (2, 3), (6, 10))
    assert int(pieces) == tensor_digest(values)
    assert tensor_digest(values.t()) == tensor_digest(values.t().contiguous())
    with pytest.raises(ValueError, match="do not fit the box"):
        box_digest(values, (1, 0), (6, 10))


def test_check_digests_names_each_differing_or_missing_tensor_and_the_dtype_held():
    expected = {"a.weight": 1, "b.weight": 2, "c.weight": 3}
    held = {"a.weight": [1, "torch.bfloat16"], "b.weight": [5, "torch.float32"]}
    message = check_digests(expected, held, "bfloat16", "engine rank 1")
    assert "engine rank 1 holds 2 of 3 tensors" in message
    assert "b.weight (digest 0x0000000000000005, sent 0x0000000000000002, held as float32)" in message
    assert "c.weight (the engine holds no such tensor)" in message and "a.weight" not in message
    assert check_digests(expected, {k: [v, "torch.bfloat16"] for k, v in expected.items()}, "bfloat16", "x") == ""


@pytest.mark.parametrize("key", ["weight_sync_tolerance", "weight_sync_quantile"])
def test_removed_logprob_tolerance_settings_are_refused_with_the_reason(key):
    from engine.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=rf"'rollout\.{key}' was removed: the weight-sync check is exact now"):
        build_config({"rollout": {key: 0.5}})


def test_a_wider_engine_parameter_is_digested_as_sent_and_must_be_exactly_what_was_sent():
    """A float32 server fed bf16 by a bf16 trainer (TRL's `vllm-serve` at dtype auto on a float32 checkpoint): the
    engine digests its float32 values cast to bf16, which equals the trainer's digest when they are exact upcasts of
    what was sent; a value the cast changes (one low bit set) could not have come from the trainer and is reported."""
    from engine.rollout.vllm_engine import _module_digests

    sent = torch.randn(6, 5).to(torch.bfloat16)
    module = torch.nn.Linear(5, 6, bias=False)
    with torch.no_grad():
        module.weight.copy_(sent.float())
    (digest, held), = _module_digests("lm_head", module, {}, torch.bfloat16).values()
    assert int(digest) == int(box_digest(sent)) and held == "torch.float32"
    with torch.no_grad():
        module.weight.view(torch.int32)[2, 3] |= 1  # below bf16's precision: the bf16 cast rounds it away
    (digest, held), = _module_digests("lm_head", module, {}, torch.bfloat16).values()
    assert int(digest) != int(box_digest(sent)) and "not exactly torch.bfloat16" in held


@pytest.mark.parametrize("gated", [True, False])
def test_fused_experts_are_digested_under_each_experts_checkpoint_names(gated):
    """vLLM's fused experts (w13 [E, 2 I, H] = [gate; up], w2 [E, H, I]) are digested per expert under the
    checkpoint's names; non-gated experts (Nemotron-H's relu2: `ckpt_up_proj_name` None, vLLM's FusedMoE on a GPU)
    hold one projection per expert in w13 [E, I, H], digested whole under its one name (up_proj), not halved."""
    from engine.rollout.vllm_engine import _module_digests

    experts, width, hidden = 3, 4, 5
    module = torch.nn.Module()
    module.w13_weight = torch.nn.Parameter(torch.randn(experts, width * (2 if gated else 1), hidden))
    module.w2_weight = torch.nn.Parameter(torch.randn(experts, hidden, width))
    module.local_num_experts = module.global_num_experts = experts
    module.ckpt_gate_proj_name, module.ckpt_down_proj_name = ("gate_proj" if gated else "up_proj"), "down_proj"
    module.ckpt_up_proj_name = "up_proj" if gated else None
    digests = _module_digests("model.layers.1.mixer.experts", module, {}, torch.float32)
    want = {}
    for e in range(experts):
        want[f"model.layers.1.mixer.experts.{e}.down_proj.weight"] = module.w2_weight[e]
        parts = {"gate_proj": slice(0, width), "up_proj": slice(width, None)} if gated else {"up_proj": slice(None)}
        want |= {f"model.layers.1.mixer.experts.{e}.{proj}.weight": module.w13_weight[e, rows]
                 for proj, rows in parts.items()}
    assert sorted(digests) == sorted(want)
    for name, tensor in want.items():
        assert int(digests[name][0]) == int(box_digest(tensor.detach())), name
