"""Rollout from a quantized checkpoint (engine/rollout/quantized_source.py, engine/rollout/fp8_checkpoint.py
`fp8_engine_settings`): what the engine starts from.

- model-dtype rollout from a block-FP8 (DeepSeek-V3) or MXFP4 (GPT-OSS) checkpoint starts from a dequantized copy
  whose every tensor is what the trainer's loader reads (and transformers' dequantization gives), with no
  quantization_config, shared per machine and deleted by its last user;
- FP8 rollout from a block-FP8 checkpoint starts from the checkpoint itself: its quantized tensors are exactly the
  ones the FP8 sync sends as payload and scales (DeepSeek-V3: MLA, MLP and expert linears; not the router gate,
  norms, embeddings, LM head); a checkpoint quantizing another set, or in other blocks, is refused naming them;
- FP8 rollout from an MXFP4 checkpoint is refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ConfigError, RolloutConfig
from engine.models.tiny_model import build_tiny_model
from engine.policy.hf_checkpoint import SafetensorsSource
from engine.policy.quantized_checkpoint import DequantizingSource, checkpoint_format
from engine.rollout.fp8_checkpoint import copy_directory, fp8_engine_settings
from engine.rollout.fp8_sync import is_fp8_weight
from engine.rollout.quantized_source import write_dequantized_engine_checkpoint
from tests.helpers.quantized import quantize_checkpoint, transformers_dequantized


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized_rollout")
    return {
        "fp8": quantize_checkpoint(build_tiny_model(root / "deepseek_v3", "deepseek_v3", seed=4), root / "fp8", "fp8"),
        "mxfp4": quantize_checkpoint(build_tiny_model(root / "gpt_oss", "gpt_oss", seed=5), root / "mxfp4", "mxfp4"),
    }


@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_the_dequantized_copy_holds_what_the_trainer_loads(sources, tmp_path, method):
    out = write_dequantized_engine_checkpoint(sources[method], tmp_path / "copy", "float32")
    written = load_file(out / "model.safetensors")
    loader = DequantizingSource(SafetensorsSource(sources[method]), checkpoint_format(sources[method]), torch.float32)
    reference = transformers_dequantized(sources[method], torch.float32)
    assert set(written) == loader.names() == set(reference)
    for name, tensor in written.items():
        assert torch.equal(tensor, loader.read(name, (slice(None),))), name
        assert torch.equal(tensor.float(), reference[name].float()), name
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert checkpoint_format(out) is None


@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_model_dtype_rollout_starts_from_the_shared_dequantized_copy(sources, method):
    rollout = RolloutConfig()  # vllm_weight_dtype: model
    first = fp8_engine_settings(sources[method], rollout, on_gpu=False, dtype="bfloat16")
    second = fp8_engine_settings(sources[method], rollout, on_gpu=True, dtype="bfloat16")
    (model_dir, kwargs, copy), (_, _, other) = first, second
    assert model_dir == copy.path == other.path and kwargs == {}, "one copy per machine, no FP8 keywords"
    assert model_dir.parent == copy_directory(sources[method], "dequantized-bfloat16")
    assert checkpoint_format(model_dir) is None
    assert all(t.dtype != torch.float8_e4m3fn and t.dtype != torch.uint8
               for t in load_file(model_dir / "model.safetensors").values())
    copy.release()
    assert model_dir.is_dir(), "the other engine still uses it"
    other.release()
    assert not model_dir.parent.exists(), "the last user's release deletes it"


def test_fp8_rollout_starts_from_a_block_fp8_checkpoint_as_it_is(sources):
    model_dir, kwargs, copy = fp8_engine_settings(sources["fp8"], RolloutConfig(vllm_weight_dtype="fp8"), on_gpu=True)
    assert (model_dir, kwargs, copy) == (sources["fp8"], {"quantization": "fp8"}, None)
    src = SafetensorsSource(sources["fp8"])
    quantized = {n for n in src.names() if n + "_scale_inv" in src.names()}
    synced = {n for n in src.names() if is_fp8_weight(n, src.shape(n))}
    assert quantized == synced and "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in quantized
    assert "model.layers.1.mlp.gate.weight" not in quantized and "lm_head.weight" not in quantized


def test_a_block_fp8_checkpoint_quantizing_other_tensors_is_refused_naming_them(sources, tmp_path):
    import shutil

    model_dir = shutil.copytree(sources["fp8"], tmp_path / "odd")
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"  # stored unquantized: the sync would send it as FP8
    tensors[name] = DequantizingSource(SafetensorsSource(sources["fp8"]), checkpoint_format(sources["fp8"]),
                                       torch.bfloat16).read(name, (slice(None),))
    del tensors[name + "_scale_inv"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ConfigError, match=rf"0 tensor\(s\) quantized .* and 1 unquantized .*{name}.*"
                                          r"set rollout.vllm_weight_dtype=model"):
        fp8_engine_settings(model_dir, RolloutConfig(vllm_weight_dtype="fp8"), on_gpu=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"weight_block_size is \[64, 64\], the sync quantizes in \[128, 128\]"):
        fp8_engine_settings(model_dir, RolloutConfig(vllm_weight_dtype="fp8"), on_gpu=True)


def test_fp8_rollout_from_an_mxfp4_checkpoint_is_refused_by_name(sources):
    with pytest.raises(ConfigError, match=r"vllm_weight_dtype=fp8 with the MXFP4 checkpoint .*vllm_weight_dtype=model"):
        fp8_engine_settings(sources["mxfp4"], RolloutConfig(vllm_weight_dtype="fp8"), on_gpu=True)
