"""Qwen2 (HF `qwen2`): the Llama-shaped translation with a QKV bias, which its config has no field for.

Owns: `SPEC`, the family's facts for the registry (engine/models/families.py).

Test: tests/unit/test_families.py, tests/unit/test_tiny_model.py.
"""

from __future__ import annotations

from engine.models.family_spec import FamilySpec, switched_sliding_window_dims


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """The tiny Qwen2: the shared tiny shapes, full attention (no sliding window)."""
    return dict(use_sliding_window=False, **common)


SPEC = FamilySpec(name="qwen2", model_types=("qwen2",), qkv_bias_default=True,
                  planner_dims=switched_sliding_window_dims, tiny_config=tiny_config)
