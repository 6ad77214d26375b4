"""Sampling and scoring one generation batch: G completions per prompt from every engine, the rewards, DAPO's
dynamic sampling, the curriculum hook's next prompts, GFPO's filter, and the held-out evaluation.

Owns: `RoundSampler` (the components and config sections sampling reads: the engine, rewards, tokenizer, prompts,
hooks and the curriculum queue; `grpo`, `data`, `generation`; never the root config), `draw_prompts` (the next
round's P prompts: the curriculum queue's, else the dataset's), `Scored` (one generation batch with its (B, K) rewards),
`sample_and_score` (with `grpo.use_dynamic_sampling`, further rounds until enough groups' rewards vary),
`queue_prompts` (the user's `dynamic_prompts_fn` on rank 0, broadcast, its prompts queued), `keep_best_in_groups` (GFPO's
`group_filter_func` on rank 0, broadcast), `score` (the reward functions on rank 0 with TRL's contract, broadcast)
`score_held_out` (held-out completions scored on rank 0; engine/train/evaluation.py reports TRL's eval metrics of
them), `evaluate` (mean weighted reward of `num_generations_eval` completions per held-out prompt) and
`PendingAgenticRound` (a multi-turn round generated ahead: rank 0's background thread drives it). Every rank makes
the same choices: whatever rank 0 decides is broadcast before anyone uses it.

Must not: hold maths (engine/grpo/: advantages, dynamic sampling, group filtering), build or train the model
(engine/train/run.py, engine/train/loop.py), or import vLLM (engine/rollout/vllm_engine.py).

Test: tests/integration/test_trainer.py (`test_dynamic_sampling_gfpo_dynamic_prompts_and_completions_table`: each
batch's groups, the hook's prompts); the choices themselves: tests/unit/test_dynamic_sampling.py,
test_group_filter.py, test_dynamic_prompts.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.agent.agentic_rollout import PROMPTS_KEY, AgenticRollout
from engine.agent.chat_tokens import completion_messages
from engine.config import DataConfig, GenerationConfig, GRPOConfigSection
from engine.grpo.advantages import aggregate_rewards
from engine.grpo.dynamic_sampling import (
    assemble_rounds,
    find_informative_groups,
    is_dynamic_batch_full,
    select_dynamic_batch,
)
from engine.grpo.group_filter import filter_groups
from engine.policy.parallel import ParallelState
from engine.rollout.client import RolloutServerLost
from engine.rollout.protocol import RolloutEngine
from engine.rollout.rollouts import Rollout
from engine.train.data import PromptBatch, PromptDataset
from engine.train.metric_logger import MetricLogger
from engine.train.prompt_queue import PromptQueue
from engine.train.prompt_rounds import PromptRounds, sampling_seeds
from engine.train.rewards import RewardFunctions
from engine.train.rollout_pipeline import RolloutPipeline, staleness_metrics

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


CANCEL_JOIN_S = 30.0
"""After a failed run: how long the background thread of a round generated ahead is waited for once cancelled (it
stops within engine/agent/multi_turn.py `CANCEL_POLL_S` unless a user's function holds it)."""


@dataclass
class RoundSampler:
    """What sampling and scoring a round reads (engine/train/run.py `build_run` makes it once)."""

    engine: RolloutEngine
    rewards: RewardFunctions
    tokenizer: PreTrainedTokenizerBase
    ps: ParallelState
    train_prompts: PromptDataset
    eval_prompts: PromptDataset | None
    logger: MetricLogger | None
    """Rank 0 only (the reward functions' `log_extra` / `log_metric`)."""
    grpo: GRPOConfigSection
    data: DataConfig
    generation: GenerationConfig
    seed: int
    """`train.seed`: the rounds' vLLM sampling seeds (engine/train/prompt_rounds.py)."""
    num_prompts: int
    """P: prompts per generation round."""
    total_steps: int
    """Optimizer steps of the run (the reward functions' `trainer_state.max_steps`)."""
    group_filter: Callable | None = None
    """GFPO's `group_filter_func` (the object given, else imported from `grpo.group_filter_func`), or None."""
    dynamic_prompts: Callable | None = None
    """The `dynamic_prompts_fn` hook (the object given, else imported from `data.dynamic_prompts_fn`), or None."""
    prompt_queue: PromptQueue | None = None
    """The prompts the hook returned, waiting for rounds of their own (engine/train/prompt_queue.py); None without
    the hook."""
    agentic: AgenticRollout | None = None
    """Multi-turn rollouts (`tools`, `environment_factory`, `rollout_func`; engine/agent/), driven on rank 0;
    None = single-turn `engine.generate`."""


def draw_prompts(sampler: RoundSampler, rounds: PromptRounds) -> tuple[PromptBatch, bool]:
    """The next round's P prompts: the curriculum queue's front when P wait (engine/train/prompt_queue.py), else
    the dataset's next round; and whether they came from the dataset (the data position moved)."""
    queued = sampler.prompt_queue.take(sampler.num_prompts) if sampler.prompt_queue is not None else None
    return (queued, False) if queued is not None else (sampler.train_prompts.select(next(rounds)), True)


@dataclass
class Scored:
    """One generation batch, scored: P prompts and their completions, prompt-major (`group_size` per prompt)."""

    picked: PromptBatch
    """The P prompts (one row each; the engine made the G copies)."""
    rollout: Rollout
    rewards: torch.Tensor
    """(P * group_size, K) rewards per function, NaN = None; the same on every rank."""
    completions: list
    """The decoded completions (str or message lists) the reward functions saw; rank 0 only ([] elsewhere)."""
    group_size: int
    stats: dict = field(default_factory=dict)


def sample_and_score(sampler: RoundSampler, rounds: PromptRounds, step: int, *, version: int,
                     pipeline: RolloutPipeline | None = None) -> Scored:
    """G completions for each prompt of the next round, scored. With `grpo.use_dynamic_sampling` (DAPO), further
    rounds of P prompts until P groups whose rewards vary are found (at most `dynamic_sampling_max_rounds`), then
    the batch is assembled from those groups, topped up with uninformative ones when short
    (engine/grpo/dynamic_sampling.py). Every rank makes the same choices: the rewards are broadcast before choosing.

    Args:
        version: the policy version the trainer holds (rounds trained): it samples what is generated now.
        pipeline: asynchronous rollout: round r's first attempt was generated ahead (engine/train/rollout_pipeline.py).
    """
    grpo, g, num_prompts = sampler.grpo, sampler.grpo.num_generations, sampler.num_prompts
    parts, informative, seconds = [], [], {"time/rollout_s": 0.0, "time/reward_s": 0.0}
    versions = []  # the policy version that sampled each completion of every attempt
    for attempt in range(grpo.dynamic_sampling_max_rounds if grpo.use_dynamic_sampling else 1):
        start = time.perf_counter()
        if attempt == 0 and pipeline is not None:  # asynchronous rollout: generated while the last round trained
            pending = pipeline.take()
            picked, rollout, sampled_by, extra = pending.picked, pending.rollout, pending.version, pending.extra
        else:
            picked, _ = draw_prompts(sampler, rounds)
            seeds = sampling_seeds(sampler.seed, step, attempt, picked.indices)
            (rollout, extra), sampled_by = generate(sampler, picked, g, seeds), version
        versions.append([sampled_by] * len(rollout.completion_ids))
        middle = time.perf_counter()
        rewards, completions = score(sampler, picked, rollout, step, extra)
        release_environments(sampler, extra)
        queue_prompts(sampler, picked, completions, rewards)
        seconds["time/rollout_s"] += middle - start
        seconds["time/reward_s"] += time.perf_counter() - middle
        parts.append(Scored(picked, rollout, rewards, completions, g))
        if not grpo.use_dynamic_sampling:
            stats = seconds | staleness_metrics(versions[0], version) | curriculum_metrics(sampler) | rollout.stats
            return replace(parts[0], stats=stats)
        informative.append(find_informative_groups(aggregate_rewards(rewards, sampler.rewards.weights), g))
        if is_dynamic_batch_full(informative, num_prompts):
            break
    selection = select_dynamic_batch(informative, num_prompts)
    per_prompt = lambda get: assemble_rounds([get(p) for p in parts], selection, 1)  # noqa: E731
    per_row = lambda get: assemble_rounds([get(p) for p in parts], selection, g)  # noqa: E731
    picked = PromptBatch(per_prompt(lambda p: p.picked.indices), per_prompt(lambda p: p.picked.prompts),
                         per_prompt(lambda p: p.picked.prompt_ids),
                         {k: per_prompt(lambda p, k=k: p.picked.columns.get(k, [None] * len(p.picked.prompts)))
                          for k in dict.fromkeys(k for p in parts for k in p.picked.columns)})  # hook rows may lack columns
    starts = [sum(len(q.rollout) for q in parts[:i]) for i in range(len(parts))]  # each round's first row
    rows = assemble_rounds([list(range(start, start + len(p.rollout))) for start, p in zip(starts, parts)], selection, g)
    rollout = Rollout.concat([p.rollout for p in parts]).select(rows)
    completions = per_row(lambda p: p.completions) if sampler.ps.rank == 0 else []
    tool_stats = [p.rollout.stats for p in parts if p.rollout.stats]  # multi-turn: the attempts' mean
    stats = {k: sum(t[k] for t in tool_stats) / len(tool_stats) for k in (tool_stats[0] if tool_stats else {})}
    stats |= seconds | staleness_metrics(assemble_rounds(versions, selection, g), version) | curriculum_metrics(sampler) | {
                       "dynamic_sampling/rounds": len(parts),
                       "dynamic_sampling/informative_fraction": selection.num_informative / num_prompts}
    return Scored(picked, rollout, per_row(lambda p: p.rewards), completions, g, stats)


def generate(sampler: RoundSampler, picked: PromptBatch, g: int, seeds: list[int] | None) -> tuple[Rollout, dict]:
    """G completions per prompt of `picked` on every rank, and (rank 0) the per-row values the reward functions
    receive besides the dataset columns. Multi-turn (engine/agent/): rank 0 drives every sample, then broadcasts
    (the other ranks follow its engine steps meanwhile where their engine is part of its: `follow_turns`)."""
    if sampler.agentic is None:
        return sampler.engine.generate(picked.prompt_ids, g, seeds), {}

    def drive():  # rank 0; colocated at vLLM TP > 1 the other ranks of its TP group mirror its engine steps
        with sampler.engine.driven_turns() as engine:
            return sampler.agentic.generate(engine, picked.prompts, picked.prompt_ids, picked.columns, g, seeds)

    try:
        return _shared_round(sampler, drive, "a multi-turn round", sampler.engine.follow_turns)
    except RolloutServerLost as lost:  # as single-turn rounds: wait for the servers, resync, ask once more
        sampler.engine.recover(lost)
        return _shared_round(sampler, drive, "a multi-turn round", sampler.engine.follow_turns)


def _shared_round(sampler: RoundSampler, drive: Callable, what: str,
                  follow: Callable | None = None) -> tuple[Rollout, dict]:
    """Rank 0 runs `drive()` (an `AgenticRound`), the others `follow()` meanwhile (when given); every rank gets its
    rollout, rank 0 its reward columns too. A failure reaches every rank: RolloutServerLost (a server gone or
    restarted: the caller recovers), else the error itself on rank 0 and a RuntimeError naming it on the others
    (which would otherwise wait in the broadcast)."""
    held: list = [None]
    extra: dict = {}
    failure: BaseException | None = None
    if sampler.ps.rank != 0 and follow is not None:
        follow()
    if sampler.ps.rank == 0:
        try:
            done = drive()
            held, extra = [("ok", done.rollout)], done.columns
        except RolloutServerLost as lost:
            held = [("lost", str(lost))]
        except Exception as e:  # noqa: BLE001 - raised on every rank below, not only here
            failure, held = e, [("error", f"{what} failed on rank 0: {type(e).__name__}: {e}")]
    dist.broadcast_object_list(held, src=0)
    status, value = held[0]
    if status == "lost":
        raise RolloutServerLost(value)
    if status == "error":
        raise failure if failure is not None else RuntimeError(value)
    return value, extra


class PendingAgenticRound:
    """A multi-turn round generated ahead (engine/train/rollout_pipeline.py, `rollout.max_staleness` > 0, server mode):
    rank 0's background thread drives its samples' turns against the servers and runs their tools while the trainer
    trains (`AgenticRollout.generate`, as `generate` does synchronously; a `rollout_func` runs there too, on a view of
    the trainer: engine/api/trl_agentic.py `BoundRolloutFunc.for_round_ahead` says what it may touch and why);
    `result()` shares the rollout (collective)
    and keeps the reward functions' per-row values in `extra` (rank 0). Off-policy rows are corrected as single-turn
    ones: the behaviour log-probs are the engine's per sampled token, tool tokens masked (tool_mask).

    The pipeline's `PendingRollout` (engine/rollout/protocol.py): the pipeline asks one round at a time and pushes
    weights only between rounds, so the servers never change weights under a turn. A failure on rank 0 (a tool loop
    error) is raised on every rank by `result()`; a lost server is recovered from as for a single-turn round
    (`result`); a failed run cancels the round (`cancel`, engine/train/loop.py `abort`)."""

    def __init__(self, sampler: RoundSampler, picked: PromptBatch, num_generations: int, seeds: list[int]):
        self.sampler, self.request = sampler, (picked, num_generations, seeds)
        self.done_at: float | None = None
        self.regenerated = False
        self.extra: dict = {}
        self._future = None
        self._cancelled = threading.Event()
        if sampler.ps.rank == 0:
            # its own tokenizer (the trainer's thread decodes meanwhile); a rollout_func bound to a view of the
            # trainer as it is now, at the step the round is issued (engine/api/trl_agentic.py `BoundRolloutFunc`)
            agentic = sampler.agentic.for_round_ahead()
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentic-ahead")
            self._future = self._executor.submit(self._run, agentic, picked, num_generations, seeds)

    def _run(self, agentic, picked: PromptBatch, num_generations: int, seeds: list[int]):
        try:
            channel = self.sampler.engine.turn_channel()  # its own turns: the trainer's thread may drive others
            return agentic.generate(channel, picked.prompts, picked.prompt_ids, picked.columns,
                                    num_generations, seeds, cancelled=self._cancelled)
        finally:
            self.done_at = time.perf_counter()

    def cancel(self, timeout_s: float = CANCEL_JOIN_S) -> bool:
        """After a failed run (engine/train/loop.py `abort`; not collective): no further turn is issued, the round's
        environment instances go back to the pool (`AgenticRollout.generate` releases them as it stops), and the
        background thread is joined, `timeout_s` at most. False when it did not stop in time (a user's
        `rollout_func` or environment `reset` still running: it is left to end on its own)."""
        self._cancelled.set()
        if self._future is None:
            return True
        try:
            wait([self._future], timeout=timeout_s)
            stopped = self._future.done()
            self._executor.shutdown(wait=stopped, cancel_futures=True)
            return stopped
        finally:
            self._future = None

    def result(self) -> Rollout:
        """The rollout on every rank (collective). A server lost while the round was driven (gone, or restarted
        since the last sync): as a single-turn round (engine/rollout/client.py `PendingGenerate`), every rank waits
        for the servers, the current weights are synced into them again, and the round is generated again now
        (synchronously, same prompts and seeds; `regenerated`: it is sampled by the current version)."""
        future = self._future

        def done():
            try:
                return future.result()
            finally:
                self._executor.shutdown(wait=False)

        try:
            rollout, self.extra = _shared_round(self.sampler, done, "a multi-turn round generated ahead")
        except RolloutServerLost as lost:
            self.regenerated = True
            self.sampler.engine.recover(lost)
            rollout, self.extra = generate(self.sampler, *self.request)
        finally:
            self._future = None
        return rollout


def release_environments(sampler: RoundSampler, extra: dict) -> None:
    """Rank 0, multi-turn: the round's environment instances are free again (its rewards are computed)."""
    if sampler.agentic is not None and extra:
        sampler.agentic.release(extra)


def queue_prompts(sampler: RoundSampler, picked: PromptBatch, completions: list, rewards: torch.Tensor) -> None:
    """The user's `dynamic_prompts_fn` (rank 0) gets this round's results, one element per sample
    (engine/grpo/dynamic_prompts.py); the rows it returns are broadcast, tokenized on every rank like the dataset's
    (same checks) and queued for rounds of their own (engine/train/prompt_queue.py). Nothing without the hook."""
    if sampler.dynamic_prompts is None:
        return
    import datasets

    from engine.grpo.dynamic_prompts import call_dynamic_prompts_fn
    from engine.train.data import prepare_prompts

    rows = [None]
    if sampler.ps.rank == 0:
        aggregated = aggregate_rewards(rewards, sampler.rewards.weights)  # (B,)
        metas = [{k: v[i] for k, v in picked.columns.items()} for i in range(len(picked.prompts))]  # P dicts
        rows = [call_dynamic_prompts_fn(sampler.dynamic_prompts, picked.prompts, completions, aggregated, metas)]
    dist.broadcast_object_list(rows, src=0)
    names = dict.fromkeys(name for row in rows[0] for name in row)  # rows may carry different columns: None fills
    dataset = datasets.Dataset.from_dict({name: [row.get(name) for row in rows[0]] for name in names})
    prepared = prepare_prompts(dataset, sampler.tokenizer, max_prompt_length=sampler.data.max_prompt_length,
                               overlong_prompt_policy="error",
                               chat_template_kwargs=sampler.generation.chat_template_kwargs)
    sampler.prompt_queue.push(prepared.select(range(len(prepared))))


def curriculum_metrics(sampler: RoundSampler) -> dict[str, float]:
    """`curriculum/queued` and `curriculum/dropped` with the hook, after this round's prompts were queued."""
    return sampler.prompt_queue.metrics() if sampler.prompt_queue is not None else {}


def keep_best_in_groups(sampler: RoundSampler, scored: Scored) -> Scored:
    """GFPO: keep the `num_remains_in_group` best completions of each group by the user's `group_filter_func`
    (called on rank 0 with aligned groups, engine/grpo/group_filter.py); the kept rows are broadcast. Without
    `num_remains_in_group`, the batch as it is."""
    k = sampler.grpo.num_remains_in_group
    if k is None:
        return scored
    keep = torch.empty(len(scored.picked.prompts) * k, dtype=torch.long)  # (P * k,)
    if sampler.ps.rank == 0:
        rewards = aggregate_rewards(scored.rewards, sampler.rewards.weights)  # (P * G,)
        keep = filter_groups(sampler.group_filter, scored.completions, rewards, scored.group_size, k)
    keep = _broadcast_from_rank0(keep, sampler.ps)
    rows = keep.tolist()
    rollout = scored.rollout.select(rows)
    completions = [scored.completions[i] for i in rows] if scored.completions else []
    return replace(scored, rollout=rollout, rewards=scored.rewards[keep], completions=completions, group_size=k)


def score(sampler: RoundSampler, picked: PromptBatch, rollout: Rollout, step: int,
          extra: dict | None = None) -> tuple[torch.Tensor, list]:
    """(B, K) rewards, NaN = None, and the decoded completions (rank 0; [] elsewhere): rank 0 calls the reward
    functions with TRL's contract, then broadcasts the rewards. `extra`: per-row values besides the dataset's
    columns (multi-turn: `environments`, rollout_func's keys). Multi-turn completions of conversational prompts are
    messages: assistant turns and tool messages (engine/agent/chat_tokens.py `completion_messages`)."""
    g = sampler.grpo.num_generations
    rewards = torch.empty(len(rollout.completion_ids), len(sampler.rewards.names))
    completions = []
    if sampler.ps.rank == 0:
        texts = sampler.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        is_conversational = sampler.train_prompts.is_conversational
        completions = [[{"role": "assistant", "content": t}] for t in texts] if is_conversational else texts
        if rollout.tool_mask is not None and is_conversational:
            completions = [completion_messages(sampler.tokenizer, ids, mask)
                           for ids, mask in zip(rollout.completion_ids, rollout.tool_mask)]
        extra = dict(extra or {})
        prompts = extra.pop(PROMPTS_KEY, None) or [p for p in picked.prompts for _ in range(g)]
        columns = {k: [v for v in values for _ in range(g)] for k, values in picked.columns.items()} | extra
        state = SimpleNamespace(global_step=step, max_steps=sampler.total_steps)
        log = sampler.logger
        rewards = sampler.rewards(prompts, completions, rollout.completion_ids, columns, trainer_state=state,
                                  log_extra=log.log_extra, log_metric=log.log_metric)
    rewards = _broadcast_from_rank0(rewards, sampler.ps)
    return rewards, completions


def _broadcast_from_rank0(tensor: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Rank 0's tensor on every rank, back on the CPU (sent on the backend's device: NCCL moves CUDA tensors only)."""
    on_device = tensor.to(ps.device)
    dist.broadcast(on_device, src=0)
    return on_device.cpu()


def score_held_out(sampler: RoundSampler, prompts: PromptDataset, num_prompts: int,
                   g: int) -> tuple[Rollout, torch.Tensor]:
    """`g` completions of each of the first `num_prompts` prompts, scored on rank 0 (TRL's reward contract).

    Returns:
        the rollout (every rank) and the (num_prompts * g, K) rewards (rank 0; NaN = None; empty elsewhere).
    """
    picked = prompts.select(list(range(num_prompts)))
    rollout, extra = generate(sampler, picked, g, None)  # multi-turn as in training
    rewards = torch.empty(0)
    if sampler.ps.rank == 0:
        texts = sampler.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if prompts.is_conversational else texts
        repeated = [p for p in picked.prompts for _ in range(g)]  # prompt-major, as the engine returns them
        repeated = extra.pop(PROMPTS_KEY, None) or repeated
        columns = {k: [v for v in values for _ in range(g)] for k, values in picked.columns.items()} | extra
        rewards = sampler.rewards(repeated, completions, rollout.completion_ids, columns)  # (P * g, K)
        release_environments(sampler, extra)
    return rollout, rewards


def evaluate(sampler: RoundSampler) -> float | None:
    """Mean weighted reward over the held-out prompts, `grpo.num_generations_eval` sampled completions each (None =
    num_generations, TRL's meaning), on the whole eval set or its first `data.eval_max_prompts` prompts (a printed
    line says so when that cuts). The same value on every rank; None without an eval set."""
    if sampler.eval_prompts is None:
        return None
    grpo, limit, total = sampler.grpo, sampler.data.eval_max_prompts, len(sampler.eval_prompts)
    num_prompts = total if limit is None else min(limit, total)
    g = grpo.num_generations_eval or grpo.num_generations
    if num_prompts < total and sampler.ps.rank == 0:
        print(f"evaluation: the first {num_prompts} of {total} held-out prompts (data.eval_max_prompts={limit}), "
              f"{g} completions each", flush=True)
    _, rewards = score_held_out(sampler, sampler.eval_prompts, num_prompts, g)
    mean = torch.zeros(1)
    if sampler.ps.rank == 0:
        weights = sampler.rewards.weights if sampler.rewards.weights is not None else torch.ones(rewards.shape[1])
        mean[0] = torch.nanmean((rewards * weights).nansum(1))
    mean = _broadcast_from_rank0(mean, sampler.ps)
    return float(mean)
