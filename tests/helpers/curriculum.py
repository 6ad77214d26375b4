"""The seed's documented `dynamic_prompts_fn` example, verbatim, and what the tests need around it: a logging wrapper
(importable as a `module:function` path, so a run's config can name it), a reward that makes the summed reward
change sign within groups (the example's two branches), and a model of the curriculum queue's policy that a run's log is checked
against (engine/train/prompt_queue.py).
Must not: assert anything but the policy it models (the tests check the rest).
"""

from __future__ import annotations

import json
import os


def curriculum_fn(prompts, completions, rewards, metas):
    new_prompts = []
    for p, c, r in zip(prompts, completions, rewards):
        if r < 0:
            new_prompts.append(p + " // Hint: check your color setup in GLSL")
        else:
            new_prompts.append(p + " // Next: add moving gradient effect")
    return new_prompts


def logged_curriculum_fn(prompts, completions, rewards, metas):
    """`curriculum_fn`, with what it got and returned appended to the JSON-lines file $PROMPTS_LOG."""
    returned = curriculum_fn(prompts, completions, rewards, metas)
    with open(os.environ["PROMPTS_LOG"], "a") as log:
        log.write(json.dumps({"given": list(prompts), "returned": returned, "rewards": list(rewards)}) + "\n")
    return returned


def sign_by_prompt(prompts, completions, **kwargs):
    """For prompts of even length in characters, +0.5 / -0.5 for the group's completions in turn (added to a reward in
    [0, 1), the sum changes sign within the group: the example's two branches, so its answer differs per sample);
    -0.25 for the others (the sum is mostly negative and the group often uniform, so DAPO's dynamic sampling still
    finds groups whose rewards do not vary). Deterministic, whatever the completions."""
    return [0.5 * (-1) ** i if len(p) % 2 == 0 else -0.25 for i, p in enumerate(prompts)]


def check_queue_policy(calls: list[dict], num_prompts: int, num_generations: int, capacity: int,
                       max_staleness: int = 0) -> int:
    """Replay the queue over a run's hook calls (one per round scored, in order): round r is drawn once the rounds up
    to r - max_staleness - 1 were scored (the asynchronous pipeline requests k rounds ahead), from the queue's front
    when it holds P prompts (asserted: the round's prompts are exactly those), else from the dataset (asserted: not
    the queue's); then the round's answer, deduplicated in order, goes to the back up to `capacity`.

    Returns the rounds drawn from the queue (a test that expects the queue to be used asserts it is > 0).
    """
    queue, pushed, from_queue = [], 0, 0
    for r, call in enumerate(calls):
        while pushed <= r - max_staleness - 1:
            for prompt in dict.fromkeys(calls[pushed]["returned"]):
                if len(queue) < capacity:
                    queue.append(prompt)
            pushed += 1
        groups = call["given"][::num_generations]
        assert len(groups) == num_prompts and call["given"] == [p for p in groups for _ in range(num_generations)]
        if len(queue) >= num_prompts:
            assert groups == queue[:num_prompts], f"round {r} must train the queue's first {num_prompts} prompts"
            queue, from_queue = queue[num_prompts:], from_queue + 1
        else:
            assert not set(groups) & set(queue), f"round {r} is a dataset round: queued prompts wait"
    return from_queue
