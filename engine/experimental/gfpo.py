"""GFPO by TRL's experimental names: `from engine.experimental.gfpo import GFPOConfig, GFPOTrainer` (TRL's
`trl.experimental.gfpo`, TRL <= 1.7.1), the same classes as `from engine import GFPOConfig,
GFPOTrainer`.

    class GroupFilter:
        def __call__(self, group_completions, group_rewards, **kwargs):
            return [[-len(c) for c in group] for group in group_completions]  # [P][G] scores, higher = keep

    args = GFPOConfig(output_dir="out", num_generations=4, num_remains_in_group=2, ...)
    trainer = GFPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=..., group_filter_func=GroupFilter())

The filter may be any callable (defined in the script, a lambda, an instance); it travels in memory to the engine.
How GFPO here differs from TRL's (aligned groups, stable ties, advantages over the survivors with NaN rewards and
`multi_objective_aggregation`): engine/grpo/group_filter.py.

Must not: hold any logic (re-exports only). Test: `pytest tests/unit/test_trl_api.py -k gfpo`.
"""

from engine.api.trl_trainer import GFPOConfig, GFPOTrainer

__all__ = ["GFPOConfig", "GFPOTrainer"]
