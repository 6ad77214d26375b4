"""The TRL-compatible public API: `GRPOConfig` (TRL's argument names over the engine's config tree) and
`GRPOTrainer` / `GFPOTrainer` (TRL's constructor over `engine.train.loop.train`). Importing it stays light: no
torch, Megatron or vLLM until a trainer is built.

May import: engine.config, engine.config_docstrings, engine.validation, engine.models, engine.train, engine.agent, engine.grpo (TRL's static
helpers over the engine's maths, trl_compat.py), engine.lora_settings (a `peft_config`'s checks), engine.policy (the
rendezvous through which the accelerator surface opens its process group, trl_accelerator.py).
"""
