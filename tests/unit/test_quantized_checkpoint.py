"""Quantized checkpoints read as their unquantized form (engine/policy/quantized_checkpoint.py), on builtin tiny
models quantized as the releases are: every tensor and every TP slice equals transformers' own dequantization; the
export's re-quantization gives back the source's bytes; quantizations the loader does not read are refused by
method, missing or mis-shaped scale tensors by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from engine.models.families import check_model_type
from engine.models.quantized import read_format
from engine.models.tiny_model import build_tiny_model
from engine.policy.hf_checkpoint import SafetensorsSource
from engine.policy.quantized_checkpoint import DequantizingSource, checkpoint_format, requantize_like_source
from tests.helpers.quantized import quantize_checkpoint, transformers_dequantized


@pytest.fixture(scope="module")
def quantized_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {
        "fp8": quantize_checkpoint(build_tiny_model(root / "deepseek_v3", "deepseek_v3", seed=4), root / "fp8", "fp8"),
        "mxfp4": quantize_checkpoint(build_tiny_model(root / "gpt_oss", "gpt_oss", seed=5), root / "mxfp4", "mxfp4"),
    }


@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_tensor_and_slice_reads_as_transformers_dequantizes_it(quantized_dirs, method, dtype):
    model_dir = quantized_dirs[method]
    source = DequantizingSource(SafetensorsSource(model_dir), checkpoint_format(model_dir), dtype)
    reference = transformers_dequantized(model_dir, dtype)
    assert source.names() == set(reference)
    stored = load_file(model_dir / "model.safetensors")
    quantized = 0
    for name, expected in reference.items():
        whole = source.read(name, (slice(None),))
        quantized += name not in stored or stored[name].dtype == torch.float8_e4m3fn
        assert source.shape(name) == tuple(expected.shape), name
        assert torch.equal(whole.to(expected.dtype), expected), name
        if expected.dim() >= 2:  # TP-like slices: rows, then columns (experts: one expert at a time)
            lead = (slice(1, 2),) if expected.dim() == 3 else ()
            rows, cols = expected.shape[-2:]
            for index in (lead + (slice(rows // 2, rows),), lead + (slice(None), slice(cols // 4, cols // 2))):
                assert torch.equal(source.read(name, index).to(expected.dtype), expected[index]), (name, index)
    assert quantized >= 8, "the quantized tensors were read"


@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_requantizing_the_dequantized_tensors_gives_back_the_source_bytes(quantized_dirs, method):
    model_dir = quantized_dirs[method]
    fmt = checkpoint_format(model_dir)
    dequantized = transformers_dequantized(model_dir, torch.bfloat16)
    again = requantize_like_source(dequantized, fmt, SafetensorsSource(model_dir))
    stored = load_file(model_dir / "model.safetensors")
    assert sorted(again) == sorted(stored)
    for name, tensor in stored.items():
        assert again[name].dtype == tensor.dtype, name
        assert torch.equal(again[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize("quant,cause", [
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"\(fp8: weight_block_size=\[64, 64\]\): FP8 in \[64, 64\] "
                                                             r"blocks is not read"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, r"\(fp8\): FP8 without weight_block_size \(per-tensor or "
                                                              r"per-channel scales\)"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, r"scale_fmt 'ue8m0' is not read"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, r"\(modelopt: quant_algo='NVFP4'\): the loader dequantises"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, r"format='nvfp4-pack-quantized'"),
    ({"quant_method": "awq", "bits": 4}, r"\(awq: bits=4\)"),
    ({"quant_method": "gptq", "bits": 4}, r"\(gptq: bits=4\)"),
])
def test_quantizations_the_loader_does_not_read_are_refused_naming_the_method_and_what_to_do(tmp_path, quant, cause):
    config = build_tiny_model(tmp_path, "qwen3", seed=6) / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"quantization_config": quant}))
    with pytest.raises(ValueError, match=f"qwen3 with quantization_config .*{cause}.*save_pretrained a bf16 copy"):
        check_model_type(AutoConfig.from_pretrained(tmp_path))


@pytest.mark.parametrize("quant", [FP8 := {"quant_method": "fp8", "weight_block_size": [128, 128]},
                                   {"quant_method": "mxfp4"}], ids=["fp8", "mxfp4"])
def test_the_formats_the_loader_reads_pass_the_family_check(quant):
    config = AutoConfig.for_model("qwen3_moe" if quant["quant_method"] == "fp8" else "gpt_oss", quantization_config=quant)
    check_model_type(config)
    assert read_format(config).method == quant["quant_method"]


def _rewrite(model_dir, change) -> SafetensorsSource:
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, model_dir / "model.safetensors")
    return DequantizingSource(SafetensorsSource(model_dir), checkpoint_format(model_dir), torch.float32)


@pytest.mark.parametrize("method,change,tensor,cause", [
    ("fp8", lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"), "model.layers.0.self_attn.o_proj.weight",
     r"is float8_e4m3fn but the checkpoint has no 'model.layers.0.self_attn.o_proj.weight_scale_inv'"),
    ("fp8", lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(2, 2)}),
     "model.layers.0.self_attn.o_proj.weight", r"scale tensor 'model.layers.0.self_attn.o_proj.weight_scale_inv' has "
                                                r"shape \(2, 2\), \(1, 1\) expected \(128 x 128 blocks"),
    ("mxfp4", lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"), "model.layers.1.mlp.experts.down_proj",
     r"'model.layers.1.mlp.experts.down_proj_blocks' has no 'model.layers.1.mlp.experts.down_proj_scales'"),
    ("mxfp4", lambda t: t.update({"model.layers.1.mlp.experts.down_proj_scales": torch.zeros(4, 128, 1, dtype=torch.uint8)}),
     "model.layers.1.mlp.experts.down_proj", r"scale tensor 'model.layers.1.mlp.experts.down_proj_scales' has shape "
                                             r"\(4, 128, 1\), \(4, 128, 2\) expected"),
], ids=["fp8-missing", "fp8-misshaped", "mxfp4-missing", "mxfp4-misshaped"])
def test_a_missing_or_misshaped_scale_tensor_is_an_error_naming_it(quantized_dirs, tmp_path, method, change, tensor,
                                                                   cause):
    import shutil

    model_dir = shutil.copytree(quantized_dirs[method], tmp_path / method)
    source = _rewrite(model_dir, change)
    with pytest.raises(ValueError, match=cause):
        source.read(tensor, (slice(None),))
