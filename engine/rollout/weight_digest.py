"""Exact weight digests: what the weight-sync verification compares (engine/rollout/sync_check.py `check_digests`).

Owns: the digest of a box of a tensor (what one engine rank holds of one Hugging Face tensor: `box_digest`, the
definition and what it catches: there), its position weights (`position_weights`) and the whole-tensor digest
(`tensor_digest`). Integer arithmetic only, on the tensor's own device (int64 multiplies and sums wrap mod 2**64 on
CPU and CUDA), in chunks of `CHUNK_ELEMENTS` (a bounded int64 temporary; no host copy).

Must not: know any layout (the callers pass boxes), import vLLM or Megatron (it runs on both sides).

Test: tests/unit/test_weight_digest.py (one flipped bit of any element, -0.0 vs 0.0, pieces sum to the whole,
non-contiguous views, bf16/fp16/fp32).
"""

from __future__ import annotations

import math

import torch

CHUNK_ELEMENTS = 1 << 22
"""Elements per int64 temporary (32 MiB)."""

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 torch holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_SALT = 0x5851F42D4C957F2D >> 8  # keeps the coordinates of different dimensions apart


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def position_weights(coords: torch.Tensor, dim: int) -> torch.Tensor:
    """w_dim(c): odd pseudo-random int64 weights of int64 coordinates along box dimension `dim` (splitmix64's
    finaliser of (c + dim salt) * golden, low bit set)."""
    z = (coords + (dim + 1) * _SALT) * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return (z ^ _shift_right(z, 31)) | 1


def box_digest(values: torch.Tensor, start: tuple[int, ...] | None = None,
               box_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The digest of `values` placed at `start` inside a box of `box_shape` (default: the whole box is `values`).

    The digest is the sum, mod 2**64, over the elements of `bits(x) * w(k)`: `bits` the element's bit pattern read as
    a signed integer of its size (bfloat16 and float16 as int16, float32 as int32; never a float value, so -0.0, NaN
    payloads and denormals count as what they are), `w(k)` the product of an odd 64-bit mix of each of its
    coordinates k in the box: an element at (c0, c1, ...) weighs w_0(c0) * w_1(c1) * ... (`position_weights`; odd: a
    product of odd numbers), so the work per element is one int64 conversion, one multiply and a sum (the weights
    are per row and per column). So:
    - one changed element (any bit of any element) always changes the digest: the change of `bits` is a nonzero
      integer below 2**32 and odd `w(k)` is invertible mod 2**64;
    - a moved element (rows swapped, a layout off by one) changes it too, up to a 2**-64-scale coincidence (the
      weights of two positions differ pseudo-randomly);
    - the digest of a box is the sum of the digests of any pieces it is cut into, each computed where it lives
      (`box_digest(piece, start, box_shape)`): the trainer's senders digest what they send, slice by slice, and the
      sums meet the engine's digests of its parameters.

    Args:
        values: any dtype, any strides, on any device; (d0, d1, ...) with the box's number of dimensions.
        start: where `values` begins in the box, per dimension.
        box_shape: the box's shape (only checked: the weights depend on the coordinates alone).
    Returns:
        an int64 scalar tensor on `values`' device (sum the pieces' digests for the box's).
    """
    values = values.reshape(1) if values.dim() == 0 else values
    start = (0,) * values.dim() if start is None else tuple(start)
    if box_shape is not None and (len(box_shape) != values.dim() or any(
            s + n > b for s, n, b in zip(start, values.shape, box_shape))):
        raise ValueError(f"box_digest: values {tuple(values.shape)} at {start} do not fit the box {tuple(box_shape)}")
    device = values.device
    bits = values.view(_INT_OF_SIZE[values.element_size()])
    inner = torch.ones((), dtype=torch.int64, device=device)  # (1, d1, d2, ...): the weights of dims 1..
    for d in range(1, values.dim()):
        shape = [1] * values.dim()
        shape[d] = values.shape[d]
        inner = inner * position_weights(start[d] + torch.arange(values.shape[d], device=device), d).view(shape)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(1, math.prod(values.shape[1:])))
    total = torch.zeros((), dtype=torch.int64, device=device)
    for r0 in range(0, values.shape[0], rows_per_chunk):
        part = bits[r0 : r0 + rows_per_chunk].to(torch.int64, copy=True)  # (rows, d1, ...): never the caller's
        row_sums = part.mul_(inner).reshape(part.shape[0], -1).sum(1)  # (rows,); in place: 1.8x on CPU
        rows = start[0] + r0 + torch.arange(part.shape[0], device=device)
        total += (row_sums * position_weights(rows, 0)).sum()
    return total


def bits_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The integer dtype of a tensor's element size (to compare bit patterns, NaNs and -0.0 included)."""
    return _INT_OF_SIZE[tensor.element_size()]


def tensor_digest(values: torch.Tensor) -> int:
    """The digest of a whole tensor, as a Python int (signed 64-bit)."""
    return int(box_digest(values))
