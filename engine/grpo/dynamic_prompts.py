"""Dynamic prompts: the user hook that picks the next generation's prompts from the last one's results (curricula).

Owns: the call contract of `dynamic_prompts_fn(prompts, completions, rewards, metas) -> new prompts` (the documented
hook of a TRL fork; TRL itself has none: `call_dynamic_prompts_fn`), laying the generation out one element per sample
for it, and the validation of what it returns (`rows_for_next_generation`), with an error that names the hook and
says what was expected and what came back.

Must not: generate, touch the dataset or sampler, queue, or loop; the trainer (engine/train/sampling.py
`queue_prompts`) calls `call_dynamic_prompts_fn` on rank 0 after each generation (also within DAPO dynamic
sampling) and queues the returned rows (engine/train/prompt_queue.py; the queue travels in checkpoints).

Test: `pytest tests/unit/test_dynamic_prompts.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

DynamicPromptsFn = Callable[[list[Any], list[Any], list[float], list[dict[str, Any]]], Sequence[Any]]
"""`dynamic_prompts_fn(prompts, completions, rewards, metas) -> next prompts`, four B-long lists (see above)."""


class DynamicPromptsError(ValueError):
    """dynamic_prompts_fn returned something that is not the next generation's prompts (or was called with
    misaligned inputs)."""


def call_dynamic_prompts_fn(
    dynamic_prompts_fn: DynamicPromptsFn,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    rewards: torch.Tensor,
    metas: Sequence[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Call the hook with one element per sample and turn its answer into the next generation's P rows.

    The contract (a TRL fork's `GRPOConfig(dynamic_prompts_fn=curriculum_fn)`). The four lists are zipped element by
    element, ONE ELEMENT PER SAMPLE, B = P * G of them, group by group:
        prompts      prompts[i] the prompt of sample i (each group's prompt repeated G times): a str, or a list of
                     {"role", "content"} messages
        completions  completions[i] that sample's completion as the reward functions saw it (str, or a message list
                     for conversational data)
        rewards      rewards[i] a python float, the sample's aggregated weighted reward (float('nan') = unscorable)
        metas        metas[i] a dict of the row's other dataset columns (everything but "prompt", e.g. the answer)
    and it returns the prompts to train next (what they may be: `rows_for_next_generation`).

    Args:
        dynamic_prompts_fn: the user's hook.
        prompts: P prompts of the generation just scored, one per group.
        completions: B = P * G completions, group by group (G consecutive per prompt), as the rewards saw them.
        rewards: (B,) float, the aggregated weighted reward of each completion (NaN = unscorable).
        metas: P dicts, the other dataset columns of each group's row.

    Returns:
        The dataset rows to train next (P, or 1..B distinct ones for a per-sample answer): dicts with a "prompt" key
        plus the columns they carry.
    """
    num_prompts, num_samples = len(prompts), len(completions)
    if num_prompts == 0 or num_samples % num_prompts:
        raise DynamicPromptsError(f"completions must be B = P*G per-sample completions; got {num_samples} for "
                                  f"P={num_prompts} prompts")
    g = num_samples // num_prompts
    if tuple(rewards.shape) != (num_samples,):
        raise DynamicPromptsError(f"rewards must be (B={num_samples},), got shape {tuple(rewards.shape)}")
    if len(metas) != num_prompts:
        raise DynamicPromptsError(f"metas must hold one dict per group (P={num_prompts}), got {len(metas)}")
    returned = dynamic_prompts_fn(
        [prompt for prompt in prompts for _ in range(g)],
        list(completions),
        [float(reward) for reward in rewards.tolist()],
        [dict(meta) for meta in metas for _ in range(g)],
    )
    return rows_for_next_generation(returned, prompts, metas, g)


def rows_for_next_generation(
    returned: Any, prompts: Sequence[Any], metas: Sequence[dict[str, Any]], num_generations: int
) -> list[dict[str, Any]]:
    """Check the hook's return value and turn it into the next generation's rows.

    The hook returns a list (or tuple) of length P (one per group: taken as they are) or B (one per sample:
    deduplicated in order, each distinct prompt once, so a group whose samples get different prompts, as in the
    seed's documented example, yields each of them). Each becomes a group of G completions of its own: the trainer
    queues them and draws every round's P prompts from the queue before the dataset (engine/train/prompt_queue.py has
    the policy, its cap and what happens past it). Each element is a prompt (str or message list) or a dataset row
    {"prompt": ..., **columns}. Columns reach the reward functions as TRL's reward kwargs do:
      * a dict row brings its own columns (and only those);
      * a str / message prompt equal to one of this generation's prompts keeps that row's columns (the row of the
        same group if its prompt is equal, else the first equal one), so rewards that read e.g. `answer` keep
        working on retried prompts;
      * a brand-new str / message prompt has no columns of its own (its value is None in columns other rows have);
        to keep a column (e.g. `answer` for a prompt with a hint appended), return a row {"prompt": ..., "answer": ...}.

    Args:
        returned: what dynamic_prompts_fn returned.
        prompts: the P prompts of the generation just scored.
        metas: their P dicts of other columns (carried over to returned prompts equal to one of them).
        num_generations: G.

    Returns:
        dicts with a "prompt" key: P for a per-group answer, the distinct prompts in order for a per-sample one.

    Raises:
        DynamicPromptsError naming the hook, the offending element and its type, or the counts expected.
    """
    num_prompts = len(prompts)
    num_samples = num_prompts * num_generations
    counts = (f"P={num_prompts} (one per group) or B=P*G={num_prompts}*{num_generations}={num_samples} "
              "(one per sample)")
    expected = (f"dynamic_prompts_fn must return the next generation's prompts, a list of {counts}: each a str, a "
                "list of {'role': ..., 'content': ...} messages, or a dataset row {'prompt': ..., **columns}")
    if not isinstance(returned, list | tuple):
        raise DynamicPromptsError(f"{expected}; it returned {type(returned).__name__}: {returned!r:.200}")
    if len(returned) not in (num_prompts, num_samples):
        raise DynamicPromptsError(f"dynamic_prompts_fn returned {len(returned)} prompts; the next generation needs "
                                  f"{counts}")
    for index, item in enumerate(returned):
        problem = _element_problem(item)
        if problem is not None:
            raise DynamicPromptsError(f"{expected}; element {index} is {problem}")
    if len(returned) == num_prompts:
        return [_as_row(item, position, prompts, metas) for position, item in enumerate(returned)]
    seen, rows = set(), []  # one per sample: each distinct prompt once, in the order returned
    for index, item in enumerate(returned):
        key = json.dumps(item, sort_keys=True, default=repr)
        if key not in seen:
            seen.add(key)
            rows.append(_as_row(item, index // num_generations, prompts, metas))
    return rows


def _as_row(item: Any, group: int, prompts: Sequence[Any], metas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A dataset row: dict rows as given; a prompt equal to one of this generation's keeps that row's columns (those
    of the group it was returned for first)."""
    if isinstance(item, dict):
        return dict(item)
    if prompts[group] == item:
        return {"prompt": item, **metas[group]}
    for prompt, meta in zip(prompts, metas, strict=True):
        if prompt == item:
            return {"prompt": item, **meta}
    return {"prompt": item}


def _element_problem(item: Any) -> str | None:
    """None if `item` is a valid prompt or a dataset row with a valid prompt; otherwise what it is."""
    if isinstance(item, dict):
        if "prompt" not in item:
            return f"a dict without a 'prompt' key (keys {sorted(item)})"
        return _prompt_problem(item["prompt"])
    return _prompt_problem(item)


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
