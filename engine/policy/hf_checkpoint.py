"""Hugging Face safetensors checkpoints in and out of the sharded Megatron policy, at any TP x PP layout.

Owns: `SafetensorsSource` (lazy slices of a single-file or sharded safetensors checkpoint), `load_hf_checkpoint`
(every rank reads only the slices of its own parameters: no rank holds the full model; a block-wise FP8 or MXFP4
checkpoint dequantized on the fly, engine/policy/quantized_checkpoint.py) and `export_hf_checkpoint`
(each pipeline stage gathers its TP shards one parameter at a time, MoE experts over the expert-TP and EP groups,
and writes its own safetensors file; rank 0
writes the index, config and tokenizer, and copies the source's multi-token-prediction layers unchanged:
engine/policy/mtp_layers.py; the directory appears atomically). The name and layout map is
engine/policy/hf_convert.py, shared with weight sync.

Must not: read Megatron's global parallel state (it receives a ParallelState), or change parameter values beyond
loading them.

Test: tests/distributed/test_checkpoint_layouts.py, tests/distributed/test_qwen3_layouts.py (Qwen3, Qwen3-MoE at EP2),
tests/distributed/test_quantized_layouts.py (quantized checkpoints in, and back out in their format).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from engine.models.stacked_experts import stack_expert_pieces
from engine.policy.hf_convert import read_megatron_shard, to_hf
from engine.policy.hf_map import FLOAT32_TENSORS, ModelDims, expert_index, family_map, find_entry
from engine.policy.lora import is_lora_param
from engine.policy.model import get_weight, global_param_names
from engine.policy.mtp_layers import MTP_SHARD, copy_mtp_layers
from engine.policy.parallel import ParallelState
from engine.policy.quantized_checkpoint import (
    DequantizingSource,
    checkpoint_format,
    is_quantized_payload,
    requantize_like_source,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")


def export_config(hf_config, dtype: torch.dtype, keep_mtp: bool = False, quantized: bool = False):
    """The config.json of an export: the dtype its weights are written in (NOTE: a bf16 run's export once said float32,
    and transformers then loaded the bf16 weights as float32), and `num_nextn_predict_layers` (GLM-4.5's and
    DeepSeek-V3's multi-token-prediction layers) kept only when `keep_mtp` (the export holds their weights, copied
    from the source: engine/policy/mtp_layers.py), 0 otherwise (a config naming them would send vLLM's MTP
    speculative decoding looking for weights the directory lacks). `quantization_config` is kept only for an export
    in the source's quantized format (`quantized`)."""
    config = copy.deepcopy(hf_config)
    config.dtype = dtype
    if not quantized and getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    if getattr(config, "num_nextn_predict_layers", 0) and not keep_mtp:
        config.num_nextn_predict_layers = 0
    return config


class SafetensorsSource:
    """Read slices of the tensors of a safetensors checkpoint directory without loading whole files."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (model_dir / "model.safetensors").exists():
            with safe_open(model_dir / "model.safetensors", framework="pt") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
        self._files = {file: safe_open(model_dir / file, framework="pt") for file in set(weight_map.values())}
        self._where = weight_map

    def names(self) -> set[str]:
        return set(self._where)

    def _slice(self, name: str):
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return self._files[self._where[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._slice(name)[index]


@torch.no_grad()
def load_hf_checkpoint(chunks: list[torch.nn.Module], ps: ParallelState, model_dir: str | Path, dims: ModelDims) -> None:
    """Copy a Hugging Face checkpoint into this rank's model chunks, reading only this rank's slices.

    A quantized checkpoint (block-wise FP8, MXFP4: engine/policy/quantized_checkpoint.py) is dequantized on the fly
    into the parameters' dtype, each rank reading the blocks and scales of its own slices only.

    Raises:
        KeyError naming a Megatron parameter without a mapping or an HF tensor missing from the checkpoint;
        ValueError on a shape mismatch (e.g. a checkpoint of another size than the config), a quantization the
        loader does not read (naming the method) or a scale tensor missing or mis-shaped (naming it); ModelDirError
        (engine/models/model_dir.py) for a missing config / weight shard or a tokenizer larger than the vocabulary.
    """
    from engine.models.model_dir import check_model_dir

    check_model_dir(model_dir, vocab_size=dims.vocab_size)
    src = SafetensorsSource(model_dir)
    fmt = checkpoint_format(model_dir)
    if fmt is not None:
        src = DequantizingSource(src, fmt, next(chunks[0].parameters()).dtype)
    entries = family_map(dims)
    for chunk in chunks:
        for name, global_name in global_param_names(chunk).items():
            if is_lora_param(name):
                continue  # adapters are not in an HF checkpoint (engine/policy/lora.py)
            param = get_weight(chunk, name)
            entry, layer = find_entry(entries, global_name)
            tp_rank, tp_size = (ps.etp_rank, ps.etp_size) if entry.is_expert else (ps.tp_rank, ps.tp_size)
            shard = read_megatron_shard(entry, layer, dims, src, tp_rank, tp_size, expert_index(global_name))
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(
                    f"{global_name}: checkpoint gives shard {tuple(shard.shape)}, the model at tp_size={tp_size} "
                    f"expects {tuple(param.shape)}"
                )
            param.copy_(shard)


def _gather(tensor: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


@torch.no_grad()
def iter_hf_tensors(chunk: torch.nn.Module, ps: ParallelState, dims: ModelDims):
    """Yield (HF name, tensor) for one model chunk, TP shards gathered one parameter at a time (collective over the
    TP group: every TP rank iterates and receives the same tensors). An expert tensor is gathered over the expert-TP
    group, then over the expert-parallel group: local expert j of EP rank r is global expert r * E/ep + j, so every
    rank of a stage yields every expert (EP rank order within each local index)."""
    from engine.policy.model import merge_tp_shards

    entries = family_map(dims)
    for name, global_name in global_param_names(chunk).items():
        if global_name == "output_layer.weight" and dims.tie_word_embeddings:
            continue  # the tied head is exported once, as the embedding
        if is_lora_param(name):
            continue  # adapters: merged into the base (engine/policy/lora.py merged_lora) or saved for PEFT
        param = get_weight(chunk, name)
        entry, layer = find_entry(entries, global_name)
        if not entry.is_expert:
            yield from to_hf(entry, layer, dims, merge_tp_shards(_gather(param, ps.tp_size, ps.groups.tp), param)).items()
            continue
        full = merge_tp_shards(_gather(param, ps.etp_size, ps.groups.expt_tp), param)
        first, num_local = expert_index(global_name), dims.num_experts // ps.ep_size
        for ep_rank, tensor in enumerate(_gather(full, ps.ep_size, ps.groups.ep)):
            expert = first - ps.ep_rank * num_local + ep_rank * num_local
            yield from to_hf(entry, layer, dims, tensor, expert).items()


def export_hf_checkpoint(
    chunks: list[torch.nn.Module], ps: ParallelState, out_dir: str | Path, hf_config, dims: ModelDims,
    tokenizer_dir: str | Path | None = None, dtype: torch.dtype | None = None, source_dir: str | Path | None = None,
    quantization: str = "none",
) -> Path | None:
    """Write the policy as a Hugging Face checkpoint (collective: every rank calls it).

    Each pipeline stage's (tp_rank 0, dp_rank 0) writes `model-<stage>-of-<stages>.safetensors` with its own
    layers; rank 0 writes `model.safetensors.index.json`, `config.json` and the tokenizer files, and copies the
    multi-token-prediction layers of `source_dir` (the checkpoint the policy was loaded from; not built or trained
    here) unchanged into `model-mtp.safetensors` (engine/policy/mtp_layers.py; dropped where it has none or
    `source_dir` is None). Everything goes to `<out_dir>.tmp` first and is renamed into place at the end, so a crash
    never leaves a half-written export under `out_dir`. Returns the directory on rank 0, None elsewhere.

    `quantization` (`checkpoint.export_quantization`): "none" writes every tensor in `dtype` and a config without
    `quantization_config` (the MTP layers of a quantized source, stored quantized, are then left out); "source"
    writes the tensors `source_dir` stores quantized in its format again (engine/policy/quantized_checkpoint.py
    `requantize_like_source`: unchanged weights give back the source's bytes) and keeps its `quantization_config`;
    for an unquantized source both write the same.
    """
    from safetensors.torch import save_file

    if quantization not in ("none", "source"):
        raise ValueError(f"checkpoint.export_quantization: {quantization!r} is not one of 'none', 'source'")
    if quantization == "source" and source_dir is None:
        raise ValueError("checkpoint.export_quantization 'source' needs the checkpoint the policy was loaded from")
    fmt = checkpoint_format(source_dir) if source_dir is not None else None
    requantize = fmt is not None and quantization == "source"
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if ps.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    tensors: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        tensors |= dict(iter_hf_tensors(chunk, ps, dims))
    tensors = stack_expert_pieces(tensors)  # GPT-OSS: its experts' pieces into the stacked HF tensors
    written_dtype = dtype or next(iter(tensors.values())).dtype
    file = f"model-{ps.pp_rank + 1:05d}-of-{ps.pp_size:05d}.safetensors"
    writer = ps.tp_rank == 0 and ps.dp_rank == 0
    if writer:
        if requantize:
            tensors = requantize_like_source(tensors, fmt, SafetensorsSource(source_dir))
        cast = {k: (v.to(dtype) if dtype and not k.endswith(FLOAT32_TENSORS) and not is_quantized_payload(k, v)
                    else v).contiguous() for k, v in tensors.items()}
        save_file(cast, tmp / file, metadata={"format": "pt"})
    names = sorted(cast) if writer else []
    per_rank: list = [None] * ps.world_size
    dist.all_gather_object(per_rank, (file, names))
    if ps.rank == 0:
        mtp = copy_mtp_layers(None if fmt is not None and not requantize else source_dir, hf_config, tmp)
        weight_map = {name: f for f, rank_names in per_rank for name in rank_names} | dict.fromkeys(mtp, MTP_SHARD)
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        export_config(hf_config, written_dtype, keep_mtp=bool(mtp),
                      quantized=requantize).save_pretrained(tmp)
        for name in TOKENIZER_FILES if tokenizer_dir else ():
            if (Path(tokenizer_dir) / name).exists():
                shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    dist.barrier()
    return out_dir if ps.rank == 0 else None
