"""Fused LM-head kernels for the GRPO loss (torch and Triton only; nothing from engine/)."""
