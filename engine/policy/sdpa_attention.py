"""The core attention of Megatron's local layer spec through `torch.nn.functional.scaled_dot_product_attention`.

Owns: `sdpa_core_attention_class` (Megatron's `DotProductAttention` with its forward replaced by one SDPA call;
packed rows through their sequences with `varlen`: engine/policy/varlen_attention.py),
`sdpa_blocker` (why a layer spec keeps its own core attention), `attention_specs` (the layer specs with the core
attention `model.attention_implementation` asks for, or its refusal) and `use_sdpa` (the layer spec with SDPA, where
the spec's core attention is Megatron's plain `DotProductAttention` and there is no window), `serves_varlen` (whether
every layer of a built model takes packed sequences instead of the mask).

Why: Megatron's local `DotProductAttention` materialises the (b x heads, s, s) scores and keeps the float32 softmax
for the backward. On the lent H200 (git 68db764, `benchmarks/results/grpo_step.csv`, no Transformer Engine there) the
local spec's Qwen2.5-1.5B step fitted at most 16384 completion tokens (it asked for 27.6 GiB of scores at 24576)
where TRL's HF model with SDPA fitted 32768. SDPA picks a flash / memory-efficient kernel on a GPU (no s x s tensor)
and a fused kernel on the CPU; the mathematics are the same (`model.attention_implementation: eager` keeps
Megatron's own).

Must not: change what is attended to. The causal case (no mask given) is SDPA's `is_causal`; a given mask (the packed
rows' block-diagonal mask of engine/policy/packing.py, True = masked) is passed as SDPA's boolean mask, inverted;
packed sequences (the `varlen` layout's carrier) attend each to itself.
Sliding windows, attention sinks (`softmax_offset`), soft-capping, an attention bias and THD packing are not handled
here: the families that need them have their own core attention (engine/models/gemma/layers.py, engine/models/
gpt_oss.py), and `use_sdpa` leaves a spec alone unless its core attention is the plain one and the config has no
window (`sdpa_blocker` says which; `attention_specs` refuses an explicit `sdpa` there, `auto` keeps the layer's).

Tested: tests/distributed/test_attention_implementation.py (logits and the GRPO step's loss and gradients against
the eager attention, padded and packed rows, GQA at TP1 and TP2).
"""

from __future__ import annotations

import dataclasses
import functools

import torch


@functools.cache
def sdpa_core_attention_class():
    """`SDPACoreAttention`, a subclass of Megatron's `DotProductAttention` (imported lazily: Megatron is heavy)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPACoreAttention(DotProductAttention):
        """DotProductAttention whose forward is one `scaled_dot_product_attention` call: query [sq, b, np, hn],
        key / value [sk, b, ng, hn] (grouped-query heads expanded by SDPA), output [sq, b, np * hn]. With `varlen`,
        it also takes packed rows' sequences in place of the mask (engine/policy/varlen_attention.py carrier) and
        each attends to itself only; a mask goes to SDPA as given."""

        def __init__(self, *args, varlen: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            self.varlen = varlen

        def _varlen(self, query, key, value, carrier, dropout):
            """The packed rows' attention through their sequences (`carrier`: engine/policy/varlen_attention.py),
            [sq, b, np * hn]."""
            from engine.policy.varlen_attention import packed_segments, varlen_attention

            if not self.varlen:
                raise ValueError("SDPA core attention got packed sequences instead of an attention mask, but this "
                                 "layer was built without varlen (model.packed_attention_implementation): build the "
                                 "micro-batches with the block-diagonal mask (engine/policy/packing.py layout mask)")
            sq, b = query.shape[0], query.shape[1]
            segments = packed_segments(carrier, query.device)
            if query.shape[0] != key.shape[0] or sum(segments.lengths) != b * sq:
                raise ValueError(f"packed sequences cover {sum(segments.lengths)} tokens, the attention got {b} rows "
                                 f"x {sq} queries and {key.shape[0]} keys: the micro-batch's rows and its sequences "
                                 "disagree")
            flat = [t.transpose(0, 1).reshape(b * sq, t.shape[2], t.shape[3]) for t in (query, key, value)]
            context = varlen_attention(*flat, segments, self.softmax_scale, dropout)  # (b * sq, np, hn)
            return context.reshape(b, sq, self.hidden_size_per_partition).transpose(0, 1).contiguous()

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            from engine.policy.varlen_attention import is_packed_sequences

            if packed_seq_params is not None or attention_bias is not None or self.softmax_offset is not None:
                raise ValueError("SDPA core attention takes neither packed_seq_params (THD), an attention bias nor "
                                 "attention sinks: set model.attention_implementation: eager")
            dropout = self.attention_dropout.p if self.training else 0.0
            if is_packed_sequences(attention_mask):
                varlen = functools.partial(self._varlen, query, key, value, attention_mask, dropout)
                if dropout and not self.config.sequence_parallel:
                    with tensor_parallel.get_cuda_rng_tracker().fork():
                        return varlen()
                return varlen()
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, hn)
            if attention_mask is None:
                if q.shape[2] != k.shape[2]:
                    raise ValueError(f"SDPA core attention: causal attention needs as many keys as queries, got "
                                     f"{k.shape[2]} keys for {q.shape[2]} queries")
                mask, causal = None, True
            else:
                mask, causal = ~attention_mask, False  # Megatron: True = masked; SDPA: True = attended
            attend = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, attn_mask=mask,
                                       dropout_p=dropout, is_causal=causal, scale=self.softmax_scale,
                                       enable_gqa=k.shape[1] != q.shape[1])
            if dropout and not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    context = attend()
            else:
                context = attend()
            sq, b = query.shape[0], query.shape[1]
            return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    return SDPACoreAttention


def sdpa_blocker(spec, config) -> str | None:
    """Why SDPA cannot be `spec`'s core attention (a sliding window, or a core attention other than Megatron's plain
    `DotProductAttention`: Transformer Engine's, Gemma's, GPT-OSS's), or None when it can."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if getattr(config, "window_size", None) is not None:
        return f"the sliding window {tuple(config.window_size)} is applied by the layer's own attention"
    core = spec.submodules.self_attention.submodules.core_attention
    if core is not DotProductAttention:
        name = getattr(core, "__name__", None) or getattr(getattr(core, "func", None), "__name__", repr(core))
        return f"the layer has its own core attention ({name})"
    return None


def use_sdpa(spec, config, varlen: bool = False):
    """`spec` (a transformer layer ModuleSpec) with `SDPACoreAttention` as its core attention (packed rows through
    their sequences with `varlen`) when `sdpa_blocker` finds nothing against it; otherwise `spec` unchanged."""
    if spec is None or sdpa_blocker(spec, config) is not None:
        return spec
    core = functools.partial(sdpa_core_attention_class(), varlen=True) if varlen else sdpa_core_attention_class()
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules,
                                                                              core_attention=core))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def attention_specs(spec, dense_spec, config, implementation: str, model_type: str, packed: str = "masked"):
    """(spec, dense_spec) with the core attention `model.attention_implementation` asks for: eager keeps Megatron's,
    auto / sdpa swap in SDPA where `sdpa_blocker` allows (auto keeps the layer's own elsewhere; sdpa is refused).
    `packed` (`model.packed_attention_implementation`): auto / varlen give that SDPA attention the packed rows'
    sequences (engine/policy/varlen_attention.py), masked keeps the dense mask; an explicit varlen where the layer
    keeps another attention (eager, a window, sinks, soft-capping, MLA) is refused."""
    blocker = sdpa_blocker(spec, config)
    varlen_blocker = "model.attention_implementation is eager" if implementation == "eager" else blocker
    if varlen_blocker is None and getattr(config, "multi_latent_attention", False):
        varlen_blocker = "multi-latent attention's query / key and value head dims differ"
    if varlen_blocker is not None and packed == "varlen":
        raise ValueError(f"model.packed_attention_implementation=varlen cannot act on this {model_type} model: "
                         f"{varlen_blocker}; packed rows keep the block-diagonal mask there (set auto or masked)")
    if implementation == "eager":
        return spec, dense_spec
    if blocker is not None and implementation == "sdpa":
        raise ValueError(f"model.attention_implementation=sdpa cannot act on this {model_type} model: {blocker}; "
                         "set auto (SDPA where the layer allows it) or eager")
    varlen = packed != "masked" and varlen_blocker is None
    return use_sdpa(spec, config, varlen), use_sdpa(dense_spec, config, varlen)


def serves_varlen(chunks) -> bool:
    """Whether every transformer layer of `chunks` (this rank's model chunks) runs its attention through
    `SDPACoreAttention` with `varlen`, so packed micro-batches may carry their sequences instead of a mask
    (engine/policy/packing.py layout `varlen`). False where any layer keeps the mask: its own core attention (sliding
    windows, sinks, soft-capping, MLA, Transformer Engine), `model.packed_attention_implementation: masked`, or a
    layer without self-attention (Nemotron-H's Mamba mixer reads the mask to find the sequences)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    sdpa = sdpa_core_attention_class()
    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]
    return bool(layers) and all(isinstance(core := getattr(layer.self_attention, "core_attention", None), sdpa)
                                and core.varlen for layer in layers)
