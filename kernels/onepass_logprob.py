"""One-pass LM-head loss: each row chunk's logits are formed once, and the loss gradient is taken in the forward.

Where the loss's d loss / d log-prob and d loss / d entropy of a token depend on that token alone (once the batch's
normalisers are known), nothing needs the logits again after the forward. Per chunk of rows: z = X W^T into a
bounded float32 workspace (rows, V_local), the softmax state (kernels/softmax_stats.py; one all-gather of (4, rows)
over the TP group), log-prob and entropy, the caller's per-token gradients (`TokenGrads`), dz in place, then
dX = dz W and dW += dz^T X. Three GEMMs of 2NHV each: the model's 6NHV, none run twice (the two-pass path of
kernels/lm_head_logprob.py runs 8NHV: it recomputes the logits in the backward).

The autograd contract: `onepass_logprob_entropy` returns detached log-probs and entropies (the loss is evaluated on
them as usual) and a 0-dim `anchor` equal to zero; the caller adds the anchor to its loss. The anchor's backward
receives the scalar that scales the loss (micro-batch scale, Megatron's 1 / num_microbatches, a loss scaler) and
returns the saved float32 dX and dW times it, rounded once to the parameters' dtype.

Memory, besides `workspace_mb` (the logits chunk and its temporaries): a float32 (N, H) dX and a float32
(V_local, H) dW, held from the forward to the backward (the two-pass path holds its float32 dX only in the
backward, and its dW in the weight's dtype).

Implementations: "torch_chunked" (torch ops on the workspace: CPU, CI, and a cuBLAS baseline on CUDA),
"cublas_triton" (cuBLAS GEMMs; the row work in the two kernels of kernels/onepass_rows.py) and "triton_fused" (three
Triton GEMMs with the row work in their epilogues / prologues, kernels/onepass_fused.py: the logits stored once,
float32, dz never stored). "auto" = cublas_triton on CUDA, torch_chunked elsewhere. Deterministic: fixed chunk and loop order, no atomics.

Must not: import engine/, hold (N, V_local) logits, or know what the loss is.

Test: `pytest tests/kernels/test_onepass_logprob.py tests/kernels/test_onepass_tp.py`.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from kernels.chunked_logprob import _tile_logits, accumulation_dtype, dz_from_logp, matmul_acc
from kernels.lm_head_logprob import check_lm_head_inputs, resolve_kernel_implementation
from kernels.onepass_fused import (
    STATS_BYTES_PER_ELEMENT,
    FusedTiles,
    default_fused_tiles,
    fused_chunk_grads,
    fused_chunk_stats,
)
from kernels.onepass_rows import RowTiles, build_workspace_dz_launch, build_workspace_stats_launch, default_row_tiles
from kernels.softmax_stats import (
    VocabShard,
    all_reduce_hidden_grad,
    build_vocab_shard,
    empty_stats,
    finalize_stats,
    reduce_stats_over_tp,
)

OnePassImplementation = Literal["auto", "torch_chunked", "cublas_triton", "triton_fused"]
ONEPASS_IMPLEMENTATIONS = typing.get_args(OnePassImplementation)
TokenGrads = Callable[[int, int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
"""(r0, r1, logprobs[r0:r1], entropy[r0:r1]) -> (d loss / d logprobs, d loss / d entropy or None), each (r1 - r0,):
the loss's per-token derivatives for rows [r0, r1), in the log-probs' dtype, before any loss scaling."""
DW_COLUMN_BLOCK_BYTES = 64 * 2**20
"""dW accumulation runs over vocabulary blocks whose float32 (cols, H) product stays within this (bounded temp)."""


def workspace_bytes_per_element(implementation: str, dtype: torch.dtype, softcap: float | None) -> int:
    """Bytes per logit element of the chunk: the float32 workspace plus each implementation's temporaries."""
    acc = accumulation_dtype(dtype).itemsize
    cast = 0 if accumulation_dtype(dtype) == dtype else dtype.itemsize  # dz in the GEMM operands' dtype
    if implementation == "cublas_triton":
        return acc + cast
    if implementation == "triton_fused":
        return 4 + STATS_BYTES_PER_ELEMENT  # the float32 workspace; dz is never stored
    return acc * (2 + (softcap is not None)) + cast  # z, exp(z) (and the cap's derivative)


def plan_chunk_rows(num_rows: int, num_local: int, workspace_bytes: int, bytes_per_element: int) -> int:
    """Rows per chunk: as many as fit the workspace with all V_local columns, at least one. From V_local (the same
    on every TP rank), not the real columns, so that every rank runs the same chunks and collectives."""
    return max(min(num_rows, workspace_bytes // max(num_local * bytes_per_element, 1)), 1)


# ---------------------------------------------------------------------------------------------------------------
# Row work on one chunk's workspace
# ---------------------------------------------------------------------------------------------------------------


def _torch_chunk_stats(z: torch.Tensor, ids: torch.Tensor):
    """(4, rows) state of tempered logits z; z is left shifted by the row max (returned as the shift)."""
    is_hit = (ids >= 0) & (ids < z.shape[1])
    picked = z.gather(1, ids.clamp(0, z.shape[1] - 1)[:, None])[:, 0]
    target = torch.where(is_hit, picked, torch.zeros_like(picked))
    row_max = z.amax(1)
    z.sub_(row_max[:, None])
    e = torch.exp(z)
    sum_exp = e.sum(1)
    q = e.mul_(z).sum(1)
    return torch.stack([row_max, sum_exp, q, target]), row_max, e


def _torch_chunk_dz(z, shift, e, ids, lse, mean_logit, g_lp, g_ent, inv_temperature, softcap, out_dtype):
    """dz (rows, cols) in out_dtype from z = tempered logits - shift; z and e (a same-shape buffer) are consumed."""
    cap_grad = None
    if softcap is not None:  # 1 - tanh^2, tanh = (z + shift) / (cap / T)
        cap_grad = torch.add(z, shift[:, None]).mul_(1.0 / (softcap * inv_temperature)).square_().neg_().add_(1.0)
    z.sub_((lse - shift)[:, None])  # log p
    return dz_from_logp(z, e, ids, lse, mean_logit, g_lp, g_ent, inv_temperature, cap_grad, out_dtype)


def _add_dw(dw_acc: torch.Tensor, dz: torch.Tensor, x_rows: torch.Tensor, is_first: bool) -> None:
    """dw_acc (cols, H) += dz^T x_rows over vocabulary blocks (bounded float32 temporaries)."""
    cols, hidden_size = dz.shape[1], x_rows.shape[1]
    block = max(DW_COLUMN_BLOCK_BYTES // (hidden_size * dw_acc.element_size()), 1)
    for c0 in range(0, cols, block):
        part = matmul_acc(dz[:, c0:c0 + block].T, x_rows, dw_acc.dtype)
        if is_first:
            dw_acc[c0:c0 + block] = part
        else:
            dw_acc[c0:c0 + block] += part


def resolve_onepass_tiles(implementation: str, row_tiles: RowTiles | FusedTiles | None, device: torch.device,
                          dtype: torch.dtype, hidden_size: int) -> RowTiles | FusedTiles:
    """The tiles an implementation launches with: `row_tiles` when given, else its default for this device, dtype and
    H (the measured table's entry where one exists: `default_fused_tiles`, `default_row_tiles`)."""
    if row_tiles is not None:
        return row_tiles
    if implementation == "triton_fused":
        return default_fused_tiles(device, dtype, hidden_size)
    return default_row_tiles(device, dtype, hidden_size)


def onepass_chunks(hidden, weight, token_ids, shard: VocabShard, inv_temperature: float, softcap, tp_group,
                   workspace_bytes: int, implementation: str, row_tiles: RowTiles | FusedTiles | None,
                   token_grads: TokenGrads | None, needs_dx: bool, needs_dw: bool):
    """(logprobs, entropy, float32 dX or None, float32 dW (num_valid, H) or None), chunk by chunk; dX summed over
    the TP group. token_grads None (or no gradient needed) = statistics only."""
    num_rows = hidden.shape[0]
    acc_dtype = accumulation_dtype(hidden.dtype)
    device = hidden.device
    local_ids = token_ids - shard.vocab_start
    w_valid = weight[:shard.num_valid]
    wants_grad = token_grads is not None and (needs_dx or needs_dw)
    rows = plan_chunk_rows(num_rows, shard.num_local, workspace_bytes,
                           workspace_bytes_per_element(implementation, hidden.dtype, softcap))
    tiles = resolve_onepass_tiles(implementation, row_tiles, device, hidden.dtype, hidden.shape[1])
    logprobs = torch.empty(num_rows, dtype=acc_dtype, device=device)
    entropy = torch.empty(num_rows, dtype=acc_dtype, device=device)
    dx = torch.zeros(hidden.shape, dtype=acc_dtype, device=device) if wants_grad and needs_dx else None
    dw = torch.empty(w_valid.shape, dtype=acc_dtype, device=device) if wants_grad and needs_dw else None
    if dw is not None and num_rows == 0:
        dw.zero_()
    for r0 in range(0, num_rows, rows):
        r1 = min(r0 + rows, num_rows)
        x_rows, ids = hidden[r0:r1], local_ids[r0:r1]
        z = shift = e = None
        if shard.num_valid == 0:
            stats = empty_stats(r1 - r0, acc_dtype, device)
        elif implementation == "cublas_triton":
            z = matmul_acc(x_rows, w_valid.T, torch.float32)  # (rows, cols) raw logits
            launch, stats = build_workspace_stats_launch(z, ids, inv_temperature, softcap, tiles)
            launch.run()
        elif implementation == "triton_fused":
            z, stats = fused_chunk_stats(x_rows, w_valid, ids, inv_temperature, softcap, tiles)
        else:
            z = _tile_logits(x_rows, w_valid, inv_temperature, softcap, acc_dtype)  # (rows, cols)
            stats, shift, e = _torch_chunk_stats(z, ids)
        result = finalize_stats(reduce_stats_over_tp(stats, tp_group), token_ids[r0:r1], shard.vocab_size)
        logprobs[r0:r1], entropy[r0:r1] = result.logprobs, result.entropy
        if not wants_grad:
            continue
        with torch.enable_grad():  # autograd.Function.forward runs without it; the loss may use autograd
            g_lp, g_ent = token_grads(r0, r1, result.logprobs, result.entropy)
        g_lp = g_lp.detach().to(acc_dtype)
        g_ent = None if g_ent is None else g_ent.detach().to(acc_dtype)
        if z is None:
            continue
        if implementation == "triton_fused":  # dz inside the dX and dW GEMMs: never stored
            fused_chunk_grads(z, x_rows, w_valid, ids, result.lse, result.mean_logit, g_lp, g_ent, inv_temperature,
                              softcap, None if dx is None else dx[r0:r1], dw, r0 > 0, tiles)
            del z
            continue
        if implementation == "cublas_triton":
            dz = z if hidden.dtype == torch.float32 else torch.empty(z.shape, dtype=hidden.dtype, device=device)
            build_workspace_dz_launch(z, dz, ids, result.lse, result.mean_logit, g_lp, g_ent, inv_temperature,
                                      softcap, tiles).run()
        else:
            dz = _torch_chunk_dz(z, shift, e, ids, result.lse, result.mean_logit, g_lp, g_ent, inv_temperature,
                                 softcap, hidden.dtype)
        del z, e
        if dx is not None:
            dx[r0:r1] = matmul_acc(dz, w_valid, acc_dtype)
        if dw is not None:
            _add_dw(dw, dz, x_rows, is_first=r0 == 0)
        del dz
    if dx is not None:
        all_reduce_hidden_grad(dx, tp_group)  # NOTE: every rank reaches it, padding-only shards too
    return logprobs, entropy, dx, dw


# ---------------------------------------------------------------------------------------------------------------
# Autograd Function and entry
# ---------------------------------------------------------------------------------------------------------------


class OnePassFunction(torch.autograd.Function):
    """(hidden, weight) -> (logprobs, entropy, anchor); the gradients are formed in the forward, the backward
    scales them by the anchor's incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, token_ids, shard, temperature, softcap, tp_group, workspace_bytes,
                implementation, row_tiles, token_grads):
        needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        logprobs, entropy, dx, dw = onepass_chunks(
            hidden, weight, token_ids, shard, 1.0 / temperature, softcap, tp_group, workspace_bytes, implementation,
            row_tiles, token_grads, needs_dx, needs_dw)
        ctx.save_for_backward(*(t for t in (dx, dw) if t is not None))
        ctx.layout = (dx is not None, dw is not None, hidden.dtype, weight.shape, weight.dtype)
        anchor = torch.zeros((), dtype=logprobs.dtype, device=hidden.device)
        ctx.mark_non_differentiable(logprobs, entropy)
        return logprobs, entropy, anchor

    @staticmethod
    def backward(ctx, _grad_logprobs, _grad_entropy, grad_anchor):
        has_dx, has_dw, hidden_dtype, weight_shape, weight_dtype = ctx.layout
        saved = list(ctx.saved_tensors)
        dx = saved.pop(0) if has_dx else None
        dw_valid = saved.pop(0) if has_dw else None
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (dx * grad_anchor).to(hidden_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros(weight_shape, dtype=weight_dtype, device=grad_anchor.device)
            grad_w[:dw_valid.shape[0]] = dw_valid * grad_anchor
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None


def resolve_onepass_implementation(implementation: OnePassImplementation, device: torch.device) -> str:
    """"auto" -> "cublas_triton" on CUDA, "torch_chunked" elsewhere; other names are checked and returned."""
    return resolve_kernel_implementation(implementation, device, ONEPASS_IMPLEMENTATIONS, "cublas_triton",
                                         "one-pass implementation")


def onepass_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    token_grads: TokenGrads,
    *,
    workspace_mb: float,
    implementation: OnePassImplementation = "auto",
    temperature: float = 1.0,
    softcap: float | None = None,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    row_tiles: RowTiles | FusedTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of the sampled tokens (as `kernels.lm_head_logprob_entropy`), with the loss gradient
    taken in the same pass over the logits.

    Args:
        hidden: (N, H) last hidden states, the same on every rank of `tp_group`.
        weight: (V_local, H) this rank's LM-head shard.
        token_ids: (N,) int64 global ids of the sampled tokens.
        token_grads: the loss's per-token derivatives of each chunk (`TokenGrads`); it must be token-local (a
            token's derivatives may depend on its own log-prob and entropy and on fixed inputs, nothing else) and
            give the same values on every TP rank.
        workspace_mb: bound on the chunk's logits and temporaries, MiB (`workspace_bytes_per_element`).
        implementation: "auto", "torch_chunked", "cublas_triton" or "triton_fused".
        temperature, softcap, vocab_size, tp_group, vocab_start: as `kernels.lm_head_logprob_entropy`.
        row_tiles: block sizes of the cublas_triton row kernels (`RowTiles`; None = `default_row_tiles`) or of the
            triton_fused GEMMs (`FusedTiles`; None = `default_fused_tiles`).

    Returns:
        (logprobs (N,), entropy (N,), anchor ()): log-probs and entropies detached, float32 (float64 for float64
        inputs); the anchor is 0 and carries the gradient: add it to the loss whose per-token derivatives
        `token_grads` gave.
    """
    check_lm_head_inputs(hidden, weight, token_ids, temperature, softcap)
    implementation = resolve_onepass_implementation(implementation, hidden.device)
    if implementation in ("cublas_triton", "triton_fused") and hidden.dtype == torch.float64:
        raise TypeError(f"{implementation} takes float32 / bfloat16 / float16; float64 runs on torch_chunked")
    wanted = FusedTiles if implementation == "triton_fused" else RowTiles
    if row_tiles is not None and not isinstance(row_tiles, wanted):
        raise TypeError(f"row_tiles for {implementation} must be {wanted.__name__}; got {type(row_tiles).__name__}")
    shard = build_vocab_shard(weight.shape[0], vocab_size, tp_group, vocab_start)
    return OnePassFunction.apply(hidden, weight, token_ids, shard, float(temperature), softcap, tp_group,
                                 int(workspace_mb * 2**20), implementation, row_tiles, token_grads)
