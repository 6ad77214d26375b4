"""Qwen2 (HF `qwen2`): the Llama-shaped translation with a QKV bias, which its config has no field for.

Owns: `SPEC`, the family's facts for the registry (engine/models/families.py).

Test: tests/unit/test_families.py, tests/unit/test_tiny_model.py.
"""

from __future__ import annotations

from engine.models.family_spec import FamilySpec, planner_shape, switched_sliding_window_dims


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """The tiny Qwen2: the shared tiny shapes, full attention (no sliding window)."""
    return dict(use_sliding_window=False, **common)


def _shape(h, layers, heads, kv, ffn, vocab, tied):
    return planner_shape(h, layers, heads, kv, ffn, vocab, tie_word_embeddings=tied, qkv_bias=True)


_QWEN25 = {
    "0.5b": _shape(896, 24, 14, 2, 4864, 151936, True),
    "7b": _shape(3584, 28, 28, 4, 18944, 152064, False),
    "72b": _shape(8192, 80, 64, 8, 29568, 152064, False),
}

PLANNER_MODELS = {
    **{f"qwen/qwen2.5-{size}{suffix}": dims for size, dims in _QWEN25.items() for suffix in ("", "-instruct")},
    # engine/models/tiny_model.py: hidden 128, 4 layers, 4 / 2 heads, MLP 352, vocabulary 400, untied.
    "builtin:tiny-qwen2": _shape(128, 4, 4, 2, 352, 400, False),
    "builtin:tiny-qwen2-arith": _shape(128, 4, 4, 2, 352, 400, False),  # the demo's warm start: same shape
}
"""The planner's shapes of Qwen2.5 (from each config.json; a QKV bias) and the tiny Qwen2s."""


SPEC = FamilySpec(planner_models=PLANNER_MODELS, name="qwen2", model_types=("qwen2",), qkv_bias_default=True,
                  planner_dims=switched_sliding_window_dims, tiny_config=tiny_config)
