"""Measured tile tables: the fastest block sizes per (device name, dtype, hidden-size bucket), read at run time.

A table is one JSON file per device in kernels/tuned/ (`table_path`: the CUDA device name with every run of
non-alphanumerics turned into "_", e.g. NVIDIA_H100_80GB_HBM3.json), written by the GPU suite's sweep
(benchmarks/gpu/lm_head.py) and committed. Layout:

    {"device": "<torch.cuda.get_device_name()>", "source": {"git_sha": ..., "date": ..., ...},
     "entries": {"<dtype>": {"<bucket>": {"lm_head": {<TritonTiles fields>, "full_ms": ...},
                                         "onepass_rows": {<RowTiles fields>, "full_ms": ...},
                                         "onepass_fused": {<FusedTiles fields>, "full_ms": ...}}}}}

Buckets (`hidden_bucket`): the next power of two >= H, clamped to [1024, 16384], as "h1024" ... "h16384". A missing
table, dtype, bucket or kind gives None: the caller keeps its register-safe default (kernels/fused_logprob.py
`default_tiles`, kernels/onepass_rows.py `default_row_tiles`, kernels/onepass_fused.py `default_fused_tiles`).
Tiles that spill are allowed here when they measured faster; kernels/compile_check.py checks the defaults only.

Must not: import engine/, measure anything, or guess tiles for a device without a table.

Test: `pytest tests/kernels/test_tuned_tiles.py` (a fixture table).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

import torch

from kernels.fused_logprob import TritonTiles
from kernels.onepass_fused import FusedTiles
from kernels.onepass_rows import RowTiles

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
KINDS = {"lm_head": TritonTiles, "onepass_rows": RowTiles, "onepass_fused": FusedTiles}
"""Table kind -> the dataclass its entries fill: the two-pass Triton kernels' tiles, the one-pass row kernels', the
one-pass fused GEMMs' ("triton_fused")."""


def device_file_name(device_name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3.json"."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") + ".json"


def table_path(device_name: str, directory: Path | None = None) -> Path:
    """Where the table of a device lives (kernels/tuned/ unless `directory`)."""
    return (TUNED_DIR if directory is None else Path(directory)) / device_file_name(device_name)


def hidden_bucket(hidden_size: int) -> str:
    """The H bucket of a table entry: next power of two >= H within [1024, 16384]."""
    power = 1 << max(int(hidden_size) - 1, 1).bit_length()
    return f"h{min(max(power, 1024), 16384)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=32)
def _read(path: Path) -> dict | None:
    if not path.is_file():
        return None
    table = json.loads(path.read_text())
    if not isinstance(table.get("entries"), dict):
        raise ValueError(f"{path}: a tuned-tile table needs an 'entries' object")
    return table


def load_table(device_name: str, directory: Path | None = None) -> dict | None:
    """The parsed table of a device, or None where none is committed (cached per path)."""
    return _read(table_path(device_name, directory))


def lookup(kind: str, device_name: str, dtype: torch.dtype, hidden_size: int, directory: Path | None = None):
    """The measured tiles of `kind` ("lm_head" -> TritonTiles, "onepass_rows" -> RowTiles, "onepass_fused" ->
    FusedTiles), or None."""
    cls = KINDS[kind]
    table = load_table(device_name, directory)
    entry = None if table is None else table["entries"].get(dtype_name(dtype), {}).get(
        hidden_bucket(hidden_size), {}).get(kind)
    if entry is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(entry) - names - {"full_ms"}
    if unknown:
        raise ValueError(f"{table_path(device_name, directory)}: {kind} entry has unknown fields {sorted(unknown)}")
    return cls(**{k: v for k, v in entry.items() if k in names})


def cuda_device_name(device: torch.device) -> str | None:
    """The CUDA device's name, or None off CUDA (and on a machine without a GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def device_lookup(kind: str, device: torch.device, dtype: torch.dtype, hidden_size: int):
    """`lookup` for the CUDA device `device` (None off CUDA): what the kernels' `default_*` functions read."""
    name = cuda_device_name(device)
    return None if name is None else lookup(kind, name, dtype, hidden_size)


def record(table: dict, kind: str, dtype: torch.dtype, hidden_size: int, tiles, full_ms: float) -> dict:
    """Put one measured best into a table (in place; returned): entries[dtype][bucket][kind]."""
    if kind not in KINDS or not isinstance(tiles, KINDS[kind]):
        raise TypeError(f"{kind} needs a {KINDS[kind].__name__}, got {type(tiles).__name__}")
    bucket = table.setdefault("entries", {}).setdefault(dtype_name(dtype), {}).setdefault(hidden_bucket(hidden_size),
                                                                                           {})
    bucket[kind] = {**dataclasses.asdict(tiles), "full_ms": round(float(full_ms), 4)}
    return table


def write_table(path: Path, table: dict) -> Path:
    """Write a table (sorted keys, one stable layout for diffs); the read cache is cleared."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    _read.cache_clear()
    return path
