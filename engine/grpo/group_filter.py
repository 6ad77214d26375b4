"""GFPO group filtering: keep the best `num_remains_in_group` of the G completions of each prompt.

Owns: cutting per-row lists into groups of G, calling the user's `group_filter_func` with aligned groups, checking
what it returns, and the top-k selection. Advantages are then computed over the survivors only
(`compute_advantages(rewards_per_func[kept], num_generations=num_remains_in_group, ...)`, see the test).

Paper: GFPO, "Sample More to Think Less", arXiv:2508.09726 (sample G, train on the k shortest / most token-efficient).
How we differ from TRL (trl.experimental.gfpo, v0.23-v1.7): `filter_groups`.

Must not: compute advantages itself, generate, or touch process groups (the caller passes every rank's rows).

Test: `pytest tests/unit/test_group_filter.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")

GroupFilterFunc = Callable[..., Any]
"""`group_filter_func(group_completions=[[c_0..c_G-1] per prompt], group_rewards=[[r_0..r_G-1] per prompt],
**kwargs) -> scores [P][G]` (list of lists or a tensor); higher = keep."""


def split_into_groups(items: Sequence[T], num_generations: int) -> list[list[T]]:
    """Cut B per-row items into P = B / G consecutive, non-overlapping groups.

    Args:
        items: B items, the G completions of a prompt in consecutive positions.
        num_generations: G.

    Returns:
        P lists of G items: group p holds items[p*G : (p+1)*G].
    """
    if num_generations < 1 or len(items) % num_generations != 0:
        raise ValueError(f"{len(items)} items are not a whole number of groups of num_generations={num_generations}")
    return [list(items[p * num_generations : (p + 1) * num_generations]) for p in range(len(items) // num_generations)]


def select_top_k_in_groups(scores: torch.Tensor, num_remains_in_group: int) -> torch.Tensor:
    """Row indices of the k best-scored completions of each group.

    Args:
        scores: (P, G) float, higher = keep.
        num_remains_in_group: k, 1 <= k <= G.

    Returns:
        (P * k,) int64 row indices into the B = P * G rows, group by group, ascending within a group (ties go to the
        earlier completion).
    """
    num_groups, num_generations = scores.shape
    if not 1 <= num_remains_in_group <= num_generations:
        raise ValueError(f"num_remains_in_group={num_remains_in_group} must be in [1, G={num_generations}]")
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # (P, G)
    kept = order[:, :num_remains_in_group].sort(dim=1).values  # (P, k)
    offsets = torch.arange(num_groups, device=scores.device).unsqueeze(1) * num_generations  # (P, 1)
    return (kept + offsets).flatten()  # (P * k,)


def filter_groups(
    group_filter_func: GroupFilterFunc,
    completions: Sequence[Any],
    rewards: torch.Tensor,
    num_generations: int,
    num_remains_in_group: int,
    **kwargs: Any,
) -> torch.Tensor:
    """Call the user's filter on aligned groups and return the rows to keep.

    Differences from TRL (trl.experimental.gfpo, v0.23-v1.7):
      * TRL handed the filter `[completions[i : i + G] for i in range(N // G)]`: overlapping windows starting at i
        instead of i*G, so every group after the first saw the wrong completions next to its rewards. We slice
        `[i*G : (i+1)*G]` (`split_into_groups`), and tests/unit/test_group_filter.py pins the alignment.
      * TRL used `torch.topk` (unstable on ties, survivors in score order). We break ties towards the earlier
        completion and keep the survivors in their original order (`select_top_k_in_groups`), so the selection is
        deterministic.
      * TRL's advantages over the survivors ignored None rewards and `multi_objective_aggregation`; ours reuse
        `compute_advantages`, so both hold.
      * We reject scores that are not a finite [P][G] array with a message (`_check_scores`), instead of failing
        inside topk.

    Args:
        group_filter_func: see `GroupFilterFunc`.
        completions: B completions (strings, message lists, token ids...), G consecutive per prompt.
        rewards: (B,) the aggregated reward of each row (`aggregate_rewards`; NaN = unscorable).
        num_generations: G.
        num_remains_in_group: k, 2 <= k <= G (a single survivor has no group std: its advantage would be 0).
        **kwargs: passed to the filter unchanged (group per-row lists with `split_into_groups` first if needed).

    Returns:
        (P * k,) int64 row indices (see `select_top_k_in_groups`).
    """
    if rewards.shape != (len(completions),):
        raise ValueError(f"rewards has shape {tuple(rewards.shape)} but there are {len(completions)} completions")
    if not 2 <= num_remains_in_group <= num_generations:
        raise ValueError(
            f"num_remains_in_group={num_remains_in_group} must be in [2, num_generations={num_generations}]: "
            "a group of one survivor has no std and carries no signal"
        )
    group_completions = split_into_groups(completions, num_generations)
    group_rewards = rewards.view(-1, num_generations).tolist()  # P lists of G
    scores = group_filter_func(group_completions=group_completions, group_rewards=group_rewards, **kwargs)
    return select_top_k_in_groups(_check_scores(scores, len(group_completions), num_generations), num_remains_in_group)


def _check_scores(scores: Any, num_groups: int, num_generations: int) -> torch.Tensor:
    """The filter's output as a (P, G) float64 tensor, or a ValueError saying what is wrong with it."""
    try:
        tensor = torch.as_tensor(scores, dtype=torch.float64).cpu()  # (P, G)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"group_filter_func must return one score per completion, [P={num_groups}][G={num_generations}] numbers; "
            f"got {type(scores).__name__}: {error}"
        ) from error
    if tensor.shape != (num_groups, num_generations):
        raise ValueError(
            f"group_filter_func returned scores of shape {tuple(tensor.shape)}, expected "
            f"[P={num_groups}][G={num_generations}] (one score per completion of each group)"
        )
    if not torch.isfinite(tensor).all():
        raise ValueError("group_filter_func returned NaN or infinite scores")
    return tensor
