"""Quantized checkpoint formats: block-wise FP8 and MXFP4, read into a policy dtype and written back.

Frontier checkpoints ship quantized. DeepSeek-V3 / R1, Kimi-K2 and the Qwen3 "-FP8" releases store each linear
weight as `float8_e4m3fn` with a float32 `weight_scale_inv` per [128, 128] block (`quantization_config`:
`{quant_method: fp8, weight_block_size: [128, 128]}`); the value is `q * scale_inv`, blocks at the right and bottom
edges may be partial (DeepSeek-V3's 576-row `kv_a_proj_with_mqa`: 4.5 blocks, 5 scale rows). GPT-OSS stores its
experts' weights as MXFP4: `*_blocks` (uint8, two e2m1 values per byte, low nibble first, 16 bytes = 32 values per
block) and `*_scales` (uint8, one e8m0 exponent per block, bias 127): the value is `e2m1 * 2**(scale - 127)`.

This module is the arithmetic only: format detection from a config, dequantization of a whole tensor or of one
rank's slice (reading only the scale blocks the slice touches), and the reference quantizers that write the same
layouts back (per-block max-abs / 448 for FP8, the scale DeepSeek's and transformers' quantizers use; the OCP MX rule
for MXFP4), such that re-quantizing unchanged weights gives back the same bytes. Which tensor of a family is quantized, and where it
goes, is the converter's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MXFP4_BLOCK = 32
"""Values per MXFP4 block (one e8m0 exponent each); 16 bytes of packed e2m1 pairs."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 e2m1 (FP4) codes in order: sign bit 3, then two exponent bits and one mantissa bit."""


@dataclass(frozen=True)
class QuantizedFormat:
    """How a checkpoint's weights are quantized (`quantization_config` of its config.json)."""

    method: str
    """"fp8" (block-wise float8_e4m3fn) or "mxfp4"."""
    block: tuple[int, int] | None = None
    """FP8's [rows, cols] per scale; None for MXFP4 (always 1 x 32)."""
    not_converted: tuple[str, ...] = ()
    """Module names the checkpoint keeps unquantized (`modules_to_not_convert`)."""


def read_format(hf_config) -> QuantizedFormat | None:
    """The quantized format of a transformers config (or its dict), None for an unquantized checkpoint.

    Raises ValueError naming the method for a quantization this module does not read (GPTQ, AWQ, bitsandbytes, FP8
    per-tensor or per-channel scales, ...)."""
    qc = hf_config.get("quantization_config") if isinstance(hf_config, dict) else getattr(
        hf_config, "quantization_config", None)
    if not qc:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    skip = tuple(qc.get("modules_to_not_convert") or ())
    if method == "fp8" and qc.get("weight_block_size"):
        rows, cols = (int(v) for v in qc["weight_block_size"])
        if qc.get("scale_fmt") not in (None, "float32"):
            raise ValueError(f"FP8 checkpoint with scale_fmt {qc['scale_fmt']!r}: only float32 block scales "
                             "(weight_scale_inv) are read; dequantise it first")
        return QuantizedFormat("fp8", (rows, cols), skip)
    if method == "mxfp4":
        return QuantizedFormat("mxfp4", None, skip)
    detail = "FP8 without weight_block_size (per-tensor or per-channel scales)" if method == "fp8" else repr(method)
    raise ValueError(f"quantized checkpoint ({detail}): block-wise FP8 (weight_block_size) and MXFP4 are read; "
                     "dequantise it first")


def block_span(start: int, stop: int, block: int) -> slice:
    """The scale blocks that rows (or columns) [start, stop) of a weight fall in."""
    return slice(start // block, -(-stop // block))


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                   offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """`q * scale_inv` per block, in `dtype` (computed in float32).

    q: float8_e4m3fn [..., rows, cols], the whole weight or a slice of it starting at `offset` (row, col) of the
    whole. scale_inv: float32 [..., scale rows, scale cols], the blocks the slice touches (`block_span` of its rows
    and of its columns), so a rank reads only its own blocks. Leading dimensions (stacked experts) are carried.
    """
    block_rows, block_cols = block
    rows, cols = q.shape[-2:]
    first_row, first_col = offset[0] % block_rows, offset[1] % block_cols
    spans = (block_span(first_row, first_row + rows, block_rows), block_span(first_col, first_col + cols, block_cols))
    need = (spans[0].stop - spans[0].start, spans[1].stop - spans[1].start)
    if tuple(scale_inv.shape[-2:]) != need:
        raise ValueError(f"FP8 scales of shape {tuple(scale_inv.shape)} for a weight slice {tuple(q.shape)} at "
                         f"{tuple(offset)}: {need} blocks of {block_rows} x {block_cols} expected")
    scale = scale_inv.float().repeat_interleave(block_rows, -2).repeat_interleave(block_cols, -1)
    scale = scale[..., first_row:first_row + rows, first_col:first_col + cols]
    return (q.float() * scale).to(dtype)


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int],
                 like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block) of a [..., rows, cols] weight: each block divided by its
    max-abs / 448 (an all-zero block: scale 1), partial edge blocks included.

    like: the source checkpoint's scale_inv for this weight. A block whose own scale is that one up to the rounding
    of a bf16 or float32 dequantization (relative 2**-8) keeps it: float32 cannot hold `q * scale_inv` exactly (4 +
    24 significant bits), so a scale computed again from dequantized values differs in its last bits about one time
    in ten, and unchanged weights would not give back the same bytes. Trained blocks get their own scale."""
    block_rows, block_cols = block
    *lead, rows, cols = weight.shape
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    padded = weight.new_zeros(*lead, grid[0] * block_rows, grid[1] * block_cols, dtype=torch.float32)
    padded[..., :rows, :cols] = weight.float()
    tiles = padded.reshape(*lead, grid[0], block_rows, grid[1], block_cols)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if like is not None:
        like = like.float()
        scale_inv = torch.where((scale_inv - like).abs() <= like.abs() * 2.0**-8, like, scale_inv)
    q = (tiles / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(*lead, grid[0] * block_rows, grid[1] * block_cols)[..., :rows, :cols].contiguous(), scale_inv


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 [..., groups, 16] uint8 codes and [..., groups] uint8 exponents -> [..., groups * 32] in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] * 2 != MXFP4_BLOCK:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: blocks of "
                         f"{MXFP4_BLOCK // 2} bytes, one scale per block expected")
    codes = blocks.to(torch.uint8)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    pairs = torch.stack((values[(codes & 0x0F).long()], values[(codes >> 4).long()]), dim=-1)
    exponent = scales.to(torch.int32) - 127
    out = torch.ldexp(pairs.flatten(-2), exponent.unsqueeze(-1))
    return out.flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [..., groups, 16] codes, uint8 [..., groups] exponents) of a [..., n * 32] weight, by the OCP MX rule:
    each block's exponent is floor(log2(max-abs)) - 2 (e2m1's largest exponent), values rounded to the nearest e2m1
    and saturated at 6. A dequantized block's max-abs is then 4 or 6 times that power of two, so quantizing it again
    picks the same exponent and codes: a round trip of unchanged weights is byte-exact."""
    *lead, width = weight.shape
    if width % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs a last dimension divisible by {MXFP4_BLOCK}, got {width}")
    tiles = weight.float().reshape(*lead, width // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = tiles.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2, torch.zeros_like(amax))
    exponent = exponent.clamp(-127, 127)
    scaled = torch.ldexp(tiles, -exponent.to(torch.int32).unsqueeze(-1))
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    code = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    code = code + 8 * ((scaled < 0) & (code > 0)).long()
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)
