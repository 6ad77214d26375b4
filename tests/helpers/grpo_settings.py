"""The GRPO maths at the engine's settings, for tests: the fields a test names, every other one at its
engine/config.py default (the maths has no defaults of its own)."""

from engine.config import GenerationConfig, GRPOConfigSection, RewardConfig


def build_loss_config(**fields):
    """`PolicyLossConfig` of a `grpo` section with these fields (`max_completion_length`: the `generation` one)."""
    from engine.grpo.settings import PolicyLossConfig

    generation = GenerationConfig(**{name: fields.pop(name) for name in ["max_completion_length"] if name in fields})
    return PolicyLossConfig.from_sections(GRPOConfigSection(**fields), generation)


def compute_default_advantages(rewards_per_func, num_generations: int, **settings):
    """`compute_advantages` with `reward_weights` None (all 1) and `scale_rewards` / `multi_objective_aggregation` at
    the config's defaults unless given."""
    from engine.grpo.advantages import compute_advantages

    defaults = dict(reward_weights=None, scale_rewards=GRPOConfigSection().scale_rewards,
                    multi_objective_aggregation=RewardConfig().multi_objective_aggregation)
    return compute_advantages(rewards_per_func, num_generations, **(defaults | settings))
