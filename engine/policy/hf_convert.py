"""Hugging Face <-> Megatron: the pure conversions of one tensor by a model's map (engine/policy/hf_map.py).

Owns the three conversions every user of the map needs:
- `read_megatron_shard`: this TP rank's shard of one Megatron parameter, reading only the HF slices it needs;
- `to_megatron_global`: the global (TP=1) Megatron tensor from full HF tensors;
- `to_hf`: the HF tensors from a global Megatron tensor (the inverse);
and where HF tensors come from (`TensorSource`, `DictSource`). GPT-OSS's stacked expert tensors convert through
engine/models/stacked_experts.py.

Must not: touch process groups, files other than through the `read` callback, or vLLM (the weight-sync module reads
these maps to plan its transfers).

Test: tests/unit/test_hf_convert.py (pure), tests/distributed/test_checkpoint_layouts.py (round trips, logits).

Why not mbridge (measured with mbridge 0.15.1 on megatron-core 0.16.1, CPU): its `get_model` fails
(`NameError: TENorm`: the layer spec is hard-wired to Transformer Engine; DeepSeek-V3 and Gemma 3 likewise); its
name maps know only TE's fused norm names and grouped-gemm expert names, so loading into this engine's local-spec
model fails (Qwen2 loads, 0 of 51 tensors different from this loader, only after 2 map entries are patched in;
Mixtral's `local_experts.<j>` are unknown to it and its export fails on transformers 5's `head_dim=None`); TP rank 0
reads whole HF tensors and scatters them (no per-rank slices); export all-gathers every tensor to every rank and
allocates on `torch.cuda.current_device()` (PP broadcast, expert bias); no GPT-OSS (built here since), Gemma 2, Cohere 2
or Nemotron-H.
Its per-family tables (~100 lines each) are what `TensorMap` tables are here, so the project keeps this converter.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.models.stacked_experts import read_stacked_expert, stacked_expert_to_hf
from engine.models.tensor_map import STACKED_KINDS
from engine.policy.hf_map import (
    ModelDims,
    TensorMap,
    _qkv_sizes,
    hf_names,
)


class TensorSource(Protocol):
    """Where HF tensors come from: a safetensors checkpoint (engine/train/checkpoint.py) or a dict (`DictSource`)."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The slice `index` of tensor `name`, e.g. (slice(0, 64),) or (slice(None), slice(0, 64))."""


class DictSource:
    """A TensorSource over in-memory tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensors[name][index]


def read_megatron_shard(
    entry: TensorMap, layer: int | None, dims: ModelDims, src: TensorSource, tp_rank: int, tp_size: int,
    expert: int | None = None,
) -> torch.Tensor:
    """This TP rank's shard of a Megatron parameter, reading only the slices of the HF tensors it needs (for an expert
    tensor: `expert` is its global index, tp_rank / tp_size are the expert-TP group's)."""
    names = hf_names(entry, layer, expert)
    every = slice(None)
    if entry.kind in STACKED_KINDS:  # GPT-OSS: read expert `expert`'s slice of the stacked tensor
        return read_stacked_expert(entry.kind, names[0], src.read(names[0], (slice(expert, expert + 1),))[0],
                                   tp_rank, tp_size)
    if entry.kind == "replicated":
        return src.read(names[0], (every,))
    if entry.kind in ("mamba_in", "mamba_conv"):  # each block's rank chunk: [z_r; x_r; B_r; C_r; dt_r] / [x_r; ...]
        blocks = dims.mamba_blocks if entry.kind == "mamba_in" else dims.mamba_blocks[1:4]
        parts, start = [], 0
        for size in blocks:
            step = size // tp_size
            parts.append(src.read(names[0], (slice(start + tp_rank * step, start + (tp_rank + 1) * step),)))
            start += size
        return torch.cat(parts, dim=0)
    if entry.kind in ("column", "gate_up"):
        parts = [_rank_slice(src, name, 0, tp_rank, tp_size) for name in names]
        return torch.cat(parts, dim=0)  # gate_up: [gate_r; up_r]
    if entry.kind == "row":
        return _rank_slice(src, names[0], 1, tp_rank, tp_size)
    if entry.kind == "vocab":
        rows = dims.padded_vocab // tp_size
        start, stop = tp_rank * rows, min((tp_rank + 1) * rows, dims.vocab_size)
        part = src.read(names[0], (slice(start, max(stop, start)),))  # (rows - padding, H)
        out = part.new_zeros((rows, *part.shape[1:]))  # (V_pad / tp, H); padded rows are zeros
        out[: part.shape[0]] = part
        return out
    q_rows, kv_rows = _qkv_sizes(dims)
    groups = dims.num_groups // tp_size
    g0 = tp_rank * groups
    q = src.read(names[0], (slice(g0 * q_rows, (g0 + groups) * q_rows),))  # (groups*q_rows, ...)
    k = src.read(names[1], (slice(g0 * kv_rows, (g0 + groups) * kv_rows),))  # (groups*kv_rows, ...)
    v = src.read(names[2], (slice(g0 * kv_rows, (g0 + groups) * kv_rows),))
    tail = q.shape[1:]
    per_group = [q.reshape(groups, q_rows, *tail), k.reshape(groups, kv_rows, *tail), v.reshape(groups, kv_rows, *tail)]
    return torch.cat(per_group, dim=1).reshape(-1, *tail)  # (groups*(q_rows+2*kv_rows), ...)


def _rank_slice(src: TensorSource, name: str, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Chunk `tp_rank` of `tp_size` equal chunks of an HF tensor along `dim`, read without the rest."""
    size = src.shape(name)[dim]
    if size % tp_size:
        raise ValueError(f"{name}: dimension {dim} of size {size} does not split into tp_size={tp_size} equal parts")
    step = size // tp_size
    index = (slice(None),) * dim + (slice(tp_rank * step, (tp_rank + 1) * step),)
    return src.read(name, index)


def to_megatron_global(entry: TensorMap, layer: int | None, dims: ModelDims, hf: dict[str, torch.Tensor],
                       expert: int | None = None) -> torch.Tensor:
    """The global (TP=1) Megatron tensor of an entry from full HF tensors."""
    return read_megatron_shard(entry, layer, dims, DictSource(hf), 0, 1, expert)


def to_hf(entry: TensorMap, layer: int | None, dims: ModelDims, full: torch.Tensor,
          expert: int | None = None) -> dict[str, torch.Tensor]:
    """The HF tensors of an entry from its global (TP=1) Megatron tensor: the inverse of `to_megatron_global`."""
    names = hf_names(entry, layer, expert)
    if entry.kind in STACKED_KINDS:  # one expert's piece; the export stacks them (gpt_oss.stack_expert_pieces)
        return stacked_expert_to_hf(entry.kind, names[0], expert, full)
    if entry.kind == "vocab":
        return {names[0]: full[: dims.vocab_size].clone()}
    if entry.kind == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return {names[0]: gate.clone(), names[1]: up.clone()}
    if entry.kind == "qkv":
        q_rows, kv_rows = _qkv_sizes(dims)
        tail = full.shape[1:]
        grouped = full.view(dims.num_groups, q_rows + 2 * kv_rows, *tail)  # (G, q+2kv, ...)
        q, k, v = grouped.split([q_rows, kv_rows, kv_rows], dim=1)
        return {n: t.reshape(-1, *tail).clone() for n, t in zip(names, (q, k, v))}
    return {names[0]: full.clone()}
