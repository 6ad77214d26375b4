"""Llama (HF `llama`): the translation every other family's defaults describe (no bias anywhere, SwiGLU, RMSNorm,
RoPE with Llama-3.1's scaling).

Owns: `SPEC`, the family's facts for the registry (engine/models/families.py).

Test: tests/unit/test_families.py, tests/unit/test_tiny_model.py.
"""

from __future__ import annotations

from engine.models.family_spec import FamilySpec


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """The tiny Llama: the shared tiny shapes, head_dim hidden / heads, no attention or MLP bias."""
    return dict(head_dim=common["hidden_size"] // common["num_attention_heads"], attention_bias=False, mlp_bias=False,
                **common)


SPEC = FamilySpec(name="llama", model_types=("llama",), tiny_config=tiny_config)
