"""The GRPO training loop: `train(cfg)` reads top to bottom (docs/contributing/house-rules.md), one generation round per iteration:

    prompts -> rollout (a `RolloutEngine`, engine/rollout/protocol.py: colocated or server(s), chosen once by
    engine/train/run.py) -> rewards (rank 0, broadcast) -> advantages -> old / ref log-probs -> num_iterations x
    optimizer steps over micro-batches -> weight sync, verified -> metrics -> checkpoint on schedule

Owns: `train`, the round's order and its hook points (`run_rounds`) and the record it logs (`log_round`: TRL's metric
names); the batch it trains on (TRL's batch semantics) is built by engine/train/round_batch.py. Built once,
resumed, saved and synced: engine/train/run.py; sampled and scored: engine/train/sampling.py; generated ahead
(`rollout.max_staleness` > 0): engine/train/rollout_pipeline.py; checkpoints and SIGUSR1: engine/train/checkpoint.py.

Must not: hold maths (engine/grpo/), ask which mode the engine runs in, import vLLM, or read Megatron's global
parallel state (engine/policy/parallel.py hands out groups).

Run: `grpo-engine train configs/tiny_cpu.yaml`; test: tests/integration/test_trainer.py (colocated),
tests/integration/test_rollout_server.py and test_async_rollout.py (server), tests/integration/test_resume.py.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.grpo.advantages import compute_advantages
from engine.grpo.metrics import (
    compute_completion_metrics,
    compute_loss_metrics,
    compute_reward_metrics,
    compute_sampling_metrics,
)
from engine.log_filters import quiet_library_logs
from engine.policy.microbatch import MicroBatch
from engine.policy.parallel import destroy_parallel
from engine.policy.reference import mix_reference_if_due
from engine.policy.step import clear_moe_aux_loss, grpo_forward_backward, take_moe_aux_loss
from engine.train.checkpoint import Progress, StopSignal, checkpoint_dir, is_save_step
from engine.train.evaluation import evaluate_sets, tokenize_eval_sets
from engine.train.hooks import LoopHooks, on_rank0, scheduled_evaluation
from engine.train.prompt_rounds import PromptRounds
from engine.train.rollout_pipeline import RolloutPipeline, rewind_rounds_ahead
from engine.train.round_batch import (
    add_old_and_ref_logprobs,
    build_round,
    eval_loss,
    per_step_microbatches,
    step_schedule,
)
from engine.train.run import (
    REFERENCE_EXPORT_SUFFIX,
    Run,
    build_run,
    check_finite,
    export_policy,
    export_reference,
    resume,
    save_run,
    sync_and_verify,
)
from engine.train.sampling import (
    PendingAgenticRound,
    Scored,
    draw_prompts,
    evaluate,
    keep_best_in_groups,
    sample_and_score,
)
from engine.train.step_schedule import OptimizerStep, StepSchedule


def train(cfg: EngineConfig, *, hooks: LoopHooks | None = None, export_dir: str | Path | None = None,
          **inputs) -> dict:
    """Run GRPO from a config; returns the held-out reward before and after (rank 0), the last metrics, and this
    call's optimizer steps (`start_step` -> `steps`, `start_step` > 0 when resumed) and tokens (`num_tokens`).

    `inputs` are the TRL-style API's (engine/api/trl_trainer.py), in memory on every rank: `train_dataset` /
    `eval_dataset` (datasets.Dataset) replace `cfg.data`'s splits, `reward_funcs` (callables and/or config strings)
    replaces `cfg.reward.reward_funcs`, `tokenizer` replaces the model directory's; `group_filter_func` /
    `dynamic_prompts_fn` (any callables: functions of the user's script, lambdas, instances) replace
    `cfg.grpo.group_filter_func` / `cfg.data.dynamic_prompts_fn` (see engine/train/run.py `resolve_hooks`); `agentic`
    holds TRL's `tools`, `environment_factory` and `rollout_func` (multi-turn rollouts, engine/agent/;
    engine/train/run.py `build_agentic`). `export_dir` receives the final policy as a Hugging Face checkpoint
    (collective). `hooks` (engine/train/hooks.py `LoopHooks`, GRPOTrainer's callbacks: engine/api/trl_callbacks.py)
    hear of the run's progress on rank 0 (train begin, epoch begin / end, each optimizer step's begin / end, the
    round's logged record) and may ask for evaluations (engine/train/evaluation.py), checkpoints and a stop, agreed
    by every rank at the round boundary.

    On any exception, first release what the run holds (`abort`: engines, reward threads, Megatron's parallel state,
    the process group), so that a new run can start in the same process.
    """
    quiet_library_logs(cfg.logging.verbose)  # before Megatron and vLLM are imported (engine/log_filters.py)
    stop, run = StopSignal().install(), None  # SIGUSR1 from now on: save at the next round boundary, then exit
    try:
        run = build_run(cfg, **inputs)
        return run_rounds(run, stop, hooks if hooks is not None else LoopHooks(), export_dir)
    except BaseException:
        stop.uninstall()
        abort(run)
        raise


@dataclass
class LoopState:
    """What the loop carries from one round to the next."""

    step: int
    """Optimizer steps done (resumed: from the checkpoint's)."""
    num_tokens: int
    """TRL's num_tokens: prompt + completion tokens seen so far (resumed: from the checkpoint's)."""
    rounds: PromptRounds
    """Which prompts each round draws (engine/train/prompt_rounds.py)."""
    schedule: StepSchedule
    """Which slices of which rounds form each optimizer step (engine/train/step_schedule.py)."""
    saved_at: int | None
    """The step of the last checkpoint (the resumed one's; None: none yet)."""
    last: dict = field(default_factory=dict)
    """The last logged record."""
    save_due: bool = False
    """A checkpoint fell due while slices were carried: written at the next boundary without any."""
    eval_sets: dict = field(default_factory=dict)
    """The hooks' eval datasets, tokenized at their first evaluation."""


@dataclass
class RoundTimes:
    """time.perf_counter() at the round's phase boundaries."""

    start: float
    reward: float = 0.0
    logprob: float = 0.0
    train: float = 0.0
    wait: float = 0.0
    end: float = 0.0


@dataclass
class TrainedRound:
    """What step 3 produced: the round's optimizer steps' micro-batches, the steps taken and their outputs."""

    units: list[OptimizerStep]
    """Every optimizer step's micro-batches this round brought (some may be carried to the next round)."""
    outputs: list
    """Each optimizer step's forward_backward outputs; empty when every slice was carried."""
    stats: dict
    """The optimizer's and the entropy controller's metrics of the last step."""
    moe: dict
    """The MoE metrics (router agreement, the load-balancing loss)."""


def run_rounds(run: Run, stop: StopSignal, hooks: LoopHooks, export_dir: str | Path | None) -> dict:
    """The rounds, one per iteration, each a named step; before them the resumed state and the held-out evaluation,
    after them the final checkpoint, evaluation and export (`finish_training`).

    Checkpoints: every `checkpoint.save_steps` optimizer steps at the end of a round, at the end of training, and at
    the end of the round in which SIGUSR1 arrived (then the run exits); when optimizer steps span rounds
    (engine/train/step_schedule.py) a save or stop that falls due while slices are carried waits for the next round
    that carries none; `resume_from_checkpoint` restores model, optimizer, scheduler, RNG, data position, step and
    the loop's carried state (adaptive entropy, the curriculum queue, rounds generated ahead) before the first round,
    and loads the restored weights into the engines. Rounds do not depend on history (engine/train/prompt_rounds.py),
    so a resumed run logs what the uninterrupted one would have. With `save_hf_at_end` the final policy is also
    exported to `<output_dir>/hf`.
    """
    progress = resume(run)  # model, optimizer, scheduler, RNG, data position, step; the weights into the engines
    before = evaluate(run.sampler)
    state = start_loop(run, progress)
    if on_rank0(run.ps, hooks.train_begin, state.step, run.total_steps).evaluate:  # eval_on_start
        scheduled_evaluation(run, hooks, state.step, state.eval_sets, loss_of=eval_loss)
    while state.step < run.total_steps:
        times = RoundTimes(start=time.perf_counter())
        epoch_before = begin_round(run, hooks, state)
        # 1. rollout and rewards: G completions for each prompt of the round, scored on rank 0 and broadcast;
        #    with dynamic sampling (DAPO), further rounds until the batch holds enough groups whose rewards vary.
        #    Asynchronous (k > 0): this round was generated by version r - k while earlier rounds trained; round
        #    r + k is asked for now and generated while this one trains
        scored = roll_out(run, state)
        # 2. GFPO keeps the best num_remains_in_group completions of each group; advantages over whole groups
        scored, adv, batch = score_round(run, scored, state.step)
        # 3. old (and reference) log-probs of this rank's rows, then num_iterations passes of optimizer steps
        #    (with slices carried from the last round first, when steps span rounds: engine/train/step_schedule.py)
        trained = optimize(run, state, hooks, batch, epoch_before, times)
        # 4. weight sync into every engine, verified on a probe of this round (asynchronous: once round r + k,
        #    sampled by the previous version, is complete: the servers never generate while their weights change)
        sync = sync_weights(run, trained, times)
        # 5. metrics (TRL names), logged on rank 0
        epoch_after = log_metrics(run, state, scored, adv, batch, trained, sync, times)
        # 6. the hooks (callbacks): evaluate, save or stop when asked
        asked = report_round(run, hooks, state.step, epoch_before, epoch_after, trained=bool(trained.outputs))
        if asked.evaluate:
            scheduled_evaluation(run, hooks, state.step, state.eval_sets, loss_of=eval_loss)
        # 7. checkpoint: SIGUSR1 on any rank -> save at this round boundary and leave; else on schedule. A
        #    checkpoint holds no carried slice: while some are carried, both wait for the next round without any
        if not checkpoint_round(run, state, hooks, stop, asked, len(trained.outputs)):
            break
    return finish_training(run, state, stop, hooks, progress, before, export_dir)


def start_loop(run: Run, progress: Progress) -> LoopState:
    """The loop's state at the first round: the resumed step, tokens and data position, the optimizer steps'
    schedule, and the rollout pipeline (`start_pipeline`)."""
    rounds = PromptRounds(len(run.sampler.train_prompts), run.derived.num_prompts_per_generation, run.cfg.train.seed,
                          run.cfg.train.shuffle_dataset, start=progress.rounds_done)
    start_pipeline(run, rounds, progress)  # max_staleness k > 0 (server mode): rounds generated ahead of training
    return LoopState(step=progress.step, num_tokens=progress.num_tokens, rounds=rounds, schedule=step_schedule(run),
                     saved_at=progress.step if run.resume_from else None)


def begin_round(run: Run, hooks: LoopHooks, state: LoopState) -> float:
    """The epoch before the round (HF's fraction of the dataset); the hooks hear when the round starts a pass."""
    epoch_before = epoch(run, state.rounds)
    if epoch_before == int(epoch_before):  # this round starts a pass over the dataset
        on_rank0(run.ps, hooks.epoch_begin, epoch_before, agree=False)
    return epoch_before


def roll_out(run: Run, state: LoopState) -> Scored:
    """Step 1: the round's completions and rewards (asked of the pipeline first when rounds are generated ahead)."""
    if run.pipeline is not None:
        run.pipeline.fill(run.policy_version)
    return sample_and_score(run.sampler, state.rounds, state.step, version=run.policy_version, pipeline=run.pipeline)


def score_round(run: Run, scored: Scored, step: int):
    """Step 2: GFPO's filter, the advantages, the logged completions and the round as tensors (every rank: the whole
    round, rows shuffled); returns (scored, advantages, batch)."""
    scored = keep_best_in_groups(run.sampler, scored)
    adv = compute_advantages(scored.rewards, scored.group_size, run.rewards.weights,
                             run.cfg.grpo.scale_rewards, run.cfg.reward.multi_objective_aggregation)
    log_completions(run, scored, adv.advantages)
    return scored, adv, build_round(run, scored.rollout, adv.advantages, step)


def optimize(run: Run, state: LoopState, hooks: LoopHooks, batch: MicroBatch, epoch_before: float,
             times: RoundTimes) -> TrainedRound:
    """Step 3: this rank's micro-batches with their old (and reference) log-probs, then the optimizer steps the
    schedule takes this round (`state.step` counts them); a diverged policy is refused before any sync."""
    ps, grpo = run.ps, run.cfg.grpo
    units = per_step_microbatches(run, batch, slices=state.schedule.units_per_step > 1)
    times.reward = time.perf_counter()
    moe = add_old_and_ref_logprobs(run, units)
    times.logprob = time.perf_counter()
    outputs, stats = [], {}
    ends_pass = int(epoch(run, state.rounds)) > int(epoch_before)
    steps = state.schedule.take(units, ends_pass=ends_pass, steps_left=run.total_steps - state.step)
    clear_moe_aux_loss()
    for optimizer_step in steps:
        on_rank0(ps, hooks.step_begin, state.step, agree=False)
        run.optimizer.zero_grad()
        out = grpo_forward_backward(run.optimizer.model, ps, optimizer_step.microbatches, run.loss_config,
                                    optimizer_step.normalizer, run.settings,
                                    entropy_coef=run.entropy.coef_to_apply(grpo))
        outputs.append(out)
        stats = run.optimizer.step() | run.entropy.update(grpo, ps, out)
        state.step += 1
        mix_reference_if_due(run.reference, run.optimizer.model, grpo, state.step)  # TR-DPO
        on_rank0(ps, hooks.step_end, state.step, agree=False)
    run.policy_version += bool(outputs)  # a round whose slices were all carried changed no weight
    aux = take_moe_aux_loss(run.optimizer.model, ps, sum(len(s.microbatches) for s in steps))
    moe |= {} if aux is None else {"aux_loss": aux}  # TRL's key: MoE load-balancing loss, unweighted
    check_finite(run, state.step, [o.loss for out in outputs for o in out])  # a diverged policy is never synced
    times.train = time.perf_counter()
    return TrainedRound(units, outputs, stats, moe)


def sync_weights(run: Run, trained: TrainedRound, times: RoundTimes) -> dict:
    """Step 4: the new weights into every engine, verified (nothing when no step was taken); its metrics."""
    if run.pipeline is not None:
        run.pipeline.complete(run.policy_version)
    times.wait = time.perf_counter()
    # the probe routes by itself on both sides: the engine's routes of this round came from the old weights
    run.last_probe = trained.units[0].microbatches[0].without_routes()
    sync = sync_and_verify(run) if trained.outputs else {}
    times.end = time.perf_counter()
    return sync


def log_metrics(run: Run, state: LoopState, scored: Scored, adv, batch: MicroBatch, trained: TrainedRound, sync: dict,
                times: RoundTimes) -> float:
    """Step 5: the round's record (TRL's names) on rank 0 when it took an optimizer step; returns the epoch after
    the round."""
    round_tokens = sum(map(len, scored.rollout.prompt_ids)) + sum(map(len, scored.rollout.completion_ids))
    state.num_tokens += round_tokens  # TRL's num_tokens: prompt + completion tokens seen so far
    step_time = times.end - times.start
    timings = scored.stats | wait_times(run, scored.stats, step_time) | {
        "time/logprob_s": times.logprob - times.reward, "time/train_s": times.train - times.logprob,
        "time/sync_s": times.end - times.wait, "step_time": step_time, "num_tokens": state.num_tokens,
        "tokens_per_s": round_tokens / step_time, "epoch": epoch(run, state.rounds)}
    if trained.outputs:  # TRL logs on optimizer steps: a round that trained none is not a record of its own
        state.last = log_round(run, state.step, scored.rewards, adv, batch, trained.units, trained.outputs,
                               trained.stats | sync | timings | trained.moe)
    return timings["epoch"]


def checkpoint_round(run: Run, state: LoopState, hooks: LoopHooks, stop: StopSignal, asked, num_steps: int) -> bool:
    """Step 7: save when due (SIGUSR1, the hooks, the schedule) and no slice is carried; returns whether the loop
    goes on (False: SIGUSR1 or the hooks asked to stop)."""
    ps, carried = run.ps, state.schedule.carried
    if stop.agreed(ps) and not carried:
        return False
    state.save_due = state.save_due or asked.save or is_save_step(run.cfg.checkpoint.save_steps, state.step, num_steps)
    if state.save_due and not carried:
        state.save_due = False
        state.saved_at = save_run(run, Progress(state.step, state.rounds.position, state.num_tokens))
        on_rank0(ps, hooks.saved, state.step, checkpoint_dir(run.cfg.train.output_dir, state.step), agree=False)
    return not asked.stop


def finish_training(run: Run, state: LoopState, stop: StopSignal, hooks: LoopHooks, progress: Progress,
                    before, export_dir: str | Path | None) -> dict:
    """After the last round: the final checkpoint (unless this step's is written), the held-out evaluation (not
    after SIGUSR1), the export, the hooks' train end; returns the run's summary."""
    cfg, ps, step = run.cfg, run.ps, state.step
    stop.uninstall()
    if state.saved_at != step:  # the end of training, or the round boundary SIGUSR1 asked for
        save_run(run, Progress(step, state.rounds.position, state.num_tokens))
        on_rank0(ps, hooks.saved, step, checkpoint_dir(cfg.train.output_dir, step), agree=False)
    after = evaluate(run.sampler) if not stop.stopping else None
    if export_dir is not None:
        export_policy(run, export_dir)
        if run.reference is not None and cfg.grpo.sync_ref_model:  # TRL's trainer.ref_model after TR-DPO
            export_reference(run, f"{export_dir}{REFERENCE_EXPORT_SUFFIX}")
    elif cfg.checkpoint.save_hf_at_end and not stop.stopping:
        export_policy(run, Path(cfg.train.output_dir) / "hf")
    on_rank0(ps, hooks.train_end, step, agree=False)
    summary = {"eval_reward_before": before, "eval_reward_after": after, "steps": step, "last": state.last,
               "rank": ps.rank, "stopped_by_signal": stop.stopping, "start_step": progress.step,
               "num_tokens": state.num_tokens - progress.num_tokens,  # this call's steps from start_step, its tokens
               "entropy_coef": run.entropy.coef}  # the adaptive controller's last coefficient (TRL's attribute)
    finish(run)
    return summary


def report_round(run: Run, hooks: LoopHooks, step: int, epoch_before: float, epoch_after: float, *,
                 trained: bool = True):
    """The hooks hear of the round's end (a finished pass first: it may ask for an evaluation, then the logged
    record, none when the round trained no step: its slices were all carried); returns their agreed `Decision`."""
    ps = run.ps
    if int(epoch_after) > int(epoch_before):
        on_rank0(ps, hooks.epoch_end, epoch_after, agree=False)
    record = run.logger.last_record if ps.rank == 0 and trained and run.logger.last_record_step == step else None
    log_now = (lambda: run.logger.log_now(step)) if ps.rank == 0 else None
    return on_rank0(ps, hooks.round_end, step, record, epoch_after, log_now)


def start_pipeline(run: Run, rounds: PromptRounds, progress: Progress) -> None:
    """The policy version the trainer holds (rounds trained), and with `rollout.max_staleness` > 0 (server mode,
    engine/validation.py) the rollout pipeline, with the complete rounds a resumed checkpoint recorded
    (engine/train/rollout_pipeline.py)."""
    per_round = max(run.derived.optimizer_steps_per_generation, 1)
    run.policy_version = progress.loop_state.get("policy_version", progress.step // per_round)
    k, state = run.cfg.rollout.max_staleness, progress.loop_state.get("async_rounds")
    if k == 0:
        rewind_rounds_ahead(state, rounds)  # rounds an asynchronous run generated ahead are sampled again
        return
    total_rounds = -(-run.total_steps // per_round)
    g, multi_turn = run.cfg.grpo.num_generations, run.sampler.agentic is not None  # multi-turn: rank 0 drives turns
    start = (lambda picked, seeds: PendingAgenticRound(run.sampler, picked, g, seeds)) if multi_turn else None
    run.pipeline = RolloutPipeline(run.engine, lambda: draw_prompts(run.sampler, rounds), k, seed=run.cfg.train.seed,
                                   num_generations=g, version=run.policy_version, steps_per_round=per_round,
                                   total_rounds=total_rounds, start_round=start, stores_rounds=not multi_turn)
    run.pipeline.restore(state)
    note = run.pipeline.regenerated_note()
    if note and run.ps.rank == 0:
        warnings.warn(note, stacklevel=2)


def epoch(run: Run, rounds: PromptRounds) -> float:
    """HF's `epoch`: the fraction of the dataset trained on (drawn, less the rounds generated ahead of training)."""
    ahead = run.pipeline.num_dataset_rounds_ahead() if run.pipeline is not None else 0
    return (rounds.position - ahead) / rounds.rounds_per_epoch


def wait_times(run: Run, stats: dict, step_time: float) -> dict:
    """`time/trainer_wait_s` (the trainer blocked on generation) and `time/rollout_wait_s` (the engine idle,
    waiting for weights) of this round, where the engine runs apart (server mode). Synchronous: the trainer waits
    the whole generation and the engine everything else."""
    if run.pipeline is not None:
        return run.pipeline.take_wait_times()
    if not run.engine.runs_apart:
        return {}
    return {"time/trainer_wait_s": stats["time/rollout_s"], "time/rollout_wait_s": step_time - stats["time/rollout_s"]}


def log_completions(run: Run, scored: Scored, advantages: torch.Tensor) -> None:
    """Rank 0: the completions table rows of this batch (prompt, completion, each reward, advantage)."""
    if run.ps.rank != 0:
        return
    prompts = [p for p in scored.picked.prompts for _ in range(scored.group_size)]
    rewards = {n: scored.rewards[:, k].tolist() for k, n in enumerate(run.rewards.names)}
    run.logger.add_completions(prompts, scored.completions, rewards, advantages.tolist())


def _merge_outputs(outputs: list):
    """One PolicyLossOutput from many (sums added, per-sequence values concatenated)."""
    first = outputs[0]
    sums = {k: sum(o.sums[k] for o in outputs) for k in first.sums}
    cat = lambda field: {k: torch.cat([getattr(o, field)[k] for o in outputs]) for k in getattr(first, field)}  # noqa: E731
    window = None if first.entropy_window is None else sum(o.entropy_window for o in outputs)
    return replace(first, loss=sum(o.loss for o in outputs), policy_loss=sum(o.policy_loss for o in outputs),
                   sums=sums, seq_min=cat("seq_min"), seq_max=cat("seq_max"), entropy_window=window)


def log_round(run: Run, step: int, rewards_per_func, adv, batch: MicroBatch, steps: list[OptimizerStep], outputs: list,
              extra: dict) -> dict:
    """Gather the last stage's loss outputs and sampling statistics to rank 0 and log one record (TRL names)."""
    ps = run.ps
    local = [o for per_step in outputs for o in per_step] if ps.is_last_stage and ps.tp_rank == 0 else []
    sampling = []
    if local:
        micro = [mb for optimizer_step in steps for mb in optimizer_step.microbatches]
        sampling = [(mb.old_logprobs, mb.sampling_logprobs, mb.completion_mask, mb.importance_sampling_ratio) for mb in micro]
    gathered: list = [None] * ps.world_size
    dist.gather_object((local, sampling), gathered if ps.rank == 0 else None, dst=0)
    if ps.rank != 0:
        return {}
    all_outputs = [o for parts, _ in gathered for o in parts]
    metrics = compute_reward_metrics(rewards_per_func, run.rewards.names, adv.is_std_zero, run.rewards.weights)
    lengths = batch.completion_mask.sum(1) if not run.cfg.grpo.mask_truncated_completions else torch.tensor(
        [float((row != 0).sum()) for row in batch.completion_ids])
    if batch.num_model_tokens is not None:  # multi-turn: tool tokens are not the model's
        lengths = batch.num_model_tokens
    metrics |= compute_completion_metrics(lengths, batch.is_truncated)
    metrics |= compute_loss_metrics(_merge_outputs(all_outputs), include_policy_loss=run.loss_config.is_entropy_bonus_enabled)
    pairs = [s for _, parts in gathered for s in parts]
    if pairs and pairs[0][3] is not None:
        old, samp, mask, ratio = (torch.cat([p[i] for p in pairs]) for i in range(4))
        metrics |= compute_sampling_metrics(old, samp, mask, ratio)
    metrics |= {"loss": float(sum(o.loss for o in all_outputs)) / max(len(outputs), 1)} | extra
    run.logger.step(step, metrics)
    return metrics


def finish(run: Run) -> None:
    """Close what the run holds (the logger, the reward workers, the environments, the engine) and the process
    group."""
    if run.logger is not None:
        run.logger.close()
    run.rewards.close()
    if run.sampler.agentic is not None:
        run.sampler.agentic.close()
    run.engine.close()
    destroy_parallel()


def abort(run: Run | None) -> None:
    """After an exception: cancel a multi-turn round generated ahead (no further turn, its thread joined, bounded),
    give every environment instance back, close what `run` holds (None: `build_run` did not finish), each part even
    if another fails, then tear down Megatron's parallel state and the process group (no collectives: a rank may be
    gone)."""
    if run is not None:
        stopped = True
        if run.pipeline is not None:  # a multi-turn round generated ahead: no more turns, its thread joined
            with contextlib.suppress(Exception):
                stopped = run.pipeline.cancel()
        if not stopped and run.ps.rank == 0:
            warnings.warn("abort: the thread of the multi-turn round generated ahead did not stop in time (a "
                          "rollout_func or an environment's reset still runs); it is left to end on its own",
                          RuntimeWarning, stacklevel=2)
        if run.sampler.agentic is not None:  # every environment instance back in the pool, tool threads stopped
            with contextlib.suppress(Exception):
                run.sampler.agentic.abort()
        for part in (run.logger, run.rewards, run.engine):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.close()
    destroy_parallel()


def evaluate_only(cfg: EngineConfig, *, train_dataset, eval_datasets: dict, reward_funcs, tokenizer, num_generations: int,
                   batch_size: int, metric_key_prefix: str = "eval", agentic: dict | None = None) -> dict[str, float]:
    """Build a run of `cfg`'s model (every rank), evaluate `eval_datasets` on it and tear it down (also when the
    evaluation raises): `GRPOTrainer.evaluate()` before or after `train()`."""
    run = None
    try:
        run = build_run(cfg, train_dataset=train_dataset, reward_funcs=reward_funcs, tokenizer=tokenizer, agentic=agentic)
        sets = tokenize_eval_sets(run, eval_datasets)
        metrics = evaluate_sets(run, sets, num_generations=num_generations, batch_size=batch_size,
                                metric_key_prefix=metric_key_prefix, loss_of=eval_loss)
    except BaseException:
        abort(run)
        raise
    finish(run)
    return metrics
