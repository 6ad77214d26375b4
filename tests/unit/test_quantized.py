"""engine/models/quantized.py against transformers' own FP8 and MXFP4 conversions, on a builtin tiny model's weights
quantized with the reference block layout: whole-tensor and per-slice dequantization, the quantizers, byte-exact
round trips of unchanged weights, and the refusals of formats it does not read."""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file

from engine.models.quantized import (
    FP8_DTYPE,
    block_span,
    dequantize_fp8,
    dequantize_mxfp4,
    quantize_fp8,
    quantize_mxfp4,
    read_format,
)
from engine.models.tiny_model import resolve_builtin_model

BLOCK = (128, 128)


def _transformers_fp8(block=BLOCK):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    config = types.SimpleNamespace(weight_block_size=list(block), scale_fmt=None, dequantize=True)
    quantizer = types.SimpleNamespace(quantization_config=config)
    return Fp8Quantize(quantizer), Fp8Dequantize(quantizer)


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    """The 2-D weights of the builtin tiny Qwen2 (hidden 128, MLP 352: full and partial 128-blocks)."""
    folder = resolve_builtin_model("builtin:tiny-qwen2-arith", tmp_path_factory.mktemp("cache"))
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(path))
    return {k: v for k, v in state.items() if v.dim() == 2 and "layers." in k}


def test_fp8_dequantization_equals_transformers_on_the_tiny_models_divisible_weights(tiny_weights):
    quantize, dequantize = _transformers_fp8()
    checked = 0
    for name, weight in tiny_weights.items():
        if weight.shape[0] % BLOCK[0] or weight.shape[1] % BLOCK[1]:
            continue  # transformers refuses partial blocks; the slice test below covers them
        theirs = quantize._quantize_one(name, weight)
        q, scale_inv = theirs[name], theirs[name.removesuffix(".weight") + ".weight_scale_inv"]
        ours_q, ours_scale = quantize_fp8(weight, BLOCK)
        assert torch.equal(ours_scale, scale_inv) or torch.allclose(ours_scale, scale_inv, rtol=2**-23, atol=0), name
        assert (ours_q.float() - q.float()).abs().max() <= (q.float().abs() * 2**-3).max(), name
        for dtype in (torch.float32, torch.bfloat16):
            expected = dequantize._dequantize_one(q, scale_inv, output_dtype=dtype)
            assert torch.equal(dequantize_fp8(q, scale_inv, BLOCK, dtype), expected), (name, dtype)
        checked += 1
    assert checked >= 8, "the tiny model has divisible projections (q, o, k/v at 128 x 128 blocks)"


@pytest.mark.parametrize("shape", [(352, 128), (300, 200), (4, 576, 260)], ids=["mlp", "partial", "experts"])
def test_a_slice_dequantizes_from_its_own_blocks_as_the_whole_weight_does(shape):
    torch.manual_seed(0)
    weight = torch.randn(shape) * torch.logspace(-3, 1, shape[-1])
    q, scale_inv = quantize_fp8(weight, BLOCK)
    assert q.dtype == FP8_DTYPE and scale_inv.shape[-2:] == (-(-shape[-2] // 128), -(-shape[-1] // 128))
    whole = dequantize_fp8(q, scale_inv, BLOCK, torch.float32)
    assert torch.allclose(whole, weight, rtol=2**-3, atol=scale_inv.max().item() * 2**-9)
    rows, cols = shape[-2:]
    for r0, r1, c0, c1 in [(0, rows // 2, 0, cols), (rows // 2, rows, cols // 3, cols), (37, rows - 5, 1, 129)]:
        rs, cs = block_span(r0, r1, 128), block_span(c0, c1, 128)
        part = dequantize_fp8(q[..., r0:r1, c0:c1], scale_inv[..., rs, cs], BLOCK, torch.float32, offset=(r0, c0))
        assert torch.equal(part, whole[..., r0:r1, c0:c1]), (r0, r1, c0, c1)
    with pytest.raises(ValueError, match="blocks of 128 x 128 expected"):
        dequantize_fp8(q[..., :130, :], scale_inv[..., :1, :], BLOCK, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unchanged_fp8_weights_requantize_to_the_same_bytes_and_trained_blocks_get_their_own_scale(dtype):
    torch.manual_seed(1)
    weight = torch.randn(384, 300) * torch.logspace(-4, 2, 300)
    q, scale_inv = quantize_fp8(weight, BLOCK)
    policy = dequantize_fp8(q, scale_inv, BLOCK, dtype)  # what the engine trains from
    again_q, again_scale = quantize_fp8(policy, BLOCK, like=scale_inv)
    assert torch.equal(again_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(again_scale, scale_inv)
    trained = policy.float().clone()
    trained[:128, :128] *= 3.0  # one block moved: its scale follows, the others keep theirs
    new_q, new_scale = quantize_fp8(trained, BLOCK, like=scale_inv)
    assert torch.allclose(new_scale[0, 0], scale_inv[0, 0] * 3, rtol=2**-7)
    assert torch.equal(new_scale[1:], scale_inv[1:]) and torch.equal(new_q[128:].view(torch.uint8), q[128:].view(torch.uint8))


def test_mxfp4_dequantization_equals_transformers_and_round_trips_byte_exact():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(2)
    experts, rows, width = 2, 6, 128  # GPT-OSS layout: [experts, rows, groups, 16] codes, [experts, rows, groups]
    weight = torch.randn(experts, rows, width) * torch.logspace(-6, 3, rows)[:, None]
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (experts, rows, width // 32, 16) and scales.shape == (experts, rows, width // 32)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, dtype)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        assert torch.equal(ours, theirs), dtype
    values = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.allclose(values, weight, rtol=0.26, atol=float(weight.abs().amax()) * 2**-4)
    again_blocks, again_scales = quantize_mxfp4(values)
    assert torch.equal(again_blocks, blocks) and torch.equal(again_scales, scales)


def test_formats_are_read_from_the_config_and_others_refused_by_name():
    assert read_format({"model_type": "qwen2"}) is None
    fp8 = read_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                               "modules_to_not_convert": ["lm_head"]}})
    assert fp8.method == "fp8" and fp8.block == (128, 128) and fp8.not_converted == ("lm_head",)
    assert read_format({"quantization_config": {"quant_method": "mxfp4"}}).method == "mxfp4"
    with pytest.raises(ValueError, match="per-tensor or per-channel"):
        read_format({"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="'gptq'.*dequantise it first"):
        read_format({"quantization_config": {"quant_method": "gptq", "bits": 4}})
    with pytest.raises(ValueError, match="scale_fmt 'ue8m0'"):
        read_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                             "scale_fmt": "ue8m0"}})
