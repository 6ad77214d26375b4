"""kernels/tuned_tiles.py: a fixture table is read back per (device, dtype, H bucket); the kernels' defaults use it on
CUDA where it has an entry and keep the register-safe tiles where it has none (the one-pass triton_fused GEMMs launch
with the table's block sizes); the writer's output is what the reader reads; a malformed entry is refused."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import tuned_tiles
from kernels.fused_logprob import FP32_TILES, INTERPRETER_TILES, TritonTiles, default_tiles
from kernels.onepass_fused import (
    FP32_FUSED_TILES,
    INTERPRETER_FUSED_TILES,
    FusedTiles,
    build_fused_grad_launches,
    build_fused_stats_launch,
    default_fused_tiles,
)
from kernels.onepass_logprob import resolve_onepass_tiles
from kernels.onepass_rows import INTERPRETER_ROW_TILES, RowTiles, default_row_tiles

DEVICE = "NVIDIA H100 80GB HBM3"
FIXTURE = {
    "device": DEVICE,
    "source": {"git_sha": "fixture", "date": "2026-01-01"},
    "entries": {"bfloat16": {
        "h2048": {"lm_head": {"block_n": 128, "block_v": 256, "block_h": 64, "group_n": 8, "num_warps": 8,
                              "num_stages": 3, "split_cols": None, "full_ms": 12.5},
                  "onepass_rows": {"stats_rows": 2, "stats_cols": 2048, "dz_rows": 16, "dz_cols": 256,
                                   "num_warps": 8, "full_ms": 10.0},
                  "onepass_fused": {"block_m": 128, "block_v": 256, "block_h": 64, "group_m": 4, "num_warps": 8,
                                    "num_stages": 3, "full_ms": 9.0}},
        "h4096": {"lm_head": {"block_n": 64, "block_v": 256, "block_h": 32, "group_n": 4, "num_warps": 4,
                              "num_stages": 4, "full_ms": 30.0}}}},
}


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    (tmp_path / "NVIDIA_H100_80GB_HBM3.json").write_text(json.dumps(FIXTURE))
    monkeypatch.setattr(tuned_tiles, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tuned_tiles, "cuda_device_name", lambda device: DEVICE if device.type == "cuda" else None)
    tuned_tiles._read.cache_clear()
    yield tmp_path
    tuned_tiles._read.cache_clear()


def test_names_and_buckets():
    assert tuned_tiles.device_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert tuned_tiles.device_file_name("NVIDIA A100-SXM4-80GB") == "NVIDIA_A100_SXM4_80GB.json"
    assert [tuned_tiles.hidden_bucket(h) for h in (64, 1024, 1025, 1536, 2048, 3584, 4096, 8192, 50000)] == [
        "h1024", "h1024", "h2048", "h2048", "h2048", "h4096", "h4096", "h8192", "h16384"]


def test_fixture_table_is_read_per_dtype_and_bucket(table_dir):
    tiles = tuned_tiles.lookup("lm_head", DEVICE, torch.bfloat16, 1536)
    assert tiles == TritonTiles(block_n=128, block_v=256, block_h=64, group_n=8, num_warps=8, num_stages=3)
    assert tuned_tiles.lookup("lm_head", DEVICE, torch.bfloat16, 3584).block_h == 32
    assert tuned_tiles.lookup("onepass_rows", DEVICE, torch.bfloat16, 2048) == RowTiles(
        stats_rows=2, stats_cols=2048, dz_rows=16, dz_cols=256, num_warps=8)
    assert tuned_tiles.lookup("onepass_rows", DEVICE, torch.bfloat16, 4096) is None  # kind missing in the bucket
    assert tuned_tiles.lookup("lm_head", DEVICE, torch.float32, 1536) is None  # dtype missing
    assert tuned_tiles.lookup("lm_head", DEVICE, torch.bfloat16, 8192) is None  # bucket missing
    assert tuned_tiles.lookup("lm_head", "NVIDIA A100-SXM4-80GB", torch.bfloat16, 1536) is None  # no table


def test_defaults_use_the_table_on_cuda_and_the_safe_tiles_elsewhere(table_dir):
    cuda = torch.device("cuda")
    assert default_tiles(cuda, torch.bfloat16, 1536).block_v == 256  # tuned
    assert default_tiles(cuda, torch.bfloat16, 8192) == TritonTiles()  # no entry: register-safe default
    assert default_tiles(cuda, torch.float32, 1536) == FP32_TILES
    assert default_tiles(cuda, torch.bfloat16) == TritonTiles()  # no H given (compile_check): the default
    assert default_tiles(torch.device("cpu"), torch.bfloat16, 1536) == INTERPRETER_TILES
    assert default_row_tiles(cuda, torch.bfloat16, 2048).stats_cols == 2048
    assert default_row_tiles(cuda, torch.bfloat16, 4096) == RowTiles()
    assert default_row_tiles(torch.device("cpu"), torch.bfloat16, 2048) == INTERPRETER_ROW_TILES


TUNED_FUSED = FusedTiles(block_m=128, block_v=256, block_h=64, group_m=4, num_warps=8, num_stages=3)
"""The fixture's onepass_fused entry (bfloat16, h2048)."""


def _fused_launch_blocks(tiles: FusedTiles, hidden_size: int) -> set[tuple]:
    """(BLOCK_M, BLOCK_V, BLOCK_H, num_warps, num_stages, GROUP_M (forward only)) of the forward, dX and dW launches
    one bf16 chunk of 256 rows gets with `tiles` (meta tensors, as kernels/compile_check.py builds them)."""
    meta = dict(device="meta")
    x = torch.empty(256, hidden_size, dtype=torch.bfloat16, **meta)
    w = torch.empty(1024, hidden_size, dtype=torch.bfloat16, **meta)
    z = torch.empty(256, 1024, dtype=torch.float32, **meta)
    ids = torch.empty(256, dtype=torch.int64, **meta)
    per_row = torch.empty(256, dtype=torch.float32, **meta)
    dx, dw = torch.empty(x.shape, dtype=torch.float32, **meta), torch.empty(w.shape, dtype=torch.float32, **meta)
    launches = [build_fused_stats_launch(x, w, ids, z, 1.0, None, tiles, 132, True)[0],
                *build_fused_grad_launches(z, x, w, ids, per_row, per_row, per_row, None, 1.0, None, dx, dw, False,
                                           tiles, True)]
    assert len(launches) == 3
    return {tuple(launch.options.get(k) for k in ("BLOCK_M", "BLOCK_V", "BLOCK_H", "num_warps", "num_stages",
                                                  "GROUP_M")) for launch in launches}


def test_triton_fused_launches_with_the_tables_tiles_and_the_default_without_an_entry(table_dir):
    cuda = torch.device("cuda")
    tiles = resolve_onepass_tiles("triton_fused", None, cuda, torch.bfloat16, 1536)  # what onepass_chunks launches
    assert tiles == TUNED_FUSED
    assert _fused_launch_blocks(tiles, 1536) == {(128, 256, 64, 8, 3, 4), (128, 256, 64, 8, 3, None)}
    for dtype, hidden_size, default in ((torch.bfloat16, 4096, FusedTiles()),  # no entry in the bucket
                                        (torch.float32, 2048, FP32_FUSED_TILES)):  # no entry for the dtype
        tiles = resolve_onepass_tiles("triton_fused", None, cuda, dtype, hidden_size)
        assert tiles == default
    assert _fused_launch_blocks(resolve_onepass_tiles("triton_fused", None, cuda, torch.bfloat16, 4096), 4096) == {
        (64, 64, 64, 8, 3, 8), (64, 64, 64, 8, 3, None)}
    assert default_fused_tiles(cuda, torch.bfloat16) == FusedTiles()  # no H given (compile_check): the default
    assert resolve_onepass_tiles("triton_fused", None, torch.device("cpu"), torch.bfloat16, 2048) == (
        INTERPRETER_FUSED_TILES)
    given = FusedTiles(block_m=32)
    assert resolve_onepass_tiles("triton_fused", given, cuda, torch.bfloat16, 2048) is given  # explicit tiles win
    assert resolve_onepass_tiles("cublas_triton", None, cuda, torch.bfloat16, 2048).stats_cols == 2048  # its own kind


def test_writer_output_reads_back(tmp_path):
    table = {"device": "NVIDIA H200", "source": {"git_sha": "abc"}}
    tuned_tiles.record(table, "lm_head", torch.bfloat16, 4096, TritonTiles(block_n=128, block_v=256), 7.25)
    tuned_tiles.record(table, "onepass_rows", torch.bfloat16, 1536, RowTiles(stats_rows=8), 3.5)
    tuned_tiles.record(table, "onepass_fused", torch.bfloat16, 1536, FusedTiles(block_m=128, block_v=128), 3.0)
    path = tuned_tiles.write_table(tuned_tiles.table_path("NVIDIA H200", tmp_path), table)
    assert path.name == "NVIDIA_H200.json"
    assert tuned_tiles.lookup("lm_head", "NVIDIA H200", torch.bfloat16, 3000, tmp_path) == TritonTiles(
        block_n=128, block_v=256)
    assert tuned_tiles.lookup("onepass_rows", "NVIDIA H200", torch.bfloat16, 1536, tmp_path).stats_rows == 8
    assert tuned_tiles.lookup("onepass_fused", "NVIDIA H200", torch.bfloat16, 1536, tmp_path) == FusedTiles(
        block_m=128, block_v=128)
    with pytest.raises(TypeError):
        tuned_tiles.record(table, "lm_head", torch.bfloat16, 4096, RowTiles(), 1.0)
    with pytest.raises(TypeError):
        tuned_tiles.record(table, "onepass_fused", torch.bfloat16, 4096, RowTiles(), 1.0)


def test_malformed_entries_are_refused(tmp_path):
    bad = {"entries": {"bfloat16": {"h2048": {"lm_head": {"block_n": 64, "blokc_v": 128}}}}}
    (tmp_path / "Bad_GPU.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unknown fields"):
        tuned_tiles.lookup("lm_head", "Bad GPU", torch.bfloat16, 2048, tmp_path)
    (tmp_path / "Empty_GPU.json").write_text("{}")
    with pytest.raises(ValueError, match="entries"):
        tuned_tiles.load_table("Empty GPU", tmp_path)
