"""Variable-length attention for packed rows on Megatron's local spec: each packed sequence attends causally to
itself only, at the cost of its own length squared, not the row's.

Owns: the packed-sequences carrier (`is_packed_sequences`, `packed_segments`: a (n + 1,) int32 tensor of cumulative
lengths over the flattened rows, built by engine/policy/packing.py from its plan and passed where Megatron passes the
attention mask), `varlen_attention` (the attention over those sequences: torch's flash varlen kernel on a GPU in
bf16 / fp16, one SDPA call per sequence otherwise) and `flash_varlen_kwargs` (the causal / GQA keywords of the
installed torch's `torch.nn.attention.varlen.varlen_attn`, whose signature changed between releases).

Why: the `mask` layout's (rows, 1, W, W) block-diagonal causal mask takes W^2 bytes per row on the host and the
device (1 GiB at W = 32768), and SDPA with a dense mask computes every (q, k) score of the row, (sum of lengths)^2,
and cannot use the flash kernel. The `varlen` layout builds no mask: the sequences come from the packing plan.

Why a tensor: Megatron hands `attention_mask` to core attention through its activation checkpointing
(`tensor_parallel.checkpoint` saves every argument with `save_for_backward`, tensors only); nothing between the model
call and core attention reads it otherwise on the local spec (rotary embeddings, MoE routers and the LM head do not).
A 1-D int32 tensor cannot be mistaken for a mask (always 4-D bool there).

Must not: change what is attended to; padding is a sequence of its own (its outputs are never read).

Test: tests/distributed/test_varlen_attention.py (the carrier of a packed micro-batch, the per-sequence path = the
masked SDPA, the flash keywords for both torch signatures, the GRPO step with packed rows = masked = padded, which
models take the carrier), tests/unit/test_packing.py (no W x W mask in a varlen micro-batch).
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
    """(n + 1,) int32 on the carrier's device."""
    lengths: tuple[int, ...]
    max_len: int


def is_packed_sequences(attention_mask) -> bool:
    """Whether Megatron's `attention_mask` argument is the packed-sequences carrier (1-D int32), not a mask."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1 and attention_mask.dtype == torch.int32


def packed_sequences(row_lengths: list[list[int]], width: int) -> torch.Tensor:
    """The carrier of rows of `width` tokens holding sequences of `row_lengths` each (in row order), (n + 1,) int32:
    each row's sequences, then the row's tail padding as a sequence of its own."""
    bounds = [0]
    for lengths in row_lengths:
        start = bounds[-1]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        if bounds[-1] < start + width:
            bounds.append(start + width)
    return torch.tensor(bounds, dtype=torch.int32)


def packed_segments(carrier: torch.Tensor, device: torch.device | None = None) -> PackedSegments:
    """The sequences of a carrier (`packed_sequences`) with cu_seqlens on `device` (None: the carrier's), their
    lengths read once per carrier tensor (every layer of a micro-batch gets the same one)."""
    if not hasattr(carrier, "_packed_lengths"):  # kept on the tensor: it lives as long as the micro-batch
        carrier._packed_lengths = tuple((carrier[1:] - carrier[:-1]).tolist())  # one host read (a sync on a GPU)
    lengths = carrier._packed_lengths
    return PackedSegments(carrier if device is None else carrier.to(device), lengths, max(lengths))


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
