"""Sampling and scoring one generation batch: G completions per prompt from every engine, the rewards, DAPO's
dynamic sampling, the curriculum hook's next prompts, GFPO's filter, and the held-out evaluation.

Owns: `generate_everywhere` (each engine generates a contiguous share of the prompts, gathered so every rank holds
the round; in server mode rank 0 asks the server(s)), `Scored` (one generation batch with its (B, K) rewards),
`sample_and_score` (with `grpo.use_dynamic_sampling`, further rounds until enough groups' rewards vary),
`queue_prompts` (the user's `dynamic_prompts_fn` on rank 0, broadcast, its prompts queued), `keep_best_in_groups` (GFPO's
`group_filter_func` on rank 0, broadcast), `score` (the reward functions on rank 0 with TRL's contract, broadcast)
`score_held_out` (held-out completions scored on rank 0; engine/train/evaluation.py reports TRL's eval metrics of
them) and `evaluate` (mean weighted reward of `num_generations_eval` completions per held-out prompt). Every rank makes the same choices:
whatever rank 0 decides is broadcast before anyone uses it.

Must not: hold maths (engine/grpo/: advantages, dynamic sampling, group filtering), build or train the model
(engine/train/run.py, engine/train/loop.py), or import vLLM (engine/rollout/vllm_engine.py).

Test: tests/integration/test_trainer.py (`test_dynamic_sampling_gfpo_dynamic_prompts_and_completions_table`: each
batch's groups, the hook's prompts); the choices themselves: tests/unit/test_dynamic_sampling.py,
test_group_filter.py, test_dynamic_prompts.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import torch
import torch.distributed as dist

from engine.grpo.advantages import aggregate_rewards
from engine.grpo.dynamic_sampling import assemble_rounds, find_informative_groups, is_dynamic_batch_full, select_dynamic_batch
from engine.grpo.group_filter import filter_groups
from engine.policy.parallel import ParallelState
from engine.rollout.vllm_engine import Rollout
from engine.train.data import PromptBatch
from engine.train.prompt_rounds import sampling_seeds
from engine.train.rollout_pipeline import staleness_metrics
from engine.train.run import Run, draw_prompts


def generate_everywhere(run: Run, prompt_ids: list[list[int]], num_generations: int,
                        seeds: list[int] | None = None) -> Rollout:
    """Every engine generates a contiguous share of the prompts (the ranks of one vLLM TP group the same share);
    the shares are gathered so every rank holds the whole round, prompt-major. `seeds`: one vLLM sampling seed per
    prompt (engine/train/prompt_rounds.py), shared out with the prompts; None = the engines' own generators."""
    if run.cfg.rollout.vllm_mode == "server":  # rank 0 asks the server, every rank gets the round
        return run.engine.generate(prompt_ids, num_generations, seeds=seeds)
    ps, vllm_tp = run.ps, run.cfg.rollout.vllm_tensor_parallel_size
    num_groups, group = ps.world_size // vllm_tp, ps.rank // vllm_tp
    share = -(-len(prompt_ids) // num_groups)
    mine = prompt_ids[group * share : (group + 1) * share]
    run.engine.wake_up()
    mine_seeds = seeds[group * share : (group + 1) * share] if seeds is not None else None
    local = run.engine.generate(mine, num_generations, seeds=mine_seeds) if mine else Rollout.empty()
    run.engine.sleep()
    gathered: list = [None] * ps.world_size
    dist.all_gather_object(gathered, local)
    return Rollout.concat(gathered[::vllm_tp])


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


def sample_and_score(run: Run, rounds, step: int) -> Scored:
    """G completions for each prompt of the next round, scored. With `grpo.use_dynamic_sampling` (DAPO), further
    rounds of P prompts until P groups whose rewards vary are found (at most `dynamic_sampling_max_rounds`), then
    the batch is assembled from those groups, topped up with uninformative ones when short
    (engine/grpo/dynamic_sampling.py). Every rank makes the same choices: the rewards are broadcast before choosing."""
    gr, g = run.cfg.grpo, run.cfg.grpo.num_generations
    num_prompts = run.derived.num_prompts_per_generation
    parts, informative, seconds = [], [], {"time/rollout_s": 0.0, "time/reward_s": 0.0}
    versions = []  # the policy version that sampled each completion of every attempt
    for attempt in range(gr.dynamic_sampling_max_rounds if gr.use_dynamic_sampling else 1):
        start = time.perf_counter()
        if attempt == 0 and run.pipeline is not None:  # asynchronous rollout: generated while the last round trained
            pending = run.pipeline.take()
            picked, rollout, version = pending.picked, pending.rollout, pending.version
        else:
            picked, _ = draw_prompts(run, rounds)
            seeds = sampling_seeds(run.cfg.train.seed, step, attempt, picked.indices)
            rollout, version = generate_everywhere(run, picked.prompt_ids, g, seeds), run.policy_version
        versions.append([version] * len(rollout.completion_ids))
        middle = time.perf_counter()
        rewards, completions = score(run, picked, rollout, step)
        queue_prompts(run, picked, completions, rewards)
        seconds["time/rollout_s"] += middle - start
        seconds["time/reward_s"] += time.perf_counter() - middle
        parts.append(Scored(picked, rollout, rewards, completions, g))
        if not gr.use_dynamic_sampling:
            stats = seconds | staleness_metrics(versions[0], run.policy_version) | curriculum_metrics(run)
            return replace(parts[0], stats=stats)
        informative.append(find_informative_groups(aggregate_rewards(rewards, run.rewards.weights), g))
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
    completions = per_row(lambda p: p.completions) if run.ps.rank == 0 else []
    stats = seconds | staleness_metrics(assemble_rounds(versions, selection, g), run.policy_version) | curriculum_metrics(run) | {
                       "dynamic_sampling/rounds": len(parts),
                       "dynamic_sampling/informative_fraction": selection.num_informative / num_prompts}
    return Scored(picked, rollout, per_row(lambda p: p.rewards), completions, g, stats)


def queue_prompts(run: Run, picked: PromptBatch, completions: list, rewards: torch.Tensor) -> None:
    """The user's `dynamic_prompts_fn` (rank 0) gets this round's results, one element per sample
    (engine/grpo/dynamic_prompts.py); the rows it returns are broadcast, tokenized on every rank like the dataset's
    (same checks) and queued for rounds of their own (engine/train/prompt_queue.py). Nothing without the hook."""
    if run.dynamic_prompts is None:
        return
    import datasets

    from engine.train.data import prepare_prompts
    from engine.grpo.dynamic_prompts import call_dynamic_prompts_fn

    rows = [None]
    if run.ps.rank == 0:
        aggregated = aggregate_rewards(rewards, run.rewards.weights)  # (B,)
        metas = [{k: v[i] for k, v in picked.columns.items()} for i in range(len(picked.prompts))]  # P dicts
        rows = [call_dynamic_prompts_fn(run.dynamic_prompts, picked.prompts, completions, aggregated, metas)]
    dist.broadcast_object_list(rows, src=0)
    names = dict.fromkeys(name for row in rows[0] for name in row)  # rows may carry different columns: None fills
    dataset = datasets.Dataset.from_dict({name: [row.get(name) for row in rows[0]] for name in names})
    data = run.cfg.data
    prepared = prepare_prompts(dataset, run.tokenizer, max_prompt_length=data.max_prompt_length,
                               overlong_prompt_policy="error", chat_template_kwargs=run.cfg.generation.chat_template_kwargs)
    run.prompt_queue.push(prepared.select(range(len(prepared))))


def curriculum_metrics(run: Run) -> dict[str, float]:
    """`curriculum/queued` and `curriculum/dropped` with the hook, after this round's prompts were queued."""
    return run.prompt_queue.metrics() if run.prompt_queue is not None else {}


def keep_best_in_groups(run: Run, scored: Scored) -> Scored:
    """GFPO: keep the `num_remains_in_group` best completions of each group by the user's `group_filter_func`
    (called on rank 0 with aligned groups, engine/grpo/group_filter.py); the kept rows are broadcast. Without
    `num_remains_in_group`, the batch as it is."""
    k = run.cfg.grpo.num_remains_in_group
    if k is None:
        return scored
    keep = torch.empty(len(scored.picked.prompts) * k, dtype=torch.long)  # (P * k,)
    if run.ps.rank == 0:
        rewards = aggregate_rewards(scored.rewards, run.rewards.weights)  # (P * G,)
        keep = filter_groups(run.group_filter, scored.completions, rewards, scored.group_size, k)
    keep = _broadcast_from_rank0(keep, run.ps)
    rows = keep.tolist()
    rollout = scored.rollout.select(rows)
    completions = [scored.completions[i] for i in rows] if scored.completions else []
    return replace(scored, rollout=rollout, rewards=scored.rewards[keep], completions=completions, group_size=k)


def score(run: Run, picked, rollout: Rollout, step: int) -> tuple[torch.Tensor, list]:
    """(B, K) rewards, NaN = None, and the decoded completions (rank 0; [] elsewhere): rank 0 calls the reward
    functions with TRL's contract, then broadcasts the rewards."""
    g = run.cfg.grpo.num_generations
    rewards = torch.empty(len(rollout.completion_ids), len(run.rewards.names))
    completions = []
    if run.ps.rank == 0:
        texts = run.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if run.train_prompts.is_conversational else texts
        prompts = [p for p in picked.prompts for _ in range(g)]
        columns = {k: [v for v in values for _ in range(g)] for k, values in picked.columns.items()}
        state = SimpleNamespace(global_step=step, max_steps=run.total_steps)
        log = run.logger
        rewards = run.rewards(prompts, completions, rollout.completion_ids, columns, trainer_state=state,
                              log_extra=log.log_extra, log_metric=log.log_metric)
    rewards = _broadcast_from_rank0(rewards, run.ps)
    return rewards, completions


def _broadcast_from_rank0(tensor: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Rank 0's tensor on every rank, back on the CPU (sent on the backend's device: NCCL moves CUDA tensors only)."""
    on_device = tensor.to(ps.device)
    dist.broadcast(on_device, src=0)
    return on_device.cpu()


def score_held_out(run: Run, prompts, num_prompts: int, g: int) -> tuple[Rollout, torch.Tensor]:
    """`g` completions of each of the first `num_prompts` prompts, scored on rank 0 (TRL's reward contract).

    Returns:
        the rollout (every rank) and the (num_prompts * g, K) rewards (rank 0; NaN = None; empty elsewhere).
    """
    picked = prompts.select(list(range(num_prompts)))
    rollout = generate_everywhere(run, picked.prompt_ids, g)
    rewards = torch.empty(0)
    if run.ps.rank == 0:
        texts = run.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if prompts.is_conversational else texts
        repeated = [p for p in picked.prompts for _ in range(g)]  # prompt-major, as the engine returns them
        columns = {k: [v for v in values for _ in range(g)] for k, values in picked.columns.items()}
        rewards = run.rewards(repeated, completions, rollout.completion_ids, columns)  # (P * g, K)
    return rollout, rewards


def evaluate(run: Run) -> float | None:
    """Mean weighted reward over the held-out prompts, `grpo.num_generations_eval` sampled completions each (None =
    num_generations, TRL's meaning), on the whole eval set or its first `data.eval_max_prompts` prompts (a printed
    line says so when that cuts). The same value on every rank; None without an eval set."""
    if run.eval_prompts is None:
        return None
    gr, limit, total = run.cfg.grpo, run.cfg.data.eval_max_prompts, len(run.eval_prompts)
    num_prompts = total if limit is None else min(limit, total)
    g = gr.num_generations_eval or gr.num_generations
    if num_prompts < total and run.ps.rank == 0:
        print(f"evaluation: the first {num_prompts} of {total} held-out prompts (data.eval_max_prompts={limit}), "
              f"{g} completions each", flush=True)
    _, rewards = score_held_out(run, run.eval_prompts, num_prompts, g)
    mean = torch.zeros(1)
    if run.ps.rank == 0:
        weights = run.rewards.weights if run.rewards.weights is not None else torch.ones(rewards.shape[1])
        mean[0] = torch.nanmean((rewards * weights).nansum(1))
    mean = _broadcast_from_rank0(mean, run.ps)
    return float(mean)
