"""Group-relative advantages (GRPO) from the rewards of several reward functions.

Owns: turning reward-function outputs (`None` = not applicable) into a (B, K) reward tensor, the weighted
aggregation of K reward functions, the group baseline and the std scaling (`scale_rewards` = group / batch / none),
`multi_objective_aggregation` = sum_then_normalize / normalize_then_sum (GDPO), and the NaN-aware std.

Must not: call reward functions, gather across ranks (the caller passes the rewards of the *whole* generation batch,
every rank's rows, so that each group of G is complete), read the config tree, or log. It warns (Python `warnings`)
when a row is unscorable, because a silent all-None row is a reward-function bug the user must see.

Layout: rows are grouped as TRL's RepeatSampler lays them out: the G completions of one prompt are G consecutive
rows, so `rewards.view(-1, G)` gives one group per row (B = P * G).

The maths, and where it differs from TRL: `compute_advantages`.

Test: `pytest tests/unit/test_advantages.py` (hand-computed values); equality with TRL on the same rewards:
`pytest tests/unit/test_trl_parity.py`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.grpo.settings import SCALE_REWARDS, MultiObjectiveAggregation, ScaleRewards

STD_EPSILON = 1e-4
"""Added to the std before dividing (TRL's constant)."""


@dataclass(frozen=True)
class Advantages:
    """The output of `compute_advantages`; every field is a (B,) tensor in the rewards' dtype unless noted."""

    advantages: torch.Tensor
    """Group-relative advantages; 0 for unscorable rows and for groups without signal."""
    rewards: torch.Tensor
    """The aggregated reward the baseline was taken of (normalize_then_sum: the sum of normalised rewards); NaN for
    unscorable rows."""
    std_rewards: torch.Tensor
    """The std each row's advantage was divided by (before the 1e-4), broadcast to rows."""
    is_std_zero: torch.Tensor
    """bool: the row's std is (close to) zero: the source of the `frac_reward_zero_std` metric."""
    is_unscorable: torch.Tensor
    """bool: every reward function returned None for the row."""


def rewards_to_tensor(
    rewards_per_func: Sequence[Sequence[float | None]], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Stack the outputs of K reward functions into one tensor, `None` -> NaN.

    Args:
        rewards_per_func: K lists (one per reward function, in order), each of B floats or `None`.
        dtype: the output dtype (TRL keeps rewards in float32).

    Returns:
        (B, K) tensor; NaN where a function returned None.

    Raises:
        ValueError if the lists differ in length (the message names the function index).
    """
    if len(rewards_per_func) == 0:
        raise ValueError("rewards_to_tensor needs at least one reward function's output")
    num_rows = len(rewards_per_func[0])
    for k, rewards in enumerate(rewards_per_func):
        if len(rewards) != num_rows:
            raise ValueError(
                f"reward function {k} returned {len(rewards)} rewards, but function 0 returned {num_rows}: "
                "every reward function must return one reward (or None) per completion"
            )
    columns = [[float("nan") if r is None else float(r) for r in rewards] for rewards in rewards_per_func]
    return torch.tensor(columns, dtype=dtype).T.contiguous()  # (B, K)


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected (n - 1) standard deviation that ignores NaNs; NaN where fewer than two values are valid.

    Args:
        x: any float tensor.
        dim: the dimension to reduce; None = all.
        keepdim: keep the reduced dimension.

    Returns:
        The std, reduced over `dim` (a 0-dim tensor when dim is None).
    """
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std if keepdim else std.squeeze(dims) if dim is not None else std.reshape(())


def find_unscorable_rows(rewards_per_func: torch.Tensor) -> torch.Tensor:
    """Rows for which every reward function returned None.

    Args:
        rewards_per_func: (B, K) rewards, NaN = None.

    Returns:
        (B,) bool.
    """
    return torch.isnan(rewards_per_func).all(dim=1)


def aggregate_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted sum over reward functions that skips None (NaN) entries; NaN for unscorable rows.

    This is the reward that `reward`, `reward_std`, GFPO's `group_rewards` and dynamic sampling see.

    Args:
        rewards_per_func: (B, K) rewards, NaN = None.
        reward_weights: (K,) weights; None = all 1.

    Returns:
        (B,) rewards in the input dtype.
    """
    weights = _weights(rewards_per_func, reward_weights)  # (K,)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)  # (B,)
    return rewards.masked_fill(find_unscorable_rows(rewards_per_func), float("nan"))


def compute_advantages(
    rewards_per_func: torch.Tensor,
    num_generations: int,
    reward_weights: torch.Tensor | None,
    scale_rewards: ScaleRewards,
    multi_objective_aggregation: MultiObjectiveAggregation,
) -> Advantages:
    """Group-relative advantages of one generation batch (every rank's rows).

    Maths (TRL 1.16 `GRPOTrainer._generate_and_score_completions`; GRPO: arXiv:2402.03300):
        sum_then_normalize:  r = nansum_k w_k R_k;  A = (r - mean_group(r)) / (std + 1e-4)
            std = Bessel nanstd over the group (`group`) or over the whole batch (`batch`, Lite PPO
            arXiv:2508.08221, the group mean is kept); `none` (Dr. GRPO arXiv:2503.20783) skips the division.
        normalize_then_sum (GDPO): Z_k = group-normalised R_k;  r = nansum_k w_k Z_k;  A = batch-normalised r
            (ignores `scale_rewards`, as TRL does).
        A row where every function returned None is unscorable: its reward is NaN (left out of the group mean and
        std) and its advantage is 0.
    The 1e-4 is added to the std (not inside a square root) and the std is Bessel-corrected (n - 1), as in TRL; the
    DeepSeekMath paper writes the plain std. One deliberate difference: where every scored reward of a group (or, for
    the batch normalisation, of the batch) is equal, the centred reward is exactly 0; TRL subtracts a floating-point
    mean and leaves residues (rewards 0.7, 0.7, 0.7 give advantages of 1e-12 after the division by 1e-4). A group
    with fewer than two scorable rows has a NaN std, so its advantages are NaN before the final `nan_to_num` and end
    up 0: such a group carries no signal.

    Args:
        rewards_per_func: (B, K) float rewards of K reward functions; NaN = the function returned None.
            B = P * G with the G completions of a prompt in consecutive rows.
        num_generations: G (after a GFPO filter: the number of survivors per group).
        reward_weights: (K,) weights; None = all 1.
        scale_rewards: `group` (divide by the group std), `batch` (by the batch std, group mean kept) or `none`.
        multi_objective_aggregation: `sum_then_normalize` or `normalize_then_sum` (GDPO; always batch-normalised).

    Returns:
        `Advantages`, every field (B,). Warns once if some row is unscorable.
    """
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must be (B, K), got shape {tuple(rewards_per_func.shape)}")
    num_rows = rewards_per_func.shape[0]
    if num_generations < 1 or num_rows % num_generations != 0:
        raise ValueError(
            f"the batch of {num_rows} rows is not a whole number of groups of num_generations={num_generations}"
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    is_unscorable = find_unscorable_rows(rewards_per_func)  # (B,)
    if is_unscorable.any():
        rows = is_unscorable.nonzero().flatten().tolist()
        warnings.warn(
            f"All reward functions returned None for {len(rows)} of {num_rows} completions (rows {rows[:8]}"
            f"{' ...' if len(rows) > 8 else ''}); their advantage is set to 0. Make sure at least one reward "
            "function returns a reward for every completion.",
            stacklevel=2,
        )
    if multi_objective_aggregation == "sum_then_normalize":
        rewards = aggregate_rewards(rewards_per_func, reward_weights)  # (B,)
        advantages, std_rewards = _normalize_in_groups(rewards, num_generations, scale_rewards)
    elif multi_objective_aggregation == "normalize_then_sum":
        rewards, advantages, std_rewards = _normalize_then_sum(rewards_per_func, num_generations, reward_weights)
    else:
        raise ValueError(
            "multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum', "
            f"got {multi_objective_aggregation!r}"
        )
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))  # (B,)
    return Advantages(
        advantages=torch.nan_to_num(advantages, nan=0.0),
        rewards=rewards,
        std_rewards=std_rewards,
        is_std_zero=is_std_zero,
        is_unscorable=is_unscorable,
    )


def _weights(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor | None) -> torch.Tensor:
    """(K,) weights on the rewards' device and dtype; all ones when None; checks K."""
    num_funcs = rewards_per_func.shape[1]
    if reward_weights is None:
        return torch.ones(num_funcs, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    weights = torch.as_tensor(reward_weights, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    if weights.shape != (num_funcs,):
        raise ValueError(f"reward_weights has {weights.numel()} entries but there are {num_funcs} reward functions")
    return weights


def _normalize_in_groups(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_then_normalize: (advantages (B,), std (B,)) of aggregated rewards (B,) with the group mean as baseline."""
    grouped = rewards.view(-1, num_generations)  # (P, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)  # (B,)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)  # (B,)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)  # (B,)
    else:
        std = torch.zeros_like(rewards)  # (B,): G = 1 only happens in eval
    advantages = _center(rewards, mean, _is_constant(grouped, dim=1).repeat_interleave(num_generations))  # (B,)
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    return advantages, std


def _normalize_then_sum(
    rewards_per_func: torch.Tensor, num_generations: int, reward_weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GDPO (arXiv:2601.05242): (summed normalised rewards, advantages, std), each (B,)."""
    num_funcs = rewards_per_func.shape[1]
    grouped = rewards_per_func.view(-1, num_generations, num_funcs)  # (P, G, K)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)  # (P, 1, K)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)  # (P, 1, K)
    centered = _center(grouped, mean_k, _is_constant(grouped, dim=1, keepdim=True))  # (P, G, K)
    normalized = (centered / (std_k + STD_EPSILON)).view(-1, num_funcs)  # (B, K)
    weights = _weights(rewards_per_func, reward_weights)  # (K,)
    rewards = (normalized * weights.unsqueeze(0)).nansum(dim=1)  # (B,)
    rewards = rewards.masked_fill(find_unscorable_rows(rewards_per_func), float("nan"))
    std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)  # (B,)
    advantages = _center(rewards, torch.nanmean(rewards), _is_constant(rewards, dim=0)) / (std + STD_EPSILON)  # (B,)
    return rewards, advantages, std


def _is_constant(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Whether every non-NaN value along `dim` is equal (False when all are NaN)."""
    high = x.nan_to_num(nan=-math.inf, posinf=math.inf).amax(dim=dim, keepdim=keepdim)
    low = x.nan_to_num(nan=math.inf, neginf=-math.inf).amin(dim=dim, keepdim=keepdim)
    return high == low


def _center(x: torch.Tensor, mean: torch.Tensor, is_constant: torch.Tensor) -> torch.Tensor:
    """x - mean, exactly 0 where the values are all equal (the float mean of 0.7, 0.7, 0.7 is not 0.7)."""
    return torch.where(is_constant & ~torch.isnan(x), torch.zeros_like(x), x - mean)
