"""Dynamic prompts: the user hook that picks the next generation's prompts from the last one's results (curricula).

Owns: the call contract of `dynamic_prompts_fn(prompts, completions, rewards, metas) -> new prompts` and the
validation of what it returns, with an error that says what was expected and what came back.

Must not: generate, touch the dataset or sampler, or loop; the trainer (a later issue) calls
`call_dynamic_prompts_fn` after each generation and feeds the returned rows to the next one instead of the next
dataloader batch.

Contract (engine-only; TRL has no such hook):
    prompts      P prompts of the generation just scored (each a str, or a list of {"role", "content"} messages)
    completions  P lists of the G completions of each prompt, in generation order
    rewards      (P, G) float tensor, the aggregated reward of each completion (NaN = unscorable)
    metas        P dicts, the other dataset columns of each prompt's row (e.g. the reference answer)
  returns a list (or tuple) of new prompts; each element is a prompt (str or message list) or a dataset row
  {"prompt": ..., **columns}, whose columns reach the reward functions as TRL's reward kwargs do. When the trainer
  needs a fixed count it passes `num_prompts`, and any other length is an error.

Test: `pytest tests/unit/test_dynamic_prompts.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

DynamicPromptsFn = Callable[[list[Any], list[list[Any]], torch.Tensor, list[dict[str, Any]]], Sequence[Any]]


class DynamicPromptsError(ValueError):
    """dynamic_prompts_fn returned something that is not a list of prompts (or was called with misaligned inputs)."""


def call_dynamic_prompts_fn(
    dynamic_prompts_fn: DynamicPromptsFn,
    prompts: Sequence[Any],
    completions: Sequence[Sequence[Any]],
    rewards: torch.Tensor,
    metas: Sequence[dict[str, Any]],
    num_prompts: int | None = None,
) -> list[dict[str, Any]]:
    """Call the hook with aligned inputs and validate its answer.

    Args:
        dynamic_prompts_fn: the user's hook.
        prompts: P prompts.
        completions: P lists of G completions.
        rewards: (P, G) aggregated rewards.
        metas: P dicts of the prompts' other dataset columns.
        num_prompts: the number of prompts the next generation needs; None = any positive number.

    Returns:
        The new prompts as dataset rows: a list of dicts, each with a "prompt" key (plus any columns it came with).
    """
    num_groups = len(prompts)
    if rewards.dim() != 2 or rewards.shape[0] != num_groups:
        raise DynamicPromptsError(f"rewards must be (P={num_groups}, G), got shape {tuple(rewards.shape)}")
    num_generations = rewards.shape[1]
    if len(completions) != num_groups or any(len(group) != num_generations for group in completions):
        raise DynamicPromptsError(f"completions must be P={num_groups} lists of G={num_generations} completions")
    if len(metas) != num_groups:
        raise DynamicPromptsError(f"metas must hold one dict per prompt ({num_groups}), got {len(metas)}")
    new_prompts = dynamic_prompts_fn(
        list(prompts), [list(group) for group in completions], rewards, [dict(meta) for meta in metas]
    )
    return validate_dynamic_prompts(new_prompts, num_prompts)


def validate_dynamic_prompts(new_prompts: Any, num_prompts: int | None = None) -> list[dict[str, Any]]:
    """Check the hook's return value and normalise it to dataset rows.

    Args:
        new_prompts: what dynamic_prompts_fn returned.
        num_prompts: the required count, or None.

    Returns:
        A list of dicts with a "prompt" key.

    Raises:
        DynamicPromptsError naming the offending element and its type.
    """
    expected = (
        "dynamic_prompts_fn must return a list of prompts: each a str, a list of {'role': ..., 'content': ...} "
        "messages, or a dataset row {'prompt': ..., **columns}"
    )
    if not isinstance(new_prompts, list | tuple):
        raise DynamicPromptsError(f"{expected}; it returned {type(new_prompts).__name__}: {new_prompts!r:.200}")
    if len(new_prompts) == 0:
        raise DynamicPromptsError(f"{expected}; it returned an empty {type(new_prompts).__name__}")
    if num_prompts is not None and len(new_prompts) != num_prompts:
        raise DynamicPromptsError(
            f"dynamic_prompts_fn returned {len(new_prompts)} prompts, but the next generation needs {num_prompts}"
        )
    rows = []
    for index, item in enumerate(new_prompts):
        row = dict(item) if isinstance(item, dict) else {"prompt": item}
        problem = _prompt_problem(row.get("prompt"))
        if isinstance(item, dict) and "prompt" not in item:
            problem = f"a dict without a 'prompt' key (keys {sorted(item)})"
        if problem is not None:
            raise DynamicPromptsError(f"{expected}; element {index} is {problem}")
        rows.append(row)
    return rows


def _prompt_problem(prompt: Any) -> str | None:
    """None if `prompt` is a non-empty str or a non-empty list of role/content messages; otherwise what it is."""
    if isinstance(prompt, str):
        return None if prompt else "an empty string"
    if isinstance(prompt, list) and prompt:
        for position, message in enumerate(prompt):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message):
                return f"a message list whose message {position} is not a {{'role', 'content'}} dict: {message!r:.100}"
        return None
    return f"{type(prompt).__name__}: {prompt!r:.100}"
