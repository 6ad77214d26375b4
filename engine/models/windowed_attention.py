"""Sliding-window core attention with optional attention-logit soft-capping, as a kind of attention several families
use (Gemma's, with Gemma 2's soft-cap; Cohere 2's, without): `windowed_core_attention_class`.

Why its own core attention: Megatron's local softmax replaces a given mask by the window mask, so packed rows would
attend across sequences; this one applies the causal (or block-causal) mask AND the sliding window of the layers
`window_attn_skip_freq` marks, in HF's eager order.

Must not: import Megatron at module level, read Megatron's global parallel state, import vLLM, or name a family.

Test: tests/distributed/test_family_layouts.py (Gemma's and Cohere 2's logits = HF at TP1, TP2 + SP and PP2).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def windowed_core_attention_class():
    """`WindowedCoreAttention`, a Megatron DotProductAttention subclass (Megatron imported on the first call)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.utils import is_layer_window_attention

    class WindowedCoreAttention(DotProductAttention):
        """Dot-product attention that applies the sliding window AND the given mask (Megatron's local softmax
        replaces a given mask by the window mask, so packed rows would attend across sequences), in HF's eager
        order: scores in the input dtype x scale, soft-capped where `softcap` is given (tanh(s / softcap) x softcap), masked,
        softmax in float32, cast back."""

        def __init__(self, config, layer_number, *args, softcap: float | None = None, **kwargs):
            super().__init__(config, layer_number, *args, **kwargs)
            self.softcap = softcap
            sliding = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            self.window = config.window_size[0] + 1 if sliding else None

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("the windowed core attention (engine/models/windowed_attention.py) takes neither "
                                 "packed_seq_params (THD) nor an attention bias")
            repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            q = query.permute(1, 2, 0, 3)  # (b, np, sq, hn)
            k = key.repeat_interleave(repeat, dim=2).permute(1, 2, 0, 3)  # (b, np, sk, hn)
            v = value.repeat_interleave(repeat, dim=2).permute(1, 2, 0, 3)
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale  # (b, np, sq, sk)
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            sq, sk = scores.shape[-2:]
            rows = torch.arange(sq, device=scores.device)[:, None] + (sk - sq)
            cols = torch.arange(sk, device=scores.device)[None, :]
            masked = cols > rows  # (sq, sk) causal
            if self.window is not None:
                masked = masked | (rows - cols >= self.window)
            if attention_mask is not None:
                masked = masked | attention_mask  # (b, 1, sq, sk), True = masked
            scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            if self.config.sequence_parallel:
                probs = self.attention_dropout(probs)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
            context = torch.matmul(probs, v)  # (b, np, sq, hn)
            return context.permute(2, 0, 1, 3).reshape(sq, q.shape[0], self.hidden_size_per_partition)

    return WindowedCoreAttention
