"""The GRPO maths: pure functions of tensors and Python lists, no process groups, no config objects, no I/O
(docs/contributing/house-rules.md).

Owns: advantages.py (group-relative advantages, reward aggregation), policy_loss.py (every TRL loss type, KL,
masks, importance-sampling correction, the layout-independent normaliser), loss_statistics.py (the sums behind the
loss metrics, made inside the loss), metrics.py (TRL's metric maths), group_filter.py (GFPO), dynamic_sampling.py
(DAPO), dynamic_prompts.py (the curriculum hook's contract), fused_terms.py (the loss's per-token terms on the fused
Triton kernel, kernels/grpo_token_terms.py), settings.py (the maths' choices as Literal types and `PolicyLossConfig`;
torch-free, so engine/config.py types its fields with them: each setting is defined once).

May import: nothing of the engine's (torch, transformers, kernels/ and the standard library only).
"""
