"""LM-head log-prob + entropy benchmark: the fused kernels against the materialised-logits reference.

Measures, per token count N (x_name "N") and per variant, rows in `benchmarks/results/fused_logprob.csv`:
- variants: `reference` (kernels/reference.py: logits materialised, autograd), `torch_chunked`
  (kernels/chunked_logprob.py), `triton` (kernels/fused_logprob.py, GPU only), the one-pass loss
  (kernels/onepass_logprob.py, full mode only) `onepass_torch_chunked` and `onepass_cublas_triton` (cuBLAS GEMMs with
  the Triton row kernels; GPU or the interpreter), and on a GPU `liger_grpo_loss`
  (Liger-Kernel's `LigerFusedLinearGRPOLoss`, beta = 0, DAPO, 1024-token sequences) where liger-kernel imports;
  otherwise the run prints a note "liger_grpo_loss skipped: <reason>" and writes no Liger rows. Liger computes a
  whole loss (no entropy) and its gradients inside its forward, so only its `full` mode is comparable;
- modes: `forward` (under torch.no_grad: the old / reference log-prob pass), `backward` (autograd.grad of
  sum(g_lp * logprobs) + sum(g_H * entropy) on a prepared graph), `full` (both);
- metrics: `time` (ms, p20/p50/p80), `throughput` (TFLOP/s of model FLOPs: 2NHV forward, 4NHV backward, 6NHV
  full; the fused kernels' recompute (+2NHV) is not counted, so every variant is charged the same work), and
  `peak_memory` (MiB over what was allocated before the call: harness.peak_memory_fn);
then redraws `benchmarks/results/plots/fused_logprob_*.png`.

    python -m benchmarks.bench_fused_logprob                 # CPU (default without CUDA): N=4096, H=512, V=32000 fp32
    python -m benchmarks.bench_fused_logprob --gpu           # N in {2K, 8K, 16K} x H in {1536, 4096}, V=151936 bf16
    python -m benchmarks.bench_fused_logprob --gpu --tokens 8192 --hidden 4096 --iters 20 --overwrite

CPU acceptance: the chunked path's peak memory at N=4096, H=512, V=32000 (float32) is at most 1/8 of the
reference's, per mode; the run prints both and their ratio. On the CPU only memory and ratios between variants of
one run are meaningful (docs/contributing/house-rules.md, Benchmarks); the Triton interpreter is not benchmarked.

Measured (rows in benchmarks/results/fused_logprob.csv; 2-core Xeon dev machine; N=4096, H=512, V=32000, float32,
workspace 128 MiB): the chunked path's extra peak memory 86 MiB vs 1999 MiB for the reference in the forward (1/23),
157 vs 2501 MiB for forward + backward (1/16), 156 vs 1500 MiB for the backward alone (1/9.6; dW itself is 62.5 MiB
of that). Beyond the tiles the chunked path holds O(N) statistics; for bf16/fp16 inputs a float32 (N, H) dX
accumulator and one float32 (rows, H) slab product; a float32 (cols, H) dW accumulator when rows are split.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness import RESULTS_DIR, EnvInfo, Row, append_rows, capture_env, make_row, peak_memory_fn, time_fn
from kernels import TritonTiles, build_lm_head_problem, lm_head_logprob_entropy, triton_logprob_entropy

BENCH = "fused_logprob"
WORKSPACE_MB = 128.0
"""--workspace-mb of the recorded rows (a 16K-row x 4K-column bf16 dz slab); the engine runs with
kernels.loss_workspace_mb (engine/config.py)."""
ENGINE_WORKSPACE_MB = 1024
"""The engine's `kernels.loss_workspace_mb` default: the one-pass variants run at it (their row chunks need it)."""
MIB = 2**20
CPU_DEFAULTS = dict(tokens="4096", hidden="512", vocab=32000, dtype="float32", iters=3, warmup=1,
                    variants="reference,torch_chunked")
GPU_DEFAULTS = dict(tokens="2048,8192,16384", hidden="1536,4096", vocab=151936, dtype="bfloat16", iters=10, warmup=3,
                    variants="reference,torch_chunked,triton,liger_grpo_loss")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLOPS_PER_NHV = {"forward": 2, "backward": 4, "full": 6}
LIGER_SEQUENCE_LENGTH = 1024


def _kernel_modes(variant: str, inputs: tuple, workspace_mb: float,
                  tiles: TritonTiles | None = None) -> dict[str, Callable[[], Callable]]:
    """Per mode, a set-up function returning the zero-argument call to measure (for one of our implementations).

    Set-up runs outside the measured region and its state lives only as long as the returned call: the backward's
    graph (for the reference: the saved logits) is built by its set-up and freed after its mode. `tiles` (Triton
    block sizes; None = the kernel's defaults) applies to the `triton` variant only.
    """
    x, w, y, g_lp, g_ent = inputs

    def run(xr, wr):
        if variant == "triton" and tiles is not None:
            return triton_logprob_entropy(xr, wr, y, workspace_mb=workspace_mb, tiles=tiles)
        return lm_head_logprob_entropy(xr, wr, y, workspace_mb=workspace_mb, implementation=variant)

    def forward():
        with torch.no_grad():
            return run(x, w)

    def full():
        xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        return torch.autograd.grad(run(xr, wr), (xr, wr), (g_lp, g_ent))

    def setup_backward():
        xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        outputs = run(xr, wr)
        return lambda: torch.autograd.grad(outputs, (xr, wr), (g_lp, g_ent), retain_graph=True)

    return {"forward": lambda: forward, "backward": setup_backward, "full": lambda: full}


ONEPASS_VARIANTS = {"onepass_torch_chunked": "torch_chunked", "onepass_cublas_triton": "cublas_triton",
                    "onepass_triton_fused": "triton_fused"}
"""Benchmark variant -> kernels/onepass_logprob.py implementation (full mode only: the gradient is formed in the
forward, the backward only scales it)."""


def _onepass_modes(variant: str, inputs: tuple, workspace_mb: float, row_tiles=None) -> dict[str, Callable]:
    """The one-pass LM-head loss with fixed per-token derivatives (g_lp, g_ent), full mode only."""
    from kernels.onepass_logprob import onepass_logprob_entropy

    x, w, y, g_lp, g_ent = inputs

    def grads(r0, r1, _lp, _ent):
        return g_lp[r0:r1], g_ent[r0:r1]

    def full():
        xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        _, _, anchor = onepass_logprob_entropy(xr, wr, y, grads, workspace_mb=workspace_mb,
                                               implementation=ONEPASS_VARIANTS[variant], row_tiles=row_tiles)
        return torch.autograd.grad(anchor, (xr, wr))

    return {"full": lambda: full}


def _liger_modes(inputs: tuple) -> dict[str, Callable[[], Callable]]:
    """Liger's fused-linear GRPO loss, full mode only (it computes its gradients inside its forward)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    x, w, y, _, _ = inputs
    num_seqs = x.shape[0] // LIGER_SEQUENCE_LENGTH
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo")
    mask = torch.ones(num_seqs, LIGER_SEQUENCE_LENGTH, device=x.device)  # (B, T)
    advantages = torch.randn(num_seqs, device=x.device)  # (B,)

    def full():
        xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        loss, _ = loss_fn(xr.view(num_seqs, LIGER_SEQUENCE_LENGTH, -1), wr, y.view(num_seqs, -1), mask, advantages)
        return torch.autograd.grad(loss, (xr, wr))

    full()  # an API mismatch with the installed version surfaces here, as a skip note
    return {"full": lambda: full}


def tiles_label(tiles: TritonTiles) -> str:
    """Block sizes as a row label, e.g. "n128_v128_h64_g8_w8_s3" (block_n, block_v, block_h, group_n, warps, stages)."""
    label = (f"n{tiles.block_n}_v{tiles.block_v}_h{tiles.block_h}_g{tiles.group_n}_w{tiles.num_warps}"
             f"_s{tiles.num_stages}")
    return label if tiles.split_cols is None else f"{label}_split{tiles.split_cols}"


def row_tiles_label(tiles) -> str:
    """One-pass row-kernel block sizes as a label, e.g. "s4x1024_d8x512_w4"."""
    return f"s{tiles.stats_rows}x{tiles.stats_cols}_d{tiles.dz_rows}x{tiles.dz_cols}_w{tiles.num_warps}"


def fused_tiles_label(tiles) -> str:
    """One-pass fused-GEMM block sizes as a label, e.g. "m64_v64_h64_g8_w8_s3" (`FusedTiles`)."""
    return (f"m{tiles.block_m}_v{tiles.block_v}_h{tiles.block_h}_g{tiles.group_m}_w{tiles.num_warps}"
            f"_s{tiles.num_stages}")


def _rows_for(env: EnvInfo, variant: str, mode: str, n: int, flop: float, timing, memory, config: dict) -> list[Row]:
    """time / throughput / peak_memory rows of one (variant, mode, N)."""
    key = dict(bench=BENCH, variant=variant, mode=mode, x_name="N", x_value=n, config=config)
    tflop = flop / 1e12
    peak = memory.extra_bytes / MIB
    return [
        make_row(env, **key, metric="time", unit="ms", p20=timing.p20_ms, p50=timing.p50_ms, p80=timing.p80_ms,
                 n_iters=timing.n_iters),
        make_row(env, **key, metric="throughput", unit="TFLOP/s", p20=tflop / (timing.p80_ms * 1e-3),
                 p50=tflop / (timing.p50_ms * 1e-3), p80=tflop / (timing.p20_ms * 1e-3), n_iters=timing.n_iters),
        make_row(env, **key, metric="peak_memory", unit="MiB", p20=peak, p50=peak, p80=peak, n_iters=1),
    ]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_point(env: EnvInfo, variants: list[str], n: int, h: int, v: int, dtype: torch.dtype,
                device: torch.device, args: argparse.Namespace) -> tuple[list[Row], dict]:
    """Every variant and mode at one (N, H, V); returns the rows and {(variant, mode): peak MiB} for the summary."""
    x, w, y = build_lm_head_problem(n, h, v, dtype=dtype, device=device, logit_std=3.0, seed=n + h)
    gen = torch.Generator(device="cpu").manual_seed(1)
    g_lp, g_ent = (torch.randn(n, generator=gen).to(device) for _ in range(2))
    inputs = (x, w, y, g_lp, g_ent)
    config = {"H": h, "V": v, "dtype": str(dtype).removeprefix("torch."), "workspace_mb": args.workspace_mb}
    tiles = getattr(args, "tiles", None)  # TritonTiles for the triton variant (the GPU suite's best); None = defaults
    if tiles is not None:
        config["tiles"] = tiles_label(tiles)
    if getattr(args, "row_tiles", None) is not None:
        config["row_tiles"] = row_tiles_label(args.row_tiles)
    if getattr(args, "fused_tiles", None) is not None:
        config["fused_tiles"] = fused_tiles_label(args.fused_tiles)
    if device.type == "cpu":
        config["torch_threads"] = torch.get_num_threads()
    rows, peaks = [], {}
    for variant in variants:
        try:
            if variant == "liger_grpo_loss":
                modes = _liger_modes(inputs)
            elif variant in ONEPASS_VARIANTS:
                # the cublas_triton row kernels' tiles, the triton_fused GEMMs' tiles
                row_tiles = {"onepass_cublas_triton": getattr(args, "row_tiles", None),
                             "onepass_triton_fused": getattr(args, "fused_tiles", None)}.get(variant)
                modes = _onepass_modes(variant, inputs, getattr(args, "onepass_workspace_mb", args.workspace_mb),
                                       row_tiles)
            else:
                modes = _kernel_modes(variant, inputs, args.workspace_mb, tiles)
        except (ImportError, TypeError, RuntimeError) as err:
            print(f"note: {variant} skipped: {type(err).__name__}: {err}")
            continue
        for mode, setup in modes.items():
            try:
                call = setup()
                timing = time_fn(call, device=device, warmup=args.warmup, n_iters=args.iters)
                memory = peak_memory_fn(call, device=device)
            except torch.cuda.OutOfMemoryError:
                print(f"note: {variant}/{mode} at N={n}, H={h}: out of memory, no rows")
                continue
            finally:
                call = None
                _free(device)
            rows += _rows_for(env, variant, mode, n, FLOPS_PER_NHV[mode] * n * h * v, timing, memory, config)
            peaks[(variant, mode)] = memory.extra_bytes / MIB
            print(f"{variant:>16} {mode:>8} N={n:<6} H={h:<5} p50 {timing.p50_ms:10.2f} ms  "
                  f"{rows[-2].p50:8.3f} TFLOP/s  peak {peaks[(variant, mode)]:9.1f} MiB")
        del modes
        _free(device)
    return rows, peaks


def _print_memory_ratios(peaks: dict, n: int, h: int) -> None:
    """torch_chunked / reference peak memory per mode (the issue's CPU acceptance: <= 1/8)."""
    for mode in FLOPS_PER_NHV:
        ref, chunked = peaks.get(("reference", mode)), peaks.get(("torch_chunked", mode))
        if ref and chunked is not None:
            verdict = "ok" if chunked <= ref / 8 else "ABOVE 1/8"
            print(f"memory N={n} H={h} {mode}: torch_chunked {chunked:.1f} MiB / reference {ref:.1f} MiB = "
                  f"{chunked / ref:.4f} (1/{ref / max(chunked, 1e-9):.1f}) {verdict}")


def main(argv: list[str] | None = None) -> None:
    """Command line: measure the sweep, append the rows, print the memory ratios, redraw the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="GPU sweep (default when CUDA is available)")
    parser.add_argument("--cpu", action="store_true", help="CPU measurement (default without CUDA)")
    parser.add_argument("--tokens", help="comma-separated N; default depends on the mode")
    parser.add_argument("--hidden", help="comma-separated H; default depends on the mode")
    parser.add_argument("--vocab", type=int, help="V rows of the LM head")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--variants", help="comma-separated subset of the variants")
    parser.add_argument("--iters", type=int, help="timed calls per (variant, mode)")
    parser.add_argument("--warmup", type=int, help="untimed calls before timing")
    parser.add_argument("--workspace-mb", type=float, default=WORKSPACE_MB, help="fused paths' workspace")
    parser.add_argument("--overwrite", action="store_true", help="replace rows with the same key")
    parser.add_argument("--csv", type=Path, default=RESULTS_DIR / f"{BENCH}.csv", help="results file")
    args = parser.parse_args(argv)
    use_gpu = args.gpu or (torch.cuda.is_available() and not args.cpu)
    defaults = GPU_DEFAULTS if use_gpu else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = torch.device("cuda" if use_gpu else "cpu")
    variants = args.variants.split(",")
    env = capture_env(device)
    print(f"{BENCH} on {env.device}: variants {variants}, V={args.vocab}, {args.dtype}, git {env.git_sha or '?'}")
    rows = []
    for h in (int(s) for s in args.hidden.split(",")):
        for n in (int(s) for s in args.tokens.split(",")):
            point_rows, peaks = bench_point(env, variants, n, h, args.vocab, DTYPES[args.dtype], device, args)
            rows += point_rows
            _print_memory_ratios(peaks, n, h)
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
