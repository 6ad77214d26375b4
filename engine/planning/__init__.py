"""Planning before launch: per-GPU memory of a config's layout and the training / inference node split
(`grpo-engine plan`, the SLURM templates in launch/).

Owns: planner.py (`build_plan`, `format_plan`: the plan and its printout), shapes.py (the model's dimensions, the
cluster shape, the layout checks, what each node holds), memory.py (every per-GPU memory term, with the formulas and
their sources), sync_memory.py (the weight sync's buffers, from the sync plan the transport follows).

May import: engine.config, engine.validation, engine.recompute, engine.models (families.py: no torch),
engine.lora_settings, engine.policy and engine.rollout (sync_memory.py only, inside functions: the sync plan, which
imports torch).
"""
