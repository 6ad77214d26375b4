"""The run: everything `train(cfg)` builds once (`Run`, `build_run`), and what it does with that state between
rounds: resume, save, export, and push the policy's weights into the engines, verified.

Owns: `build_run` (parallel state, config validation, the resolved config in the run directory, model, reference,
optimizer, the engines: colocated vLLM, or the rollout server(s) with one weight-transfer group each and a first sync,
datasets, reward functions, the metric logger, the loss config and log-prob settings), `resolve_hooks` (the user's
GFPO filter and curriculum hook: objects in memory, else the config's `module:function`), `AdaptiveEntropy` (the
adaptive entropy-bonus controller's state), `resume` / `save_run` / `export_policy` (engine/train/checkpoint.py and
engine/policy/hf_checkpoint.py with the loop's own state and, with TR-DPO, the mixed reference), `check_finite` (a
diverged policy stops the run, before its weights are synced: `TrainingDivergedError`), and `sync_weights` /
`sync_and_verify` (the weight sync into every engine, verified bit for bit by digests, and the log-prob probe's
health metrics).

Must not: run a round (engine/train/loop.py `train` reads the round top to bottom; engine/train/sampling.py samples
and scores), hold maths (engine/grpo/), import vLLM (engine/rollout/vllm_engine.py), or read Megatron's global
parallel state (engine/policy/parallel.py hands out groups).

Test: `pytest tests/unit/test_trainer_config.py` (the loss config, the hooks); the whole run:
tests/integration/test_trainer.py, tests/integration/test_resume.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig, config_to_dict, write_resolved_config
from engine.grpo.policy_loss import PolicyLossConfig, entropy_coef_to_apply, update_entropy_coef
from engine.policy.parallel import ParallelState, init_parallel
from engine.policy.step import LogprobSettings
from engine.rollout.colocated_sync import build_colocated_plan, sync_colocated
from engine.rollout.server_sync import build_server_sync, sync_server
from engine.rollout.sync_check import logprob_health
from engine.train.checkpoint import (Progress, agree_on_resume_checkpoint, describe_model, load_checkpoint,
                                     read_progress, save_checkpoint)
from engine.train.data import PromptBatch
from engine.train.prompt_queue import PromptQueue
from engine.validation import Derived, validate


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
    prompt_queue: PromptQueue | None = None
    """The prompts the hook returned, waiting for rounds of their own (engine/train/prompt_queue.py); None without
    the hook."""
    last_probe: dict | None = None
    """The last round's first micro-batch: the weight-sync verification probe (also after a server restart)."""
    resume_from: Path | None = None
    """The checkpoint this run resumes from (`checkpoint.resume_from_checkpoint` resolved), or None."""
    entropy: AdaptiveEntropy = field(default_factory=lambda: AdaptiveEntropy(0.0, enabled=False))
    policy_version: int = 0
    """Rounds trained so far: the version of the policy the trainer holds (and last pushed into the engines)."""
    pipeline: object = None
    """Server mode with `rollout.max_staleness` > 0: the RolloutPipeline (engine/train/rollout_pipeline.py)."""
    colocated_plan: object = None
    """Colocated mode: the sync plan whose engine boxes the digest verification checks (engine/rollout/colocated_sync.py)."""


class TrainingDivergedError(RuntimeError):
    """The policy's loss or weights went non-finite: the run stops before the weights reach the engines."""


@dataclass
class AdaptiveEntropy:
    """The adaptive entropy-bonus controller's state (Skywork-OR1; TRL's `use_adaptive_entropy`, anchors/trl.md
    §3.8): the coefficient and the previous optimizer step's world entropy. The maths is engine/grpo/policy_loss.py's."""

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


def build_run(cfg: EngineConfig, *, train_dataset=None, eval_dataset=None, reward_funcs=None, tokenizer=None,
              group_filter_func=None, dynamic_prompts_fn=None) -> Run:
    """Parallel state, model, reference, optimizer, engine, data, rewards, logger (every rank); the keyword-only
    inputs replace what the config names (see engine/train/loop.py `train`)."""
    from transformers import AutoConfig, AutoTokenizer

    from engine.train.data import load_prompts
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_convert import ModelDims
    from engine.train.metric_logger import MetricLogger
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.optimizer import build_optimizer
    from engine.policy.reference import ReferencePolicy
    from engine.train.rewards import RewardFunctions, build_reward_funcs
    from engine.rollout.vllm_engine import ColocatedEngine
    from engine.rollout.client import connect_rollout_server
    from engine.models.tiny_model import resolve_builtin_model

    cfg, group_filter, dynamic_prompts = resolve_hooks(cfg, group_filter_func, dynamic_prompts_fn)
    ps = init_parallel(cfg.parallel, seed=cfg.train.seed)
    derived = validate(cfg, ps.world_size)
    run_dir = Path(cfg.train.output_dir)
    name = cfg.model.name_or_path
    if ps.rank == 0:
        write_resolved_config(cfg, run_dir)
        model_dir = resolve_builtin_model(name, run_dir / "models") if name.startswith("builtin:") else Path(name)
    dist.barrier()
    model_dir = resolve_model_dir(name, run_dir, need_tokenizer=tokenizer is None)  # every rank: all raise alike
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_dir)
    dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, cfg.model, ps.tp_size).padded_vocab_size)
    if cfg.model.moe_enable_routing_replay and not dims.num_experts:
        raise ValueError(f"model.moe_enable_routing_replay replays routed experts, but {name} "
                         f"({hf_config.model_type}) has no mixture-of-experts layers: set it to false")
    chunks = build_policy(hf_config, cfg.model, ps, cfg.train)
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
        _sync_servers(popt.model, ps, dims, engine, verify=cfg.rollout.verify_weight_sync)
    else:
        engine = ColocatedEngine(model_dir, cfg.rollout, cfg.generation, seed=cfg.train.seed + ps.rank // cfg.rollout.vllm_tensor_parallel_size,
                                 dtype=cfg.model.dtype, world_size=ps.world_size)
    resume_from = agree_on_resume_checkpoint(cfg.checkpoint.resume_from_checkpoint, run_dir, ps)
    resume_step = read_progress(resume_from).step if resume_from is not None else None  # later log lines are dropped
    logger = MetricLogger(cfg.logging, run_dir, max_steps=total_steps, resume_step=resume_step) if ps.rank == 0 else None
    loss_config = PolicyLossConfig.from_sections(cfg.grpo, cfg.generation)
    settings = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=cfg.generation.temperature,
                               kernels=cfg.kernels)
    run = Run(cfg, ps, derived, Path(model_dir), tokenizer, dims, chunks, popt, reference, engine, train_prompts,
              eval_prompts, rewards, logger, loss_config, settings, total_steps,
              group_filter, dynamic_prompts, resume_from=resume_from, entropy=AdaptiveEntropy(cfg.grpo.entropy_coef, enabled=cfg.grpo.use_adaptive_entropy))
    if dynamic_prompts is not None:
        run.prompt_queue = PromptQueue(cfg.data.dynamic_prompts_queue_rounds * derived.num_prompts_per_generation)
    if cfg.rollout.vllm_mode == "server":  # a server that restarts mid-run is synced again before it samples
        engine.resync = lambda: sync_and_verify(run)
    else:
        run.colocated_plan = build_colocated_plan(dims, cfg.rollout.vllm_tensor_parallel_size, dtype=cfg.model.dtype,
                                                  ffn_hidden_size=hf_config.intermediate_size)
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
    from engine.train.rewards import import_callable

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


def _total_steps(cfg: EngineConfig, d: Derived, num_prompts: int) -> int:
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    rounds = math.ceil(cfg.train.num_train_epochs * num_prompts / d.num_prompts_per_generation)
    return rounds * d.optimizer_steps_per_generation


def draw_prompts(run: Run, rounds) -> tuple[PromptBatch, bool]:
    """The next round's P prompts: the curriculum queue's front when P wait (engine/train/prompt_queue.py), else
    the dataset's next round; and whether they came from the dataset (the data position moved)."""
    num_prompts = run.derived.num_prompts_per_generation
    queued = run.prompt_queue.take(num_prompts) if run.prompt_queue is not None else None
    return (queued, False) if queued is not None else (run.train_prompts.select(next(rounds)), True)


def resume(run: Run) -> Progress:
    """Restore `run.resume_from` (model, optimizer, scheduler, RNG, data position, step; collective), then load the
    restored policy into every engine, which started from the Hugging Face weights. Progress() when not resuming."""
    if run.resume_from is None:
        return Progress()
    progress = load_checkpoint(run.resume_from, run.popt, run.ps, model=_model_identity(run),
                               reference=_mixed_reference(run))
    entropy = progress.loop_state.get("entropy", {})
    run.entropy.coef = entropy.get("coef", run.entropy.coef)
    run.entropy.last_entropy = entropy.get("last_entropy", run.entropy.last_entropy)
    if run.prompt_queue is not None:  # the prompts the dynamic-prompts hook returned, still waiting
        run.prompt_queue.restore(progress.loop_state.get("prompt_queue"))
        pending = progress.loop_state.get("pending_prompts")  # a checkpoint from before the queue: its one choice
        if pending is not None:
            run.prompt_queue.push(PromptBatch(**pending))
    sync_weights(run)
    return progress


def save_run(run: Run, progress: Progress) -> int:
    """Write `<output_dir>/checkpoint-<step>` (collective), keep the newest `save_total_limit`; returns the step."""
    entropy = {"coef": run.entropy.coef, "last_entropy": run.entropy.last_entropy}
    queue = run.prompt_queue.state() if run.prompt_queue is not None else None
    in_flight = run.pipeline.state() if run.pipeline is not None else None  # asynchronous rollout's complete rounds
    progress = replace(progress, loop_state=progress.loop_state | {
        "entropy": entropy, "prompt_queue": queue, "policy_version": run.policy_version,
        "async_rounds": in_flight})
    save_checkpoint(run.cfg.train.output_dir, progress, run.popt, run.ps, model=_model_identity(run),
                    run_config=config_to_dict(run.cfg), save_total_limit=run.cfg.checkpoint.save_total_limit,
                    reference=_mixed_reference(run))
    return progress.step


def _mixed_reference(run: Run) -> list | None:
    """The reference's chunks when TR-DPO mixes them (`grpo.sync_ref_model`): saved and restored with the run; None
    otherwise (a frozen reference is the Hugging Face checkpoint, rebuilt at start)."""
    return run.reference.chunks if run.cfg.grpo.sync_ref_model and run.reference is not None else None


def resolve_model_dir(name: str, run_dir: Path, *, need_tokenizer: bool) -> Path:
    """The directory `model.name_or_path` names: a built-in model's (written under `run_dir`/models), a local
    directory, checked before transformers reads it (engine/models/model_dir.py: a missing config.json would give
    transformers' misleading "model_type" message), or a hub id, passed on to transformers unchecked."""
    from engine.models.model_dir import check_model_dir
    from engine.models.tiny_model import resolve_builtin_model

    model_dir = resolve_builtin_model(name, run_dir / "models") if name.startswith("builtin:") else Path(name)
    if model_dir.is_dir():
        check_model_dir(model_dir, need_tokenizer=need_tokenizer)
    return model_dir


def _model_identity(run: Run) -> dict:
    from transformers import AutoConfig

    return describe_model(AutoConfig.from_pretrained(run.model_dir), run.dims.padded_vocab)


def export_policy(run: Run, out_dir: str | Path) -> None:
    """Write the current policy as a Hugging Face checkpoint in the model's dtype, with the model directory's
    config and tokenizer files (collective: every rank calls it)."""
    from transformers import AutoConfig

    from engine.policy.hf_checkpoint import export_hf_checkpoint

    dtype = getattr(torch, run.cfg.model.dtype)
    export_hf_checkpoint(run.chunks, run.ps, out_dir, AutoConfig.from_pretrained(run.model_dir), run.dims,
                         tokenizer_dir=run.model_dir, dtype=dtype)


def sync_weights(run: Run) -> dict:
    """Push the policy's weights into the engines: bucketed in-process loads (colocate) or shard to shard into the
    rollout server(s) (server; a failure raises WeightSyncError on every rank and leaves the trainer untouched). With
    `rollout.verify_weight_sync`, every engine rank's digests of what it then holds are checked against the trainer's
    digests of what it sent (engine/rollout/sync_check.py): a WeightSyncError names any tensor that differs."""
    verify = run.cfg.rollout.verify_weight_sync
    if run.cfg.rollout.vllm_mode == "server":
        return _sync_servers(run.popt.model, run.ps, run.dims, run.engine, verify=verify)
    return sync_colocated(run.popt.model, run.ps, run.dims, run.engine, run.cfg.rollout.weight_sync_bucket_mb,
                          run.colocated_plan if verify else None)


def _sync_servers(chunks, ps: ParallelState, dims, engine, *, verify: bool) -> dict:
    """One sync into each rollout server in turn (each through its own transfer group); the stats summed."""
    total: dict = {}
    for link in engine.weight_links:
        for key, value in sync_server(chunks, ps, dims, engine, link, verify=verify).items():
            total[key] = total.get(key, 0.0) + value
    return total | {"weight_sync/servers": float(len(engine.weight_links)),
                    "weight_sync/server_restarts": float(engine.num_restarts)}


def sync_and_verify(run: Run, probe: dict | None = None) -> dict:
    """`sync_weights` (verified by digests), then, with `rollout.verify_weight_sync`, the log-prob probe's health
    metrics (`weight_sync/logprob_diff_p50/_p90/_max`: the engines' log-probs of `probe`, default the last round's
    probe micro-batch, none before the first round, against the trainer's; logged, never a gate)."""
    sync = sync_weights(run)
    probe = probe if probe is not None else run.last_probe
    if run.cfg.rollout.verify_weight_sync and probe is not None:
        sync |= logprob_health(run.popt.model, run.ps, run.engine, probe, run.dims.vocab_size)
    return sync


def check_finite(run: Run, step: int, losses: list) -> None:
    """Stop a diverged run before its weights are synced (collective): the round's losses and every weight of the
    policy must be finite on every rank.

    Args:
        step: the optimizer step just taken (as logged).
        losses: this rank's micro-batch losses of the round (tensors or floats; where they are computed).
    Raises:
        TrainingDivergedError on every rank, naming the step, what went non-finite and where.
    """
    bad_loss = next((float(v) for v in losses if not math.isfinite(float(v))), None)
    bad_weight = None
    for chunk in run.chunks:
        for name, param in chunk.named_parameters():
            if not bool(torch.isfinite(param).all()):
                bad_weight = name
                break
        if bad_weight is not None:
            break
    flag = torch.tensor([float(bad_loss is not None or bad_weight is not None)], device=run.ps.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not float(flag):
        return
    found: list = [None] * run.ps.world_size
    dist.all_gather_object(found, (bad_loss, bad_weight))
    rank, (loss, weight) = next((r, f) for r, f in enumerate(found) if f[0] is not None or f[1] is not None)
    what = f"the loss is {loss}" if loss is not None else f"the policy's weight {weight} is not finite"
    raise TrainingDivergedError(
        f"training diverged at step {step}: {what} (trainer rank {rank}); the weights were not synced to the "
        f"engines. Lower optimizer.learning_rate (now {run.cfg.optimizer.learning_rate:g}) or set "
        "optimizer.max_grad_norm, and resume from the last checkpoint")
