"""Variable-length attention for packed rows on Megatron's local spec: each packed sequence attends causally to
itself only, at the cost of its own length squared, not the row's.

Owns: `packed_segments` (the sequences of a block-causal mask, as cumulative lengths over the flattened rows; None
when the mask is not one), `varlen_attention` (the attention over those sequences: torch's flash varlen kernel on a
GPU in bf16 / fp16, one SDPA call per sequence otherwise) and `flash_varlen_kwargs` (the causal / GQA keywords of
the installed torch's `torch.nn.attention.varlen.varlen_attn`, whose signature changed between releases).

Why: packed rows (engine/policy/packing.py, the `mask` layout) carry a (rows, 1, W, W) block-diagonal causal mask;
SDPA with a dense mask computes every (q, k) score of the row, (sum of lengths)^2, and cannot use the flash kernel.

Must not: change what is attended to. The sequences are read from the mask (a new one starts where a token may not
see the token before it) and checked against it: the mask rebuilt from them must equal the given one, else the caller
keeps the masked path. The check runs once per mask tensor (every layer of a micro-batch gets the same one).

Test: tests/distributed/test_varlen_attention.py (segments and refusal of other masks, the per-sequence path = the
masked SDPA, the flash keywords for both torch signatures, the GRPO step with packed rows = masked = padded).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PackedSegments:
    """The sequences of packed rows flattened row after row: sequence i is tokens cu[i] .. cu[i + 1] - 1."""

    cu_seqlens: torch.Tensor
    """(n + 1,) int32 on the mask's device."""
    lengths: tuple[int, ...]
    max_len: int


def _segments_of(mask: torch.Tensor) -> PackedSegments | None:
    rows, _, width, _ = mask.shape
    sub = torch.diagonal(mask[:, 0], offset=-1, dim1=1, dim2=2)  # (rows, W - 1): True = q may not see q - 1
    starts = torch.cat([torch.ones(rows, 1, dtype=torch.bool, device=mask.device), sub], dim=1)  # (rows, W)
    segment = torch.cumsum(starts.reshape(-1).long(), 0).reshape(rows, width)  # global segment ids, row-major
    causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril()
    rebuilt = ~((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]
    if not torch.equal(rebuilt, mask):
        return None
    flat = starts.reshape(-1).nonzero().flatten()
    bounds = torch.cat([flat, torch.tensor([rows * width], device=mask.device)])
    lengths = tuple((bounds[1:] - bounds[:-1]).tolist())
    return PackedSegments(bounds.to(torch.int32), lengths, max(lengths))


def packed_segments(mask: torch.Tensor) -> PackedSegments | None:
    """The sequences of a (rows, 1, W, W) boolean mask (True = masked) that is block-causal over contiguous runs of
    each row (engine/policy/packing.py block_causal_mask; padding is a run of its own), or None for any other mask.
    Cached per mask tensor."""
    if mask.dim() != 4 or mask.dtype != torch.bool or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        return None
    if not hasattr(mask, "_packed_segments"):  # kept on the tensor: it lives as long as the micro-batch's mask
        mask._packed_segments = _segments_of(mask)
    return mask._packed_segments


def flash_varlen_kwargs(parameters, num_heads: int, num_groups: int) -> tuple[dict, bool]:
    """(keywords for causal attention with grouped heads, whether key / value heads must be repeated first) for a
    `varlen_attn` with these parameter names: newer torch takes window_size=(-1, 0) and enable_gqa, older is_causal
    and equal head counts."""
    kwargs = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    grouped = num_heads != num_groups
    if grouped and "enable_gqa" in parameters:
        return kwargs | {"enable_gqa": True}, False
    return kwargs, grouped


def _flash_varlen(q, k, v, segments: PackedSegments, scale: float | None):
    from torch.nn.attention.varlen import varlen_attn

    kwargs, repeat = flash_varlen_kwargs(inspect.signature(varlen_attn).parameters, q.shape[1], k.shape[1])
    if repeat:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    cu = segments.cu_seqlens
    return varlen_attn(q, k, v, cu, cu, segments.max_len, segments.max_len, scale=scale, **kwargs)


def _per_sequence(q, k, v, segments: PackedSegments, scale: float | None, dropout: float):
    outs, start = [], 0
    for length in segments.lengths:
        part = [t[start:start + length].transpose(0, 1)[None] for t in (q, k, v)]  # (1, heads, L, hn)
        outs.append(F.scaled_dot_product_attention(*part, dropout_p=dropout, is_causal=True, scale=scale,
                                                   enable_gqa=k.shape[1] != q.shape[1])[0].transpose(0, 1))
        start += length
    return torch.cat(outs, dim=0)


def uses_flash(q: torch.Tensor, dropout: float) -> bool:
    """Whether `varlen_attention` takes torch's flash varlen kernel: CUDA, bf16 / fp16, no dropout, torch has it."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or dropout:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: PackedSegments,
                     scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention within each sequence of `segments`. q (T, heads, hn), k / v (T, groups, hn) with T the rows'
    tokens flattened row after row; returns (T, heads, hn)."""
    if uses_flash(q, dropout):
        return _flash_varlen(q, k, v, segments, scale)
    return _per_sequence(q, k, v, segments, scale, dropout)
