"""GRPO post-training engine: Megatron-core policy, fused loss, vLLM rollout. See README.md."""
