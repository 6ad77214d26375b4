"""TRL's `rollout_func(prompts, trainer) -> dict`: the user builds the rows; this module checks them against TRL's
contract and turns them into a `Rollout`.

Owns: `REQUIRED_KEYS` and `call_rollout_func` (the call, then: every required key present, one row per prompt in
every per-row key, each `logprobs` / `env_mask` row as long as its completion; errors name the key and the counts).
`env_mask` becomes the rollout's tool mask (0 = context, no gradient); every other key than the required ones and
`logprob_token_ids` reaches the reward functions (a list: one value per row; anything else: the same for every row).
A completion is truncated when its last token is not the tokenizer's EOS (or it is empty), as TRL decides.

The trainer argument: engine/api/trl_trainer.py passes the `GRPOTrainer` (weights are synced into the engine at the
end of every round, so the engine holds the current policy when the function runs); for a round generated ahead
(`rollout.max_staleness` > 0) a view of it as it was when the round was issued, in rank 0's background thread
(engine/api/trl_agentic.py `BoundRolloutFunc.for_round_ahead`); the engine's own loop passes None.

`RoundEngine` / `current_round()`: while the function runs, the round's rollout engine, seeds and group size, so
that TRL's `_generate_single_turn` on the trainer (engine/api/trl_generate.py) can generate with the engine from
inside it (a subclass's `_generate` override calling `super()._generate`).

Must not: generate (the function does), import vLLM.

Test: tests/unit/test_agent_tools.py.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.rollout.protocol import RolloutEngine
from engine.rollout.rollouts import Rollout

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")


@dataclass(frozen=True)
class RoundEngine:
    """The round a rollout_func call belongs to: what generating with the engine from inside it needs."""

    engine: RolloutEngine
    seeds: list[int] | None
    """One per prompt of the round (None: unseeded)."""
    num_generations: int
    max_completion_length: int
    cancelled: threading.Event | None = None
    """A round generated ahead: set when the run failed (generation from inside the function stops issuing turns)."""


_ROUND: contextvars.ContextVar[RoundEngine | None] = contextvars.ContextVar("rollout_round", default=None)


def current_round() -> RoundEngine | None:
    """The round whose rollout_func runs now (this thread), else None."""
    return _ROUND.get()


def call_rollout_func(rollout_func: Callable, prompts: list, tokenizer,
                      round_engine: RoundEngine | None = None) -> tuple[Rollout, dict[str, list]]:
    """Call `rollout_func(prompts)` (one prompt per row, G copies of each; `current_round()` is `round_engine`
    meanwhile) and check its answer.

    Returns:
        the rows as a `Rollout` (`tool_mask` = `env_mask` when given) and the extra per-row columns.
    Raises:
        ValueError: a missing key, a key with another number of rows than prompts, a row of `logprobs` / `env_mask`
            not as long as its completion.
    """
    token = _ROUND.set(round_engine)
    try:
        output = rollout_func(prompts)
    finally:
        _ROUND.reset(token)
    if not isinstance(output, dict):
        raise ValueError(f"rollout_func must return a dict with keys {list(REQUIRED_KEYS)}, got {type(output).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in output]
    if missing:
        raise ValueError(f"rollout_func must return keys {list(REQUIRED_KEYS)}: {missing} missing "
                         f"(it returned {sorted(output)})")
    num_rows = len(prompts)
    for key in (*REQUIRED_KEYS, "env_mask", "logprob_token_ids"):
        if key in output and len(output[key]) != num_rows:
            raise ValueError(f"rollout_func returned {len(output[key])} rows of {key!r} for {num_rows} prompts "
                             "(one row per prompt it was given)")
    completions = [list(c) for c in output["completion_ids"]]
    for key in ("logprobs", "env_mask"):
        for i, (row, completion) in enumerate(zip(output.get(key) or [], completions)):
            if len(row) != len(completion):
                raise ValueError(f"rollout_func: row {i} of {key!r} has {len(row)} values for its "
                                 f"{len(completion)} completion tokens")
    logprobs = [[float(x[0]) if isinstance(x, (list, tuple)) else float(x) for x in row] for row in output["logprobs"]]
    eos = tokenizer.eos_token_id
    is_truncated = [not c or c[-1] != eos for c in completions]
    mask = [[int(x) for x in row] for row in output["env_mask"]] if "env_mask" in output else None
    rollout = Rollout([list(p) for p in output["prompt_ids"]], completions, logprobs, is_truncated, tool_mask=mask)
    extra = {k: (v if isinstance(v, list) else [v] * num_rows) for k, v in output.items()
             if k not in (*REQUIRED_KEYS, "env_mask", "logprob_token_ids")}
    return rollout, extra
