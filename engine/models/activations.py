"""MLP activations Megatron lacks, shared by the families whose TransformerConfig sets them (Gemma's
`finish_transformer_config`): `gelu_tanh`. The fused layer kernels recognise them (engine/policy/fused_layers.py).

Must not: name a family.

Test: tests/distributed/test_family_layouts.py (logits = HF).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF's `gelu_pytorch_tanh`: GELU with the tanh approximation (Gemma's hidden_activation)."""
    return F.gelu(x, approximate="tanh")
