"""Suite part b: the bf16 GEMM floor, a Triton tile sweep, then the fused log-prob sweep against its baselines.

In order, each step appending its rows as soon as it has them (a time limit keeps what was measured):
1. the floor: `torch.matmul` of square bf16 matrices (benchmarks/bench_gemm.py; rows in `gemm.csv`); the floor is
   the best p50 TFLOP/s of those sizes, the rate the LM-head GEMMs could reach at best on this device;
2. tile choices tried: the Triton kernels (kernels/fused_logprob.py) at one point (`--tile-tokens`, the largest
   `--hidden`) for each of `TILE_CANDIDATES` (forward, backward and full; rows in `fused_logprob.csv` with the
   block sizes in `config.tiles`), then, full mode, the one-pass row kernels' `ROW_TILE_CANDIDATES`
   (`config.row_tiles`) and fused GEMMs' `FUSED_TILE_CANDIDATES` (`config.fused_tiles`); a candidate that does not
   compile or run is reported and skipped; the best by full-mode p50 goes into the tuned-tile table and is used next;
3. the sweep (benchmarks/bench_fused_logprob.py's `bench_point`): every (N, H) of `--tokens` x `--hidden` at
   V = `--vocab`, variants reference (logits materialised), torch_chunked, triton (best tiles; and, first, at the
   kernel's default tiles where the best differ, so that a change of default rests on the whole sweep), the one-pass
   onepass_torch_chunked, onepass_cublas_triton and onepass_triton_fused (each at its best tiles, and its default
   tiles first where they differ) and Liger's `LigerFusedLinearGRPOLoss` (full mode only; skipped with a printed
   reason where liger-kernel does not import):
   p50 ms and TFLOP/s (6NHV for full), peak extra memory, plus a `fraction_of_floor` row (TFLOP/s / floor) per
   throughput row.

    python -m benchmarks.gpu.lm_head --results-dir /tmp/gpu                     # GPU defaults (the issue's sweep)
    TRITON_INTERPRET=1 python -m benchmarks.gpu.lm_head --cpu --results-dir /tmp/cpu   # tiny CPU smoke

Must not: change the kernels' defaults (a better tile is a row; kernels/fused_logprob.py is edited by hand) or judge
timings.

Run by the suite (benchmarks/gpu/suite.py) as part b; test: tests/integration/test_gpu_suite.py (CPU smoke).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks import bench_fused_logprob, bench_gemm
from benchmarks.harness import RESULTS_DIR, append_rows, capture_env
from kernels import TritonTiles, fused_logprob, onepass_fused, onepass_rows, tuned_tiles
from kernels.onepass_fused import INTERPRETER_FUSED_TILES, FusedTiles
from kernels.onepass_rows import INTERPRETER_ROW_TILES, RowTiles

TILE_CANDIDATES = (
    TritonTiles(),  # the bf16 default: 64 x 128 x 64, 8 warps, 3 stages (no spills: kernels/compile_check.py)
    TritonTiles(block_n=128, block_v=128, block_h=64, num_warps=8, num_stages=3),  # the old default (spills)
    TritonTiles(block_n=128, block_v=256, block_h=64, num_warps=8, num_stages=3),
    TritonTiles(block_n=64, block_v=128, block_h=64, num_warps=4, num_stages=4),
    TritonTiles(block_n=128, block_v=128, block_h=32, num_warps=4, num_stages=4),
    TritonTiles(block_n=256, block_v=128, block_h=64, num_warps=8, num_stages=3),
)
CPU_TILE_CANDIDATES = (
    TritonTiles(block_n=32, block_v=64, block_h=32, group_n=2, num_warps=4, num_stages=1),
    TritonTiles(block_n=16, block_v=128, block_h=32, group_n=2, num_warps=4, num_stages=1),
)
ROW_TILE_CANDIDATES = (
    RowTiles(),  # the default: statistics 4 x 1024, dz 8 x 512, 4 warps
    RowTiles(stats_rows=2, stats_cols=2048, dz_rows=8, dz_cols=512, num_warps=8),
    RowTiles(stats_rows=8, stats_cols=512, dz_rows=16, dz_cols=256, num_warps=4),
    RowTiles(stats_rows=1, stats_cols=4096, dz_rows=4, dz_cols=1024, num_warps=8),
)
CPU_ROW_TILE_CANDIDATES = (INTERPRETER_ROW_TILES, RowTiles(stats_rows=2, stats_cols=128, dz_rows=2, dz_cols=128))
FUSED_TILE_CANDIDATES = (
    FusedTiles(),  # the bf16 default: 64 x 64 x 64, 8 warps, 3 stages (no spills: kernels/compile_check.py)
    FusedTiles(block_m=128, block_v=128, block_h=64, num_warps=8, num_stages=3),
    FusedTiles(block_m=128, block_v=256, block_h=64, num_warps=8, num_stages=3),
    FusedTiles(block_m=64, block_v=128, block_h=64, num_warps=4, num_stages=4),
    FusedTiles(block_m=128, block_v=64, block_h=64, num_warps=8, num_stages=3),
)
CPU_FUSED_TILE_CANDIDATES = (INTERPRETER_FUSED_TILES,
                             FusedTiles(block_m=32, block_v=64, block_h=32, group_m=2, num_warps=4, num_stages=1))
VARIANTS = ("reference,torch_chunked,triton,onepass_torch_chunked,onepass_cublas_triton,onepass_triton_fused,"
            "liger_grpo_loss")
GPU = dict(gemm_sizes="4096,8192", tokens="2048,8192,16384", hidden="1536,4096", vocab=151936, dtype="bfloat16",
           tile_tokens=8192, iters=10, warmup=3, variants=VARIANTS,
           onepass_workspace_mb=bench_fused_logprob.ENGINE_WORKSPACE_MB)
CPU = dict(gemm_sizes="64", tokens="16", hidden="32", vocab=128, dtype="float32", tile_tokens=16, iters=1, warmup=0,
           variants=VARIANTS, onepass_workspace_mb=0.01)


def measure_floor(env, device: torch.device, dtype_name: str, sizes: list[int], args) -> float:
    """bench_gemm at `sizes`; rows to gemm.csv; returns the best p50 TFLOP/s (the floor's rate)."""
    config = {"dtype": dtype_name}
    rows = []
    for n in sizes:
        timing, memory = bench_gemm.bench_size(n, bench_gemm.DTYPES[dtype_name], device, args.warmup, args.iters)
        rows += bench_gemm.rows_for_size(env, n, timing, memory, config, args.iters)
    append_rows(args.results_dir / "gemm.csv", rows)
    rate = max(row.p50 for row in rows if row.metric == "throughput")
    print(f"floor: torch.matmul {dtype_name} at {sizes}: best p50 {rate:.2f} TFLOP/s")
    return rate


def with_fraction_of_floor(rows: list, floor_tflops: float) -> list:
    """The rows plus, per throughput row, a `fraction_of_floor` row (its TFLOP/s over the floor's)."""
    extra = [dataclasses.replace(r, metric="fraction_of_floor", unit="1", p20=r.p20 / floor_tflops,
                                 p50=r.p50 / floor_tflops, p80=r.p80 / floor_tflops)
             for r in rows if r.metric == "throughput"]
    return rows + extra


def sweep_tiles(env, device, args, floor_tflops: float, candidates, hidden: int, variant: str = "triton",
                field: str = "tiles", label=bench_fused_logprob.tiles_label):
    """Every candidate of `variant`'s tiles (`field` of the point's args) at (tile_tokens, H); rows appended;
    returns (best by full-mode p50, its ms), or (None, inf) when none ran."""
    best, best_ms = None, float("inf")
    for tiles in candidates:
        name = label(tiles)
        point_args = argparse.Namespace(**{**vars(args), field: tiles})
        try:
            rows, _ = bench_fused_logprob.bench_point(env, [variant], args.tile_tokens, hidden, args.vocab,
                                                      args.torch_dtype, device, point_args)
        except Exception as error:  # noqa: BLE001 - a tile that does not compile (shared memory, registers) is a result
            first_line = (str(error).splitlines() or [""])[0][:160]
            print(f"SUITE-NOTE: {variant} tiles {name} failed: {type(error).__name__}: {first_line}")
            continue
        append_rows(args.results_dir / "fused_logprob.csv", with_fraction_of_floor(rows, floor_tflops))
        full = [r.p50 for r in rows if r.mode == "full" and r.metric == "time"]
        print(f"{variant} tiles {name}: full p50 {full[0]:.2f} ms" if full else f"tiles {name}: no full-mode row")
        if full and full[0] < best_ms:
            best, best_ms = tiles, full[0]
    if best is not None:
        print(f"SUITE-NOTE: best {variant} tiles {label(best)} (full p50 {best_ms:.2f} ms at N={args.tile_tokens}, "
              f"H={hidden})")
    return best, best_ms


def sweep_and_record(env, device, args, floor: float, variants: list[str]) -> tuple[dict, dict, dict]:
    """Per H: the two-pass Triton tiles, the one-pass row tiles and the one-pass fused GEMMs' tiles by measurement;
    the bests go into a tuned-tile table (kernels/tuned_tiles.py layout) at <results>/tuned/<device>.json, to be
    committed to kernels/tuned/. Returns ({H: best TritonTiles}, {H: best RowTiles}, {H: best FusedTiles})."""
    table = {"device": env.device, "source": {
        "git_sha": env.git_sha, "date": datetime.now(UTC).isoformat(timespec="seconds"), "torch": env.torch_version,
        "triton": env.triton_version, "mode": "cpu" if args.cpu else "gpu", "tile_tokens": args.tile_tokens,
        "vocab": args.vocab, "workspace_mb": args.workspace_mb, "onepass_workspace_mb": args.onepass_workspace_mb}}
    best_tiles, best_rows, best_fused = {}, {}, {}
    for h in args.hidden:
        if "triton" in variants:
            tiles, ms = sweep_tiles(env, device, args, floor, CPU_TILE_CANDIDATES if args.cpu else TILE_CANDIDATES, h)
            if tiles is not None:
                best_tiles[h] = tiles
                tuned_tiles.record(table, "lm_head", args.torch_dtype, h, tiles, ms)
        if "onepass_cublas_triton" in variants:
            rows, ms = sweep_tiles(env, device, args, floor, CPU_ROW_TILE_CANDIDATES if args.cpu else
                                   ROW_TILE_CANDIDATES, h, "onepass_cublas_triton", "row_tiles",
                                   bench_fused_logprob.row_tiles_label)
            if rows is not None:
                best_rows[h] = rows
                tuned_tiles.record(table, "onepass_rows", args.torch_dtype, h, rows, ms)
        if "onepass_triton_fused" in variants:
            fused, ms = sweep_tiles(env, device, args, floor, CPU_FUSED_TILE_CANDIDATES if args.cpu else
                                    FUSED_TILE_CANDIDATES, h, "onepass_triton_fused", "fused_tiles",
                                    bench_fused_logprob.fused_tiles_label)
            if fused is not None:
                best_fused[h] = fused
                tuned_tiles.record(table, "onepass_fused", args.torch_dtype, h, fused, ms)
    if table.get("entries"):
        path = tuned_tiles.write_table(tuned_tiles.table_path(env.device, args.results_dir / "tuned"), table)
        print(f"SUITE-NOTE: tuned-tile table {path.name} written ({sum(len(b) for b in table['entries'].values())} "
              f"H buckets); commit it to kernels/tuned/")
    return best_tiles, best_rows, best_fused


def run(args: argparse.Namespace) -> None:
    device = torch.device("cpu" if args.cpu else "cuda")
    env = capture_env(device)
    print(f"lm-head part on {env.device}: git {env.git_sha or '?'}, torch {env.torch_version}, "
          f"triton {env.triton_version}")
    floor = measure_floor(env, device, args.dtype, args.gemm_sizes, args)
    variants = args.variants.split(",")
    if "liger_grpo_loss" in variants and importlib.util.find_spec("liger_kernel") is None:
        print("SUITE-NOTE: liger_grpo_loss skipped: liger-kernel is not installed (benchmarks/gpu/fetch_wheels.sh "
              "carries it to the GPU machine)")
        variants.remove("liger_grpo_loss")
    best_tiles, best_rows, best_fused = sweep_and_record(env, device, args, floor, variants)
    if "triton" in variants and not best_tiles:
        print("SUITE-NOTE: triton skipped in the sweep: no tile candidate ran")
        variants.remove("triton")
    for h in args.hidden:
        # Measured bests other than the defaults: the defaults are timed at every point too (before the sweep's row,
        # which the summary reads as the last row of its variant and point), so a change of default rests on the
        # whole sweep.
        extra = []
        tiles, default = best_tiles.get(h), fused_logprob.default_tiles(device, args.torch_dtype)
        if "triton" in variants and tiles not in (None, default):
            extra.append((["triton"], {"tiles": default}))
        rows_best, rows_default = best_rows.get(h), onepass_rows.default_row_tiles(device)
        if "onepass_cublas_triton" in variants and rows_best not in (None, rows_default):
            extra.append((["onepass_cublas_triton"], {"row_tiles": rows_default}))
        fused_best, fused_default = best_fused.get(h), onepass_fused.default_fused_tiles(device, args.torch_dtype)
        if "onepass_triton_fused" in variants and fused_best not in (None, fused_default):
            extra.append((["onepass_triton_fused"], {"fused_tiles": fused_default}))
        point_args = argparse.Namespace(**{**vars(args), "tiles": tiles, "row_tiles": rows_best,
                                           "fused_tiles": fused_best})
        for n in args.tokens:
            start = time.monotonic()
            try:
                rows = []
                for extra_variants, fields in extra:
                    rows += bench_fused_logprob.bench_point(env, extra_variants, n, h, args.vocab, args.torch_dtype,
                                                            device, argparse.Namespace(**{**vars(point_args),
                                                                                          **fields}))[0]
                rows += bench_fused_logprob.bench_point(env, variants, n, h, args.vocab, args.torch_dtype, device,
                                                        point_args)[0]
            except Exception as error:  # noqa: BLE001 - one failing point must not lose the others
                print(f"SUITE-NOTE: point N={n} H={h} failed: {type(error).__name__}: "
                      f"{(str(error).splitlines() or [''])[0][:160]}")
                continue
            append_rows(args.results_dir / "fused_logprob.csv", with_fraction_of_floor(rows, floor))
            print(f"point N={n} H={h}: {len(rows)} rows in {time.monotonic() - start:.1f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny CPU smoke (Triton under TRITON_INTERPRET=1)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    for name in ("gemm_sizes", "tokens", "hidden", "variants", "dtype"):
        parser.add_argument(f"--{name.replace('_', '-')}")
    for name in ("vocab", "tile_tokens", "iters", "warmup"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int)
    parser.add_argument("--workspace-mb", type=float, default=bench_fused_logprob.WORKSPACE_MB)
    parser.add_argument("--onepass-workspace-mb", type=float, help="the one-pass variants' workspace (default: the "
                        "engine's 1024 MiB on a GPU)")
    args = parser.parse_args(argv)
    for name, value in (CPU if args.cpu else GPU).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.gemm_sizes = [int(s) for s in str(args.gemm_sizes).split(",")]
    args.tokens = [int(s) for s in str(args.tokens).split(",")]
    args.hidden = [int(s) for s in str(args.hidden).split(",")]
    args.torch_dtype = bench_fused_logprob.DTYPES[args.dtype]
    run(args)


if __name__ == "__main__":
    main()
