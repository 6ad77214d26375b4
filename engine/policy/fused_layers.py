"""The local layer spec with the project's fused Triton kernels for RMSNorm, the gated MLP activation and RoPE.

Owns: `FusedRMSNorm` / `FusedGemmaRMSNorm` (kernels/rms_norm.py; offset 0 / 1), `fused_glu_mlp_class` (Megatron's
MLP whose activation is kernels/glu.py: SwiGLU or Gemma's tanh-GeGLU), `fused_rope_attention_class` (a
SelfAttention, Gemma's included, that rotates queries and keys with kernels/rope.py: full, partial and interleaved
RoPE), `use_layer_kernels` (`model.layer_kernel_implementation` resolved) and `fused_layer_specs` (the ModuleSpec
swaps, walking every spec of the model).

Why: without Transformer Engine, Megatron's local spec runs these as separate torch element-wise ops (RMSNorm's
several passes, act and product, RoPE's rotate-half and concatenation), each a round trip through GPU memory;
TE's spec (and TRL with Liger-Kernel) fuses them. The kernels compute in float32 and round once.

How: only ModuleSpec swaps. Every `LocalRMSNorm` / `GemmaRMSNorm` class in a spec becomes its fused twin (same
parameter name and `sequence_parallel` mark: checkpoints, export and TP / SP layouts are unchanged); an `MLP` spec
whose activation is SiLU or tanh-GELU, gated, unclamped, becomes the fused MLP; a `SelfAttention` /
`GemmaSelfAttention` spec becomes its fused-RoPE subclass where the RoPE is Megatron's plain one (no YaRN mscale,
no MLA). What stays unfused: Gemma's post-norms (inside its output projections), Cohere 2's LayerNorm, MoE experts'
and GPT-OSS's clamped activations, Nemotron-H's squared ReLU, MLA's and YaRN's RoPE.

Must not: read Megatron's global parallel state.

Test: tests/distributed/test_layer_kernels_model.py (the swaps act; logits and the GRPO step equal the unfused path at
TP1 and TP2 + SP), tests/kernels/test_layer_kernels.py (each kernel against the unfused ops).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

TRITON_KERNELS = "triton"


def use_layer_kernels(implementation: str) -> bool:
    """`model.layer_kernel_implementation` resolved: `triton` -> True, `torch` -> False, `auto` -> CUDA available."""
    if implementation == "auto":
        return torch.cuda.is_available()
    return implementation == TRITON_KERNELS


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm through kernels/rms_norm.py: x * rsqrt(mean(x^2) + eps) * (w + OFFSET), float32 inside.

    Built as the local spec's norms are (`(config, hidden_size, eps)`), weight in `params_dtype`, initialised to
    1 - OFFSET (ones for Llama-style norms, zeros for Gemma's (1 + w)), marked `sequence_parallel` like
    engine/policy/model.py LocalRMSNorm (why: there)."""

    local_spec_norm = True
    """A norm of Megatron's local spec (engine/policy/model.py builds its blocks and fused swaps around it)."""

    OFFSET = 0.0

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), 1.0 - self.OFFSET, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.rms_norm import rms_norm

        return rms_norm(x, self.weight, self.eps, self.OFFSET)


class FusedGemmaRMSNorm(FusedRMSNorm):
    """Gemma's RMSNorm ((1 + w), engine/models/gemma/layers.py GemmaRMSNorm) through the same kernel."""

    OFFSET = 1.0


def _glu_activation(config) -> str | None:
    """The kernels/glu.py activation name for the config's gated MLP, or None when the kernel cannot express it."""
    from engine.models.activations import gelu_tanh

    if not config.gated_linear_unit or config.activation_func_clamp_value is not None or config.glu_linear_offset:
        return None
    return {F.silu: "silu", gelu_tanh: "gelu_tanh"}.get(config.activation_func)


@functools.cache
def fused_glu_mlp_class():
    """`FusedGLUMLP`, Megatron's MLP with the gated activation through kernels/glu.py (imported lazily)."""
    from megatron.core.transformer.mlp import MLP

    class FusedGLUMLP(MLP):
        """MLP: fc1 -> act(gate) * up in one kernel (gate | up halves of this rank's fc1 output) -> fc2."""

        def __init__(self, config, submodules, *args, **kwargs):
            super().__init__(config, submodules, *args, **kwargs)
            self.glu_activation = _glu_activation(config)
            if self.glu_activation is None:
                raise ValueError("FusedGLUMLP needs a gated SiLU or tanh-GELU MLP without clamp or offset")

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            from kernels.glu import gated_activation

            if per_token_scale is not None:
                raise ValueError("FusedGLUMLP is a dense MLP: no per-token scale")
            intermediate, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                intermediate = intermediate + bias
            return self.linear_fc2(gated_activation(intermediate, self.glu_activation))

    return FusedGLUMLP


@functools.cache
def fused_rope_attention_class(base):
    """A subclass of `base` (Megatron's SelfAttention, or a subclass such as Gemma's) whose queries and keys are
    rotated by kernels/rope.py right after the QKV projection and q/k norms, where Megatron's own RoPE would run."""

    class FusedRopeSelfAttention(base):
        """The layer's RoPE frequencies are kept aside for `get_query_key_value_tensors` and Megatron's forward
        runs without them (so it does not rotate again). Inference, THD-packed and RoPE-less calls keep Megatron's
        path; a layer's own frequencies (`layer_rotary_pos_emb`: Gemma's sliding layers) are used where it has them."""

        _fused_freqs = None

        def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
            no_rope = bool(self.config.no_rope_freq) and self.config.no_rope_freq[self.layer_number - 1]
            fusable = (rotary_pos_emb is not None and not no_rope and kwargs.get("inference_context") is None
                       and kwargs.get("inference_params") is None and kwargs.get("packed_seq_params") is None)
            if not fusable:
                return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
            if hasattr(self, "layer_rotary_pos_emb"):
                rotary_pos_emb = self.layer_rotary_pos_emb(rotary_pos_emb)
            self._fused_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            try:
                return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs)
            finally:
                self._fused_freqs = None

        def get_query_key_value_tensors(self, *args, **kwargs):
            from kernels.rope import apply_rope

            out = super().get_query_key_value_tensors(*args, **kwargs)
            if self._fused_freqs is None:
                return out
            query, key, *rest = out
            interleaved = self.config.rotary_interleaved
            q_freqs, k_freqs = self._fused_freqs
            return (apply_rope(query, q_freqs, interleaved), apply_rope(key, k_freqs, interleaved), *rest)

    FusedRopeSelfAttention.__name__ = FusedRopeSelfAttention.__qualname__ = f"FusedRope{base.__name__}"
    return FusedRopeSelfAttention


def _swap(node, swaps: dict, seen: dict):
    """`node` with every class in `swaps` replaced, through ModuleSpecs, spec dataclasses, lists and tuples."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(node, type) or node is None:
        if node in swaps:
            seen.setdefault("applied", set()).add(node.__name__)
            return swaps[node]
        return node
    key = id(node)
    if key in seen:
        return seen[key]
    if isinstance(node, ModuleSpec):
        out = dataclasses.replace(node, module=_swap(node.module, swaps, seen),
                                  submodules=_swap(node.submodules, swaps, seen))
    elif dataclasses.is_dataclass(node):
        changes = {f.name: _swap(getattr(node, f.name), swaps, seen) for f in dataclasses.fields(node) if f.init}
        out = dataclasses.replace(node, **{k: v for k, v in changes.items() if v is not getattr(node, k)})
    elif isinstance(node, (list, tuple)):
        out = type(node)(_swap(item, swaps, seen) for item in node)
    else:
        out = node  # functools.partial core attentions, callables, params
    seen[key] = out
    return out


def fused_layer_specs(specs: list, config, rope_fusable: bool, local_norm: type,
                      family_modules: dict | None = None) -> tuple[list, set[str]]:
    """Every spec in `specs` (layer specs, dense-first-layer spec, per-layer lists; None passes through) with the
    fused modules swapped in where they act (module docstring), and the names of the classes that were replaced.
    `local_norm` is the local spec's RMSNorm class (engine/policy/model.py LocalRMSNorm); `family_modules` the
    family's own norms and attention classes (its spec's `fused_modules()`: "offset_norms", "attention")."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    family_modules = family_modules or {}
    swaps = {local_norm: FusedRMSNorm, **{norm: FusedGemmaRMSNorm for norm in family_modules.get("offset_norms", ())}}
    if _glu_activation(config) is not None:
        swaps[MLP] = fused_glu_mlp_class()
    if rope_fusable:
        for base in (SelfAttention, *family_modules.get("attention", ())):
            swaps[base] = fused_rope_attention_class(base)
    seen: dict = {}
    out = [_swap(spec, swaps, seen) for spec in specs]
    return out, seen.get("applied", set())
