"""What the training loop asks of a rollout engine, whichever mode serves it: the `RolloutEngine` protocol.

Owns: `RolloutEngine` (generate a round, prompt log-probs, push and verify the policy's weights, sleep / wake,
close, and one sample's next turn by token ids while other samples run), `PendingRollout` (a round asked for, not
yet shared) and the turn records `TurnRequest` / `TurnResult`.

Two implementations, chosen once in engine/train/run.py `build_run`: engine/rollout/colocated.py `ColocatedRollout`
(a vLLM engine in every training process) and engine/rollout/server_rollout.py `ServerRollout` (one or several
rollout servers over HTTP, weights over a transfer group each). The loop calls only these methods: it never asks
which mode it runs in.

Collective calls (every trainer rank, same order): `generate`, `PendingRollout.result`, `prompt_logprobs`,
`prompt_logprobs_each`, `sync_weights`. Turn calls (`submit_turn`, `collect_turns`) are not collective: they serve
one caller (multi-turn rollouts), which shares their results itself; rank 0 drives them inside
`driven_turns()` while the other ranks are in `follow_turns()` (a colocated engine at vLLM TP > 1 mirrors them).

Must not: import vLLM or know Megatron's layout (this is an interface only).

Test: tests/unit/test_rollout_protocol.py (both implementations satisfy it); the behaviour: tests/integration/
test_weight_sync.py (colocated turns), tests/integration/test_rollout_server.py (server turns).
"""

from __future__ import annotations

from collections.abc import Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from engine.rollout.rollouts import Rollout


@dataclass(frozen=True)
class TurnRequest:
    """One sample's next turn: continue `prompt_ids` (the whole conversation so far, as token ids: never
    re-tokenized) by at most `max_tokens` sampled tokens."""

    key: Hashable
    """The caller's name for the sample (returned with the result)."""
    prompt_ids: list[int]
    max_tokens: int
    """The turn's budget (what is left of `max_completion_length` after earlier turns and tool tokens)."""
    seed: int | None = None
    """vLLM's per-request sampling seed; None = the engine's own generator."""


@dataclass(frozen=True)
class TurnResult:
    """A finished turn: the tokens sampled after the request's `prompt_ids` and their log-probs (after temperature)."""

    key: Hashable
    completion_ids: list[int]
    sampling_logprobs: list[float]
    is_truncated: bool
    """True when the turn used its whole `max_tokens` without a stop token."""


@runtime_checkable
class PendingRollout(Protocol):
    """A round asked for (`RolloutEngine.generate_async`) whose rollout is shared by `result()`."""

    done_at: float | None
    """When the engine finished it (time.perf_counter on the asking rank; None before)."""
    regenerated: bool
    """True when the round had to be generated again after a lost server was resynced with the current weights."""

    def result(self) -> Rollout:
        """The round on every rank (collective)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """The loop's rollout engine (module docstring)."""

    runs_apart: bool
    """True when the engine has devices of its own (server mode): it generates while the trainer trains, and the
    trainer and the engine each wait for the other (`time/trainer_wait_s`, `time/rollout_wait_s`)."""

    def generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None = None) -> Rollout:
        """G completions per prompt, prompt-major, the whole round on every rank (collective). `seeds`: one vLLM
        sampling seed per prompt (None = the engines' own generators)."""

    def generate_async(self, prompt_ids: list[list[int]], num_generations: int,
                       seeds: list[int] | None = None) -> PendingRollout:
        """Start `generate`; the caller's work overlaps it where the engine runs apart. At most one in flight, and
        no `sync_weights` while it is."""

    def prompt_logprobs(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        """The engine's log-prob of every token after the first of each of this rank's sequences (collective; each
        rank its own sequences)."""

    def prompt_logprobs_each(self, sequences: list[list[int]], temperature: float) -> list[list[list[float]]]:
        """`prompt_logprobs` from each engine replica that holds its own copy of the weights (one per server)."""

    def sync_weights(self, chunks: list, *, verify: bool) -> dict[str, float]:
        """Push the policy's weights (its Megatron chunks) into the engine(s) (collective); with `verify`, every
        engine rank's digests of what it then holds are checked against what was sent: a WeightSyncError
        (engine/rollout/sync_check.py) names any tensor that differs. Returns `weight_sync/*` metrics."""

    def submit_turn(self, request: TurnRequest) -> None:
        """Start one sample's next turn; returns at once (the others keep running). Not collective."""

    def collect_turns(self, timeout_s: float | None = None) -> list[TurnResult]:
        """The turns finished since the last call: blocks until at least one is (or `timeout_s` passes, or none is
        in flight). Not collective."""

    def turn_channel(self) -> RolloutEngine:
        """An object with `submit_turn` / `collect_turns` / `wake_up` / `sleep` whose `collect_turns` returns only the
        turns submitted through it (a second driver of turns at the same time: a round generated ahead); an engine
        that serves one driver at a time returns itself. Not collective."""

    def driven_turns(self) -> AbstractContextManager:
        """Rank 0, around a multi-turn round it drives: a context manager giving the object its turns go through
        (`submit_turn` / `collect_turns` / `wake_up` / `sleep`; the engine itself where nothing else must run them).
        Colocated at vLLM TP > 1, the other ranks of rank 0's vLLM TP group run the same engine steps meanwhile
        (`follow_turns`), released when the block ends."""

    def follow_turns(self) -> None:
        """Every rank but 0, while rank 0 is in `driven_turns`: mirror its engine steps where this rank's engine is
        part of rank 0's (colocated, vLLM TP > 1); else return at once."""

    def recover(self, lost: Exception) -> None:
        """After `lost` (a RolloutServerLost raised on every rank, e.g. by a multi-turn round's turns): wait for the
        servers, sync the current weights into them again (collective); re-raises `lost` where nothing can be
        recovered (no server to lose, or no weights pushed yet)."""

    def sleep(self) -> None:
        """Free the engine's accelerator memory for training (a no-op where the engine runs apart)."""

    def wake_up(self) -> None:
        """Take the memory back before generating."""

    def close(self) -> None:
        """Release the engine (before the trainer's process groups are destroyed)."""
