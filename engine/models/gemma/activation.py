"""Gemma's MLP activation, the one torch piece its TransformerConfig needs (engine/models/gemma/__init__.py
`finish_transformer_config`; the fused layer kernels recognise it: engine/policy/fused_layers.py).

Test: tests/distributed/test_family_layouts.py (logits = HF).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF's `gelu_pytorch_tanh` (Gemma's hidden_activation)."""
    return F.gelu(x, approximate="tanh")
