"""Llama (HF `llama`): the translation every other family's defaults describe (no bias anywhere, SwiGLU, RMSNorm,
RoPE with Llama-3.1's scaling).

Owns: `SPEC`, the family's facts for the registry (engine/models/families.py).

Test: tests/unit/test_families.py, tests/unit/test_tiny_model.py.
"""

from __future__ import annotations

from engine.models.family_spec import FamilySpec, planner_shape


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """The tiny Llama: the shared tiny shapes, head_dim hidden / heads, no attention or MLP bias."""
    return dict(head_dim=common["hidden_size"] // common["num_attention_heads"], attention_bias=False, mlp_bias=False,
                **common)


def _shape(h, layers, heads, kv, ffn, vocab):
    return planner_shape(h, layers, heads, kv, ffn, vocab, tie_word_embeddings=False, qkv_bias=False)


_LLAMA_8B = _shape(4096, 32, 32, 8, 14336, 128256)
_LLAMA_70B = _shape(8192, 80, 64, 8, 28672, 128256)

PLANNER_MODELS = {
    **{f"meta-llama/{name}{suffix}": dims for name, dims in [
        ("llama-3.1-8b", _LLAMA_8B), ("meta-llama-3.1-8b", _LLAMA_8B), ("meta-llama-3-8b", _LLAMA_8B),
        ("llama-3.1-70b", _LLAMA_70B), ("meta-llama-3.1-70b", _LLAMA_70B), ("llama-3.3-70b", _LLAMA_70B),
    ] for suffix in ("", "-instruct")},
    "builtin:tiny-llama": _shape(128, 4, 4, 2, 352, 400),
}
"""The planner's shapes of Llama 3 / 3.1 / 3.3 (from each config.json; no bias) and the tiny Llama."""


SPEC = FamilySpec(planner_models=PLANNER_MODELS, name="llama", model_types=("llama",), tiny_config=tiny_config)
