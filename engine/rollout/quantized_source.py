"""Rollout from a quantized checkpoint (block-FP8: DeepSeek-V3 / R1, Kimi-K2, Qwen3 -FP8; MXFP4: GPT-OSS): what the
engine starts from, so that it holds what every sync sends.

The trainer loads such a checkpoint dequantized into `model.dtype` (engine/policy/quantized_checkpoint.py). The engine:
- `rollout.vllm_weight_dtype: fp8` with a block-FP8 source starts from the source as it is: its layout is the one the
  sync quantizes into (128 x 128 blocks, float32 `weight_scale_inv`), provided the source quantizes exactly the
  tensors the sync does (engine/rollout/fp8_sync.py `is_fp8_weight`: `fp8_source_problems` names any other);
- `rollout.vllm_weight_dtype: model` with any quantized source starts from a dequantized copy in the engine's dtype
  (`write_dequantized_engine_checkpoint`, the loader's own dequantization, so the engine starts from the trainer's
  values), shared per machine like the FP8 copy (engine/rollout/fp8_checkpoint.py `acquire_fp8_engine_checkpoint`);
- an MXFP4 source with `vllm_weight_dtype: fp8` is refused (vLLM's block-FP8 path has no MXFP4 experts).

Must not: import vLLM; write next to the user's checkpoint.

Test: tests/unit/test_quantized_rollout.py (the copy equals the loader's dequantization, the FP8 source's tensor set,
the refusals); tests/integration/test_quantized_rollout.py (a tiny FP8 Qwen3 trained one step colocated, real vLLM
started from the shared dequantized copy, syncs verified, the copy gone after the engines close).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.quantized import QuantizedFormat
from engine.policy.hf_checkpoint import SafetensorsSource
from engine.policy.quantized_checkpoint import FP8_SCALE, MXFP4_PARTS, DequantizingSource, checkpoint_format
from engine.rollout.fp8_sync import FP8_BLOCK, is_fp8_weight


def fp8_source_problems(model_dir: str | Path, fmt: QuantizedFormat) -> list[str]:
    """Why a block-FP8 source cannot be the FP8 engine's start as it is ([] when it can): a block other than
    128 x 128, or tensors it stores quantized that the sync sends unquantized, or the other way round (named)."""
    setting = f"rollout.vllm_weight_dtype=fp8 with the FP8 checkpoint {model_dir}"
    if tuple(fmt.block) != FP8_BLOCK:
        return [f"{setting}: its weight_block_size is {list(fmt.block)}, the sync quantizes in {list(FP8_BLOCK)} "
                "blocks; set rollout.vllm_weight_dtype=model (the engine then starts from a dequantized copy)"]
    src = SafetensorsSource(model_dir)
    stored = src.names()
    weights = {n for n in stored if not n.endswith(FP8_SCALE)}
    quantized = {n for n in weights if n + FP8_SCALE in stored}
    synced = {n for n in weights if is_fp8_weight(n, src.shape(n))}
    wrong = sorted(quantized - synced)[:4] + sorted(synced - quantized)[:4]
    if not wrong:
        return []
    return [f"{setting}: it stores {len(quantized - synced)} tensor(s) quantized that the FP8 sync sends unquantized "
            f"and {len(synced - quantized)} unquantized that it sends as FP8 (e.g. {', '.join(wrong)}); set "
            "rollout.vllm_weight_dtype=model (the engine then starts from a dequantized copy)"]


def write_dequantized_engine_checkpoint(model_dir: str | Path, out_dir: str | Path, dtype: str) -> Path:
    """A copy of the quantized checkpoint in `model_dir` with every quantized tensor dequantized into `dtype` (the
    loader's `DequantizingSource`, the same values the trainer loads), unquantized tensors as stored, the same
    safetensors files, a config.json without `quantization_config`; other files linked. Returns `out_dir`."""
    model_dir, out = Path(model_dir), Path(out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    fmt_config = config.get("quantization_config")
    if not fmt_config:
        raise ValueError(f"{model_dir} is not quantized (no quantization_config): the engine starts from it directly")
    source = DequantizingSource(SafetensorsSource(model_dir), checkpoint_format(model_dir), getattr(torch, dtype))
    hidden = (FP8_SCALE, MXFP4_PARTS[1])
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            keys = [k for k in f.keys() if not k.endswith(hidden)]
        names = [k.removesuffix(MXFP4_PARTS[0]) for k in keys]
        tensors = {name: source.read(name, (slice(None),)).contiguous() for name in names}
        save_file(tensors, out / path.name, metadata={"format": "pt"})
        index |= {name: path.name for name in tensors}
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("config.json", "model.safetensors.index.json"):
            (out / path.name).symlink_to(path.resolve())
    if (model_dir / "model.safetensors.index.json").is_file():
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    config = {k: v for k, v in config.items() if k != "quantization_config"} | {"dtype": dtype}
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
