"""The Megatron-core policy: parallel state (the only module that touches Megatron's global `parallel_state`:
parallel.py), the CPU compatibility layer, the GPTModel built from a Hugging Face config, HF <-> Megatron
conversion and checkpoints, the optimizer, one pass of Megatron's schedule with the GRPO loss (step.py), the frozen
reference model, and completions as micro-batches (batch.py).

May import: engine.config, engine.validation, engine.recompute, engine.lora_settings, engine.grpo, engine.models.
"""
