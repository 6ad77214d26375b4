"""The LM-head log-prob's tile primitives in Triton: the logits tiles live in registers only, never in memory.

Owns two kernels and their launchers (`build_stats_launch`, `build_dz_launch`; kernels/compile_check.py compiles
exactly these launches): `_stats_fwd_kernel`, the GEMM tile z = x W^T / T (fp32 accumulator) with the online-softmax
epilogue, each program writing its (4, BLOCK_N) partial state (m, s, q, t) to a (num_splits, 4, N) float32 buffer
merged in split order (no atomics: two passes are bitwise equal); and `_dz_kernel`, the backward's recomputed
dz = [g_lp 1{v=y} - p (g_lp + g_H (z - E[z]))] / T written once in X's dtype into a (rows, cols) slab, whose two
GEMMs run in cuBLAS in the loop shared with the torch path (kernels/lm_head_logprob.py `backward_tiles`). Dtypes:
bf16 / fp16 (tensor cores) and fp32 (IEEE dot, no TF32); int64 offsets (N * V can exceed 2^31); columns past the
shard's real rows are -inf in the forward and never stored in the backward.

Must not: import engine/, hold a (N, V_local) tensor, or run on CPU tensors without TRITON_INTERPRET=1 (set before
triton is imported; tests/conftest.py does it without CUDA). NOTE: triton 3.9's interpreter computes `tl.dot` of
bf16 operands wrongly (garbage ~1e10), so under the interpreter the operands are upcast to float32 before the dot.

Test: `pytest tests/kernels/test_fused_logprob.py` (interpreter on CPU, or real on a GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.softmax_stats import NUM_STATS, merge_stats

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PROGRAMS_PER_SM = 2
"""Forward: enough vocabulary splits that the grid holds about this many programs per SM."""
MERGE_TEMPS = 3
"""The partial-state merge holds about this many (num_splits, N) float32 temporaries per state row."""


@dataclass(frozen=True)
class TritonTiles:
    """Block sizes and launch settings of both kernels. The defaults are the bf16 / fp16 tiles on CUDA (64 x 128 x 64,
    8 warps, 3 stages), chosen by register use (no spills on sm_90 and sm_80). On one H100 80GB (bf16,
    V = 151936) the GPU suite timed them against the other tile choices: at N x H = 8192 x 4096 these took 91.6 ms
    and the fastest, 128 x 256 x 64, 77.6 ms, which spills ~1 KB per thread on sm_90, so the default stays until a
    tile table is measured per device (kernels/tuned/, empty so far). Rows: benchmarks/results/fused_logprob.csv;
    figures: docs/performance.md.

    NOTE (registers, `python -m kernels.compile_check`, Triton 3.9, ptxas -v): the previous default 128 x 128 x 64
    put `_stats_fwd_kernel` at the 255-register cap with spills on sm_90 (8 B stores / 8 B loads in bf16; in fp32
    ~11 KB stores / 25 KB loads on sm_90 and sm_80). The cause is the online-softmax epilogue: a (BLOCK_N, BLOCK_V)
    fp32 logits tile over 256 threads is 64 registers per thread per live copy, and the epilogue keeps the logits,
    the masked exponentials and their product with (z - m) live together, on top of the accumulator's operands.
    Halving BLOCK_N halves every copy: 64 x 128 x 64 uses 188 (sm_90) / 180 (sm_80) registers in bf16, no spills,
    72 / 48 KiB of shared memory. fp32 (IEEE dot, no tensor cores) needs a shorter K step too: `FP32_TILES`."""

    block_n: int = 64
    """Rows (tokens) per program tile."""
    block_v: int = 128
    """Vocabulary columns per tile."""
    block_h: int = 64
    """K step over the hidden size."""
    group_n: int = 8
    """Row blocks that sweep the vocabulary together (L2 reuse of W)."""
    num_warps: int = 8
    num_stages: int = 3
    split_cols: int | None = None
    """Forward: vocabulary columns per program (rounded up to block_v); None = enough splits to fill the GPU."""


FP32_TILES = TritonTiles(block_h=32)
"""float32 on CUDA: 64 x 128 x 32, 8 warps, 3 stages: no spills on sm_90 and sm_80 under Triton 3.9 (CI's) and 3.6
(the lent GPU machine's): at most 202 registers, except 255 for the forward on sm_80 under 3.9. The earlier
64 x 128 x 16 spilled 16 B in the backward on sm_90 under 3.6 (128 registers, found by the GPU suite on an H200);
128 x 128 x 64 spills kilobytes under both. Not timed on a GPU (fp32 is not TRL's default)."""
INTERPRETER_TILES = TritonTiles(block_n=32, block_v=64, block_h=32, group_n=2, num_warps=4, num_stages=1)
"""Under the interpreter: fewer, larger numpy steps; still several tiles on test shapes."""


def default_tiles(device: torch.device, dtype: torch.dtype, hidden_size: int | None = None) -> TritonTiles:
    """On CUDA the measured tiles of this device, dtype and H (kernels/tuned_tiles.py) where a table has them, else
    the register-safe `FP32_TILES` for float32, `TritonTiles()` otherwise; `INTERPRETER_TILES` on the CPU."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    if hidden_size is not None:
        from kernels.tuned_tiles import device_lookup

        tuned = device_lookup("lm_head", device, dtype, hidden_size)
        if tuned is not None:
            return tuned
    return FP32_TILES if dtype == torch.float32 else TritonTiles()


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch as the launcher builds it: what runs on the GPU, and what kernels/compile_check.py compiles."""

    kernel: triton.runtime.JITFunction
    grid: tuple[int, ...]
    args: tuple
    """Positional arguments (tensors, ints, floats), in the kernel's order."""
    options: dict[str, object]
    """Constexprs by name, plus num_warps / num_stages."""
    report_arg: int = 0
    """The positional argument whose dtype names this launch in kernels/compile_check.py's reports."""

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.options)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _grouped_tile(pid, num_row_blocks, num_col_blocks, GROUP_N: tl.constexpr):
    """(row block, column block) of program `pid`: GROUP_N row blocks visit each column block consecutively."""
    programs_per_group = GROUP_N * num_col_blocks
    group = pid // programs_per_group
    first_row_block = group * GROUP_N
    group_rows = tl.minimum(num_row_blocks - first_row_block, GROUP_N)
    in_group = pid % programs_per_group
    return first_row_block + in_group % group_rows, in_group // group_rows


@triton.jit
def _tanh(y):
    """tanh in float32 from one exp: 1 - 2 / (e^(2y) + 1) (+-1 at overflow / underflow, never NaN)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)


@triton.jit
def _logits_tile(x_ptr, w_ptr, rows, cols, num_rows, num_cols, hidden_size, stride_x, stride_w, inv_temperature,
                 softcap, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_FP32: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """(BLOCK_N, BLOCK_V) float32 tile of x W^T / T, or of cap tanh(x W^T / cap) / T under HAS_SOFTCAP (the cap
    before the temperature, as HF and vLLM); rows/cols are int64 indices (out of range rows/cols read 0)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    x_row_ptrs = x_ptr + rows[:, None] * stride_x
    w_row_ptrs = w_ptr + cols[:, None] * stride_w
    for k0 in range(0, hidden_size, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < hidden_size
        x = tl.load(x_row_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_row_ptrs + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)
    if HAS_SOFTCAP:
        acc = _tanh(acc * (1.0 / softcap)) * softcap
    return acc * inv_temperature


@triton.jit
def _fold_tile(z, cols, col_mask, ids, m, s, q, t):
    """One vocabulary tile z (rows, cols) folded into the rows' running state: max m, sum-exp s relative to m, q =
    sum e^(z - m) (z - m) (for the entropy), t the target's logit; masked columns (padding, tile tail) add nothing."""
    t += tl.sum(tl.where(col_mask & (cols[None, :] == ids[:, None]), z, 0.0), axis=1)
    m_new = tl.maximum(m, tl.max(tl.where(col_mask, z, float("-inf")), axis=1))
    alpha = tl.exp(m - m_new)
    shifted = tl.where(col_mask, z - m_new[:, None], 0.0)
    e = tl.where(col_mask, tl.exp(shifted), 0.0)
    q = alpha * (q + (m - m_new) * s) + tl.sum(e * shifted, axis=1)
    s = alpha * s + tl.sum(e, axis=1)
    return m_new, s, q, t


@triton.jit
def _dz_tile(z, rows, cols, row_mask, ids_ptr, lse_ptr, mean_ptr, grad_lp_ptr, grad_ent_ptr, inv_temperature,
             softcap, HAS_ENTROPY_GRAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """dz of a tile of tempered (capped) logits z: [g_lp 1{col = id} - p (g_lp + g_H (z - E[z]))] / T, times the
    cap's derivative 1 - tanh^2 = 1 - (z T / cap)^2 under HAS_SOFTCAP (tanh(x w / cap) from the tempered logit);
    float32, not masked (the caller masks its store)."""
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    grad_lp = tl.load(grad_lp_ptr + rows, mask=row_mask, other=0.0)
    ids = tl.load(ids_ptr + rows, mask=row_mask, other=-1)
    probs = tl.exp(z - lse[:, None])
    coef = grad_lp[:, None] + tl.zeros(z.shape, dtype=tl.float32)
    if HAS_ENTROPY_GRAD:
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        grad_ent = tl.load(grad_ent_ptr + rows, mask=row_mask, other=0.0)
        coef += grad_ent[:, None] * (z - mean[:, None])
    dz = tl.where(cols[None, :] == ids[:, None], grad_lp[:, None], 0.0) - probs * coef
    if HAS_SOFTCAP:
        tanh = z * (1.0 / (softcap * inv_temperature))
        dz = dz * (inv_temperature * (1.0 - tanh * tanh))
    else:
        dz = dz * inv_temperature
    return dz


@triton.jit
def _stats_fwd_kernel(x_ptr, w_ptr, ids_ptr, parts_ptr, num_rows, num_cols, hidden_size, split_cols, num_splits,
                      stride_x, stride_w, inv_temperature, softcap, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                      BLOCK_H: tl.constexpr, GROUP_N: tl.constexpr, DOT_FP32: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Partial state (m, s, q, t) of BLOCK_N rows over one vocabulary split -> parts[split, :, rows]."""
    pid = tl.program_id(0).to(tl.int64)
    row_block, split = _grouped_tile(pid, tl.cdiv(num_rows, BLOCK_N), num_splits, GROUP_N)
    rows = row_block * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_mask = rows < num_rows
    ids = tl.load(ids_ptr + rows, mask=row_mask, other=-1)  # local ids; outside [0, num_cols) never hit
    # NOTE: a finite start for m keeps alpha = 0 and (m - m_new) * s = 0 on the first tile (no -inf * 0).
    m = tl.full((BLOCK_N,), -1.0e30, dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    q = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    col_start = split * split_cols
    col_end = tl.minimum(col_start + split_cols, num_cols)
    for c0 in range(col_start, col_end, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_mask = (cols < col_end)[None, :]
        z = _logits_tile(x_ptr, w_ptr, rows, cols, num_rows, num_cols, hidden_size, stride_x, stride_w,
                         inv_temperature, softcap, BLOCK_N, BLOCK_V, BLOCK_H, DOT_FP32, INPUT_PRECISION, HAS_SOFTCAP)
        m, s, q, t = _fold_tile(z, cols, col_mask, ids, m, s, q, t)
    out = parts_ptr + split * 4 * num_rows + rows
    tl.store(out, m, mask=row_mask)
    tl.store(out + num_rows, s, mask=row_mask)
    tl.store(out + 2 * num_rows, q, mask=row_mask)
    tl.store(out + 3 * num_rows, t, mask=row_mask)


@triton.jit
def _dz_kernel(x_ptr, w_ptr, ids_ptr, lse_ptr, mean_ptr, grad_lp_ptr, grad_ent_ptr, dz_ptr, num_rows, num_cols,
               hidden_size, stride_x, stride_w, stride_dz, inv_temperature, softcap, HAS_ENTROPY_GRAD: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, GROUP_N: tl.constexpr,
               DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """dz[rows, cols] = [g_lp 1{col = id} - p (g_lp + g_H (z - E[z]))] / T for one (BLOCK_N, BLOCK_V) tile, times
    the cap's derivative 1 - tanh^2 = 1 - (z T / cap)^2 under HAS_SOFTCAP."""
    pid = tl.program_id(0).to(tl.int64)
    row_block, col_block = _grouped_tile(pid, tl.cdiv(num_rows, BLOCK_N), tl.cdiv(num_cols, BLOCK_V), GROUP_N)
    rows = row_block * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    cols = col_block * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    row_mask = rows < num_rows
    z = _logits_tile(x_ptr, w_ptr, rows, cols, num_rows, num_cols, hidden_size, stride_x, stride_w,
                     inv_temperature, softcap, BLOCK_N, BLOCK_V, BLOCK_H, DOT_FP32, INPUT_PRECISION, HAS_SOFTCAP)
    dz = _dz_tile(z, rows, cols, row_mask, ids_ptr, lse_ptr, mean_ptr, grad_lp_ptr, grad_ent_ptr, inv_temperature,
                  softcap, HAS_ENTROPY_GRAD, HAS_SOFTCAP)
    mask = row_mask[:, None] & (cols < num_cols)[None, :]
    tl.store(dz_ptr + rows[:, None] * stride_dz + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


def check_triton_operands(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """Device, dtype and layout the kernels need."""
    if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton path needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
                           "imported); use implementation='torch_chunked' on the CPU")
    if hidden.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the Triton path supports {SUPPORTED_DTYPES}, got {hidden.dtype}; float64 runs on "
                        f"implementation='torch_chunked'")
    if hidden.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"hidden and weight need a contiguous last dim; strides {hidden.stride()}, "
                         f"{weight.stride()}")


def _dot_settings(dtype: torch.dtype, is_gpu: bool) -> dict[str, object]:
    """DOT_FP32 (interpreter workaround, see module docstring) and the fp32 dot precision."""
    dot_fp32 = not is_gpu
    precision = "ieee" if (dot_fp32 or dtype == torch.float32) else "tf32"
    return dict(DOT_FP32=dot_fp32, INPUT_PRECISION=precision)


def _softcap_arg(softcap: float | None) -> float:
    """The kernels' `softcap` argument: the cap, or 1.0 (unread: HAS_SOFTCAP is off) for None."""
    return 1.0 if softcap is None else float(softcap)


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _num_splits(num_rows: int, num_cols: int, tiles: TritonTiles, num_sms: int, workspace_bytes: int) -> int:
    """Vocabulary splits of the forward grid: fill the GPU, within the workspace, at least one tile each."""
    max_splits = triton.cdiv(num_cols, tiles.block_v)
    if tiles.split_cols is not None:
        return triton.cdiv(num_cols, triton.cdiv(tiles.split_cols, tiles.block_v) * tiles.block_v)
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, triton.cdiv(num_rows, tiles.block_n))
    affordable = max(workspace_bytes // (NUM_STATS * 4 * MERGE_TEMPS * max(num_rows, 1)), 1)
    return max(min(wanted, affordable, max_splits), 1)


def build_stats_launch(hidden: torch.Tensor, weight_valid: torch.Tensor, local_ids: torch.Tensor,
                       inv_temperature: float, workspace_bytes: int, tiles: TritonTiles, num_sms: int,
                       is_gpu: bool, softcap: float | None = None) -> tuple[KernelLaunch, torch.Tensor]:
    """The forward statistics launch and its (num_splits, 4, N) float32 output buffer (tensors may be on "meta":
    kernels/compile_check.py compiles exactly this launch for a GPU target). softcap None = no capping (the
    HAS_SOFTCAP constexpr off: the kernel has no tanh)."""
    num_rows, hidden_size = hidden.shape
    num_cols = weight_valid.shape[0]
    num_splits = _num_splits(num_rows, num_cols, tiles, num_sms, workspace_bytes)
    split_cols = triton.cdiv(triton.cdiv(num_cols, num_splits), tiles.block_v) * tiles.block_v
    num_splits = triton.cdiv(num_cols, split_cols)
    parts = torch.empty(num_splits, NUM_STATS, num_rows, dtype=torch.float32, device=hidden.device)  # (K, 4, N)
    launch = KernelLaunch(
        kernel=_stats_fwd_kernel,
        grid=(triton.cdiv(num_rows, tiles.block_n) * num_splits,),
        args=(hidden, weight_valid, local_ids.contiguous(), parts, num_rows, num_cols, hidden_size, split_cols,
              num_splits, hidden.stride(0), weight_valid.stride(0), inv_temperature, _softcap_arg(softcap)),
        options=dict(BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, GROUP_N=tiles.group_n,
                     num_warps=tiles.num_warps, num_stages=tiles.num_stages, HAS_SOFTCAP=softcap is not None,
                     **_dot_settings(hidden.dtype, is_gpu)),
    )
    return launch, parts


def triton_local_stats(hidden: torch.Tensor, weight_valid: torch.Tensor, local_ids: torch.Tensor,
                       inv_temperature: float, workspace_bytes: int, softcap: float | None = None,
                       tiles: TritonTiles | None = None) -> torch.Tensor:
    """(4, N) float32 softmax state of this shard's real rows (fused GEMM + online softmax, fixed-order merge).

    Args:
        hidden: (N, H) CUDA (or interpreter) tensor, float32/bfloat16/float16, contiguous last dim.
        weight_valid: (num_valid, H) the shard's real rows, same dtype.
        local_ids: (N,) int64 ids relative to the shard's first row.
        inv_temperature: 1 / T.
        workspace_bytes: bound on the partial-state buffer and its merge.
        softcap: final-logit soft-capping cap (logits -> cap tanh(logits / cap) before the temperature); None = off.
        tiles: block sizes; None = `default_tiles`.
    """
    check_triton_operands(hidden, weight_valid)
    tiles = default_tiles(hidden.device, hidden.dtype, hidden.shape[1]) if tiles is None else tiles
    launch, parts = build_stats_launch(hidden, weight_valid, local_ids, inv_temperature, workspace_bytes, tiles,
                                       _num_sms(hidden.device), hidden.is_cuda, softcap)
    launch.run()
    return merge_stats(parts)


def triton_tile_dz(x_rows: torch.Tensor, w_cols: torch.Tensor, tile_ids: torch.Tensor, lse: torch.Tensor,
                   mean_logit: torch.Tensor, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None,
                   inv_temperature: float, softcap: float | None = None,
                   tiles: TritonTiles | None = None) -> torch.Tensor:
    """d loss / d (x w^T) of one (rows, cols) slab, written once in x's dtype.

    Args:
        x_rows: (rows, H) hidden rows of the slab.
        w_cols: (cols, H) real LM-head rows of the slab.
        tile_ids: (rows,) int64 token ids relative to the slab's first column.
        lse, mean_logit: (rows,) float32 from the forward.
        grad_logprobs: (rows,) float32 d loss / d logprobs.
        grad_entropy: (rows,) float32 d loss / d entropy, or None (entropy unused: its term is skipped).
        inv_temperature: 1 / T.
        softcap: final-logit soft-capping cap; None = off.
        tiles: block sizes; None = `default_tiles`.

    Returns:
        (rows, cols) dz in x's dtype.
    """
    check_triton_operands(x_rows, w_cols)
    tiles = default_tiles(x_rows.device, x_rows.dtype, x_rows.shape[1]) if tiles is None else tiles
    launch, dz = build_dz_launch(x_rows, w_cols, tile_ids, lse, mean_logit, grad_logprobs, grad_entropy,
                                 inv_temperature, tiles, x_rows.is_cuda, softcap)
    launch.run()
    return dz


def build_dz_launch(x_rows: torch.Tensor, w_cols: torch.Tensor, tile_ids: torch.Tensor, lse: torch.Tensor,
                    mean_logit: torch.Tensor, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None,
                    inv_temperature: float, tiles: TritonTiles, is_gpu: bool,
                    softcap: float | None = None) -> tuple[KernelLaunch, torch.Tensor]:
    """The backward dz launch and its (rows, cols) output slab in x's dtype (tensors may be on "meta")."""
    num_rows, hidden_size = x_rows.shape
    num_cols = w_cols.shape[0]
    dz = torch.empty(num_rows, num_cols, dtype=x_rows.dtype, device=x_rows.device)  # (rows, cols)
    launch = KernelLaunch(
        kernel=_dz_kernel,
        grid=(triton.cdiv(num_rows, tiles.block_n) * triton.cdiv(num_cols, tiles.block_v),),
        args=(x_rows, w_cols, tile_ids.contiguous(), lse.contiguous(), mean_logit.contiguous(),
              grad_logprobs.contiguous(), lse if grad_entropy is None else grad_entropy.contiguous(), dz,
              num_rows, num_cols, hidden_size, x_rows.stride(0), w_cols.stride(0), dz.stride(0), inv_temperature,
              _softcap_arg(softcap)),
        options=dict(HAS_ENTROPY_GRAD=grad_entropy is not None, HAS_SOFTCAP=softcap is not None, BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v,
                     BLOCK_H=tiles.block_h, GROUP_N=tiles.group_n, num_warps=tiles.num_warps,
                     num_stages=tiles.num_stages, **_dot_settings(x_rows.dtype, is_gpu)),
    )
    return launch, dz
