"""The GRPO loop and its I/O: loop.py (`train(cfg)`, reading top to bottom: rollout -> reward -> advantage ->
old/ref log-probs -> forward_backward -> optimizer step -> weight sync -> log), run.py (what `train` builds once, and
resuming, saving, exporting and syncing it), sampling.py (sampling and scoring a round: DAPO, GFPO, the curriculum
hook, the held-out evaluation), checkpoints, datasets, reward functions (rewards.py: resolving and calling them with
TRL's contract; builtin_rewards.py: the built-ins), the metric logger (metric_logger.py) and its sinks
(metric_sinks.py: JSONL, TensorBoard, W&B, parquet, PNG), and the prompt rounds (what each round samples, as a
function of seed and round).

May import: engine.config, engine.validation, engine.log_filters, engine.lora_settings, engine.models, engine.grpo,
engine.policy, engine.rollout, engine.agent.
"""
