"""Unit tests of the benchmark harness (benchmarks/harness.py, benchmarks/plot.py): percentiles, CPU timing with a
fake clock, the keyed results CSV (header, append, overwrite, header mismatch), CPU peak memory, environment
capture and figure drawing. CPU, a few seconds, plus one gpu-marked test of the CUDA paths (skipped without CUDA);
every file goes to tmp_path, never to benchmarks/results/.

    pytest tests/unit/test_bench_harness.py
"""

import csv
import subprocess
import time

import pytest
import torch

from benchmarks.harness import (
    CSV_COLUMNS,
    EnvInfo,
    append_rows,
    capture_env,
    git_sha,
    make_row,
    peak_memory_fn,
    percentiles,
    read_rows,
    time_fn,
)
from benchmarks.plot import redraw

ENV = EnvInfo(
    device="Test CPU",
    num_gpus=0,
    git_sha="abc1234",
    torch_version="2.13.0",
    vllm_version="",
    mcore_version="",
    triton_version="",
    transformers_version="",
)


def _row(x_value=256, p50=1.0, variant="torch.matmul", metric="time", config=None):
    return make_row(
        ENV,
        bench="gemm",
        variant=variant,
        mode="forward",
        metric=metric,
        unit="ms",
        x_name="M=N=K",
        x_value=x_value,
        p20=p50 * 0.9,
        p50=p50,
        p80=p50 * 1.1,
        n_iters=5,
        config=config or {"dtype": "float32"},
    )


def _csv_lines(path):
    with path.open(newline="") as f:
        return list(csv.reader(f))


def test_percentiles_interpolate_linearly_between_ranks():
    assert percentiles([5.0, 1.0, 4.0, 2.0, 3.0]) == pytest.approx([1.8, 3.0, 4.2])
    assert percentiles([10.0, 20.0], qs=(0, 50, 100)) == pytest.approx([10.0, 15.0, 20.0])
    assert percentiles([7.0]) == pytest.approx([7.0, 7.0, 7.0])
    with pytest.raises(ValueError):
        percentiles([])


def test_time_fn_cpu_reports_percentiles_of_timed_calls_only():
    durations_s = iter([0.005, 0.001, 0.004, 0.002, 0.003])
    now = [100.0]
    calls = []

    def clock():
        return now[0]

    def fn():
        calls.append(1)
        if len(calls) > 2:  # the 2 warm-up calls take no (fake) time and are not timed
            now[0] += next(durations_s)

    timing = time_fn(fn, warmup=2, n_iters=5, clock=clock)
    assert len(calls) == 7
    assert timing.n_iters == 5
    assert timing.samples_ms == pytest.approx((5.0, 1.0, 4.0, 2.0, 3.0))
    assert (timing.p20_ms, timing.p50_ms, timing.p80_ms) == pytest.approx((1.8, 3.0, 4.2))


def test_append_rows_creates_header_once_then_appends(tmp_path):
    path = tmp_path / "sub" / "gemm.csv"
    append_rows(path, [_row(256), _row(512)])
    append_rows(path, [_row(256, p50=2.0)])
    lines = _csv_lines(path)
    assert tuple(lines[0]) == CSV_COLUMNS
    assert [line[0] for line in lines].count("bench") == 1
    rows = read_rows(path)
    assert [(r["x_value"], r["p50"]) for r in rows] == [("256", "1"), ("512", "1"), ("256", "2")]
    assert rows[0]["config_json"] == '{"dtype":"float32"}'
    assert rows[0]["device"] == "Test CPU" and rows[0]["git_sha"] == "abc1234"


def test_append_rows_overwrite_replaces_only_rows_with_the_same_key(tmp_path):
    path = tmp_path / "gemm.csv"
    append_rows(
        path,
        [
            _row(256, p50=1.0),
            _row(512, p50=1.0),
            _row(256, p50=1.0, variant="triton"),
            _row(256, p50=1.0, metric="throughput"),
            _row(256, p50=1.0, config={"dtype": "bfloat16"}),
            _row(256, p50=1.5),  # a duplicate key from an earlier append-only run: replaced too
        ],
    )
    append_rows(path, [_row(256.0, p50=9.0)], overwrite=True)  # 256.0 is the same x as 256
    append_rows(path, [_row(2**21, p50=3.0)])
    append_rows(path, [_row(float(2**21), p50=4.0)], overwrite=True)
    rows = read_rows(path)
    got = [(r["variant"], r["metric"], r["x_value"], r["config_json"], r["p50"]) for r in rows]
    assert got == [
        ("torch.matmul", "time", "512", '{"dtype":"float32"}', "1"),
        ("triton", "time", "256", '{"dtype":"float32"}', "1"),
        ("torch.matmul", "throughput", "256", '{"dtype":"float32"}', "1"),
        ("torch.matmul", "time", "256", '{"dtype":"bfloat16"}', "1"),
        ("torch.matmul", "time", "256", '{"dtype":"float32"}', "9"),
        ("torch.matmul", "time", "2097152", '{"dtype":"float32"}', "4"),
    ]
    assert not (tmp_path / "gemm.csv.tmp").exists()


def test_append_rows_refuses_a_file_with_another_header(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text("kernel_name,metric_name,y_value_50\nrms_norm,speed,1.0\n")
    before = path.read_text()
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="header does not match"):
            append_rows(path, [_row()], overwrite=overwrite)
    assert path.read_text() == before


def test_read_rows_refuses_a_row_with_missing_cells(tmp_path):
    path = tmp_path / "gemm.csv"
    append_rows(path, [_row()])
    with path.open("a") as f:
        f.write("gemm,torch.matmul,forward\n")
    with pytest.raises(ValueError, match=r"gemm.csv:3: 3 cells"):
        read_rows(path)


def test_peak_memory_cpu_sees_a_large_allocation_freed_before_return():
    num_bytes = 200_000_000

    def fn():
        x = torch.ones(num_bytes // 4, dtype=torch.float32)  # 200 MB, every page written
        time.sleep(0.2)  # long enough for the sampling thread to run on a loaded machine (20 ms was not: flaky)
        del x  # freed before returning: only the sampling thread can see it

    memory = peak_memory_fn(fn)
    assert 150e6 <= memory.extra_bytes <= 300e6, memory
    assert memory.peak_bytes - memory.baseline_bytes == memory.extra_bytes
    assert "statm" in memory.method


def test_peak_memory_cpu_counts_a_buffer_recycled_from_earlier_frees():
    for _ in range(3):  # after these frees glibc serves 4 MiB buffers from heap pages it already holds
        torch.ones(2**20, dtype=torch.float32).sum()
    memory = peak_memory_fn(lambda: torch.ones(2**20, dtype=torch.float32))  # 4 MiB, held until sampled
    assert memory.extra_bytes >= 3.5 * 2**20, memory


def test_peak_memory_cpu_of_a_small_call_is_small():
    memory = peak_memory_fn(lambda: sum(range(1000)))
    assert memory.extra_bytes < 20e6, memory


def test_capture_env_records_torch_and_device():
    env = capture_env("cpu")
    assert env.torch_version.split("+")[0] == torch.__version__.split("+")[0]
    assert env.device
    assert env.num_gpus == torch.cuda.device_count()


def test_git_sha_is_short_commit_with_dirty_suffix_for_tracked_changes(tmp_path):
    def git(*args):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True, capture_output=True
        )

    assert git_sha(tmp_path) == ""  # not a repository
    git("init", "-q")
    (tmp_path / "a.txt").write_text("one")
    git("add", "a.txt")
    git("commit", "-q", "-m", "first")
    sha = git_sha(tmp_path)
    assert len(sha) >= 7 and "dirty" not in sha
    (tmp_path / "untracked.csv").write_text("rows")
    assert git_sha(tmp_path) == sha
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "bench.csv").write_text("header")
    git("add", "benchmarks")
    git("commit", "-q", "-m", "results")
    sha = git_sha(tmp_path)
    (results / "bench.csv").write_text("header\nrow")  # a benchmark appending its rows: still the clean commit
    assert git_sha(tmp_path) == sha
    assert git_sha(results) == sha  # from anywhere in the tree
    (tmp_path / "a.txt").write_text("two")
    assert git_sha(tmp_path) == f"{sha}-dirty"


def test_redraw_writes_one_png_per_bench_and_metric(tmp_path):
    path = tmp_path / "gemm.csv"
    rows = [_row(n, p50=n / 256) for n in (256, 512, 1024)]
    rows += [_row(n, p50=n / 512, variant="triton") for n in (256, 512, 1024)]
    rows += [_row(n, p50=0.5, metric="throughput") for n in (256, 512)]
    append_rows(path, rows)
    written = redraw(path, tmp_path / "plots")
    assert written == [tmp_path / "plots" / "gemm_throughput.png", tmp_path / "plots" / "gemm_time.png"]
    for png in written:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 5_000
