"""Quantized tiny checkpoints as the releases write them, and transformers' own dequantization of them.

Owns: `quantize_checkpoint` (a builtin tiny model's directory rewritten as block-wise FP8, the DeepSeek-V3 / Qwen3-FP8
layout: the layers' linear weights float8_e4m3fn + float32 `weight_scale_inv` per 128 x 128 block, everything else
bf16 but the float32 router bias; or as GPT-OSS's MXFP4: the experts' `*_blocks` + `*_scales`, everything else bf16) and
`transformers_dequantized` (the unquantized tensors of such a directory by transformers' `Fp8Dequantize` and
`convert_moe_packed_tensors`, the reference the loader is compared with).
Must not: assert what a test checks.
"""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.models.quantized import quantize_fp8, quantize_mxfp4
from engine.policy.hf_map import FLOAT32_TENSORS

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
"""DeepSeek-V3's quantization_config."""
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                  "model.embed_tokens", "lm_head"]}
"""openai/gpt-oss-20b's quantization_config."""
MXFP4_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def is_fp8_weight(name: str, tensor: torch.Tensor) -> bool:
    """The tensors the FP8 releases quantize: the decoder layers' linear weights (not norms, not the router gate)."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2
            and "norm" not in name and not name.endswith(".mlp.gate.weight"))


def quantize_checkpoint(src_dir: str | Path, out_dir: str | Path, method: str) -> Path:
    """Copy `src_dir` (an unquantized tiny checkpoint) to `out_dir` quantized by `method` ("fp8" / "mxfp4")."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    shutil.copytree(src_dir, out_dir)
    tensors = {}
    for path in sorted(src_dir.glob("*.safetensors")):
        tensors |= load_file(path)
        (out_dir / path.name).unlink()
    (out_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    out = {}
    for name, tensor in tensors.items():  # quantized from the float32 weights (the scales are not a bf16 value / 448)
        if method == "fp8" and is_fp8_weight(name, tensor):
            out[name], out[name + "_scale_inv"] = quantize_fp8(tensor, (128, 128))
        elif method == "mxfp4" and name.endswith(MXFP4_EXPERTS):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2))
        else:
            out[name] = tensor if name.endswith(FLOAT32_TENSORS) else tensor.to(torch.bfloat16)
    save_file(out, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG if method == "fp8" else MXFP4_CONFIG
    config["dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _transformers_fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' `Fp8Dequantize` of one weight; a weight with partial edge blocks (which it refuses) is padded
    with zeros to whole blocks first and cropped after, so each block is still its own arithmetic."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    config = types.SimpleNamespace(weight_block_size=[128, 128], scale_fmt=None, dequantize=True)
    dequantize = Fp8Dequantize(types.SimpleNamespace(quantization_config=config))
    rows, cols = q.shape
    padded = torch.zeros(scale_inv.shape[0] * 128, scale_inv.shape[1] * 128, dtype=q.dtype)
    padded[:rows, :cols] = q
    return dequantize._dequantize_one(padded, scale_inv, output_dtype=dtype)[:rows, :cols]


def transformers_dequantized(model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The unquantized tensors of a quantized checkpoint (`quantize_checkpoint`), by transformers' dequantization
    into `dtype`; unquantized tensors are cast to `dtype` (but the float32 router bias, as the export keeps it)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = load_file(Path(model_dir) / "model.safetensors")
    out = {}
    for name, tensor in stored.items():
        if name.endswith(("_scale_inv", "_scales")):
            continue
        if name + "_scale_inv" in stored:
            out[name] = _transformers_fp8_dequantize(tensor, stored[name + "_scale_inv"], dtype)
        elif name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            out[base] = convert_moe_packed_tensors(tensor, stored[base + "_scales"], dtype=dtype).contiguous()
        else:
            out[name] = tensor if name.endswith(FLOAT32_TENSORS) else tensor.to(dtype)
    return out


def write_unquantized(tensors: dict[str, torch.Tensor], quantized_dir: str | Path, out_dir: str | Path) -> Path:
    """`quantized_dir` with its weights replaced by `tensors` and no quantization_config: the checkpoint
    transformers' dequantization gives, which transformers can load on CPU for its logits."""
    out_dir = Path(out_dir)
    shutil.copytree(quantized_dir, out_dir)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    del config["quantization_config"]
    config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
