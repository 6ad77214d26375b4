"""Multi-turn rounds on a colocated engine at vLLM TP > 1: one rank drives, the other ranks of its vLLM TP group
mirror every engine call.

Owns: `MirroredTurns` (the driver's turn channel: each engine step is one "wave" broadcast to the group, the turns
submitted since the last step in order, then one step on every rank; `end` closes the round and checks that every
rank finished the same turns with the same tokens) and `follow_turns` (a follower's loop: the waves until `end`).

Why: the engines of one vLLM TP group (`external_launcher`) each run their own scheduler and meet in the model's
collectives, so every rank must add the same requests in the same order and step the same number of times. The
tools, environments and per-sample turn logic live on the driver (rank 0, where the reward functions run); the
followers only run their engine. A sample whose tool calls return joins the next step's wave (continuous batching),
as at TP 1. A turn without a seed gets one drawn by the driver (sent in the wave): each rank's engine would otherwise
sample from its process's global generator, which the trainer's processes need not hold in the same state.

Cost relative to TP 1 / server mode: one small object broadcast per engine step, and the followers' engine shares
stand idle while the driver handles finished turns (the driver's own engine does too at TP 1; a server steps on its
own time). Only rank 0's TP group generates a multi-turn round: other groups' engines idle, as at TP 1 with DP > 1.

Must not: import vLLM (engine/rollout/vllm_engine.py), read Megatron's parallel state.

Test: tests/integration/test_agentic.py (a tool run at colocated vLLM TP 2 against the TP 1 run).
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import replace

import torch.distributed as dist

from engine.rollout.protocol import TurnRequest, TurnResult

STEP, WAKE, SLEEP, END = "step", "wake", "sleep", "end"
"""A wave's operation: add its turns then one engine step; wake the engine; put it to sleep; the round is over."""


class MirroredTurns:
    """The driver's channel (`submit_turn` / `collect_turns` / `wake_up` / `sleep`, engine/rollout/protocol.py):
    every engine call it makes is broadcast first to the other ranks of its vLLM TP group (module docstring)."""

    def __init__(self, engine, group, src: int):
        """`engine`: this rank's engine/rollout/vllm_engine.py `ColocatedEngine`; `group`: the process group of the
        vLLM TP group (None = the whole world); `src`: this (the driving) rank, global."""
        self.engine, self.group, self.src = engine, group, src
        self._pending: list[TurnRequest] = []
        self._in_flight = 0
        self._digest = hashlib.sha256()
        self._seeds = random.Random()
        self.num_waves = 0
        """Waves broadcast so far (engine steps of the round)."""

    def submit_turn(self, request: TurnRequest) -> None:
        """Queued for the next wave (a seed drawn here when it has none)."""
        if request.seed is None:
            request = replace(request, seed=self._seeds.randrange(2**31))
        self._pending.append(request)

    def collect_turns(self, timeout_s: float | None = None) -> list[TurnResult]:
        """Waves (each: the queued turns, then one step on every rank) until a turn finishes or, after a whole
        step, `timeout_s` has passed; none in flight or queued: [] at once."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._pending or self._in_flight:
            added, self._pending = self._pending, []
            self._send((STEP, added))
            done = _step(self.engine, added, self._digest)
            self._in_flight += len(added) - len(done)
            if done or (deadline is not None and time.monotonic() >= deadline):
                return done
        return []

    def wake_up(self) -> None:
        self._send((WAKE, None))
        self.engine.wake_up()

    def sleep(self) -> None:
        self._send((SLEEP, None))
        self.engine.sleep()

    def end(self, completed: bool) -> None:
        """The round is over: the followers leave `follow_turns`. `completed` (the round was not abandoned by an
        error): every rank's digest of the turns it finished must equal the driver's, else RuntimeError (the
        engines diverged: their rows would not be the ones the driver's engine sampled)."""
        self._send((END, completed))
        if completed:
            _check_same_turns(self._digest.hexdigest(), self.group, self.num_waves)

    def _send(self, wave: tuple) -> None:
        dist.broadcast_object_list([wave], src=self.src, group=self.group)
        self.num_waves += wave[0] == STEP


def follow_turns(engine, group, src: int) -> None:
    """A follower's side of a round driven by `src` (every rank of its vLLM TP group but the driver): apply every
    wave to this rank's engine until the driver's `end`; then the digest check (`MirroredTurns.end`)."""
    digest, num_waves = hashlib.sha256(), 0
    while True:
        held = [None]
        dist.broadcast_object_list(held, src=src, group=group)
        op, payload = held[0]
        if op == STEP:
            _step(engine, payload, digest)
            num_waves += 1
        elif op == WAKE:
            engine.wake_up()
        elif op == SLEEP:
            engine.sleep()
        elif op == END:
            if payload:
                _check_same_turns(digest.hexdigest(), group, num_waves)
            return
        else:
            raise RuntimeError(f"follow_turns: unknown wave {op!r} from rank {src}")


def _step(engine, added: list[TurnRequest], digest) -> list[TurnResult]:
    """Add the wave's turns in order, run one engine step; the finished turns, fed to `digest`."""
    for request in added:
        engine.add_turn(request)
    done = engine.step_turns(0.0)  # a whole step, then the deadline has passed: exactly one
    for result in done:
        digest.update(repr((result.key, result.completion_ids, result.is_truncated)).encode())
    return done


def _check_same_turns(mine: str, group, num_waves: int) -> None:
    """Every rank of the group gathers every digest; the driver (the group's first rank) raises on a difference."""
    size = dist.get_world_size(group)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, (mine, num_waves), group=group)
    if len(set(gathered)) > 1 and dist.get_rank() == min(dist.get_process_group_ranks(group) if group else [0]):
        raise RuntimeError(f"colocated vLLM TP {size}: the engine ranks of one TP group finished different turns "
                           f"(digest, waves per rank: {gathered}): their engines diverged")
