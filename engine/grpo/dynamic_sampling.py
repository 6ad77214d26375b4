"""DAPO dynamic sampling: keep only groups whose rewards vary, and fill the batch from further generation rounds.

Owns: which groups carry signal (`find_informative_groups`), whether the rounds so far fill a batch
(`is_dynamic_batch_full`), which (round, group) pairs make up the batch (`select_dynamic_batch`), and assembling
tensors or lists from the rounds in that order (`assemble_rounds`; how the loop strings them together: there).

Paper: DAPO arXiv:2503.14476 §3.2 ("over-sample and filter out prompts with accuracy 0 or 1"); how we differ:
`find_informative_groups` (what is filtered) and `select_dynamic_batch` (too few or too many groups).

Must not: generate, score, or loop (engine/train/sampling.py `sample_and_score` does).

Test: `pytest tests/unit/test_dynamic_sampling.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.grpo.advantages import nanstd


@dataclass(frozen=True)
class DynamicBatchSelection:
    """The groups of a dynamic-sampling batch, sorted by (round, group): the order `assemble_rounds` produces."""

    groups: tuple[tuple[int, int], ...]
    """(round index, group index within the round)."""
    num_informative: int
    """How many of them carry signal (the rest are fill)."""


def find_informative_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Groups whose rewards are not all equal.

    Differences from DAPO (arXiv:2503.14476 §3.2):
      * DAPO filters on the accuracy reward; we filter on the aggregated (weighted) reward the advantages use, so a
        group is dropped exactly when its advantages would all be zero. Rows whose reward is None (NaN) are ignored;
        a group with fewer than two scored rows is uninformative.
      * "Zero variance" is TRL's test for `frac_reward_zero_std`: the Bessel std is close to 0 (torch.isclose).

    Args:
        rewards: (B,) aggregated rewards of one round (NaN = unscorable), G consecutive rows per prompt.
        num_generations: G.

    Returns:
        (P,) bool: True where the group's NaN-aware Bessel std is defined and not close to 0.
    """
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are not whole groups of {num_generations}")
    std = nanstd(rewards.view(-1, num_generations), dim=1)  # (P,)
    return ~torch.isnan(std) & ~torch.isclose(std, torch.zeros_like(std))


def is_dynamic_batch_full(informative_per_round: Sequence[torch.Tensor], num_prompts: int) -> bool:
    """Whether the rounds so far hold at least `num_prompts` informative groups.

    Args:
        informative_per_round: one (P_r,) bool tensor per generation round.
        num_prompts: P, groups one batch needs.

    Returns:
        bool.
    """
    return sum(int(mask.sum().item()) for mask in informative_per_round) >= num_prompts


def select_dynamic_batch(
    informative_per_round: Sequence[torch.Tensor], num_prompts: int, fill_with_uninformative: bool = True
) -> DynamicBatchSelection:
    """Pick the groups of one batch: informative ones first (earliest rounds first), then fill if short.

    Differences from DAPO / verl:
      * When `dynamic_sampling_max_rounds` rounds do not yield enough informative groups, verl raises; we fill the
        rest of the batch with uninformative groups (advantage 0, so no policy-gradient signal; they still carry the
        KL term) to keep the batch geometry (micro-batches x DP ranks) fixed. `fill_with_uninformative=False`
        returns the short batch instead.
      * Extra informative groups beyond P are dropped, earliest rounds first kept (as DAPO/verl trim the excess).

    Args:
        informative_per_round: one (P_r,) bool tensor per generation round.
        num_prompts: P, groups one batch needs.
        fill_with_uninformative: when short of informative groups, fill up with uninformative ones (earliest first).

    Returns:
        `DynamicBatchSelection` with exactly P groups (fewer only if fill_with_uninformative is False).

    Raises:
        ValueError when the rounds hold fewer than P groups in all and filling was asked for.
    """
    candidates = [(r, g) for r, mask in enumerate(informative_per_round) for g in range(mask.numel())]
    informative = [(r, g) for r, g in candidates if bool(informative_per_round[r][g])]
    chosen = informative[:num_prompts]
    if fill_with_uninformative and len(chosen) < num_prompts:
        if len(candidates) < num_prompts:
            raise ValueError(f"{len(candidates)} groups generated in all, fewer than the {num_prompts} a batch needs")
        fill = [pair for pair in candidates if not bool(informative_per_round[pair[0]][pair[1]])]
        chosen = chosen + fill[: num_prompts - len(chosen)]
    return DynamicBatchSelection(groups=tuple(sorted(chosen)), num_informative=min(len(informative), num_prompts))


def rows_per_round(selection: DynamicBatchSelection, num_generations: int, num_rounds: int) -> list[torch.Tensor]:
    """Row indices to take from each round, in batch order.

    Args:
        selection: from `select_dynamic_batch`.
        num_generations: G.
        num_rounds: how many rounds there were (rounds with nothing selected get an empty index).

    Returns:
        `num_rounds` int64 tensors (N_r * G,), rows g*G .. g*G+G-1 of each selected group g.
    """
    offsets = torch.arange(num_generations)  # (G,)
    rows = []
    for r in range(num_rounds):
        groups = torch.tensor([g for rr, g in selection.groups if rr == r], dtype=torch.long)  # (N_r,)
        rows.append((groups.unsqueeze(1) * num_generations + offsets).flatten())  # (N_r * G,)
    return rows


def assemble_rounds(
    per_round: Sequence[torch.Tensor | Sequence[Any]], selection: DynamicBatchSelection, num_generations: int
) -> torch.Tensor | list[Any]:
    """Concatenate the selected rows of every round (tensors along dim 0, or plain lists).

    The trainer (engine/train/sampling.py `sample_and_score`) reads top to bottom:
        rounds = []
        for _ in range(dynamic_sampling_max_rounds):
            generate P prompts x G; rewards = aggregate_rewards(...); rounds.append(find_informative_groups(rewards, G))
            if is_dynamic_batch_full(rounds, P): break
        selection = select_dynamic_batch(rounds, P); batch = assemble_rounds(per-round tensors, selection, G)
    and only then computes advantages over the assembled batch (every kept group is whole, so group statistics are
    the ones the filter saw).

    Args:
        per_round: one item per round: a tensor with B_r rows on dim 0, or a list of B_r per-row values.
        selection: from `select_dynamic_batch`.
        num_generations: G.

    Returns:
        A (P * G, ...) tensor, or a list of P * G values, in (round, group) order.
    """
    rows = rows_per_round(selection, num_generations, len(per_round))
    if all(isinstance(item, torch.Tensor) for item in per_round):
        return torch.cat([item[idx.to(item.device)] for item, idx in zip(per_round, rows, strict=True)], dim=0)
    return [item[i] for item, idx in zip(per_round, rows, strict=True) for i in idx.tolist()]
