"""Quantized Hugging Face checkpoints (block-wise FP8, GPT-OSS's MXFP4) through the loader and the export.

Owns: `DequantizingSource`, the loader's view of a quantized checkpoint as the unquantized one it stands for (same
names, shapes and layouts, values dequantized into the policy's dtype), so that every family's map
(engine/policy/hf_convert.py) reads it unchanged and each rank reads only the blocks and scales of its own slices;
`requantize_like_source`, the export's way back: every tensor the source stores quantized is quantized again in the
same layout, with the source's scales for blocks whose scale did not move (unchanged weights give back the same
bytes); `checkpoint_format`, the format of a checkpoint directory.

Which tensors are quantized is what the checkpoint holds, as in the releases: FP8 `<name>.weight` (float8_e4m3fn)
with `<name>.weight_scale_inv` (float32, one per block) beside it, norms, embeddings, LM head and router gates
unquantized; MXFP4 `<name>_blocks` (uint8 [..., rows, groups, 16]) and `<name>_scales` (uint8 [..., rows, groups])
for the expert tensor `<name>` of shape [..., groups * 32, rows] (GPT-OSS's `mlp.experts.gate_up_proj` /
`down_proj`: x @ W, the stored blocks are W transposed). The arithmetic is engine/models/quantized.py.

Must not: change a value beyond the formats' arithmetic, or read more of a quantized tensor than the slice asked for
(its scale rows and columns: the blocks the slice touches).

Test: tests/unit/test_quantized_checkpoint.py (refusals, missing / mis-shaped scales, slices);
tests/distributed/test_quantized_layouts.py (TP1 / TP2 loads equal transformers' dequantization, byte-exact export).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.models.quantized import (
    FP8_DTYPE,
    MXFP4_BLOCK,
    QuantizedFormat,
    block_span,
    dequantize_fp8,
    dequantize_mxfp4,
    quantize_fp8,
    quantize_mxfp4,
    read_format,
)

FP8_SCALE = "_scale_inv"
"""Suffix of an FP8 weight's scale tensor: `<name>.weight` -> `<name>.weight_scale_inv`."""
MXFP4_PARTS = ("_blocks", "_scales")
"""Suffixes of an MXFP4 tensor's codes and exponents: `<name>` -> `<name>_blocks`, `<name>_scales`."""


def checkpoint_format(model_dir: str | Path) -> QuantizedFormat | None:
    """The quantized format of a checkpoint directory's config.json (None: unquantized, or no config.json);
    ValueError naming the method for one the loader does not read (engine/models/quantized.py `read_format`)."""
    config = Path(model_dir) / "config.json"
    return read_format(json.loads(config.read_text())) if config.is_file() else None


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, stop) per dimension of a tuple of unit-step slices over `shape` (missing ones: the whole dimension)."""
    out = []
    for dim, size in enumerate(shape):
        start, stop, step = (index[dim] if dim < len(index) else slice(None)).indices(size)
        if step != 1:
            raise ValueError(f"quantized tensors are read in unit-step slices, got {index[dim]}")
        out.append((start, max(start, stop)))
    return out


class DequantizingSource:
    """A TensorSource (engine/policy/hf_convert.py) over a quantized checkpoint that reads as its unquantized form.

    `src`: the checkpoint's SafetensorsSource (names / shape / read); `fmt`: its format (`checkpoint_format`);
    `dtype`: the policy's dtype, the one transformers' dequantization would give (computed in float32, then cast).
    Unquantized tensors are read as stored."""

    def __init__(self, src, fmt: QuantizedFormat, dtype: torch.dtype):
        self.src, self.fmt, self.dtype = src, fmt, dtype
        stored = self._stored = src.names()
        self._mxfp4 = {n.removesuffix(MXFP4_PARTS[0]) for n in stored if n.endswith(MXFP4_PARTS[0])} \
            if fmt.method == "mxfp4" else set()
        hidden = {n for n in stored if n.endswith(FP8_SCALE)} if fmt.method == "fp8" else \
            {n + part for n in self._mxfp4 for part in MXFP4_PARTS}
        self._names = (stored - hidden) | self._mxfp4

    def names(self) -> set[str]:
        return set(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._mxfp4:
            *lead, rows, groups, _ = self.src.shape(name + MXFP4_PARTS[0])
            return (*lead, groups * MXFP4_BLOCK, rows)
        return self.src.shape(name)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if name in self._mxfp4:
            return self._read_mxfp4(name, index)
        stored = self.src.read(name, index)
        if stored.dtype != FP8_DTYPE:
            return stored
        if self.fmt.method != "fp8" or name + FP8_SCALE not in self._stored:
            raise ValueError(f"tensor {name!r} is float8_e4m3fn but the checkpoint has no {name + FP8_SCALE!r} "
                             "(its per-block scales): the checkpoint is incomplete or not block-wise FP8")
        shape = self.src.shape(name)
        block = self.fmt.block
        self._check_scale(name + FP8_SCALE, shape, (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])),
                          f"{block[0]} x {block[1]} blocks of {name} {shape}")
        *lead, (r0, r1), (c0, c1) = _bounds(index, shape)
        scale_index = tuple(slice(a, b) for a, b in lead) + (block_span(r0, r1, block[0]), block_span(c0, c1, block[1]))
        scale = self.src.read(name + FP8_SCALE, scale_index)
        return dequantize_fp8(stored, scale, block, self.dtype, offset=(r0, c0))

    def _read_mxfp4(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        blocks_name, scales_name = (name + part for part in MXFP4_PARTS)
        blocks_shape = self.src.shape(blocks_name)
        if scales_name not in self._stored:
            raise ValueError(f"MXFP4 tensor {blocks_name!r} has no {scales_name!r} (its per-block exponents): the "
                             "checkpoint is incomplete")
        if blocks_shape[-1] * 2 != MXFP4_BLOCK:
            raise ValueError(f"MXFP4 tensor {blocks_name!r} of shape {blocks_shape}: {MXFP4_BLOCK // 2} bytes per "
                             "block expected in its last dimension")
        self._check_scale(scales_name, blocks_shape, blocks_shape[:-1], f"one exponent per block of {blocks_name}")
        *lead, (c0, c1), (r0, r1) = _bounds(index, self.shape(name))  # logical [..., groups * 32, rows]
        groups = block_span(c0, c1, MXFP4_BLOCK)
        stored = tuple(slice(a, b) for a, b in lead) + (slice(r0, r1), groups)
        values = dequantize_mxfp4(self.src.read(blocks_name, stored), self.src.read(scales_name, stored), self.dtype)
        first = groups.start * MXFP4_BLOCK
        return values[..., c0 - first:c1 - first].transpose(-1, -2).contiguous()

    def _check_scale(self, scale_name: str, of_shape: tuple[int, ...], expected: tuple[int, ...], what: str) -> None:
        shape = self.src.shape(scale_name)
        if tuple(shape) != tuple(expected):
            raise ValueError(f"scale tensor {scale_name!r} has shape {tuple(shape)}, {tuple(expected)} expected "
                             f"({what}): the checkpoint does not match its quantization_config")


def requantize_like_source(tensors: dict[str, torch.Tensor], fmt: QuantizedFormat, source) -> dict[str, torch.Tensor]:
    """`tensors` (an export's HF tensors, unquantized) with every tensor the source checkpoint `source` (a
    SafetensorsSource) stores quantized written in the source's layout: FP8 weights as float8_e4m3fn + float32
    `weight_scale_inv` in `fmt.block` blocks, keeping the source's scale of each block whose own scale is that one up
    to rounding (engine/models/quantized.py `quantize_fp8`, `like=`); MXFP4 expert tensors as `_blocks` + `_scales`.
    Other tensors pass unchanged."""
    stored = source.names()
    out = {}
    for name, tensor in tensors.items():
        if fmt.method == "fp8" and name + FP8_SCALE in stored:
            like = source.read(name + FP8_SCALE, (slice(None),))
            out[name], out[name + FP8_SCALE] = quantize_fp8(tensor, fmt.block, like=like)
        elif fmt.method == "mxfp4" and name + MXFP4_PARTS[0] in stored:
            blocks, scales = quantize_mxfp4(tensor.transpose(-1, -2))
            out[name + MXFP4_PARTS[0]], out[name + MXFP4_PARTS[1]] = blocks, scales
        else:
            out[name] = tensor
    return out


def is_quantized_payload(name: str, tensor: torch.Tensor) -> bool:
    """A tensor the export writes as it is (no cast to the export dtype): FP8 values and scales, MXFP4 codes."""
    return tensor.dtype in (FP8_DTYPE, torch.uint8) or name.endswith(FP8_SCALE)
