"""Model sources: the tiny Hugging Face models built in-process and shipped (`builtin:tiny-qwen2-arith`, its
tokenizer and corpus under assets/), and hub ids resolved to a local snapshot.

Owns: families.py (the families the engine builds, the refusal of others, each family's MoE field names),
tiny_model.py (build / resolve builtin models), hub.py (hub cache or download), model_dir.py (what a model
directory must hold: config, safetensors weights, a tokenizer that fits), assets/ (package data).

May import: nothing of the engine's (torch, transformers and the standard library only).
"""
