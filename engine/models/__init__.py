"""Model families and model sources: one folder per family behind the registry, the tiny Hugging Face models built
in-process and shipped (`builtin:tiny-qwen2-arith`, its tokenizer and corpus under assets/), and hub ids resolved to
a local snapshot.

Owns: `<family>/` (one per family: its `SPEC`, refusals, TransformerConfig hooks, tensor map, planner shape, tiny
config; its torch or Megatron pieces in modules of the folder, Megatron imported inside functions), families.py (the
registry: which families exist, lookup by model_type, the refusal of others), family_spec.py (what a spec holds),
tensor_map.py and stacked_experts.py (the converter's vocabulary the families' maps use), tiny_model.py (build /
resolve builtin models), hub.py (hub cache or download), model_dir.py (what a model directory must hold: config,
safetensors weights, a tokenizer that fits), assets/ (package data). Adding a family: a new folder, listed in
families.py, with its tests.

May import: nothing of the engine's (torch, transformers and the standard library only; Megatron inside functions).
"""
