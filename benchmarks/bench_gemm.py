"""GEMM benchmark: `torch.matmul` of two square (n, n) matrices at a few sizes; the harness's end-to-end check.

Measures, per size n (x_name "M=N=K"), three rows in `benchmarks/results/gemm.csv` (variant "torch.matmul",
mode "forward"):
- `time` (ms): p20/p50/p80 over `--iters` calls after `--warmup` calls (CUDA events on a GPU, perf_counter on CPU);
- `throughput` (TFLOP/s): 2*n^3 FLOP / time. p50 comes from the p50 time; p20 from the p80 time and p80 from
  the p20 time (a slower call is a lower throughput);
- `peak_memory` (MiB): extra memory of one call over what the inputs already hold, i.e. about the (n, n)
  output (harness.peak_memory_fn: CUDA caching allocator on GPU; process RSS sampled every 1 ms on CPU);
then redraws `benchmarks/results/plots/gemm_*.png`. Not a tuned GEMM study: no L2 flush, no layouts or
transposes, one stream.

    python -m benchmarks.bench_gemm                                # CPU: 256,512,1024 float32, a few seconds
    python -m benchmarks.bench_gemm --sizes 1024,4096 --dtype bfloat16 --iters 50 --overwrite
    python -m benchmarks.bench_gemm --device cuda                  # GPU default: 1024..8192 bfloat16

Defaults depend on the device: CPU sizes 256,512,1024 in float32 (p50 19.8 ms, 0.11 TFLOP/s at 1024 on the
2-core Xeon dev machine: results/gemm.csv), CUDA sizes 1024,2048,4096,8192 in bfloat16. `--overwrite` replaces
earlier rows with the same key instead of adding rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.harness import (
    RESULTS_DIR,
    EnvInfo,
    PeakMemory,
    Row,
    Timing,
    append_rows,
    capture_env,
    make_row,
    peak_memory_fn,
    time_fn,
)

DEFAULT_SIZES = {"cpu": "256,512,1024", "cuda": "1024,2048,4096,8192"}
DEFAULT_DTYPE = {"cpu": "float32", "cuda": "bfloat16"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MIB = 2**20


def bench_size(
    n: int, dtype: torch.dtype, device: torch.device, warmup: int, n_iters: int
) -> tuple[Timing, PeakMemory]:
    """Time and measure one (n, n) @ (n, n) matmul.

    Args:
        n: M = N = K.
        dtype: element type of both inputs and the output.
        device: where the matrices live.
        warmup: untimed calls before timing.
        n_iters: timed calls.

    Returns:
        (Timing, PeakMemory) of the matmul.
    """
    generator = torch.Generator(device=device).manual_seed(n)
    a = torch.randn(n, n, dtype=dtype, device=device, generator=generator)  # (M, K)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=generator)  # (K, N)
    timing = time_fn(lambda: torch.matmul(a, b), device=device, warmup=warmup, n_iters=n_iters)
    memory = peak_memory_fn(lambda: torch.matmul(a, b), device=device)  # (M, N) output, held until the sample
    return timing, memory


def rows_for_size(
    env: EnvInfo, n: int, timing: Timing, memory: PeakMemory, config: dict[str, object], n_iters: int
) -> list[Row]:
    """The three rows (time, throughput, peak_memory) of one size.

    Args:
        env: from harness.capture_env.
        n: M = N = K.
        timing: durations of the matmul.
        memory: peak memory of one matmul.
        config: workload settings other than n (dtype, CPU threads).
        n_iters: timed calls behind `timing`.

    Returns:
        Three rows, in that order.
    """
    key = dict(bench="gemm", variant="torch.matmul", mode="forward", x_name="M=N=K", x_value=n, config=config)
    tflop = 2 * n**3 / 1e12  # 2*M*N*K FLOP: one multiply and one add per (m, n, k)
    peak_mib = memory.extra_bytes / MIB
    return [
        make_row(
            env,
            **key,
            metric="time",
            unit="ms",
            p20=timing.p20_ms,
            p50=timing.p50_ms,
            p80=timing.p80_ms,
            n_iters=n_iters,
        ),
        make_row(
            env,
            **key,
            metric="throughput",
            unit="TFLOP/s",
            p20=tflop / (timing.p80_ms * 1e-3),
            p50=tflop / (timing.p50_ms * 1e-3),
            p80=tflop / (timing.p20_ms * 1e-3),
            n_iters=n_iters,
        ),
        make_row(env, **key, metric="peak_memory", unit="MiB", p20=peak_mib, p50=peak_mib, p80=peak_mib, n_iters=1),
    ]


def main(argv: list[str] | None = None) -> None:
    """Command line: measure every size, append the rows, print a table, redraw the figures."""
    parser = argparse.ArgumentParser(description="torch.matmul at square sizes -> benchmarks/results/gemm.csv")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    parser.add_argument("--sizes", help="comma-separated n for (n, n) @ (n, n); default depends on the device")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per size before timing")
    parser.add_argument("--overwrite", action="store_true", help="replace rows with the same key")
    parser.add_argument("--csv", type=Path, default=RESULTS_DIR / "gemm.csv", help="results file")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    sizes = [int(s) for s in (args.sizes or DEFAULT_SIZES[device.type]).split(",")]
    dtype_name = args.dtype or DEFAULT_DTYPE[device.type]
    config = {"dtype": dtype_name}
    if device.type == "cpu":
        config["torch_threads"] = torch.get_num_threads()
    env = capture_env(device)
    print(f"gemm on {env.device} ({device}), {config}, torch {env.torch_version}, git {env.git_sha or '?'}")

    rows = []
    print(f"{'n':>6} {'p50 ms':>10} {'p20-p80 ms':>19} {'TFLOP/s':>9} {'peak MiB':>9}")
    for n in sizes:
        timing, memory = bench_size(n, DTYPES[dtype_name], device, args.warmup, args.iters)
        size_rows = rows_for_size(env, n, timing, memory, config, args.iters)
        rows += size_rows
        print(
            f"{n:>6} {timing.p50_ms:>10.3f} {timing.p20_ms:>9.3f}-{timing.p80_ms:<9.3f} "
            f"{size_rows[1].p50:>9.4f} {size_rows[2].p50:>9.2f}"
        )
    append_rows(args.csv, rows, overwrite=args.overwrite)
    print(f"{len(rows)} rows -> {args.csv}")

    try:
        from benchmarks.plot import redraw
    except ModuleNotFoundError as err:  # the rows are saved; figures are derived and can be redrawn later
        print(f"figures not redrawn ({err}); run `python -m benchmarks.plot` where matplotlib is installed")
        return
    for png in redraw(args.csv):
        print(png)


if __name__ == "__main__":
    main()
