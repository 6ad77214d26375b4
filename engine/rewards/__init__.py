"""TRL's `trl.rewards` at the path a TRL user would guess: `from engine.rewards import accuracy_reward` (was
`from trl.rewards import accuracy_reward`). Only re-exports: the functions live in engine/train/builtin_rewards.py
(the reward-function contract in engine/train/rewards.py).

Test: tests/integration/test_trl_guides.py (the TRL quick start imports `accuracy_reward` from here).

May import: engine.train.
"""

from engine.train.builtin_rewards import (
    SoftOverlongPunishment,
    accuracy_reward,
    think_answer_format_reward,
    think_format_reward,
)

__all__ = ["SoftOverlongPunishment", "accuracy_reward", "get_soft_overlong_punishment", "think_answer_format_reward",
           "think_format_reward"]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """TRL's factory name for the DAPO soft overlong punishment reward."""
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)
