"""Compile-only check of every Triton kernel in kernels/ for sm_90 and sm_80, at the launches a GPU run makes.

Owns: building each kernel's launch as its launcher would on a GPU (`lm_head_launches`, `onepass_launches`,
`fused_onepass_launches`, `token_terms_launches`: the launchers' own `build_*_launch` on "meta" tensors), compiling
it to a cubin without a GPU (`_specialise`, `compile_launch`: how, and what fails; `_compile_all`: as many at once
as the CPUs allow), the launch points (`LAUNCH_POINTS`, `LAUNCH_WORKSPACES_MB`: the GPU suite's sweep and the GPU
tests' shape) and the report (`CompileReport`, `format_table`).

Must not: run under TRITON_INTERPRET=1 (triton.jit then returns interpreted functions, which have no compiler IR):
`check_kernels` raises; the test runs it in a subprocess without that variable. It relies on Triton internals that
`JITFunction.run` uses (`JITFunction._pack_args`, `triton.runtime.jit.create_function_from_signature`; checked on
Triton 3.9, the version CI installs; the GPU machine's 3.6 is not checked).

    python -m kernels.compile_check                  # the table, sm_90 and sm_80; exit status 1 on a failure
    python -m kernels.compile_check --arch 90 --json # one JSON object per compiled kernel

Test: `pytest tests/kernels/test_compile_check.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from kernels.chunked_logprob import plan_tiles
from kernels.fused_logprob import (
    SUPPORTED_DTYPES,
    KernelLaunch,
    TritonTiles,
    build_dz_launch,
    build_stats_launch,
    default_tiles,
)
from kernels.grpo_token_terms import TokenTermParams, build_token_terms_launch
from kernels.onepass_fused import build_fused_grad_launches, build_fused_stats_launch, default_fused_tiles
from kernels.onepass_logprob import plan_chunk_rows, workspace_bytes_per_element
from kernels.onepass_rows import build_workspace_dz_launch, build_workspace_stats_launch, default_row_tiles

ARCHS = (90, 80)
SHARED_MEMORY_LIMIT_BYTES = {90: 227 * 1024, 80: 163 * 1024}
"""Per-block dynamic shared memory (opt-in maximum): H100 227 KiB, A100 163 KiB."""
MAX_SPILL_BYTES = 0
"""Spill stores + loads allowed per kernel at the default tiles."""
NUM_SMS = {90: 132, 80: 108}
"""H100 SXM and A100 SXM: the forward's vocabulary split count depends on it."""
LAUNCH_POINTS = (
    *((n, h, 151936) for n in (2048, 8192, 16384) for h in (1536, 4096)),
    (64, 48, 300),
)
"""(N, H, V) of the GPU suite's sweep (benchmarks/gpu/lm_head.py `GPU`: N in 2048, 8192, 16384; H in 1536, 4096;
V = 151936) and the GPU tests' shape (tests/kernels/test_fused_logprob.py: N=64, H=48, V=300), checked in every dtype
the launchers accept, with the default tiles (`default_tiles`), at `LAUNCH_WORKSPACES_MB`.

NOTE: meta tensors have data_ptr 0, so every pointer is taken as 16-byte aligned; a real slab of an odd-H problem may
not be (Triton then compiles a less vectorised variant that this check does not see)."""
LAUNCH_WORKSPACES_MB = (128.0, 1024.0)
"""`workspace_mb` of the recorded benchmark runs (128) and the engine's `kernels.loss_workspace_mb` default (1024;
tests/kernels/test_compile_check.py checks that the engine's default is here): the backward's slab shapes follow."""
SOFTCAPS = (None, 30.0)
"""Final-logit soft-caps compiled: off, and Gemma 2's 30 (any value compiles the same HAS_SOFTCAP variant)."""
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class CompileReport:
    """One compiled kernel specialisation on one target."""

    kernel: str
    arch: int
    dtype: str
    variant: str
    """Constexprs and launch options, e.g. BLOCK_N=64 BLOCK_V=128 ... num_warps=8 num_stages=3."""
    points: str
    """The (N, H, V) launch points that share this specialisation."""
    registers: int | None
    spill_stores: int | None
    spill_loads: int | None
    shared_bytes: int | None
    shared_limit_bytes: int
    compile_s: float
    error: str | None
    """The compile error, or why the result is out of bounds; None = ok."""


def lm_head_launches(num_rows: int, hidden_size: int, vocab: int, dtype: torch.dtype, arch: int,
                     tiles: TritonTiles | None = None) -> list[KernelLaunch]:
    """The launches of one forward + backward of the fused log-prob at (N, H, V) on a GPU: the statistics kernel,
    and the dz kernel with and without the entropy gradient on the backward's first and last slab; the statistics
    kernel and the dz kernel with the entropy gradient (its most registers) also with the final-logit soft-cap
    (`SOFTCAPS`: the HAS_SOFTCAP variants)."""
    tiles = default_tiles(torch.device("cuda"), dtype) if tiles is None else tiles

    def meta(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt, device="meta")

    hidden, weight = meta(num_rows, hidden_size), meta(vocab, hidden_size)
    ids, per_row = meta(num_rows, dt=torch.int64), meta(num_rows, dt=torch.float32)
    launches, slabs = [], set()
    for workspace_bytes in (int(mb * 2**20) for mb in LAUNCH_WORKSPACES_MB):
        for softcap in SOFTCAPS:
            stats, _ = build_stats_launch(hidden, weight, ids, 1.0, workspace_bytes, tiles, NUM_SMS[arch], True,
                                          softcap)
            launches.append(stats)
        plan = plan_tiles(num_rows, vocab, workspace_bytes, dtype.itemsize)
        slabs |= {(plan.rows, plan.cols), (num_rows - (num_rows - 1) // plan.rows * plan.rows,
                                           vocab - (vocab - 1) // plan.cols * plan.cols)}
    for rows, cols in sorted(slabs):
        for grad_entropy, softcap in [(per_row[:rows], cap) for cap in SOFTCAPS] + [(None, None)]:
            launch, _ = build_dz_launch(hidden[:rows], weight[:cols], ids[:rows], per_row[:rows], per_row[:rows],
                                        per_row[:rows], grad_entropy, 1.0, tiles, True, softcap)
            launches.append(launch)
    return launches


def onepass_launches(num_rows: int, hidden_size: int, vocab: int, dtype: torch.dtype) -> list[KernelLaunch]:
    """The one-pass path's row kernels (kernels/onepass_rows.py) on the first and last row chunk of (N, H, V) at
    each workspace: the statistics kernel with and without the soft-cap; the dz kernel writing dz in `dtype` (in
    place for float32), with and without the entropy gradient and the soft-cap. Default row tiles (no table)."""
    tiles = default_row_tiles(torch.device("cuda"))
    chunks = set()
    for workspace_mb in LAUNCH_WORKSPACES_MB:
        for softcap in SOFTCAPS:
            per_element = workspace_bytes_per_element("cublas_triton", dtype, softcap)
            rows = plan_chunk_rows(num_rows, vocab, int(workspace_mb * 2**20), per_element)
            chunks |= {rows, num_rows - (num_rows - 1) // rows * rows}
    launches = []
    for rows in sorted(chunks):
        z = torch.empty(rows, vocab, dtype=torch.float32, device="meta")
        dz = z if dtype == torch.float32 else torch.empty(rows, vocab, dtype=dtype, device="meta")
        ids = torch.empty(rows, dtype=torch.int64, device="meta")
        per_row = torch.empty(rows, dtype=torch.float32, device="meta")
        for softcap in SOFTCAPS:
            launches.append(build_workspace_stats_launch(z, ids, 1.0, softcap, tiles)[0])
            for grad_entropy in (None, per_row):
                launches.append(build_workspace_dz_launch(z, dz, ids, per_row, per_row, per_row, grad_entropy, 1.0,
                                                          softcap, tiles))
    return launches


def fused_onepass_launches(num_rows: int, hidden_size: int, vocab: int, dtype: torch.dtype,
                           arch: int) -> list[KernelLaunch]:
    """The triton_fused one-pass GEMMs (kernels/onepass_fused.py) on the first and last row chunk of (N, H, V) at each
    workspace: the forward with and without the soft-cap; dX and dW (first chunk, and accumulating) with and without
    the entropy gradient and the soft-cap. Default tiles."""
    tiles = default_fused_tiles(torch.device("cuda"), dtype)
    per_element = workspace_bytes_per_element("triton_fused", dtype, None)
    chunks = set()
    for workspace_mb in LAUNCH_WORKSPACES_MB:
        rows = plan_chunk_rows(num_rows, vocab, int(workspace_mb * 2**20), per_element)
        chunks |= {rows, num_rows - (num_rows - 1) // rows * rows}
    weight = torch.empty(vocab, hidden_size, dtype=dtype, device="meta")
    dw = torch.empty(vocab, hidden_size, dtype=torch.float32, device="meta")
    launches = []
    for rows in sorted(chunks):
        x = torch.empty(rows, hidden_size, dtype=dtype, device="meta")
        z = torch.empty(rows, vocab, dtype=torch.float32, device="meta")
        dx = torch.empty(rows, hidden_size, dtype=torch.float32, device="meta")
        ids = torch.empty(rows, dtype=torch.int64, device="meta")
        per_row = torch.empty(rows, dtype=torch.float32, device="meta")
        for softcap in SOFTCAPS:
            launches.append(build_fused_stats_launch(x, weight, ids, z, 1.0, softcap, tiles, NUM_SMS[arch], True)[0])
            for grad_entropy, accumulate in ((None, False), (per_row, True)):
                launches += build_fused_grad_launches(z, x, weight, ids, per_row, per_row, per_row, grad_entropy, 1.0,
                                                      softcap, dx, dw, accumulate, tiles, True)
    return launches


def token_terms_launches(num_rows: int) -> list[KernelLaunch]:
    """The GRPO per-token terms kernel on (B, T) = (N / 512, 512) float32 log-probs, one launch per surrogate, the
    optional inputs switched on in different mixes (token / sequence level, KL estimators, per-row / per-token IS)."""
    batch, seq_len = max(num_rows // 512, 1), 512

    def meta(*shape, dt=torch.float32):
        return torch.empty(*shape, dtype=dt, device="meta")

    tokens, rows = meta(batch, seq_len), meta(batch, 1)
    variants = [
        (TokenTermParams(surrogate="clipped", delta=4.0, beta=0.04), dict(is_ratio=tokens, off=None)),
        (TokenTermParams(surrogate="clipped", is_sequence_level=True, beta=0.04, kl_estimator="k2",
                         use_bias_correction_kl=True), dict(is_ratio=rows, off=rows)),
        (TokenTermParams(surrogate="cispo", epsilon_high=5.0), dict(is_ratio=tokens, off=None)),
        (TokenTermParams(surrogate="sapo", beta=0.01, kl_estimator="k1"), dict(is_ratio=None, off=rows)),
        (TokenTermParams(surrogate="vespo", is_sequence_level=True), dict(is_ratio=None, off=None)),
    ]
    launches = []
    for params, extra in variants:
        launch, _ = build_token_terms_launch(
            tokens, None if params.is_sequence_level else tokens, rows if params.is_sequence_level else None,
            rows, tokens if params.beta else None, extra["off"],
            meta(batch, seq_len, dt=torch.bool) if params.surrogate == "clipped" else None, extra["is_ratio"],
            rows if params.surrogate == "vespo" else None, params)
        launches.append(launch)
    return launches


LAYER_POINTS = ((8192, 1536, 8960, 12, 2, 128), (8192, 3584, 18944, 28, 4, 128))
"""(tokens, hidden, ffn, query heads, key / value heads, head_dim) of Qwen2.5-1.5B and -7B at 8192 tokens per
micro-batch: the fused layer kernels' launches (`layer_launches`)."""


def layer_launches(point: tuple, dtypes=(torch.bfloat16, torch.float32)) -> list[KernelLaunch]:
    """The fused layer kernels (kernels/rms_norm.py, glu.py, rope.py) forward and backward at `point`
    (`LAYER_POINTS`), bfloat16 and float32: the hidden-size norm and the q/k (head_dim) norm, SwiGLU and GeGLU, RoPE
    on queries and keys, full, partial (half the head) and interleaved, in each of `dtypes`."""
    from kernels.glu import ACTIVATIONS, build_glu_bwd_launch, build_glu_fwd_launch
    from kernels.rms_norm import build_rms_norm_bwd_launch, build_rms_norm_fwd_launch
    from kernels.rope import build_rope_launch

    tokens, hidden, ffn, heads, groups, head_dim = point
    launches = []
    for dtype in dtypes:
        def meta(*shape, dt=dtype):
            return torch.empty(*shape, dtype=dt, device="meta")

        for rows, width, offset in ((tokens, hidden, 0.0), (tokens * heads, head_dim, 1.0)):
            fwd, _, rstd = build_rms_norm_fwd_launch(meta(rows, width), meta(width), 1e-6, offset)
            bwd, _, _ = build_rms_norm_bwd_launch(meta(rows, width), meta(rows, width), meta(width), rstd, offset)
            launches += [fwd, bwd]
        for activation in ACTIVATIONS:
            launches += [build_glu_fwd_launch(meta(tokens, 2 * ffn), activation)[0],
                         build_glu_bwd_launch(meta(tokens, ffn), meta(tokens, 2 * ffn), activation)[0]]
        for n_heads in (heads, groups):
            for rot_dim, interleaved in ((head_dim, False), (head_dim // 2, False), (head_dim, True)):
                cos = meta(tokens, 1, rot_dim)
                launches += [build_rope_launch(meta(tokens, 1, n_heads, head_dim), cos, cos, interleaved, backward)[0]
                             for backward in (False, True)]
    return launches


def _specialise(launch: KernelLaunch, arch: int) -> tuple[triton.compiler.ASTSource, dict, str]:
    """(ASTSource, compile options, cache key) of a launch, as `JITFunction.run` builds them.

    The launch carries the GPU run's dtypes, shapes, strides, block sizes, num_warps, num_stages and integer
    specialisation; launches whose specialisation is the same (signature, divisibility attributes, constexprs,
    options: the cache key) are compiled once.
    """
    fn = launch.kernel
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.options)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.options, bound_args, specialization,
                                                          options)
    key = repr((fn.__name__, arch, signature, attrs, sorted(constexprs.items()), sorted(options.__dict__.items())))
    return triton.compiler.ASTSource(fn, signature, constexprs, attrs), options.__dict__, key


@contextlib.contextmanager
def _fresh_compiler() -> Iterator[str]:
    """A throw-away Triton cache, recompilation forced, ptxas -v logged to stdout; restored afterwards."""
    saved = (knobs.cache.dir, knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log)
    with tempfile.TemporaryDirectory(prefix="triton-compile-check-") as cache_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        knobs.cache.dir, knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = cache_dir, True, True
        try:
            yield cache_dir
        finally:
            knobs.cache.dir, knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved


def _variant(launch: KernelLaunch) -> str:
    return " ".join(f"{k}={v}" for k, v in launch.options.items() if k not in ("INPUT_PRECISION",))


def compile_launch(launch: KernelLaunch, arch: int, source: tuple | None = None) -> CompileReport:
    """Compile one launch for sm_<arch> and check it (shared memory, spills); errors are reported, not raised.

    `triton.compile(..., target=GPUTarget("cuda", arch, 32))` down to a cubin (ptxas ships in the triton wheel, no GPU
    or driver is needed), in a fresh temporary cache (`_fresh_compiler`: nothing is cached across runs). It reports
    registers and spill bytes (ptxas -v, captured through `knobs.nvidia.dump_ptxas_log`) and the shared memory the
    launch needs (`metadata.shared`), and fails on:
    - a compile error (Triton front end, LLVM or ptxas);
    - shared memory over the per-block limit (`SHARED_MEMORY_LIMIT_BYTES`: sm_90 227 KiB, sm_80 163 KiB dynamic);
    - any spill (`MAX_SPILL_BYTES` = 0 at the chosen tiles: the kernels' defaults were picked so that nothing spills).
    """
    src, options, _ = source or _specialise(launch, arch)
    limit = SHARED_MEMORY_LIMIT_BYTES[arch]
    dtype = str(launch.args[launch.report_arg].dtype).removeprefix("torch.")
    common = dict(kernel=launch.kernel.__name__, arch=arch, dtype=dtype, variant=_variant(launch), points="",
                  shared_limit_bytes=limit)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as error:  # noqa: BLE001 - any compile failure is the finding
        return CompileReport(**common, registers=None, spill_stores=None, spill_loads=None, shared_bytes=None,
                             compile_s=time.perf_counter() - start, error=f"{type(error).__name__}: {error}"[:2000])
    elapsed = time.perf_counter() - start
    registers = _PTXAS_REGISTERS.search(log.getvalue())
    spills = _PTXAS_SPILLS.search(log.getvalue())
    stores, loads = (int(spills.group(1)), int(spills.group(2))) if spills else (None, None)
    shared = int(compiled.metadata.shared)
    problems = []
    if registers is None or spills is None:
        problems.append(f"no ptxas -v figures in the log: {log.getvalue()[-500:]!r}")
    elif stores + loads > MAX_SPILL_BYTES:
        problems.append(f"spills {stores} B stores + {loads} B loads > {MAX_SPILL_BYTES} B")
    if shared > limit:
        problems.append(f"shared memory {shared} B > the sm_{arch} per-block limit {limit} B")
    return CompileReport(**common, registers=int(registers.group(1)) if registers else None, spill_stores=stores,
                         spill_loads=loads, shared_bytes=shared, compile_s=elapsed,
                         error="; ".join(problems) or None)


def check_kernels(archs=ARCHS, dtypes=SUPPORTED_DTYPES, points=LAUNCH_POINTS, tiles: TritonTiles | None = None,
                  kernels: tuple[str, ...] | None = None, jobs: int = 1) -> list[CompileReport]:
    """Compile every distinct launch of every kernel at `points` for each arch and dtype.

    Args:
        archs: CUDA compute capabilities x10 (90 = H100, 80 = A100).
        dtypes: input dtypes of the LM-head problem.
        points: (N, H, V) launch points.
        tiles: block sizes for every LM-head launch; None = the launchers' defaults.
        kernels: kernel names to compile; None = all.
        jobs: compilations run at once (forked processes).

    Returns:
        One `CompileReport` per distinct specialisation (its `points` lists the points that share it).
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("kernels.compile_check compiles for a GPU target: run it without TRITON_INTERPRET=1")
    distinct = []
    for arch in archs:
        compiled: set[str] = set()  # the one-pass statistics kernel reads float32 whatever the dtype: once
        for dtype in dtypes:
            launches = {p: lm_head_launches(*p, dtype, arch, tiles) + onepass_launches(*p, dtype)
                        + fused_onepass_launches(*p, dtype, arch) for p in points}
            distinct += _distinct(arch, launches, kernels, compiled)
        distinct += _distinct(arch, {p: token_terms_launches(p[0]) for p in points}, kernels, compiled)
        distinct += _distinct(arch, {p: layer_launches(p, dtypes) for p in LAYER_POINTS}, kernels, compiled)
    with _fresh_compiler():
        return _compile_all(distinct, jobs)


def _distinct(arch: int, launches: dict[tuple, list[KernelLaunch]], kernels: tuple[str, ...] | None,
              compiled: set[str]) -> list[tuple[int, KernelLaunch, tuple, str]]:
    """(arch, launch, specialisation, points) of each distinct specialisation among the launches of every point,
    but those already in `compiled` (which receives the new ones)."""
    distinct: dict[str, tuple] = {}
    for point, point_launches in launches.items():
        for launch in point_launches:
            if kernels is not None and launch.kernel.__name__ not in kernels:
                continue
            source = _specialise(launch, arch)
            if source[2] in compiled:
                continue
            distinct.setdefault(source[2], (launch, source, []))[2].append(point)
    compiled.update(distinct)
    return [(arch, launch, source, ",".join("x".join(map(str, p)) for p in dict.fromkeys(points)))
            for launch, source, points in distinct.values()]


_pending: list[tuple[int, KernelLaunch, tuple, str]] = []
"""The compilations `_compile_all` hands to its forked workers (inherited, not pickled: kernels do not pickle)."""


def _compile_pending(index: int) -> CompileReport:
    arch, launch, source, points = _pending[index]
    return CompileReport(**{**asdict(compile_launch(launch, arch, source)), "points": points})


def _compile_all(items: list[tuple[int, KernelLaunch, tuple, str]], jobs: int) -> list[CompileReport]:
    """Compile each item, `jobs` at a time in forked processes (each compilation is independent and single-threaded
    on the CPU: front end, LLVM, ptxas), reports in the order of `items`."""
    _pending[:] = items
    try:
        if jobs <= 1 or len(items) <= 1:
            return [_compile_pending(i) for i in range(len(items))]
        with multiprocessing.get_context("fork").Pool(min(jobs, len(items))) as pool:
            return pool.map(_compile_pending, range(len(items)), chunksize=1)
    finally:
        _pending.clear()


def format_table(reports: list[CompileReport]) -> str:
    """A fixed-width table, one line per report."""
    header = f"{'kernel':<24} {'sm':>3} {'dtype':<9} {'regs':>4} {'spill st/ld B':>13} {'smem KiB':>9} " \
             f"{'limit':>5} {'s':>5}  variant @ N x H x V points | result"
    lines = [header, "-" * len(header)]
    for r in reports:
        spill = "-" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        shared = "-" if r.shared_bytes is None else f"{r.shared_bytes / 1024:.0f}"
        lines.append(f"{r.kernel:<24} {r.arch:>3} {r.dtype:<9} {r.registers or '-':>4} {spill:>13} {shared:>9} "
                     f"{r.shared_limit_bytes // 1024:>5} {r.compile_s:>5.1f}  {r.variant} @ {r.points} | "
                     f"{r.error or 'ok'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default=",".join(map(str, ARCHS)), help="compute capabilities x10, e.g. 90,80")
    parser.add_argument("--dtype", default=",".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
    parser.add_argument("--tiles", help="block_n,block_v,block_h,num_warps,num_stages for every launch "
                        "(default: the launchers' own choice)")
    parser.add_argument("--kernels", help="comma-separated kernel names (default: all)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of the table")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="compilations at once (default: the CPUs this process may use)")
    args = parser.parse_args(argv)
    tiles = None
    if args.tiles:
        block_n, block_v, block_h, num_warps, num_stages = (int(v) for v in args.tiles.split(","))
        tiles = TritonTiles(block_n=block_n, block_v=block_v, block_h=block_h, num_warps=num_warps,
                            num_stages=num_stages)
    archs = tuple(int(a) for a in args.arch.split(","))
    dtypes = tuple(getattr(torch, d) for d in args.dtype.split(","))
    kernels = tuple(args.kernels.split(",")) if args.kernels else None
    reports = check_kernels(archs, dtypes, tiles=tiles, kernels=kernels, jobs=args.jobs)
    print("\n".join(json.dumps(asdict(r)) for r in reports) if args.json else format_table(reports))
    failed = [r for r in reports if r.error]
    if failed and not args.json:
        print(f"\n{len(failed)} of {len(reports)} kernel compilations failed the check", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
