"""The embedded demo (`grpo-engine demo`, `make demo`) and the warm start that produced the shipped tiny model
(`python -m engine.demo.warm_start`).

May import: engine.config, engine.validation, engine.models, engine.train.
"""
