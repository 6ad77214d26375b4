"""The curriculum queue: the prompts the `dynamic_prompts_fn` hook returned, waiting for a round of their own.

Policy (the README's curriculum section says the same):
- every prompt the hook returns is trained with G completions of its own: a round takes its P prompts from the
  front of this queue, in the order they were returned, when the queue holds at least P of them; otherwise the round
  is the dataset's next P prompts and the queued ones keep waiting (a group never mixes prompts, and a round never
  mixes the queue with a dataset round, so the data position a checkpoint stores stays a count of dataset rounds);
- the hook's answers go to the back: P entries (one per group) as they are, B = P * G entries (one per sample)
  deduplicated in order (engine/grpo/dynamic_prompts.py), so the seed's documented example, which returns a
  different prompt per sample whenever a group's rewards differ in sign, trains each distinct prompt once;
- at most `capacity` prompts wait (`data.dynamic_prompts_queue_rounds` x P); prompts returned past that are dropped,
  counted (`curriculum/dropped`, cumulative) and warned about once per run: a hook that returns more distinct prompts
  than the rounds consume outruns any queue, and an unbounded one would train prompts chosen arbitrarily long ago;
- the queue is part of the checkpoint (`state` / `restore`), so a resumed run draws what the uninterrupted one would.

Owns: `PromptQueue`. Must not: call the hook, tokenize, or know the dataset (engine/train/sampling.py does).

Test: tests/unit/test_prompt_queue.py; in the loop: tests/integration/test_trainer.py (colocated),
test_async_rollout.py (server mode, k = 1), test_resume.py (resume with prompts waiting).
"""

from __future__ import annotations

import warnings
from typing import Any

from engine.train.data import PromptBatch


class PromptQueue:
    """Rows the hook returned, oldest first (module docstring)."""

    def __init__(self, capacity: int):
        """Args:
            capacity: the most prompts that may wait (`data.dynamic_prompts_queue_rounds` x prompts per round).
        """
        if capacity < 1:
            raise ValueError(f"the curriculum queue needs room for at least one prompt, got capacity {capacity}")
        self.capacity = capacity
        self.rows: list[dict[str, Any]] = []
        """Each {"index", "prompt", "prompt_ids", "columns"}: one returned prompt, tokenized."""
        self.num_dropped = 0
        """Prompts returned while the queue was full, over the run (resumed runs included)."""

    def __len__(self) -> int:
        return len(self.rows)

    def push(self, batch: PromptBatch) -> int:
        """Append the hook's rows in order; those past `capacity` are dropped (warned once). Returns how many were."""
        rows = [{"index": batch.indices[i], "prompt": batch.prompts[i], "prompt_ids": batch.prompt_ids[i],
                 "columns": {k: v[i] for k, v in batch.columns.items()}} for i in range(len(batch.prompts))]
        room = max(self.capacity - len(self.rows), 0)
        self.rows += rows[:room]
        dropped = len(rows) - min(room, len(rows))
        if dropped and not self.num_dropped:
            warnings.warn(f"dynamic_prompts_fn: the curriculum queue is full ({self.capacity} prompts = "
                          "data.dynamic_prompts_queue_rounds x prompts per round); prompts returned past it are "
                          "dropped and counted in curriculum/dropped (raise data.dynamic_prompts_queue_rounds, or "
                          "return fewer distinct prompts per round)", UserWarning, stacklevel=2)
        self.num_dropped += dropped
        return dropped

    def take(self, num_prompts: int) -> PromptBatch | None:
        """The oldest `num_prompts` rows as the next round's prompts, or None (nothing taken) when fewer wait."""
        if len(self.rows) < num_prompts:
            return None
        taken, self.rows = self.rows[:num_prompts], self.rows[num_prompts:]
        names = dict.fromkeys(name for row in taken for name in row["columns"])  # rows may carry different columns
        return PromptBatch(indices=[row["index"] for row in taken], prompts=[row["prompt"] for row in taken],
                           prompt_ids=[list(row["prompt_ids"]) for row in taken],
                           columns={name: [row["columns"].get(name) for row in taken] for name in names})

    def metrics(self) -> dict[str, float]:
        """`curriculum/queued` (prompts waiting now) and `curriculum/dropped` (over the run)."""
        return {"curriculum/queued": float(len(self.rows)), "curriculum/dropped": float(self.num_dropped)}

    def state(self) -> dict:
        """The checkpoint's record (the values the hook returned, as they came)."""
        return {"rows": self.rows, "num_dropped": self.num_dropped}

    def restore(self, state: dict | None) -> None:
        """Put a checkpoint's queue back; None (a checkpoint without one) leaves it empty."""
        if state:
            self.rows = [dict(row) for row in state["rows"]]
            self.num_dropped = int(state["num_dropped"])
