"""Asynchronous rollout in server mode: the rollout server(s) generate the next round while the trainer trains on
this one, `rollout.max_staleness` (k) policy versions ahead at most, on a deterministic schedule.

Owns: `RolloutPipeline` (the rounds requested ahead of training: the completed ones waiting to be trained on, the
one being generated, the staleness and wait-time metrics, and their state in a checkpoint) and `PendingRound`. The
schedule, what is off-policy and how it is corrected, the interplay with DAPO, the curriculum hook and GFPO, and
checkpoints: `RolloutPipeline`'s docstring.

Must not: import vLLM, hold maths, or run collectives anywhere but in the caller's thread (the background thread
only makes rank 0's HTTP requests, and for multi-turn rounds runs rank 0's tool loop).

Test: tests/integration/test_async_rollout.py (two real servers; k = 0 equals the synchronous loop, k = 1 staleness
exactly 1 after warm-up, SIGKILL + resume at k = 1); multi-turn rounds ahead: tests/integration/test_agentic.py
(server mode, tools and environments, k = 1, resume). Benchmark: benchmarks/bench_async_rollout.py.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from engine.rollout.protocol import PendingRollout, RolloutEngine
from engine.rollout.rollouts import Rollout
from engine.train.data import PromptBatch
from engine.train.prompt_rounds import sampling_seeds


@dataclass
class PendingRound:
    """One round asked of the servers: its prompts and seeds, the optimizer step it starts at (which names its
    seeds), the policy version that samples it, and (once complete) its rollout, on every rank."""

    index: int
    """The round's number in the run (0 = the first round trained)."""
    step: int
    picked: PromptBatch
    seeds: list[int]
    version: int
    rollout: Rollout | None = None
    is_from_dataset: bool = True
    """False when the curriculum hook chose the prompts (the dataset's position did not move)."""
    extra: dict = field(default_factory=dict)
    """Rank 0, multi-turn rounds: the per-row values the reward functions receive besides the dataset's columns
    (`environments`, the prompts as shown: engine/agent/agentic_rollout.py `AgenticRound.columns`); never stored."""

    def to_state(self, with_rollout: bool = True) -> dict:
        """JSON values for a checkpoint (a complete round only; `with_rollout=False`: its prompts and seeds only,
        generated again on resume)."""
        return {"index": self.index, "step": self.step, "picked": asdict(self.picked), "seeds": self.seeds,
                "version": self.version, "rollout": self.rollout.to_json() if with_rollout else None,
                "is_from_dataset": self.is_from_dataset}

    @classmethod
    def from_state(cls, state: dict) -> PendingRound:
        rollout = Rollout.from_json(state["rollout"]) if state["rollout"] is not None else None
        return cls(state["index"], state["step"], PromptBatch(**state["picked"]), list(state["seeds"]),
                   state["version"], rollout, state.get("is_from_dataset", True))


class RolloutPipeline:
    """The rounds generated ahead of training. Every rank holds the same pipeline and makes the same calls in the
    same order; only rank 0's client talks HTTP.

    The schedule (verl's one-step-off-policy generalised; NeMo-RL's `max_trajectory_age_steps`): a policy *version* is
    the number of rounds trained (version 0 = the initial weights), round r is sampled from version max(0, r - k), and
    the weights of version v are pushed and verified before generation of round v + k starts. At the start of round
    r's iteration the pipeline holds rounds r .. r+k-1, complete; `fill` asks for round r+k (rank 0, a background
    thread: the HTTP requests overlap the trainer's forward/backward passes); the trainer trains on round r (version
    r -> r+1), `complete` waits for round r+k, and only then are the weights of version r+1 pushed: the servers never
    generate while their weights change (the push happens between generation rounds, so nothing of vLLM's own
    pause/resume is needed; the pause it costs is `time/rollout_wait_s`), and one generate request per server is in
    flight at any time. So every round is sampled by one known version with per-prompt seeds, whatever the timing:
    runs are reproducible and a resumed run logs what the uninterrupted one did.

    What is off-policy and how it is corrected: the trainer recomputes the old log-probs at its current version
    (engine/train/round_batch.py `add_old_and_ref_logprobs`), so the PPO ratio and clip are taken against the current policy,
    and the sampler/learner gap (k versions plus the engine's numerics) is corrected by TRL's vLLM importance-sampling
    correction (`grpo.vllm_importance_sampling_correction`, engine/grpo/policy_loss.py): this is AReaL's decoupled PPO
    with the proximal policy recomputed (`prox_logp_method: recompute`, arXiv 2505.24298), and verl's rollout
    correction with `bypass_mode` off; TRL's AsyncGRPOTrainer instead takes vLLM's log-probs as the old ones.

    Interplay (each deterministic): DAPO's dynamic sampling takes round r's first attempt from the pipeline and samples
    any further attempts synchronously from the servers' current weights (version r, staleness 0; they are counted in
    the staleness metrics); the curriculum hook's prompts (`data.dynamic_prompts_fn`), queued after round r is scored
    (engine/train/prompt_queue.py), feed the rounds requested from then on, round r+k+1 first: k rounds later than in
    the synchronous loop; GFPO filters the round as it comes.

    Checkpoints: a checkpoint is written at the end of a round's iteration, when no request is in flight; it records
    the k completed rounds waiting to be trained on (their prompts, seeds, completions, sampling log-probs and versions:
    they were sampled by weights the checkpoint no longer holds, so they are stored, not regenerated); resume puts them
    back and asks for the next round exactly as the uninterrupted run did. Multi-turn rounds (`start_round` given,
    `stores_rounds` False: their environment instances and the per-row values their reward functions read cannot be
    stored) are recorded by their prompts and seeds only: resume generates them again, in order, from the restored
    weights (their staleness is then 0, and `regenerated_note` says so in a warning), before any new round; the
    data position and the curriculum's prompts are kept. A server lost while a round is in flight is
    handled as in the synchronous loop (engine/rollout/client.py `SharedRolloutClient`: wait, resync the current
    weights, ask again: that round is then sampled by the current version, and its staleness says so); a multi-turn
    round the same way (engine/train/sampling.py `PendingAgenticRound.result`: the whole round is generated again).
    """

    def __init__(self, engine: RolloutEngine, draw_prompts: Callable[[], tuple[PromptBatch, bool]], max_staleness: int,
                 *, seed: int, num_generations: int, version: int, steps_per_round: int, total_rounds: int,
                 start_round: Callable[[PromptBatch, list[int]], PendingRollout] | None = None,
                 stores_rounds: bool = True):
        """
        Args:
            engine: the run's engine (one that runs apart: `generate_async` overlaps training).
            draw_prompts: the next round's prompts and whether they came from the dataset (engine/train/run.py
                `draw_prompts`: called at request time, so a checkpoint's data position counts the rounds requested).
            max_staleness: k >= 1.
            seed: `train.seed` (the rounds' sampling seeds, engine/train/prompt_rounds.py).
            num_generations: G.
            version: rounds trained so far (0 on a fresh run; the checkpoint's on resume).
            steps_per_round: optimizer steps per round (round r starts at optimizer step r * steps_per_round).
            total_rounds: rounds the run trains on (none is requested beyond).
            start_round: starts one round (its prompts, their seeds) and returns its handle; None =
                `engine.generate_async` (single-turn). Multi-turn: engine/train/sampling.py `PendingAgenticRound`,
                whose handle also carries the round's `extra`.
            stores_rounds: False: a checkpoint records the rounds ahead without their rollouts (class docstring).
        """
        if max_staleness < 1:
            raise ValueError(f"the pipeline needs max_staleness >= 1, got {max_staleness} (0 = the synchronous loop)")
        self.engine, self.draw_prompts, self.k = engine, draw_prompts, max_staleness
        self.seed, self.num_generations = seed, num_generations
        self.steps_per_round, self.total_rounds = steps_per_round, total_rounds
        self.start_round = start_round or (lambda picked, seeds: engine.generate_async(
            picked.prompt_ids, num_generations, seeds=seeds))
        self.stores_rounds = stores_rounds
        self.ready: deque[PendingRound] = deque()
        self.redo: deque[PendingRound] = deque()
        """Rounds a checkpoint recorded without rollouts: generated again, in order, before any new one."""
        self.in_flight: tuple[PendingRound, PendingRollout] | None = None
        self.next_index = version
        """The next round to request."""
        self._waited_s = 0.0  # trainer blocked on generation since the last `take_wait_times`
        self._idle_s = 0.0  # servers idle (waiting for weights) since the last `take_wait_times`
        self._done_at: float | None = None  # rank 0: when the last request finished (perf_counter)

    # --- requests -------------------------------------------------------------------------------------------------

    def _request(self, version: int) -> tuple[PendingRound, PendingRollout]:
        """Pick round `next_index`'s prompts (the curriculum queue's next P, else the dataset's next round),
        its seeds, and start generating it with policy `version` (rank 0's background thread); a round to generate
        again (`redo`) first, with its own prompts and seeds."""
        if self.redo:
            pending = self.redo.popleft()
            pending.version = version
        else:
            picked, is_from_dataset = self.draw_prompts()
            step = self.next_index * self.steps_per_round
            seeds = sampling_seeds(self.seed, step, 0, picked.indices)
            pending = PendingRound(self.next_index, step, picked, seeds, version=version,
                                   is_from_dataset=is_from_dataset)
            self.next_index += 1
        if self._done_at is not None:
            self._idle_s += time.perf_counter() - self._done_at
            self._done_at = None
        return pending, self.start_round(pending.picked, pending.seeds)

    def _finish(self, pending: PendingRound, handle: PendingRollout, version: int) -> PendingRound:
        """Wait for a request (rank 0), share its rollout with every rank (collective)."""
        start = time.perf_counter()
        pending.rollout = handle.result()
        pending.extra = getattr(handle, "extra", {})
        self._waited_s += time.perf_counter() - start
        self._done_at = handle.done_at if handle.done_at is not None else time.perf_counter()
        if handle.regenerated:  # a restarted server was resynced with the current weights, which sampled it
            pending.version = version
        return pending

    def fill(self, version: int) -> None:
        """Before training round r (the trainer holding policy `version`): rounds r .. r+k-1 complete (generated
        synchronously while fewer: the warm-up, rounds 0 .. k-1, all by version 0), round r+k requested. Collective."""
        while len(self.ready) < self.k and self._has_more() and self.in_flight is None:
            self.ready.append(self._finish(*self._request(version), version))
        if self.in_flight is None and self._has_more() and len(self.ready) <= self.k:
            self.in_flight = self._request(version)  # (more than k ready: a checkpoint of a larger k, drained first)

    def _has_more(self) -> bool:
        return bool(self.redo) or self.next_index < self.total_rounds

    def take(self) -> PendingRound:
        """Round r, the oldest complete one (`fill` has made sure there is one). Not collective."""
        return self.ready.popleft()

    def complete(self, version: int) -> None:
        """After training round r, before the weights of `version` (r+1) are pushed: wait for round r+k. Collective."""
        if self.in_flight is not None:
            pending, handle = self.in_flight
            self.in_flight = None
            self.ready.append(self._finish(pending, handle, version))

    def cancel(self) -> bool:
        """After a failed run (engine/train/loop.py `abort`; not collective, no rollout is shared): the round in flight,
        if its handle can be cancelled (a multi-turn round: its thread stops issuing turns and is joined, bounded),
        is dropped. False when its thread did not stop in time. A single-turn request is left to end (the engine's
        close waits for its HTTP answer)."""
        if self.in_flight is None:
            return True
        _, handle = self.in_flight
        self.in_flight = None
        cancel = getattr(handle, "cancel", None)
        return cancel() if cancel is not None else True

    # --- metrics and state ------------------------------------------------------------------------------------------

    def num_dataset_rounds_ahead(self) -> int:
        """Rounds drawn from the dataset but not trained on yet (the data position runs this far ahead of training)."""
        ahead = list(self.ready) + list(self.redo) + ([self.in_flight[0]] if self.in_flight is not None else [])
        return sum(p.is_from_dataset for p in ahead)

    def take_wait_times(self) -> dict[str, float]:
        """Seconds the trainer waited for generation and the servers waited for weights since the last call."""
        out = {"time/trainer_wait_s": self._waited_s, "time/rollout_wait_s": self._idle_s}
        self._waited_s = self._idle_s = 0.0
        return out

    def state(self) -> dict:
        """The checkpoint's record (called with nothing in flight): the complete rounds not yet trained on (without
        their rollouts when `stores_rounds` is False: class docstring)."""
        if self.in_flight is not None:
            raise RuntimeError("a checkpoint is written between rounds: a request is still in flight")
        rounds = [p.to_state(self.stores_rounds) for p in self.ready] + [p.to_state(False) for p in self.redo]
        return {"max_staleness": self.k, "next_index": self.next_index, "ready": rounds}

    def restore(self, state: dict | None) -> None:
        """Put a checkpoint's complete rounds back (resume). A checkpoint written at a smaller max_staleness, or by
        the synchronous loop, holds fewer or none: `fill` generates what is missing from the restored weights; one
        of a larger max_staleness holds more, which are trained on before the next request."""
        if not state:
            return
        rounds = [PendingRound.from_state(p) for p in state["ready"]]
        self.ready = deque(p for p in rounds if p.rollout is not None)
        self.redo = deque(p for p in rounds if p.rollout is None)
        self.next_index = state["next_index"]

    def regenerated_note(self) -> str | None:
        """After `restore`: the warning for rounds the checkpoint held without rollouts (None when there are none)."""
        if not self.redo:
            return None
        return (f"resumed with {len(self.redo)} multi-turn round(s) generated ahead of the checkpoint (rounds "
                f"{[p.index for p in self.redo]}): a checkpoint cannot hold their environment instances and reward "
                "inputs, so it recorded their prompts and seeds only; they are generated again now by the restored "
                "weights (staleness 0), so the run from here differs from the uninterrupted one")


def rewind_rounds_ahead(state: dict | None, rounds) -> None:
    """Resuming synchronously (max_staleness 0, or colocated) from a checkpoint that holds rounds generated ahead:
    move the data position back over the ones drawn from the dataset, so their prompts are sampled again by the
    current policy instead of being skipped."""
    if state:
        rounds.position -= sum(p.get("is_from_dataset", True) for p in state["ready"])


def staleness_metrics(versions: list[int], current: int) -> dict[str, float]:
    """`rollout/staleness_mean` / `_max`: policy versions between the sampler and the trainer, over the completions."""
    if not versions:
        return {}
    gaps = [current - v for v in versions]
    return {"rollout/staleness_mean": sum(gaps) / len(gaps), "rollout/staleness_max": float(max(gaps))}
