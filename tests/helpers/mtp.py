"""A multi-token-prediction (MTP) layer added to a saved tiny DeepSeek-V3 / GLM-4.5, under the names the hub
checkpoints use (deepseek-ai/DeepSeek-V3's model.layers.61.*), for the export pass-through tests
(engine/policy/mtp_layers.py).

Owns: `add_mtp_layer` (one layer after the last: enorm, hnorm, eh_proj, shared_head.norm / .head, embed_tokens and a
copy of the last decoder layer's attention and MoE tensors under the new index, in bfloat16 except the float32 expert
bias; config.json then says num_nextn_predict_layers=1).
Must not: assert what a test checks, or touch any tensor of the model itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def add_mtp_layer(model_dir: str | Path, sharded: bool = True) -> dict[str, torch.Tensor]:
    """Give the checkpoint in `model_dir` (a single model.safetensors, as build_tiny_model writes) one MTP layer.

    Args:
        sharded: write the MTP tensors to a second shard with an index (as the hub checkpoints are sharded), else
            rewrite the single file with them.
    Returns:
        {name: tensor} of the MTP tensors written.
    """
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tensors = load_file(model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(13)
    extra = {f"model.layers.{mtp}.{name}": torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape in (
        ("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)), ("eh_proj.weight", (hidden, 2 * hidden)),
        ("shared_head.norm.weight", (hidden,)), ("shared_head.head.weight", (vocab, hidden)),
        ("embed_tokens.weight", (vocab, hidden)))}
    prefix = f"model.layers.{last}."
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            keep = tensor.dtype == torch.float32 and name.endswith("e_score_correction_bias")
            extra[f"model.layers.{mtp}.{name[len(prefix):]}"] = tensor.clone() if keep else tensor.to(torch.bfloat16)
    if sharded:
        os.replace(model_dir / "model.safetensors", model_dir / "model-00001-of-00002.safetensors")
        save_file(extra, model_dir / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
        weight_map = dict.fromkeys(tensors, "model-00001-of-00002.safetensors")
        weight_map |= dict.fromkeys(extra, "model-00002-of-00002.safetensors")
        (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(tensors | extra, model_dir / "model.safetensors", metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}, indent=2))
    return extra
