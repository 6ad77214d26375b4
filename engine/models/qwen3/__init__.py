"""Qwen3 (HF `qwen3`): the Llama-shaped translation with a per-head RMSNorm on queries and keys and a head_dim field.

Owns: `SPEC`, the family's facts for the registry (engine/models/families.py).

Test: tests/unit/test_families.py, tests/unit/test_tiny_model.py.
"""

from __future__ import annotations

from engine.models.family_spec import TINY_QWEN3_HEAD_DIM, FamilySpec, planner_shape, switched_sliding_window_dims


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """The tiny Qwen3: head_dim `TINY_QWEN3_HEAD_DIM` (heads x head_dim != hidden), no bias, full attention."""
    return dict(head_dim=TINY_QWEN3_HEAD_DIM, attention_bias=False, use_sliding_window=False, **common)


_QWEN3_8B = planner_shape(4096, 36, 32, 8, 12288, 151936, False, False, head_dim=128, qk_norm=True)

PLANNER_MODELS = {
    **{f"qwen/qwen3-8b{suffix}": _QWEN3_8B for suffix in ("", "-base")},
    "builtin:tiny-qwen3": planner_shape(128, 4, 4, 2, 352, 400, False, False, head_dim=64, qk_norm=True),
}
"""The planner's shapes of Qwen3-8B (from its config.json) and the tiny Qwen3."""


SPEC = FamilySpec(planner_models=PLANNER_MODELS, name="qwen3", model_types=("qwen3",), qk_norm_types=("qwen3",),
                  planner_dims=switched_sliding_window_dims, tiny_config=tiny_config)
