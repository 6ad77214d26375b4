"""Multi-token-prediction (MTP) layers of DeepSeek-V3 / GLM-4.5 checkpoints, passed through an export unchanged.

Owns: which tensors of a source checkpoint are its MTP layers (`mtp_tensor_names`: every name under
`model.layers.{num_hidden_layers + k}.` for k < `num_nextn_predict_layers`: DeepSeek-V3's enorm / hnorm / eh_proj /
shared_head / embed_tokens and the layer's own attention and MoE tensors) and `copy_mtp_layers`, which streams them
from the source's safetensors files into one shard of an export (`MTP_SHARD`), byte for byte.

Why a pass-through: neither the engine nor transformers builds these layers, and GRPO does not train them (the loss
reads the main LM head's next-token log-probs only). But vLLM's MTP speculative decoding serves with them as its
draft head, so an export without them would lose it: the export keeps them as the source had them (their dtype too)
and keeps `num_nextn_predict_layers` in its config.json. They are stale with respect to the trained policy (a draft
head trained with the original weights: speculative acceptance may drop; outputs do not change).

Must not: load a whole file or a whole layer into memory (at 671B one MTP layer is ~11B parameters): tensors are
copied in `_COPY_BYTES` pieces; import Megatron or vLLM; change a byte.

Test: tests/unit/test_mtp_layers.py (byte-equal copy, names, the absent and partial cases, the piecewise copy);
tests/distributed/test_family_layouts.py (the tiny DeepSeek-V3 with one MTP layer, exported at EP1 / EP2 / TP2 x EP2
/ PP2: the MTP tensors byte-equal, config keeps 1, the export loads in transformers).
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

MTP_SHARD = "model-mtp.safetensors"
"""The export's shard holding the source's MTP tensors (named by the index like every other shard)."""

_COPY_BYTES = 64 << 20
"""Bytes copied at a time (64 MiB): the copy's memory, whatever the size of a tensor."""

logger = logging.getLogger(__name__)


def num_mtp_layers(hf_config) -> int:
    """`num_nextn_predict_layers` of a DeepSeek-V3 / GLM-4.5 config (0 for other families)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def _weight_map(source_dir: Path) -> dict[str, str]:
    """{tensor name: file} of a safetensors checkpoint directory ({} where it has none)."""
    index = source_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = source_dir / "model.safetensors"
    return {name: single.name for name in _read_header(single)[0]} if single.is_file() else {}


def _read_header(path: Path) -> tuple[dict, int]:
    """({tensor name: {dtype, shape, data_offsets}}, the byte where the data starts) of a safetensors file."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def mtp_tensor_names(source_dir: str | Path | None, hf_config) -> dict[str, str]:
    """{name: source file} of every MTP tensor of `source_dir`: all of `model.layers.{L + k}.*` (L =
    num_hidden_layers, k < num_nextn_predict_layers); {} where the config has no MTP layers, `source_dir` is None or
    not a local safetensors checkpoint, or it lacks any of the layers (a conversion that stripped them)."""
    layers = int(hf_config.num_hidden_layers)
    prefixes = [f"model.layers.{layers + k}." for k in range(num_mtp_layers(hf_config))]
    is_local = source_dir is not None and Path(source_dir).is_dir()
    weight_map = _weight_map(Path(source_dir)) if prefixes and is_local else {}
    names = {name: file for name, file in weight_map.items() if name.startswith(tuple(prefixes))}
    if not all(any(name.startswith(p) for name in names) for p in prefixes):
        return {}
    return names


def copy_mtp_layers(source_dir: str | Path | None, hf_config, out_dir: str | Path) -> list[str]:
    """Copy the MTP tensors of `source_dir` (`mtp_tensor_names`) into `out_dir`/MTP_SHARD, bytes unchanged, streamed
    `_COPY_BYTES` at a time; log what happened either way (one warning).

    Returns:
        the names copied (sorted; for the export's index), [] where there is nothing to copy (the export then drops
        the layers: its config says num_nextn_predict_layers=0).
    """
    mtp = num_mtp_layers(hf_config)
    if not mtp:
        return []
    first = int(hf_config.num_hidden_layers)
    names = mtp_tensor_names(source_dir, hf_config)
    if not names:
        logger.warning("%s with num_nextn_predict_layers=%d: the source checkpoint (%s) lacks the multi-token-"
                       "prediction tensors of some or all of model.layers.%d-%d.*, so the export drops them and its "
                       "config.json says num_nextn_predict_layers=0",
                       hf_config.model_type, mtp, source_dir, first, first + mtp - 1)
        return []
    entries, layout, offset = [], {}, 0  # (source file, source byte range), the output header, its data offset
    for file in sorted(set(names.values())):
        header, start = _read_header(Path(source_dir) / file)
        for name in sorted(n for n, f in names.items() if f == file):
            begin, end = header[name]["data_offsets"]
            entries.append((Path(source_dir) / file, start + begin, end - begin))
            layout[name] = {"dtype": header[name]["dtype"], "shape": header[name]["shape"],
                            "data_offsets": [offset, offset + end - begin]}
            offset += end - begin
    _write_shard(Path(out_dir) / MTP_SHARD, layout, entries)
    logger.warning("%s with num_nextn_predict_layers=%d: the multi-token-prediction layers (model.layers.%d.* on, %d "
                   "tensors, %.3g GB) are not trained; exported unchanged from %s", hf_config.model_type, mtp, first,
                   len(names), offset / 1e9, source_dir)
    return sorted(names)


def _write_shard(path: Path, layout: dict, entries: list[tuple[Path, int, int]]) -> None:
    """A safetensors file of header `layout` whose data are the byte ranges `entries` (file, start, length), in order."""
    header = json.dumps({"__metadata__": {"format": "pt"}, **layout}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data start 8-byte aligned, as safetensors writes them
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(header)) + header)
        for source, start, length in entries:
            with open(source, "rb") as f:
                f.seek(start)
                remaining = length
                while remaining:
                    piece = f.read(min(remaining, _COPY_BYTES))
                    if not piece:
                        raise OSError(f"{source}: ends before byte {start + length} (a truncated shard?)")
                    out.write(piece)
                    remaining -= len(piece)
