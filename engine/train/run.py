"""The run: everything `train(cfg)` builds once (`Run`, `build_run`), and what it does with that state between
rounds: resume, save, export, and push the policy's weights into the engine, verified.

Owns: `build_run` (parallel state, validation, the resolved config in the run directory, model, reference,
optimizer, data, rewards, logger, the loss config, the round sampler; a failure after the engine started closes
it: `close_on_error`), `build_engine` (the one place that picks the
`RolloutEngine` by `rollout.vllm_mode`), `resolve_hooks` (the user's GFPO filter and curriculum hook: objects in
memory, else the config's `module:function`), `AdaptiveEntropy` (the adaptive entropy-bonus controller's state),
`resume` / `save_run` / `export_policy` / `export_reference` (TR-DPO's mixed reference), `check_finite` (a diverged policy stops the run before its weights are
synced: `TrainingDivergedError`) and `sync_weights` / `sync_and_verify` (the engine's verified sync, and the log-prob
probe's health metrics).

Must not: run a round (engine/train/loop.py), sample or score (engine/train/sampling.py), hold maths (engine/grpo/),
import vLLM, or read Megatron's global parallel state (engine/policy/parallel.py hands out groups).

Test: tests/unit/test_trainer_config.py (the loss config, the hooks), tests/unit/test_rollout_protocol.py (the mode
is chosen here only); the whole run: tests/integration/test_trainer.py, tests/integration/test_resume.py.
"""

from __future__ import annotations

import contextlib
import math
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.config import EngineConfig, GRPOConfigSection, config_to_dict, write_resolved_config
from engine.grpo.policy_loss import PolicyLossConfig, entropy_coef_to_apply, update_entropy_coef
from engine.lora_settings import LoraSettings, lora_settings_from_config, refuse_expert_adapters
from engine.models.model_dir import resolve_model_dir
from engine.policy.hf_map import ModelDims
from engine.policy.lora import apply_lora, merged_lora
from engine.policy.microbatch import MicroBatch
from engine.policy.optimizer import PolicyOptimizer
from engine.policy.parallel import ParallelState, init_parallel
from engine.policy.reference import ReferencePolicy
from engine.policy.step import LogprobSettings
from engine.rollout.protocol import RolloutEngine
from engine.rollout.sync_check import logprob_health
from engine.train.checkpoint import (
    Progress,
    agree_on_resume_checkpoint,
    describe_model,
    load_checkpoint,
    read_progress,
    save_checkpoint,
)
from engine.train.data import PromptBatch
from engine.train.metric_logger import MetricLogger
from engine.train.prompt_queue import PromptQueue
from engine.train.rewards import RewardFunctions
from engine.train.sampling import RoundSampler
from engine.train.step_schedule import count_total_steps, uses_carried_slices
from engine.validation import Derived, validate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.train.rollout_pipeline import RolloutPipeline


@dataclass
class Run:
    """Everything `train` builds once (see `build_run`): the components, each typed with what it holds."""

    cfg: EngineConfig
    ps: ParallelState
    derived: Derived
    model_dir: Path
    tokenizer: PreTrainedTokenizerBase
    dims: ModelDims
    chunks: list[torch.nn.Module]
    """The policy's Megatron model chunks (one per virtual pipeline stage), as the optimizer holds them."""
    optimizer: PolicyOptimizer
    reference: ReferencePolicy | None
    """The KL reference (None when `grpo.beta` is 0)."""
    engine: RolloutEngine
    """Colocated vLLM or the rollout server(s), chosen once (engine/rollout/protocol.py)."""
    rewards: RewardFunctions
    logger: MetricLogger | None
    """Rank 0 only."""
    sampler: RoundSampler
    """Sampling and scoring rounds: the engine, rewards, prompts, hooks and curriculum queue, with the `grpo`,
    `data` and `generation` sections (engine/train/sampling.py)."""
    loss_config: PolicyLossConfig
    settings: LogprobSettings
    total_steps: int
    last_probe: MicroBatch | None = None
    """The last round's first micro-batch: the weight-sync verification probe (also after a server restart)."""
    resume_from: Path | None = None
    """The checkpoint this run resumes from (`checkpoint.resume_from_checkpoint` resolved), or None."""
    entropy: AdaptiveEntropy = field(default_factory=lambda: AdaptiveEntropy(0.0, enabled=False))
    policy_version: int = 0
    """Rounds trained so far: the version of the policy the trainer holds (and last pushed into the engines)."""
    pipeline: RolloutPipeline | None = None
    """With `rollout.max_staleness` > 0 (server mode): the rounds generated ahead (engine/train/rollout_pipeline.py)."""
    lora: LoraSettings | None = None
    """With `lora.use_peft`: the adapters on the frozen policy (engine/policy/lora.py)."""


class TrainingDivergedError(RuntimeError):
    """The policy's loss or weights went non-finite: the run stops before the weights reach the engines."""


@dataclass
class AdaptiveEntropy:
    """The adaptive entropy-bonus controller's state (Skywork-OR1; TRL 1.16's
    `use_adaptive_entropy`): the coefficient and the previous optimizer step's world entropy. The maths is engine/grpo/policy_loss.py's."""

    coef: float
    last_entropy: float = math.inf
    """Token-mean entropy of the previous optimizer step over all ranks (inf before the first, as TRL)."""
    enabled: bool = True

    def coef_to_apply(self, grpo: GRPOConfigSection) -> float | None:
        """This step's coefficient (None = the loss config's fixed entropy_coef)."""
        return entropy_coef_to_apply(self.coef, self.last_entropy, grpo.entropy_target) if self.enabled else None

    def update(self, grpo: GRPOConfigSection, ps: ParallelState, outputs: list) -> dict[str, float]:
        """After an optimizer step: the world entropy of its micro-batches (summed over the last stage's DP ranks;
        collective), then the controller's step. Returns {"entropy_coef": the new coefficient} (TRL logs it so:
        0.01 + 0.005 * global_step while the entropy stays below the target); a static bonus (coef != 0, not
        adaptive) returns its fixed coefficient, as TRL logs it whenever the bonus is on."""
        if not self.enabled:
            return {"entropy_coef": self.coef} if self.coef else {}
        window = torch.zeros(2, dtype=torch.float64, device=ps.device)  # [sum H m_eff, sum m_eff]
        if ps.is_last_stage and ps.tp_rank == 0:
            for out in outputs:
                window += out.entropy_window.double().to(ps.device)
        dist.all_reduce(window)
        self.last_entropy = float(window[0] / window[1].clamp(min=1.0))
        self.coef = update_entropy_coef(self.coef, self.last_entropy, entropy_target=grpo.entropy_target,
                                        entropy_coef_delta=grpo.entropy_coef_delta,
                                        entropy_coef_min=grpo.entropy_coef_min, entropy_coef_max=grpo.entropy_coef_max)
        return {"entropy_coef": self.coef}


def build_run(cfg: EngineConfig, *, train_dataset=None, eval_dataset=None, reward_funcs=None, tokenizer=None,
              group_filter_func=None, dynamic_prompts_fn=None, agentic: dict | None = None) -> Run:
    """Parallel state, model, reference, optimizer, engine, data, rewards, logger (every rank); the keyword-only
    inputs replace what the config names (see engine/train/loop.py `train`). `agentic`: TRL's `tools`,
    `environment_factory` and `rollout_func` (engine/agent/agentic_rollout.py), None = single-turn."""
    from transformers import AutoConfig, AutoTokenizer

    from engine.models.tiny_model import resolve_builtin_model
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.optimizer import build_optimizer
    from engine.train.data import load_prompts
    from engine.train.rewards import build_reward_funcs

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
    lora = lora_settings_from_config(cfg.lora) if cfg.lora.use_peft else None
    if lora is not None:  # before the model is built and loaded
        refuse_expert_adapters(lora, hf_config.model_type, dims.num_experts, cfg.parallel.expert_tp_size)
    chunks = build_policy(hf_config, cfg.model, ps, cfg.train)
    load_hf_checkpoint(chunks, ps, model_dir, dims)
    if lora is not None:  # before the optimizer: it then holds the adapters only
        apply_lora(chunks, lora, ps, seed=cfg.train.seed)
    reference = None if cfg.grpo.beta == 0 else (ReferencePolicy.base_of(chunks, ps) if lora is not None else  # no copy
                                                 ReferencePolicy.build(hf_config, cfg.model, ps, model_dir, dims))
    max_len = cfg.rollout.vllm_max_model_length or hf_config.max_position_embeddings
    multi_turn = build_agentic(cfg, agentic, tokenizer, name)
    generation = cfg.generation if multi_turn is None else replace(  # the prompts show the tools
        cfg.generation, chat_template_kwargs=multi_turn.chat_template_kwargs())
    train_prompts = load_prompts(cfg.data, tokenizer, generation, split="train", max_model_length=max_len,
                                 dataset=train_dataset)
    eval_prompts = load_prompts(cfg.data, tokenizer, generation, split="test", max_model_length=max_len,
                                dataset=eval_dataset)
    opened: list = []  # closed when the rest raises: a failed build_run leaks no engine (a new trainer trains)
    with close_on_error(opened):
        rewards = (build_reward_funcs(cfg.reward, cfg.generation) if reward_funcs is None
                   else RewardFunctions(reward_funcs, cfg.reward.reward_weights, cfg.generation))
        opened.append(rewards)
        total_steps = _total_steps(cfg, derived, len(train_prompts))
        optimizer = build_optimizer(cfg.optimizer, chunks, ps, total_steps=total_steps)
        engine = build_engine(cfg, ps, dims, model_dir, optimizer.model,
                              ffn_hidden_size=hf_config.intermediate_size)
        opened.append(engine)
        resume_from = agree_on_resume_checkpoint(cfg.checkpoint.resume_from_checkpoint, run_dir, ps)
        # a resumed run drops its log lines after the checkpoint's step
        resume_step = read_progress(resume_from).step if resume_from is not None else None
        logger = (MetricLogger(cfg.logging, run_dir, max_steps=total_steps, resume_step=resume_step)
                  if ps.rank == 0 else None)
        loss_config = PolicyLossConfig.from_sections(cfg.grpo, cfg.generation)
        settings = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=cfg.generation.temperature,
                                   kernels=cfg.kernels)
        num_prompts = derived.num_prompts_per_generation
        queue = (PromptQueue(cfg.data.dynamic_prompts_queue_rounds * num_prompts) if dynamic_prompts is not None
                 else None)
        sampler = RoundSampler(engine, rewards, tokenizer, ps, train_prompts, eval_prompts, logger, cfg.grpo, cfg.data,
                               generation, seed=cfg.train.seed, num_prompts=num_prompts, total_steps=total_steps,
                               group_filter=group_filter, dynamic_prompts=dynamic_prompts, prompt_queue=queue,
                               agentic=multi_turn)
        entropy = AdaptiveEntropy(cfg.grpo.entropy_coef, enabled=cfg.grpo.use_adaptive_entropy)
        return Run(cfg, ps, derived, Path(model_dir), tokenizer, dims, chunks, optimizer, reference, engine, rewards,
                   logger, sampler, loss_config, settings, total_steps, resume_from=resume_from, entropy=entropy,
                   lora=lora)


@contextlib.contextmanager
def close_on_error(opened: list):
    """On an exception inside the block, `close()` every part in `opened` (each even if another fails), then
    re-raise: `build_run`'s engine and reward functions do not outlive a failed build."""
    try:
        yield
    except BaseException:
        for part in reversed(opened):
            with contextlib.suppress(Exception):
                part.close()
        raise


def build_agentic(cfg: EngineConfig, agentic: dict | None, tokenizer, model_name: str):
    """The run's `AgenticRollout` (engine/agent/), or None without tools, environments or rollout_func (any engine
    layout: colocated at vLLM TP > 1, rank 0's TP group mirrors its turns, engine/rollout/colocated_turns.py)."""
    from engine.agent.agentic_rollout import AgenticRollout

    if not agentic or not any(v is not None and v != [] for v in agentic.values()):
        return None
    return AgenticRollout(tools=agentic.get("tools"), environment_factory=agentic.get("environment_factory"),
                          rollout_func=agentic.get("rollout_func"), tokenizer=tokenizer, generation=cfg.generation,
                          model_name=model_name)


def build_engine(cfg: EngineConfig, ps: ParallelState, dims: ModelDims, model_dir: Path, chunks: list, *,
                 ffn_hidden_size: int) -> RolloutEngine:
    """The run's rollout engine, chosen here once by `rollout.vllm_mode`: a vLLM engine in every process
    (colocate), or the rollout server(s), connected (waiting up to `vllm_server_timeout` for their health checks)
    and synced with the policy's weights (server: they outlive trainer runs and restarts)."""
    from engine.rollout.colocated import ColocatedRollout
    from engine.rollout.server_rollout import ServerRollout

    adapter_only = cfg.lora.use_peft and cfg.lora.lora_weight_sync == "adapter"  # engine/rollout/adapter_sync.py
    adapter = lora_settings_from_config(cfg.lora) if adapter_only else None
    if cfg.rollout.vllm_mode == "server":
        return ServerRollout(cfg.rollout, cfg.generation, ps, dims, chunks, ffn_hidden_size=ffn_hidden_size,
                             dtype=cfg.model.dtype, verify=cfg.rollout.verify_weight_sync, adapter=adapter)
    return ColocatedRollout.build(model_dir, cfg.rollout, cfg.generation, ps, dims, seed=cfg.train.seed,
                                  dtype=cfg.model.dtype, ffn_hidden_size=ffn_hidden_size, adapter=adapter)


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


def _total_steps(cfg: EngineConfig, derived: Derived, num_prompts: int) -> int:
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    micro_steps = derived.steps_per_generation * cfg.grpo.num_iterations
    if uses_carried_slices(derived.steps_per_generation, cfg.grpo.num_iterations, cfg.train.gradient_accumulation_steps):
        return count_total_steps(num_prompts // derived.num_prompts_per_generation, micro_steps,
                                 cfg.train.gradient_accumulation_steps, cfg.train.num_train_epochs)
    rounds = math.ceil(cfg.train.num_train_epochs * num_prompts / derived.num_prompts_per_generation)
    return rounds * derived.optimizer_steps_per_generation


def resume(run: Run) -> Progress:
    """Restore `run.resume_from` (model, optimizer, scheduler, RNG, data position, step; collective), then load the
    restored policy into every engine, which started from the Hugging Face weights. Progress() when not resuming."""
    if run.resume_from is None:
        return Progress()
    progress = load_checkpoint(run.resume_from, run.optimizer, run.ps, model=_model_identity(run),
                               reference=_mixed_reference(run))
    entropy = progress.loop_state.get("entropy", {})
    run.entropy.coef = entropy.get("coef", run.entropy.coef)
    run.entropy.last_entropy = entropy.get("last_entropy", run.entropy.last_entropy)
    queue = run.sampler.prompt_queue
    if queue is not None:  # the prompts the dynamic-prompts hook returned, still waiting
        queue.restore(progress.loop_state.get("prompt_queue"))
        pending = progress.loop_state.get("pending_prompts")  # a checkpoint from before the queue: its one choice
        if pending is not None:
            queue.push(PromptBatch(**pending))
    sync_weights(run)
    return progress


def save_run(run: Run, progress: Progress) -> int:
    """Write `<output_dir>/checkpoint-<step>` (collective), keep the newest `save_total_limit`; returns the step."""
    entropy = {"coef": run.entropy.coef, "last_entropy": run.entropy.last_entropy}
    queue = run.sampler.prompt_queue.state() if run.sampler.prompt_queue is not None else None
    in_flight = run.pipeline.state() if run.pipeline is not None else None  # asynchronous rollout's complete rounds
    progress = replace(progress, loop_state=progress.loop_state | {
        "entropy": entropy, "prompt_queue": queue, "policy_version": run.policy_version,
        "async_rounds": in_flight})
    save_checkpoint(run.cfg.train.output_dir, progress, run.optimizer, run.ps, model=_model_identity(run),
                    run_config=config_to_dict(run.cfg), save_total_limit=run.cfg.checkpoint.save_total_limit,
                    reference=_mixed_reference(run))
    return progress.step


def _mixed_reference(run: Run) -> list | None:
    """The reference's chunks when TR-DPO mixes them (`grpo.sync_ref_model`): saved and restored with the run; None
    otherwise (a frozen reference is the Hugging Face checkpoint, rebuilt at start)."""
    return run.reference.chunks if run.cfg.grpo.sync_ref_model and run.reference is not None else None


def _model_identity(run: Run) -> dict:
    from transformers import AutoConfig

    return describe_model(AutoConfig.from_pretrained(run.model_dir), run.dims.padded_vocab)


def export_initial_adapter(cfg: EngineConfig, target: str | Path) -> Path:
    """Before any run (GRPOTrainer.save_model() before train()): the PEFT adapter a LoRA run of `cfg` starts from,
    into `target` (engine/policy/peft_adapter.py `write_initial_adapter`; one process, no parallel state)."""
    from engine.policy.peft_adapter import write_initial_adapter

    return write_initial_adapter(cfg, target)


def export_policy(run: Run, out_dir: str | Path) -> None:
    """Write the current policy as a Hugging Face checkpoint in the model's dtype (the quantized weights of a quantized
    source in its format with `checkpoint.export_quantization: source`), with the model directory's
    config and tokenizer files and its multi-token-prediction layers, untrained (collective: every rank calls it).
    With LoRA: a PEFT adapter directory instead (engine/policy/peft_adapter.py, with the tokenizer files; the
    adapters in their own dtype, lora.lora_adapter_dtype, as PEFT saves them), and with `lora.lora_save_merged` the
    merged model as an HF checkpoint to `<out_dir>_merged` too."""
    from transformers import AutoConfig

    from engine.policy.hf_checkpoint import TOKENIZER_FILES, export_hf_checkpoint
    from engine.policy.peft_adapter import save_peft_adapter

    dtype = getattr(torch, run.cfg.model.dtype)
    hf_config = AutoConfig.from_pretrained(run.model_dir)
    if run.lora is None:
        export_hf_checkpoint(run.chunks, run.ps, out_dir, hf_config, run.dims, tokenizer_dir=run.model_dir, dtype=dtype,
                             source_dir=run.model_dir, quantization=run.cfg.checkpoint.export_quantization)
        return
    out_dir = Path(out_dir)
    save_peft_adapter(run.chunks, run.ps, out_dir, run.lora, base_model_name_or_path=str(run.model_dir))  # as held
    if run.ps.rank == 0:
        for name in TOKENIZER_FILES:
            if (run.model_dir / name).exists():
                shutil.copy2(run.model_dir / name, out_dir / name)
    if run.cfg.lora.lora_save_merged:
        with merged_lora(run.chunks):
            export_hf_checkpoint(run.chunks, run.ps, out_dir.with_name(out_dir.name + "_merged"), hf_config,
                                 run.dims, tokenizer_dir=run.model_dir, dtype=dtype, source_dir=run.model_dir,
                                 quantization=run.cfg.checkpoint.export_quantization)


REFERENCE_EXPORT_SUFFIX = "_reference"
"""`<export_dir><suffix>`: where a TR-DPO run (`grpo.sync_ref_model`) writes its mixed reference next to the policy."""


def export_reference(run: Run, out_dir: str | Path) -> None:
    """Write the TR-DPO reference (mixed towards the policy during the run) as a Hugging Face checkpoint, as
    `export_policy` writes the policy (collective; an offloaded reference is brought to the device for it)."""
    from transformers import AutoConfig

    from engine.policy.hf_checkpoint import export_hf_checkpoint

    reference = run.reference
    if reference.offload:
        reference._move(reference.device)
    try:
        export_hf_checkpoint(reference.chunks, run.ps, out_dir, AutoConfig.from_pretrained(run.model_dir), run.dims,
                             tokenizer_dir=run.model_dir, dtype=getattr(torch, run.cfg.model.dtype),
                             source_dir=run.model_dir, quantization=run.cfg.checkpoint.export_quantization)
    finally:
        if reference.offload:
            reference._move(torch.device("cpu"))


def sync_weights(run: Run) -> dict:
    """Push the policy's weights into the engine(s) (`RolloutEngine.sync_weights`): with `rollout.verify_weight_sync`
    every engine rank's digests of what it then holds are checked against the trainer's digests of what it sent
    (engine/rollout/sync_check.py): a WeightSyncError names any tensor that differs, and leaves the trainer as it was."""
    return run.engine.sync_weights(run.optimizer.model, verify=run.cfg.rollout.verify_weight_sync)


def sync_and_verify(run: Run, probe: MicroBatch | None = None) -> dict:
    """`sync_weights` (verified by digests), then, with `rollout.verify_weight_sync`, the log-prob probe's health
    metrics (`weight_sync/logprob_diff_p50/_p90/_max`: the engines' log-probs of `probe`, default the last round's
    probe micro-batch, none before the first round, against the trainer's; logged, never a gate)."""
    sync = sync_weights(run)
    probe = probe if probe is not None else run.last_probe
    if run.cfg.rollout.verify_weight_sync and probe is not None:
        sync |= logprob_health(run.optimizer.model, run.ps, run.engine, probe, run.dims.vocab_size)
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
