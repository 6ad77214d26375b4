"""The GPU suite's CPU smoke (`python -m benchmarks.gpu.suite --cpu`): every part runs or says why it was skipped,
and the rows the GPU run will produce are there (device, git sha, versions, the measurements each part owns); the
returned rows are collected into a results folder as after a device call.

The suite runs as a subprocess, as on the lent machine (its parts are subprocesses too: the Triton interpreter,
real Megatron on gloo, a real TRL GRPOTrainer): about 150 s of CPU time, 15 to 20 minutes of wall time on a loaded
2-core machine. Each part does the least work that still writes every row the GPU run writes; the kernels' correctness is
tests/kernels' job, not this one's.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu.suite import PARTS
from benchmarks.harness import read_rows

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    results = tmp_path_factory.mktemp("gpu_suite")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.suite", "--cpu", "--results-dir", str(results)],
                          cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return results, proc.stdout


def _parts(results: Path) -> dict[str, dict]:
    rows = [r for r in read_rows(results / "suite.csv") if r["metric"] == "wall_time"]
    return {r["x_value"]: {**r, **json.loads(r["config_json"])} for r in rows}


def test_every_part_ran_or_says_why_it_was_skipped(smoke):
    results, _ = smoke
    parts = _parts(results)
    assert sorted(parts) == sorted(p.key for p in PARTS)
    for key, part in parts.items():
        assert part["status"] in ("ok", "skipped"), f"part {key}: {part['status']} {part['reason']}"
        if part["status"] == "skipped":
            assert part["reason"], f"part {key} skipped without a reason"
    for key in ("a", "b", "c", "d", "f"):  # kernels, lm-head, Megatron, TRL, the long-tailed batch all run on CPU
        assert parts[key]["status"] == "ok" and float(parts[key]["p50"]) > 0 and parts[key]["cpu_s"] > 0
    assert "GPU only" in parts["c7"]["reason"]
    assert parts["e"]["status"] == "ok" or "bench_packing" in parts["e"]["reason"]  # not there yet, or no --csv
    assert any(re.search(r"\b[1-9]\d* passed", note) and "failed" not in note for note in parts["a"]["notes"])


def test_rows_carry_device_git_sha_and_versions(smoke):
    results, _ = smoke
    env = [r for r in read_rows(results / "suite.csv") if r["variant"] == "environment"]
    versions = json.loads(env[-1]["config_json"])
    assert set(versions) >= {"python", "transformers", "trl", "liger_kernel", "datasets", "cuda"}
    assert versions["trl"] and versions["transformers"]
    for name in ("suite.csv", "gemm.csv", "fused_logprob.csv", "grpo_step.csv", "trl_grpo_step.csv"):
        for row in read_rows(results / name):
            assert row["device"] and row["torch_version"] and row["git_sha"], (name, row)
            assert row["num_gpus"] == str(torch.cuda.device_count())


def test_lm_head_part_measures_floor_tiles_and_every_variant(smoke):
    results, _ = smoke
    assert [r for r in read_rows(results / "gemm.csv") if r["metric"] == "throughput"]
    rows = read_rows(results / "fused_logprob.csv")
    tiles = {json.loads(r["config_json"]).get("tiles") for r in rows if r["variant"] == "triton"}
    assert len(tiles) >= 2  # at least two tile choices were tried
    for variant in ("reference", "torch_chunked", "triton"):
        mine = {(r["mode"], r["metric"]) for r in rows if r["variant"] == variant}
        for mode in ("forward", "backward", "full"):
            assert {(mode, m) for m in ("time", "throughput", "peak_memory", "fraction_of_floor")} <= mine
    for variant in ("onepass_torch_chunked", "onepass_cublas_triton", "onepass_triton_fused"):  # full mode only
        mine = {(r["mode"], r["metric"]) for r in rows if r["variant"] == variant}
        assert mine == {("full", m) for m in ("time", "throughput", "peak_memory", "fraction_of_floor")}, variant
    row_tiles = {json.loads(r["config_json"]).get("row_tiles") for r in rows if r["variant"] == "onepass_cublas_triton"}
    assert len(row_tiles - {None}) >= 2  # row-tile choices tried
    fused_tiles = {json.loads(r["config_json"]).get("fused_tiles") for r in rows
                   if r["variant"] == "onepass_triton_fused"}
    assert len(fused_tiles - {None}) >= 2  # the fused GEMMs' tile choices tried
    [table] = (results / "tuned").glob("*.json")  # the sweep's bests, as kernels/tuned_tiles.py reads them
    entries = json.loads(table.read_text())["entries"]["float32"]["h1024"]
    assert set(entries) == {"lm_head", "onepass_rows", "onepass_fused"}
    parts = _parts(results)
    liger_installed = importlib.util.find_spec("liger_kernel") is not None
    assert liger_installed or any("liger_grpo_loss skipped" in n for n in parts["b"]["notes"])


def test_step_parts_measure_nominal_step_and_longest_fit(smoke):
    results, _ = smoke
    megatron = read_rows(results / "grpo_step.csv")
    for implementation in ("torch_chunked", "onepass_torch_chunked", "reference"):
        mine = [r for r in megatron if json.loads(r["config_json"])["implementation"] == implementation]
        assert {r["metric"] for r in mine if r["mode"] == "train_step"} == {"time", "tokens_per_s", "peak_memory"}
        share = [float(r["p50"]) for r in mine if r["metric"] == "lm_head_share"]
        assert len(share) == 1 and 0 < share[0], implementation  # the LM head's share of the step
        fit = [r for r in mine if r["metric"] == "max_completion_len"]
        assert float(fit[-1]["p50"]) == 32 and json.loads(fit[-1]["config_json"])["stopped"]
        assert [r for r in mine if r["mode"] == "longest_fit" and r["metric"] == "peak_memory" and r["x_value"] == "32"]
    trl = read_rows(results / "trl_grpo_step.csv")
    assert {r["metric"] for r in trl if r["variant"] == "trl" and r["mode"] == "train_step"} == {
        "time", "tokens_per_s", "peak_memory"}
    trl_fit = [r for r in trl if r["variant"] == "trl" and r["metric"] == "max_completion_len"]
    assert trl_fit and float(trl_fit[-1]["p50"]) == 32
    same_tokens = {r["x_value"] for r in megatron + trl if r["mode"] == "train_step"}
    assert same_tokens == {"64"}  # 4 completions x 16 tokens, the same batch on both sides


def test_long_tail_part_measures_the_engine_and_trl_on_the_same_useful_tokens(smoke):
    results, _ = smoke
    rows = [r for r in read_rows(results / "long_tail.csv") if r["mode"] == "train_step"]
    assert {r["variant"] for r in rows} >= {"engine", "trl"}
    for variant in ("engine", "trl"):
        assert {r["metric"] for r in rows if r["variant"] == variant} == {"time", "tokens_per_s", "peak_memory"}
    assert len({r["x_value"] for r in rows}) == 1  # the same useful completion tokens on both sides
    engine = json.loads(next(r for r in rows if r["variant"] == "engine")["config_json"])
    trl = json.loads(next(r for r in rows if r["variant"] == "trl")["config_json"])
    assert engine["padding_free"] and engine["gradient_checkpointing"] and trl["gradient_checkpointing"]
    assert trl["padded_completion_tokens"] >= trl["completion_tokens"]


def test_summary_table_is_printed_last(smoke):
    _, stdout = smoke
    tail = stdout[stdout.rindex("==== GPU suite summary"):]
    for text in ("a kernel_tests", "b lm_head", "GEMM floor", "megatron tiny torch_chunked", "trl tiny trl", "rows:"):
        assert text in tail
    assert tail.rstrip().splitlines()[-1].startswith("rows:")


def test_collect_appends_the_returned_rows_to_the_results_folder(smoke, tmp_path):
    from benchmarks.gpu.collect import collect

    results, _ = smoke
    counts = collect(results, tmp_path)
    again = collect(results, tmp_path)  # a second collect appends the same rows again (append, never overwrite)
    for name, n in counts.items():
        assert n == len(read_rows(results / name)) and len(read_rows(tmp_path / name)) == 2 * n == n + again[name]
    assert {"suite.csv", "gemm.csv", "fused_logprob.csv", "grpo_step.csv", "trl_grpo_step.csv"} <= set(counts)
    assert list(tmp_path.glob("gpu_suite_*.log"))
    tuned = tmp_path / "tuned"
    collect(results, tmp_path, tuned_dir=tuned)
    assert not tuned.exists()  # a CPU smoke's table is never committed; a GPU run's goes to kernels/tuned/
