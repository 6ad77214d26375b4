"""The GRPO training loop (vLLM colocated or behind a rollout server): `train(cfg)` reads top to bottom (STYLE.md rule 8).

One generation round: sample prompts -> G completions per prompt (vLLM, every rank's engine generates a share,
results gathered so every rank holds the round) -> rewards (rank 0, broadcast) -> group-relative advantages ->
old (and reference) log-probs of this rank's rows -> `num_iterations` passes of optimizer steps over micro-batches
-> weight sync into the engines, verified -> metrics. Batch semantics are TRL's: per_device_train_batch_size counts
completions per data-parallel rank per micro-batch; a round holds per_device * dp * steps_per_generation completions,
shuffled, then cut into optimizer steps of per_device * dp * gradient_accumulation_steps completions; groups are
never split across rounds. The loss normaliser counts the tokens and sequences of each optimizer step over all
ranks (layout-independent, engine/policy_loss.py).

Server mode (`rollout.vllm_mode: server`, engine/rollout_server.py on other processes or nodes): rank 0 asks
the server(s) for each round over HTTP and broadcasts it (engine/rollout_client.py; several servers split the
prompts); the weight sync goes shard to shard over one transfer group per server (engine/weight_sync.py
`sync_server`) and is verified as in colocated mode. A server that restarts mid-run is waited for, synced and
verified again before it samples (`sync_and_verify` as the client's `resync`).

The TRL-compatible `GRPOConfig` / `GRPOTrainer` (engine/trl_config.py, engine/trl_api.py) call `train` with
in-memory datasets, reward callables, a tokenizer and the user's GFPO filter / curriculum hook objects (its
keyword-only inputs).

Checkpoints (engine/checkpoint.py): every `checkpoint.save_steps` optimizer steps at the end of a round, at the end of
training, and at the end of the round in which SIGUSR1 arrived (then the run exits); `resume_from_checkpoint` restores
model, optimizer, scheduler, RNG, data position and step before the first round and loads the restored weights into
the engines. Rounds do not depend on history (engine/prompt_rounds.py: prompts, vLLM seeds and the row shuffle are
functions of the seed and the round), so a resumed run logs what the uninterrupted run would have. With
`save_hf_at_end` the final policy is also exported as a Hugging Face checkpoint to `<output_dir>/hf`. The loop's
own carried state (adaptive entropy controller, the dynamic-prompts hook's pending choice) travels in the checkpoint.

Must not: hold maths (engine/advantages.py, engine/policy_loss.py), import vLLM (engine/rollout.py), or read
Megatron's global parallel state (engine/parallel.py hands out groups).

Run: `grpo-engine train configs/tiny_cpu.yaml`; test: tests/integration/test_trainer.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from engine.advantages import aggregate_rewards, compute_advantages
from engine.batch import pack_completions, split_microbatches
from engine.checkpoint import (Progress, StopSignal, agree_on_resume_checkpoint, describe_model, is_save_step,
                               load_checkpoint, read_progress, save_checkpoint)
from engine.config import EngineConfig, config_to_dict, write_resolved_config
from engine.data import PromptBatch
from engine.dynamic_sampling import assemble_rounds, find_informative_groups, is_dynamic_batch_full, select_dynamic_batch
from engine.group_filter import filter_groups
from engine.grpo_metrics import compute_completion_metrics, compute_loss_metrics, compute_reward_metrics, compute_sampling_metrics
from engine.parallel import ParallelState, destroy_parallel, init_parallel
from engine.policy_loss import (LossNormalizer, PolicyLossConfig, compute_vllm_importance_sampling_ratio,
                                 entropy_coef_to_apply, update_entropy_coef)
from engine.prompt_rounds import PromptRounds, sampling_seeds, shuffle_order
from engine.rollout import Rollout
from engine.step import LogprobSettings, forward_logprobs, grpo_forward_backward
from engine.validation import Derived, validate
from engine.weight_sync import build_server_sync, sync_colocated, sync_server, verify_sync


@dataclass
class Run:
    """Everything `train` builds once (see `build_run`)."""

    cfg: EngineConfig
    ps: ParallelState
    derived: Derived
    model_dir: Path
    tokenizer: object
    dims: object
    chunks: list
    popt: object
    reference: object
    engine: object
    train_prompts: object
    eval_prompts: object
    rewards: object
    logger: object
    loss_config: PolicyLossConfig
    settings: LogprobSettings
    total_steps: int
    group_filter: object = None
    """GFPO's `group_filter_func` (the object given, else imported from `grpo.group_filter_func`), or None."""
    dynamic_prompts: object = None
    """The `dynamic_prompts_fn` hook (the object given, else imported from `data.dynamic_prompts_fn`), or None."""
    pending_prompts: object = None
    """The PromptBatch the hook chose for the next round (None = the dataset's next rows)."""
    last_probe: dict | None = None
    """The last round's first micro-batch: the weight-sync verification probe (also after a server restart)."""
    resume_from: Path | None = None
    """The checkpoint this run resumes from (`checkpoint.resume_from_checkpoint` resolved), or None."""
    entropy: AdaptiveEntropy = field(default_factory=lambda: AdaptiveEntropy(0.0, enabled=False))


@dataclass
class AdaptiveEntropy:
    """The adaptive entropy-bonus controller's state (Skywork-OR1; TRL's `use_adaptive_entropy`, anchors/trl.md
    §3.8): the coefficient and the previous optimizer step's world entropy. The maths is engine/policy_loss.py's."""

    coef: float
    last_entropy: float = math.inf
    """Token-mean entropy of the previous optimizer step over all ranks (inf before the first, as TRL)."""
    enabled: bool = True

    def coef_to_apply(self, gr) -> float | None:
        """This step's coefficient (None = the loss config's fixed entropy_coef)."""
        return entropy_coef_to_apply(self.coef, self.last_entropy, gr.entropy_target) if self.enabled else None

    def update(self, gr, ps: ParallelState, outputs: list) -> dict[str, float]:
        """After an optimizer step: the world entropy of its micro-batches (summed over the last stage's DP ranks;
        collective), then the controller's step. Returns {"entropy_coef": the new coefficient} (TRL logs it so:
        0.01 + 0.005 * global_step while the entropy stays below the target)."""
        if not self.enabled:
            return {}
        window = torch.zeros(2, dtype=torch.float64, device=ps.device)  # [sum H m_eff, sum m_eff]
        if ps.is_last_stage and ps.tp_rank == 0:
            for out in outputs:
                window += out.entropy_window.double().to(ps.device)
        dist.all_reduce(window)
        self.last_entropy = float(window[0] / window[1].clamp(min=1.0))
        self.coef = update_entropy_coef(self.coef, self.last_entropy, entropy_target=gr.entropy_target,
                                        entropy_coef_delta=gr.entropy_coef_delta, entropy_coef_min=gr.entropy_coef_min,
                                        entropy_coef_max=gr.entropy_coef_max)
        return {"entropy_coef": self.coef}


def train(cfg: EngineConfig, *, train_dataset=None, eval_dataset=None, reward_funcs=None, tokenizer=None,
          export_dir: str | Path | None = None, group_filter_func=None, dynamic_prompts_fn=None) -> dict:
    """Run GRPO from a config; returns the held-out reward before and after (rank 0), the last metrics, and this
    call's optimizer steps (`start_step` -> `steps`, `start_step` > 0 when resumed) and tokens (`num_tokens`).

    The keyword-only inputs are the TRL-style API's (engine/trl_api.py), in memory on every rank: `train_dataset` /
    `eval_dataset` (datasets.Dataset) replace `cfg.data`'s splits, `reward_funcs` (callables and/or config strings)
    replaces `cfg.reward.reward_funcs`, `tokenizer` replaces the model directory's; `export_dir` receives the final
    policy as a Hugging Face checkpoint (collective); `group_filter_func` / `dynamic_prompts_fn` (any callables:
    functions of the user's script, lambdas, instances) replace `cfg.grpo.group_filter_func` /
    `cfg.data.dynamic_prompts_fn` (see `resolve_hooks`).
    """
    stop = StopSignal().install()  # SIGUSR1 from now on: save at the next round boundary, then exit
    run = build_run(cfg, train_dataset=train_dataset, eval_dataset=eval_dataset, reward_funcs=reward_funcs,
                    tokenizer=tokenizer, group_filter_func=group_filter_func, dynamic_prompts_fn=dynamic_prompts_fn)
    cfg, ps, d = run.cfg, run.ps, run.derived
    progress = resume(run)  # model, optimizer, scheduler, RNG, data position, step; the weights into the engines
    before = evaluate(run)
    rounds = PromptRounds(len(run.train_prompts), d.num_prompts_per_generation, cfg.train.seed,
                          cfg.train.shuffle_dataset, start=progress.rounds_done)
    step, last, num_tokens = progress.step, {}, progress.num_tokens
    saved_at = progress.step if run.resume_from else None
    while step < run.total_steps:
        start = time.perf_counter()
        # 1. rollout and rewards: G completions for each prompt of the round, scored on rank 0 and broadcast;
        #    with dynamic sampling (DAPO), further rounds until the batch holds enough groups whose rewards vary
        scored = sample_and_score(run, rounds, step)
        # 2. GFPO keeps the best num_remains_in_group completions of each group; advantages over whole groups
        scored = keep_best_in_groups(run, scored)
        adv = compute_advantages(scored.rewards, scored.group_size, run.rewards.weights,
                                 cfg.grpo.scale_rewards, cfg.reward.multi_objective_aggregation)
        log_completions(run, scored, adv.advantages)
        batch = build_round(run, scored.rollout, adv.advantages, step)  # every rank: the whole round, rows shuffled
        # 3. old (and reference) log-probs of this rank's rows, then num_iterations passes of optimizer steps
        steps = per_step_microbatches(run, batch)
        t_reward = time.perf_counter()
        add_old_and_ref_logprobs(run, steps)
        t_logprob = time.perf_counter()
        outputs, stats = [], {}
        for _ in range(cfg.grpo.num_iterations):
            for micro, normalizer in steps:
                run.popt.zero_grad()
                out = grpo_forward_backward(run.popt.model, ps, micro, run.loss_config, normalizer, run.settings,
                                            entropy_coef=run.entropy.coef_to_apply(cfg.grpo))
                outputs.append(out)
                stats = run.popt.step() | run.entropy.update(cfg.grpo, ps, out)
                step += 1
        t_train = time.perf_counter()
        # 4. weight sync into every engine, verified on a probe of this round
        run.last_probe = steps[0][0][0]
        sync = sync_and_verify(run)
        end = time.perf_counter()
        # 5. metrics (TRL names), logged on rank 0
        round_tokens = sum(map(len, scored.rollout.prompt_ids)) + sum(map(len, scored.rollout.completion_ids))
        num_tokens += round_tokens  # TRL's num_tokens: prompt + completion tokens seen so far
        timings = scored.stats | {"time/logprob_s": t_logprob - t_reward, "time/train_s": t_train - t_logprob,
                                  "time/sync_s": end - t_train, "step_time": end - start,
                                  "num_tokens": num_tokens, "tokens_per_s": round_tokens / (end - start),
                                  "epoch": rounds.position / rounds.rounds_per_epoch}  # HF's: dataset fraction drawn
        last = log_round(run, step, scored.rewards, adv, batch, steps, outputs, stats | sync | timings)
        # 6. checkpoint: SIGUSR1 on any rank -> save at this round boundary and leave; else on schedule
        if stop.agreed(ps):
            break
        if is_save_step(cfg.checkpoint.save_steps, step, len(steps) * cfg.grpo.num_iterations):
            saved_at = save_run(run, Progress(step, rounds.position, num_tokens))
    stop.uninstall()
    if saved_at != step:  # the end of training, or the round boundary SIGUSR1 asked for
        save_run(run, Progress(step, rounds.position, num_tokens))
    after = evaluate(run) if not stop.stopping else None
    if export_dir is not None:
        export_policy(run, export_dir)
    elif cfg.checkpoint.save_hf_at_end and not stop.stopping:
        export_policy(run, Path(cfg.train.output_dir) / "hf")
    summary = {"eval_reward_before": before, "eval_reward_after": after, "steps": step, "last": last, "rank": ps.rank,
               "stopped_by_signal": stop.stopping, "start_step": progress.step,
               "num_tokens": num_tokens - progress.num_tokens}  # this call's steps from start_step, and its tokens
    finish(run, summary)
    return summary


# ---------------------------------------------------------------------------------------------------------------
# set-up


def build_run(cfg: EngineConfig, *, train_dataset=None, eval_dataset=None, reward_funcs=None, tokenizer=None,
              group_filter_func=None, dynamic_prompts_fn=None) -> Run:
    """Parallel state, model, reference, optimizer, engine, data, rewards, logger (every rank); the keyword-only
    inputs replace what the config names (see `train`)."""
    from transformers import AutoConfig, AutoTokenizer

    from engine.data import load_prompts
    from engine.hf_checkpoint import load_hf_checkpoint
    from engine.hf_convert import ModelDims
    from engine.metrics import MetricLogger
    from engine.model import build_policy, policy_shape
    from engine.optimizer import build_optimizer
    from engine.reference_model import ReferencePolicy
    from engine.rewards import RewardFunctions, build_reward_funcs
    from engine.rollout import ColocatedEngine
    from engine.rollout_client import connect_rollout_server
    from engine.tiny_model import resolve_builtin_model

    cfg, group_filter, dynamic_prompts = resolve_hooks(cfg, group_filter_func, dynamic_prompts_fn)
    ps = init_parallel(cfg.parallel, seed=cfg.train.seed)
    derived = validate(cfg, ps.world_size)
    run_dir = Path(cfg.train.output_dir)
    name = cfg.model.name_or_path
    if ps.rank == 0:
        write_resolved_config(cfg, run_dir)
        model_dir = resolve_builtin_model(name, run_dir / "models") if name.startswith("builtin:") else Path(name)
    dist.barrier()
    model_dir = resolve_builtin_model(name, run_dir / "models") if name.startswith("builtin:") else Path(name)
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_dir)
    dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, cfg.model, ps.tp_size).padded_vocab_size)
    chunks = build_policy(hf_config, cfg.model, ps)
    load_hf_checkpoint(chunks, ps, model_dir, dims)
    reference = ReferencePolicy.build(hf_config, cfg.model, ps, model_dir, dims) if cfg.grpo.beta != 0 else None
    max_len = cfg.rollout.vllm_max_model_length or hf_config.max_position_embeddings
    train_prompts = load_prompts(cfg.data, tokenizer, cfg.generation, split="train", max_model_length=max_len,
                                 dataset=train_dataset)
    eval_prompts = load_prompts(cfg.data, tokenizer, cfg.generation, split="test", max_model_length=max_len,
                                dataset=eval_dataset)
    rewards = (build_reward_funcs(cfg.reward, cfg.generation) if reward_funcs is None
               else RewardFunctions(reward_funcs, cfg.reward.reward_weights, cfg.generation))
    total_steps = _total_steps(cfg, derived, len(train_prompts))
    popt = build_optimizer(cfg.optimizer, chunks, ps, total_steps=total_steps)
    if cfg.rollout.vllm_mode == "server":  # waits up to vllm_server_timeout for the server's health check
        engine = connect_rollout_server(cfg.rollout, cfg.generation, ps.rank)
        engine.weight_links = [
            build_server_sync(ps, dims, health["vllm_tensor_parallel_size"], ffn_hidden_size=hf_config.intermediate_size,
                              dtype=cfg.model.dtype, group_port=cfg.rollout.vllm_group_port + i,
                              timeout_s=cfg.rollout.vllm_server_timeout, bucket_mb=cfg.rollout.weight_sync_bucket_mb,
                              server=i)
            for i, health in enumerate(engine.healths)]
        # NOTE: the servers outlive trainer runs (and restarts): whatever they hold, the first round samples from
        # the trainer's weights.
        _sync_servers(popt.model, ps, dims, engine)
    else:
        engine = ColocatedEngine(model_dir, cfg.rollout, cfg.generation, seed=cfg.train.seed + ps.rank // cfg.rollout.vllm_tensor_parallel_size,
                                 dtype=cfg.model.dtype, world_size=ps.world_size)
    resume_from = agree_on_resume_checkpoint(cfg.checkpoint.resume_from_checkpoint, run_dir, ps)
    resume_step = read_progress(resume_from).step if resume_from is not None else None  # later log lines are dropped
    logger = MetricLogger(cfg.logging, run_dir, max_steps=total_steps, resume_step=resume_step) if ps.rank == 0 else None
    loss_config = build_loss_config(cfg)
    settings = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=cfg.generation.temperature,
                               implementation=cfg.kernels.loss_implementation, workspace_mb=cfg.kernels.loss_workspace_mb)
    run = Run(cfg, ps, derived, Path(model_dir), tokenizer, dims, chunks, popt, reference, engine, train_prompts,
              eval_prompts, rewards, logger, loss_config, settings, total_steps,
              group_filter, dynamic_prompts, resume_from=resume_from, entropy=AdaptiveEntropy(cfg.grpo.entropy_coef, enabled=cfg.grpo.use_adaptive_entropy))
    if cfg.rollout.vllm_mode == "server":  # a server that restarts mid-run is synced again before it samples
        engine.resync = lambda: sync_and_verify(run)
    return run


def resolve_hooks(cfg: EngineConfig, group_filter_func=None,
                  dynamic_prompts_fn=None) -> tuple[EngineConfig, object, object]:
    """The user's GFPO filter and curriculum hook: the objects given in memory (any callable; under torchrun every
    rank runs the user's script, so every rank holds them), else imported from the config's `module:function`.

    Returns the config with each given object's description filled in where the field was empty (the resolved
    config and checkpoints hold strings; validation sees the filter), the filter, and the hook (None = not set).
    A field holding a description of an in-memory object (a resumed TRL-API run) is never imported when the object
    is given."""
    from engine.config import describe_callable
    from engine.rewards import import_callable

    resolved = []
    for given, section, name in ((group_filter_func, "grpo", "group_filter_func"),
                                 (dynamic_prompts_fn, "data", "dynamic_prompts_fn")):
        spec = getattr(getattr(cfg, section), name)
        if given is not None and not callable(given):
            raise TypeError(f"{name} must be a callable, got {type(given).__name__}: {given!r:.100}")
        if given is not None and spec is None:
            cfg = replace(cfg, **{section: replace(getattr(cfg, section), **{name: describe_callable(given)})})
        if given is None and spec is not None:
            try:
                given = import_callable(spec, f"{section}.{name}")
            except ValueError as error:
                raise ValueError(f"{error}. A config recorded from an object passed in memory names it without "
                                 f"being importable: pass the object again (GRPOConfig({name}=...), or "
                                 f"train(cfg, {name}=...))") from error
        resolved.append(given)
    return cfg, resolved[0], resolved[1]


def build_loss_config(cfg: EngineConfig) -> PolicyLossConfig:
    """The loss hyperparameters: every PolicyLossConfig field takes the `grpo` field of the same (TRL) name."""
    names = {f.name for f in fields(PolicyLossConfig)} - {"max_completion_length"}
    return PolicyLossConfig(**{name: getattr(cfg.grpo, name) for name in names},
                            max_completion_length=cfg.generation.max_completion_length)


def _total_steps(cfg: EngineConfig, d: Derived, num_prompts: int) -> int:
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    rounds = math.ceil(cfg.train.num_train_epochs * num_prompts / d.num_prompts_per_generation)
    return rounds * d.optimizer_steps_per_generation


def sync_check(cfg: EngineConfig) -> tuple[float, float]:
    """(tolerance, quantile) of the weight-sync verification: the config's, else by dtype (config.py)."""
    full = cfg.model.dtype == "float32"
    tolerance = cfg.rollout.weight_sync_tolerance
    quantile = cfg.rollout.weight_sync_quantile
    return (tolerance if tolerance is not None else 1e-3 if full else 0.2,
            quantile if quantile is not None else 1.0 if full else 0.9)


def resume(run: Run) -> Progress:
    """Restore `run.resume_from` (model, optimizer, scheduler, RNG, data position, step; collective), then load the
    restored policy into every engine, which started from the Hugging Face weights. Progress() when not resuming."""
    if run.resume_from is None:
        return Progress()
    progress = load_checkpoint(run.resume_from, run.popt, run.ps, model=_model_identity(run))
    entropy = progress.loop_state.get("entropy", {})
    run.entropy.coef = entropy.get("coef", run.entropy.coef)
    run.entropy.last_entropy = entropy.get("last_entropy", run.entropy.last_entropy)
    pending = progress.loop_state.get("pending_prompts")  # the dynamic-prompts hook's choice for the next round
    run.pending_prompts = PromptBatch(**pending) if pending is not None else None
    sync_weights(run)
    return progress


def save_run(run: Run, progress: Progress) -> int:
    """Write `<output_dir>/checkpoint-<step>` (collective), keep the newest `save_total_limit`; returns the step."""
    entropy = {"coef": run.entropy.coef, "last_entropy": run.entropy.last_entropy}
    pending = asdict(run.pending_prompts) if run.pending_prompts is not None else None
    progress = replace(progress, loop_state=progress.loop_state | {"entropy": entropy, "pending_prompts": pending})
    save_checkpoint(run.cfg.train.output_dir, progress, run.popt, run.ps, model=_model_identity(run),
                    run_config=config_to_dict(run.cfg), save_total_limit=run.cfg.checkpoint.save_total_limit)
    return progress.step


def _model_identity(run: Run) -> dict:
    from transformers import AutoConfig

    return describe_model(AutoConfig.from_pretrained(run.model_dir), run.dims.padded_vocab)


def export_policy(run: Run, out_dir: str | Path) -> None:
    """Write the current policy as a Hugging Face checkpoint in the model's dtype, with the model directory's
    config and tokenizer files (collective: every rank calls it)."""
    from transformers import AutoConfig

    from engine.hf_checkpoint import export_hf_checkpoint

    dtype = getattr(torch, run.cfg.model.dtype)
    export_hf_checkpoint(run.chunks, run.ps, out_dir, AutoConfig.from_pretrained(run.model_dir), run.dims,
                         tokenizer_dir=run.model_dir, dtype=dtype)


def sync_weights(run: Run) -> dict:
    """Push the policy's weights into the engines: bucketed in-process loads (colocate) or shard to shard into the
    rollout server(s) (server; a failure raises WeightSyncError on every rank and leaves the trainer untouched)."""
    if run.cfg.rollout.vllm_mode == "server":
        return _sync_servers(run.popt.model, run.ps, run.dims, run.engine)
    return sync_colocated(run.popt.model, run.ps, run.dims, run.engine, run.cfg.rollout.weight_sync_bucket_mb)


def _sync_servers(chunks, ps: ParallelState, dims, engine) -> dict:
    """One sync into each rollout server in turn (each through its own transfer group); the stats summed."""
    total: dict = {}
    for link in engine.weight_links:
        for key, value in sync_server(chunks, ps, dims, engine, link).items():
            total[key] = total.get(key, 0.0) + value
    return total | {"weight_sync/servers": float(len(engine.weight_links)),
                    "weight_sync/server_restarts": float(engine.num_restarts)}


def sync_and_verify(run: Run, probe: dict | None = None) -> dict:
    """`sync_weights`, then (if `rollout.verify_weight_sync`) the engines' log-probs of `probe` (default: the last
    round's probe micro-batch; none before the first round) against the trainer's."""
    sync = sync_weights(run)
    probe = probe if probe is not None else run.last_probe
    if run.cfg.rollout.verify_weight_sync and probe is not None:
        tolerance, quantile = sync_check(run.cfg)
        sync["weight_sync/max_logprob_diff"] = verify_sync(run.popt.model, run.ps, run.engine, probe,
                                                           run.dims.vocab_size, tolerance, quantile=quantile)
    return sync


def finish(run: Run, summary: dict) -> None:
    if run.logger is not None:
        run.logger.close()
    run.rewards.close()
    run.engine.close()
    destroy_parallel()


# ---------------------------------------------------------------------------------------------------------------
# one round


def generate_everywhere(run: Run, prompt_ids: list[list[int]], num_generations: int,
                        seeds: list[int] | None = None) -> Rollout:
    """Every engine generates a contiguous share of the prompts (the ranks of one vLLM TP group the same share);
    the shares are gathered so every rank holds the whole round, prompt-major. `seeds`: one vLLM sampling seed per
    prompt (engine/prompt_rounds.py), shared out with the prompts; None = the engines' own generators."""
    if run.cfg.rollout.vllm_mode == "server":  # rank 0 asks the server, every rank gets the round
        return run.engine.generate(prompt_ids, num_generations, seeds=seeds)
    ps, vllm_tp = run.ps, run.cfg.rollout.vllm_tensor_parallel_size
    num_groups, group = ps.world_size // vllm_tp, ps.rank // vllm_tp
    share = -(-len(prompt_ids) // num_groups)
    mine = prompt_ids[group * share : (group + 1) * share]
    run.engine.wake_up()
    mine_seeds = seeds[group * share : (group + 1) * share] if seeds is not None else None
    local = run.engine.generate(mine, num_generations, seeds=mine_seeds) if mine else Rollout([], [], [], [])
    run.engine.sleep()
    gathered: list = [None] * ps.world_size
    dist.all_gather_object(gathered, local)
    out = Rollout([], [], [], [])
    for part in gathered[::vllm_tp]:
        out.prompt_ids += part.prompt_ids
        out.completion_ids += part.completion_ids
        out.sampling_logprobs += part.sampling_logprobs
        out.is_truncated += part.is_truncated
    return out


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
    (engine/dynamic_sampling.py). Every rank makes the same choices: the rewards are broadcast before choosing."""
    gr, g = run.cfg.grpo, run.cfg.grpo.num_generations
    num_prompts = run.derived.num_prompts_per_generation
    parts, informative, seconds = [], [], {"time/rollout_s": 0.0, "time/reward_s": 0.0}
    for attempt in range(gr.dynamic_sampling_max_rounds if gr.use_dynamic_sampling else 1):
        start = time.perf_counter()
        picked = run.pending_prompts or run.train_prompts.select(next(rounds))
        rollout = generate_everywhere(run, picked.prompt_ids, g, sampling_seeds(run.cfg.train.seed, step, attempt, picked.indices))
        middle = time.perf_counter()
        rewards, completions = score(run, picked, rollout, step)
        run.pending_prompts = next_dynamic_prompts(run, picked, completions, rewards)
        seconds["time/rollout_s"] += middle - start
        seconds["time/reward_s"] += time.perf_counter() - middle
        parts.append(Scored(picked, rollout, rewards, completions, g))
        if not gr.use_dynamic_sampling:
            return replace(parts[0], stats=seconds)
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
    rollout = Rollout(*(per_row(lambda p, f=f: getattr(p.rollout, f)) for f in
                        ("prompt_ids", "completion_ids", "sampling_logprobs", "is_truncated")))
    completions = per_row(lambda p: p.completions) if run.ps.rank == 0 else []
    stats = seconds | {"dynamic_sampling/rounds": len(parts),
                       "dynamic_sampling/informative_fraction": selection.num_informative / num_prompts}
    return Scored(picked, rollout, per_row(lambda p: p.rewards), completions, g, stats)


def next_dynamic_prompts(run: Run, picked: PromptBatch, completions: list, rewards: torch.Tensor) -> PromptBatch | None:
    """The user's `dynamic_prompts_fn` (rank 0) picks the next round's P prompts from this round's results, given
    one element per sample (engine/dynamic_prompts.py); the rows are broadcast and tokenized on every rank like the
    dataset's (same checks). None without the hook."""
    if run.dynamic_prompts is None:
        return None
    import datasets

    from engine.data import prepare_prompts
    from engine.dynamic_prompts import call_dynamic_prompts_fn

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
    return prepared.select(range(len(prepared)))


def keep_best_in_groups(run: Run, scored: Scored) -> Scored:
    """GFPO: keep the `num_remains_in_group` best completions of each group by the user's `group_filter_func`
    (called on rank 0 with aligned groups, engine/group_filter.py); the kept rows are broadcast. Without
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
    pick = lambda values: [values[i] for i in rows]  # noqa: E731
    rollout = Rollout(*(pick(getattr(scored.rollout, f)) for f in
                        ("prompt_ids", "completion_ids", "sampling_logprobs", "is_truncated")))
    completions = pick(scored.completions) if scored.completions else []
    return replace(scored, rollout=rollout, rewards=scored.rewards[keep], completions=completions, group_size=k)


def log_completions(run: Run, scored: Scored, advantages: torch.Tensor) -> None:
    """Rank 0: the completions table rows of this batch (prompt, completion, each reward, advantage)."""
    if run.ps.rank != 0:
        return
    prompts = [p for p in scored.picked.prompts for _ in range(scored.group_size)]
    rewards = {n: scored.rewards[:, k].tolist() for k, n in enumerate(run.rewards.names)}
    run.logger.add_completions(prompts, scored.completions, rewards, advantages.tolist())


def _broadcast_from_rank0(tensor: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Rank 0's tensor on every rank, back on the CPU (sent on the backend's device: NCCL moves CUDA tensors only)."""
    on_device = tensor.to(ps.device)
    dist.broadcast(on_device, src=0)
    return on_device.cpu()


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


def build_round(run: Run, rollout: Rollout, advantages: torch.Tensor, step: int) -> dict:
    """The round as tensors (engine/batch.py layout) with advantages, vLLM log-probs and the loss mask; rows
    shuffled with a permutation seeded by (seed, the round's first step): the same on every rank, and on resume."""
    from engine.policy_loss import mask_truncated_completions

    pad = run.tokenizer.pad_token_id or 0
    batch = pack_completions(rollout.prompt_ids, rollout.completion_ids, pad)
    mask = batch["completion_mask"]
    sampling = torch.zeros_like(mask)  # (B, C)
    for i, row in enumerate(rollout.sampling_logprobs):
        sampling[i, : len(row)] = torch.tensor(row)
    is_truncated = torch.tensor(rollout.is_truncated, dtype=torch.bool)  # (B,)
    if run.cfg.grpo.mask_truncated_completions:
        batch["completion_mask"] = mask_truncated_completions(mask, is_truncated)
    batch |= {"advantages": advantages.float(), "sampling_logprobs": sampling, "is_truncated": is_truncated}
    order = shuffle_order(mask.shape[0], run.cfg.train.seed, step)
    return {k: v[order] for k, v in batch.items()}


def per_step_microbatches(run: Run, batch: dict) -> list[tuple[list[dict], LossNormalizer]]:
    """For each optimizer step of the round: this DP rank's micro-batches and the step's global normaliser."""
    d, ps = run.derived, run.ps
    per_rank = d.micro_batch_size * d.num_microbatches
    steps = []
    for start in range(0, d.generation_batch_size, d.global_batch_size):
        rows = {k: v[start : start + d.global_batch_size] for k, v in batch.items()}
        normalizer = LossNormalizer(num_tokens=float(rows["completion_mask"].sum()), num_sequences=float(d.global_batch_size))
        mine = {k: v[ps.dp_rank * per_rank : (ps.dp_rank + 1) * per_rank] for k, v in rows.items()}
        steps.append((split_microbatches(mine, d.micro_batch_size), normalizer))
    return steps


def add_old_and_ref_logprobs(run: Run, steps: list) -> None:
    """Old log-probs (and the vLLM IS ratio), reference log-probs when beta > 0, added to every micro-batch on the
    last stage (the only stage that computes the loss)."""
    gr = run.cfg.grpo
    for micro, _ in steps:
        old = forward_logprobs(run.popt.model, run.ps, micro, run.settings)
        ref = run.reference.logprobs(run.ps, micro, run.settings) if run.reference is not None else []
        for i, (logprobs, _) in enumerate(old):
            mb = micro[i]
            mb["old_logprobs"] = logprobs
            if gr.vllm_importance_sampling_correction:
                mb["importance_sampling_ratio"] = compute_vllm_importance_sampling_ratio(
                    logprobs, mb["sampling_logprobs"], mb["completion_mask"], gr.vllm_importance_sampling_mode,
                    gr.vllm_importance_sampling_clip_min, gr.vllm_importance_sampling_clip_max)
            if ref:
                mb["ref_logprobs"] = ref[i][0]


def _merge_outputs(outputs: list):
    """One PolicyLossOutput from many (sums added, per-sequence values concatenated)."""
    first = outputs[0]
    sums = {k: sum(o.sums[k] for o in outputs) for k in first.sums}
    cat = lambda field: {k: torch.cat([getattr(o, field)[k] for o in outputs]) for k in getattr(first, field)}  # noqa: E731
    window = None if first.entropy_window is None else sum(o.entropy_window for o in outputs)
    return replace(first, loss=sum(o.loss for o in outputs), policy_loss=sum(o.policy_loss for o in outputs),
                   sums=sums, seq_min=cat("seq_min"), seq_max=cat("seq_max"), entropy_window=window)


def log_round(run: Run, step: int, rewards_per_func, adv, batch: dict, steps: list, outputs: list, extra: dict) -> dict:
    """Gather the last stage's loss outputs and sampling statistics to rank 0 and log one record (TRL names)."""
    ps = run.ps
    local = [o for per_step in outputs for o in per_step] if ps.is_last_stage and ps.tp_rank == 0 else []
    sampling = []
    if local:
        micro = [mb for per_step, _ in steps for mb in per_step]
        sampling = [(mb["old_logprobs"], mb["sampling_logprobs"], mb["completion_mask"], mb.get("importance_sampling_ratio")) for mb in micro]
    gathered: list = [None] * ps.world_size
    dist.gather_object((local, sampling), gathered if ps.rank == 0 else None, dst=0)
    if ps.rank != 0:
        return {}
    all_outputs = [o for parts, _ in gathered for o in parts]
    metrics = compute_reward_metrics(rewards_per_func, run.rewards.names, adv.is_std_zero, run.rewards.weights)
    lengths = batch["completion_mask"].sum(1) if not run.cfg.grpo.mask_truncated_completions else torch.tensor(
        [float((row != 0).sum()) for row in batch["completion_ids"]])
    metrics |= compute_completion_metrics(lengths, batch["is_truncated"])
    metrics |= compute_loss_metrics(_merge_outputs(all_outputs), include_policy_loss=run.loss_config.is_entropy_bonus_enabled)
    pairs = [s for _, parts in gathered for s in parts]
    if pairs and pairs[0][3] is not None:
        old, samp, mask, ratio = (torch.cat([p[i] for p in pairs]) for i in range(4))
        metrics |= compute_sampling_metrics(old, samp, mask, ratio)
    metrics |= {"loss": float(sum(o.loss for o in all_outputs)) / max(len(steps), 1)} | extra
    run.logger.step(step, metrics)
    return metrics


def evaluate(run: Run, max_prompts: int = 200) -> float | None:
    """Mean weighted reward of one sampled completion per held-out prompt (rank 0; None without a test split)."""
    if run.eval_prompts is None:
        return None
    picked = run.eval_prompts.select(list(range(min(max_prompts, len(run.eval_prompts)))))
    rollout = generate_everywhere(run, picked.prompt_ids, 1)
    mean = torch.zeros(1)
    if run.ps.rank == 0:
        texts = run.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if run.eval_prompts.is_conversational else texts
        rewards = run.rewards(picked.prompts, completions, rollout.completion_ids, picked.columns)  # (P, K)
        weights = run.rewards.weights if run.rewards.weights is not None else torch.ones(rewards.shape[1])
        mean[0] = torch.nanmean((rewards * weights).nansum(1))
    mean = _broadcast_from_rank0(mean, run.ps)
    return float(mean)
