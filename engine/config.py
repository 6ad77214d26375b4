"""The engine's configuration: one typed tree, every default in one place.

Owns: the dataclass tree (`EngineConfig` and its sections), loading from YAML plus dotted overrides, the type
checks that name the full dotted path, and writing the resolved config into the run directory. Cross-field checks
live in `engine/validation.py` (one function, `validate`), derived numbers in `derive`.

Must not: read the environment, touch torch.distributed, or hand the root config to a component (components take
their own section, e.g. `build_optimizer(cfg.optimizer, model)`: docs/contributing/house-rules.md).

Names: fields that exist in TRL's `GRPOConfig` / `TrainingArguments` carry TRL's name and TRL 1.16's default (the
version the tests compare with). Every leaf name is unique across the tree, so a flat TRL keyword argument has exactly
one home (`find_field`). Engine-only fields (parallelism, kernels, weight sync) use Megatron's vocabulary (`tp_size`).

Longer than 600 lines: the tree is the one place for every default and every field's one-line meaning (its docstring,
which configs/SETTINGS.md is generated from, engine/api/settings_table.py). Test: `pytest tests/unit/test_config.py`.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from engine.config_files import ConfigError, apply_overrides, config_to_dict, describe_callable, write_resolved_config  # noqa: F401
from engine.grpo.settings import (
    ImportanceSamplingLevel,
    ISMode,
    KLEstimator,
    LossType,
    MultiObjectiveAggregation,
    ScaleRewards,
    TermsImplementation,
)


def _aliases(**mapping: Any) -> dict:
    """Field metadata: input values accepted for TRL compatibility and what they mean (e.g. True -> 'group')."""
    return {"aliases": mapping}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    name_or_path: str = "builtin:tiny-qwen2"
    """Hugging Face checkpoint: a local directory or a hub name. `builtin:tiny-<family>` (any of `TINY_FAMILIES` in
    engine/models/tiny_model.py: qwen2 ... nemotron_h) builds a tiny random-weight model in-process, cached in the run
    directory; `builtin:tiny-qwen2-arith` / `-calc` are the shipped warm-started demo model and its tool-calling twin."""
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Parameter and activation dtype of the policy (TRL's `bf16=True` -> bfloat16). Softmax statistics and the
    loss are always accumulated in float32."""
    trust_remote_code: bool = False
    """Let a hub checkpoint run its own code where it is resolved (the TRL API, the rollout server's vLLM)."""
    disable_dropout: bool = False
    """Whether the policy trains without dropout (True) or with the HF config's `attention_dropout` / `hidden_dropout`
    (False, TRL's default; engine/policy/model.py `dropout_settings`); log-prob-only forwards never drop."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times tp_size; padded rows are never sampled."""
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"
    """Megatron layer spec: `auto` = Transformer Engine when it imports (GPU), the local spec otherwise."""
    attention_implementation: Literal["auto", "sdpa", "eager"] = "auto"
    """The local spec's core attention (HF's `attn_implementation` names): `sdpa` = torch's fused attention (no s x s
    scores; engine/policy/sdpa_attention.py; refused where it cannot act), `eager` = Megatron's DotProductAttention,
    `auto` = sdpa where the layer's attention is the plain one, else the layer's own (Gemma, GPT-OSS, windows, TE)."""
    packed_attention_implementation: Literal["auto", "varlen", "masked"] = "auto"
    """Packed rows' attention: `varlen` = each sequence attends to itself, given by its bounds (no W x W mask is built:
    engine/policy/varlen_attention.py), `masked` = SDPA with the block-diagonal mask; `auto` = varlen where every layer's
    attention is SDPA's without windows, sinks or MLA (explicit varlen refused elsewhere)."""
    layer_kernel_implementation: Literal["auto", "triton", "torch"] = "auto"
    """The local spec's RMSNorm, SwiGLU / GeGLU and RoPE: `triton` = fused kernels (engine/policy/fused_layers.py;
    refused where none acts), `torch` = Megatron's unfused ops; `auto` = triton on CUDA, torch on CPU (interpreter)."""
    offload_reference: bool = False
    """Keep the frozen reference model (beta > 0) in CPU memory between its forward passes."""
    moe_aux_loss_coeff: float | None = None
    """MoE models: load-balancing aux loss coefficient (Megatron's per-micro-batch `aux_loss`, logged as TRL's
    `aux_loss`); None = the HF config's `router_aux_loss_coef` (as TRL), 0 = off (keeps the pretrained router)."""
    moe_z_loss_coeff: float | None = None
    """MoE models: router z-loss coefficient (ST-MoE); None = off."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """MoE models: how tokens reach the experts of other expert-parallel ranks (Megatron's dispatchers)."""
    moe_enable_routing_replay: bool = False
    """MoE models: rollout routing replay (R3): micro-batches that carry the engine's routed experts (`routed_experts`)
    are trained with those experts instead of the router's own top-k (Megatron's RouterReplay;
    engine/policy/routing_replay.py), in the old-log-prob forward and the training forward alike. Off: they are
    compared with the trainer's own choice, logged as `moe/router_agreement`. Needs the engine's routes
    (`vllm_return_routed_experts`, on by default for MoE models)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    tp_size: int = 1
    """Megatron tensor-parallel size (GPUs that split every layer)."""
    pp_size: int = 1
    """Megatron pipeline-parallel size (stages)."""
    dp_size: int | None = None
    """Data-parallel size (model replicas); None = world_size / (tp_size * pp_size)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (activations split along the sequence in the TP region). Needs tp_size > 1."""
    virtual_pipeline_size: int | None = None
    """Model chunks per pipeline stage (interleaved 1F1B). None = not interleaved. Needs pp_size > 1."""
    distributed_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """`auto` = nccl when CUDA is available, gloo otherwise."""
    ep_size: int = 1
    """MoE models: expert-parallel size (Megatron's expert_model_parallel_size): each rank holds num_experts / ep_size
    experts; must divide tp_size * dp_size."""
    expert_tp_size: int = 1
    """MoE models: tensor-parallel size inside each expert (Megatron's expert_tensor_parallel_size)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Batch geometry and run length, with TRL / TrainingArguments names and semantics (TRL 1.16 `GRPOConfig`).

    `per_device_train_batch_size` counts *completions* per data-parallel rank per micro-batch (a model replica
    spans tp_size * pp_size GPUs; this is Megatron's micro_batch_size). One generation batch holds
    per_device_train_batch_size * dp_size * steps_per_generation completions = num_prompts * num_generations.
    """

    output_dir: str = "runs/grpo"
    """Run directory: resolved config, logs, checkpoints, exports."""
    max_steps: int = -1
    """Optimizer steps to run; -1 = use num_train_epochs."""
    num_train_epochs: float = 3.0
    """Passes over the train prompts when max_steps is -1."""
    per_device_train_batch_size: int = 8
    """Completions per data-parallel rank per micro-batch (Megatron's micro_batch_size)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step on each data-parallel rank."""
    generation_batch_size: int | None = None
    """Completions per generation round, all ranks. Exclusive with steps_per_generation."""
    steps_per_generation: int | None = None
    """Micro-steps served by one generation batch. None = gradient_accumulation_steps."""
    shuffle_dataset: bool = True
    """Shuffle the train prompts each epoch (seeded by `seed`)."""
    seed: int = 42
    """Seeds the prompt order, vLLM's per-prompt sampling seeds, the row shuffle and model init."""
    gradient_checkpointing: bool = True
    """TRL's name and default: Megatron's activation recompute, as `recompute_granularity` / `recompute_method` /
    `recompute_num_layers` / `recompute_modules` say (default: full, uniform, one layer per unit: each transformer
    layer keeps only its input and runs its forward again in the backward). False = every activation is kept."""
    recompute_granularity: Literal["full", "selective"] = "full"
    """What the activation recompute reruns (Megatron-LM's name): `full` = whole transformer layers (`recompute_method`,
    `recompute_num_layers`); `selective` = only the submodules in `recompute_modules`, in every layer."""
    recompute_method: Literal["uniform", "block"] | None = None
    """Megatron-LM's name; full granularity only. `uniform`: the layers of each model chunk are cut into units of
    `recompute_num_layers` layers, each unit keeps only its input; `block`: the first `recompute_num_layers` layers of
    each model chunk are recomputed, the rest keep every activation. None = uniform."""
    recompute_num_layers: int | None = None
    """Megatron-LM's name; full granularity only. Layers per unit (uniform; must divide the layers of a model chunk)
    or layers recomputed per model chunk (block; at most the chunk's layers). None = 1 (uniform) or every layer of
    the chunk (block)."""
    recompute_modules: list[str] | None = None
    """Megatron-LM's name; selective granularity only: `core_attn` (attention scores and softmax), `layernorm` (the
    two norms' outputs), `mlp` (the dense MLP), `moe` (the whole MoE layer: router, dispatch, experts). None =
    Megatron's default, ["core_attn"]. Megatron's `moe_act` (grouped GEMM only), `mla_up_proj` (MLA models) and
    `shared_experts` are refused with the reason (engine/validation.py): nothing here runs them."""
    pad_to_multiple_of: int | None = None
    """Pad every micro-batch's sequence length to a multiple of this; None = no extra padding."""
    padding_free: bool = True
    """Pack several sequences into one row, attention confined to each sequence (TRL SFTConfig's name; verl's
    `use_remove_padding`): no compute spent on padding. Transformer Engine: THD packed sequences; local spec (CPU): a
    block-diagonal causal mask (engine/policy/packing.py). Loss and gradients equal the padded path's (up to float
    summation order). False = right-padded rows."""
    max_tokens_per_microbatch: int | None = None
    """Token budget of a training micro-batch, per data-parallel rank (prompt + completion tokens; verl's
    `ppo_max_token_len_per_gpu`): micro-batches are formed by tokens, balanced over DP ranks, the same number on every
    rank. None = per_device_train_batch_size * the step's longest sequence (never more than a padded micro-batch
    holds) when padding_free, else the padded path's fixed rows."""
    max_tokens_per_logprob_microbatch: int | None = None
    """Token budget of the forward-only old / reference log-prob micro-batches (verl's
    `log_prob_max_token_len_per_gpu`). None = 2 * the training budget (no activations are kept for a backward)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfigSection:
    """The objective, with TRL's names and defaults, plus GFPO and DAPO dynamic sampling."""

    num_generations: int = 8
    """G: completions per prompt; at least 2."""
    num_generations_eval: int | None = None
    """Completions sampled per held-out prompt in the evaluation before and after training; None = num_generations
    (TRL's default)."""
    num_iterations: int = 1
    """mu: optimisation passes over each generation batch."""
    beta: float = 0.0
    """KL penalty coefficient against the reference model; 0 = no KL term and no reference model is loaded."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator (Schulman's k1 / k2 / k3); engine-only, TRL has k3 only."""
    epsilon: float = 0.2
    """Lower clip of the importance ratio (1 - epsilon); also the upper one when epsilon_high is None."""
    epsilon_high: float | None = None
    """Upper clip; None = epsilon. For cispo it is the IS-weight cap (ScaleRL recommends 5.0)."""
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2): the ratio is also capped at delta (> 1 + epsilon)."""
    loss_type: LossType = "dapo"
    """The policy loss and its normaliser, TRL's loss types (engine/grpo/policy_loss.py)."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """`token`: a ratio per token; `sequence`: one per sequence (GSPO)."""
    sapo_temperature_pos: float = 1.0
    """SAPO (loss_type sapo): temperature of the soft gate sigmoid(tau (r - 1)) for tokens with positive advantage."""
    sapo_temperature_neg: float = 1.05
    """SAPO (loss_type sapo): temperature of the soft gate for tokens with negative advantage."""
    vespo_k_pos: float = 2.0
    """VESPO (loss_type vespo): shape k of the gamma weight phi(W) for sequences with advantage >= 0."""
    vespo_lambda_pos: float = 3.0
    """VESPO (loss_type vespo): rate lambda of the gamma weight phi(W) for sequences with advantage >= 0."""
    vespo_k_neg: float = 3.0
    """VESPO (loss_type vespo): shape k of the gamma weight phi(W) for sequences with negative advantage."""
    vespo_lambda_neg: float = 2.0
    """VESPO (loss_type vespo): rate lambda of the gamma weight phi(W) for sequences with negative advantage."""
    scale_rewards: ScaleRewards = field(default="group", metadata=_aliases(true="group", false="none"))
    """`group`: divide by the group std; `batch`: by the batch std; `none`: no scaling (Dr. GRPO).
    TRL's True / False are accepted and mean group / none."""
    mask_truncated_completions: bool = False
    """Completions cut by max_completion_length (no EOS) get no loss (DAPO's overlong filtering)."""
    use_bias_correction_kl: bool = True
    """Multiply the k3 KL by the (non-detached) importance ratio (DeepSeek-V3.2). TRL 1.16's default; 1.10 had False."""
    sync_ref_model: bool = False
    """TR-DPO: mix the reference towards the policy every `ref_model_sync_steps` optimizer steps; needs beta > 0."""
    ref_model_mixup_alpha: float = 0.6
    """TR-DPO's alpha: ref = alpha * policy + (1 - alpha) * ref."""
    ref_model_sync_steps: int = 512
    """TR-DPO's tau: optimizer steps between reference mixes (after steps tau, 2 tau, ...)."""
    top_entropy_quantile: float = 1.0
    """Keep the loss only on the top-rho quantile of tokens by entropy (1.0 = all)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 = off); the start value with use_adaptive_entropy."""
    use_adaptive_entropy: bool = False
    """Adapt entropy_coef towards entropy_target after every optimizer step (Skywork-OR1)."""
    entropy_coef_min: float = 0.0
    """Adaptive entropy (use_adaptive_entropy): lower bound of the entropy coefficient."""
    entropy_coef_max: float = 1.0
    """Adaptive entropy (use_adaptive_entropy): upper bound of the entropy coefficient."""
    entropy_coef_delta: float = 0.005
    """Adaptive entropy: step of the coefficient per optimizer step."""
    entropy_target: float = 0.2
    """Adaptive entropy: the token-mean policy entropy (nats) the coefficient steers towards."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2: drop sequences with A < 0 whose mean KL(sampler || policy) exceeds this; None = off."""
    vllm_importance_sampling_correction: bool = True
    """Correct the sampler/learner gap with the vLLM importance-sampling ratio."""
    vllm_importance_sampling_mode: ISMode = "sequence_mask"
    """How that ratio is applied: truncated or masked, per token or per sequence."""
    vllm_importance_sampling_clip_min: float | None = None
    """Lower bound of the vLLM importance-sampling ratio (truncated or masked below it); None = no bound."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """Upper bound of the vLLM importance-sampling ratio (TRL's former vllm_importance_sampling_cap); None = none."""
    num_remains_in_group: int | None = None
    """GFPO: keep the top-k completions of each group (by `group_filter_func`); None = keep all. The generation
    batch (per_device_train_batch_size * dp * steps_per_generation) counts the k survivors of each prompt, so
    micro-batches stay full: a round samples generation_batch_size / k prompts, G completions each."""
    group_filter_func: str | None = None
    """GFPO's filter `f(group_completions, group_rewards, **kw) -> [P][G]` scores, higher = keep
    (engine/grpo/group_filter.py), as a `module:function` import path. Any callable object (a function of the user's
    script, a lambda, an instance) travels in memory instead (`GFPOTrainer(group_filter_func=...)`,
    `train(cfg, group_filter_func=...)`) and is recorded here as its description (`describe_callable`)."""
    use_dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards have zero variance and refill the batch from further prompts."""
    dynamic_sampling_max_rounds: int = 4
    """Generation rounds allowed to fill one batch with informative groups before training on what there is."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationConfig:
    """Sampling, with TRL's names and defaults (TRL 1.16 `GRPOConfig`)."""

    max_completion_length: int = 512
    """Tokens sampled at most per completion (vLLM's max_tokens)."""
    temperature: float = 1.0
    """Sampling temperature (vLLM's); the trainer divides its logits by it too, so log-probs match the sampler's."""
    top_p: float = 1.0
    """Nucleus sampling (vLLM's top_p)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (vLLM's top_k); 0 = no limit (vLLM's -1)."""
    min_p: float | None = None
    """vLLM's min_p; None = off."""
    repetition_penalty: float = 1.0
    """Penalty on tokens already in the prompt or completion (vLLM's repetition_penalty); 1.0 = none."""
    generation_kwargs: dict[str, Any] | None = None
    """Extra vLLM SamplingParams keyword arguments; they override the fields above; None = none."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments of the tokenizer's chat template for conversational prompts."""
    max_tool_calling_iterations: int | None = None
    """Tool rounds one sample may make (TRL's name; with tools); None = until max_completion_length is spent."""
    tool_call_timeout_s: float | None = None
    """Seconds one tool call may run; past it the model sees {"error": ...}. None = no limit (TRL's behaviour)."""
    max_concurrent_tool_calls: int = 16
    """Tool calls running at once over all samples of a round (TRL runs those of different samples one by one)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """vLLM, with TRL's names and defaults, plus the weight transfer."""

    vllm_mode: Literal["colocate", "server"] = "colocate"
    """`colocate`: vLLM in every training process; `server`: rollout server(s) elsewhere."""
    vllm_tensor_parallel_size: int = 1
    """Colocate: vLLM's tensor-parallel size (ranks per engine)."""
    vllm_gpu_memory_utilization: float = 0.3
    """Colocate: the fraction of accelerator memory vLLM takes (on CPU: of host memory)."""
    vllm_enable_sleep_mode: bool = False
    """Colocate on GPU: vLLM sleeps (frees its memory) during training."""
    vllm_max_model_length: int | None = None
    """vLLM's max_model_len; None = the model's max_position_embeddings."""
    vllm_model_impl: Literal["vllm", "transformers"] = "vllm"
    """vLLM's model_impl: its own model classes or transformers'."""
    vllm_return_routed_experts: bool | None = None
    """MoE: the engine returns the experts it routed every token to (vLLM's `enable_return_routed_experts`; on CPU
    this project's recorder, engine/rollout/vllm_engine.py), for routing replay (`moe_enable_routing_replay`) or,
    with replay off, the `moe/router_agreement` metric. None = on for MoE models. Costs host memory and (server mode)
    transfer: tokens x layers x top-k ids per round."""
    vllm_structured_outputs_regex: str | None = None
    """Every completion matches this regex (vLLM's structured outputs; server mode: sent with every request). vLLM's
    sampled-token log-probs are then those of the constrained distribution. None = unconstrained."""
    vllm_server_base_url: str | None = None
    """Server mode: the rollout server's URL; replaces host and port."""
    vllm_server_host: str = "0.0.0.0"
    """Server mode: the rollout server's host (with vllm_server_port)."""
    vllm_server_port: int = 8000
    """Server mode: the rollout server's port."""
    vllm_server_timeout: float = 240.0
    """Seconds to wait for the server's health check (at start, and for a restarted server to come back)."""
    vllm_server_base_urls: list[str] | None = None
    """Several rollout servers, one per replica (engine-only; TRL has one): each round's prompts are split among them
    in order, the i-th synced over port `vllm_group_port + i`. Replaces `vllm_server_base_url` / host / port."""
    vllm_nodes_per_server: int = 1
    """Server mode: inference nodes one rollout server's vLLM engine spans (its TP over all their GPUs)."""
    vllm_request_timeout: float = 3600.0
    """Seconds one generate / prompt-logprobs / weight-update request to a rollout server may take."""
    max_staleness: int = 0
    """Server mode: how many policy versions generation may run ahead of training (TRL's AsyncGRPOTrainer name;
    verl's one-step-off-policy is 1). 0 = the synchronous loop: generate round r, train on it, sync. k > 0: round r is
    sampled from the policy of version r - k exactly (version = rounds trained; rounds 0..k use version 0): the
    weights of version v are pushed and verified before generation of round v + k starts, and the servers generate
    that round while the trainer trains (engine/train/rollout_pipeline.py). Old log-probs are the trainer's
    recomputation at its current version and `vllm_importance_sampling_correction` corrects the sampler/learner gap
    (AReaL's decoupled PPO with recomputed proximal log-probs). Colocated mode is synchronous (0 only)."""
    vllm_group_port: int = 51216
    """TCP port of the weight-transfer group (global rank 0's host; server i of the URL list: `vllm_group_port + i`)."""
    vllm_weight_dtype: Literal["model", "fp8"] = "model"
    """The dtype vLLM serves the policy's linear layers in. `model`: model.dtype. `fp8`: vLLM's block-wise FP8
    (float8_e4m3fn, one float32 scale per 128 x 128 block): every sync quantizes on the trainer and sends payload and
    scales, both verified (engine/rollout/fp8_sync.py; server mode: engine/rollout/fp8_wire.py). A quantized
    `model.name_or_path`: `fp8` starts vLLM from a block-FP8 checkpoint as it is, `model` from its dequantized copy
    (engine/rollout/quantized_source.py). Refused on a CPU without AMX."""
    vllm_kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """vLLM's KV-cache dtype: `auto` (the model's) or `fp8` (half the bytes per token; refused on a CPU without
    AVX-512 or AMX)."""
    weight_sync_bucket_mb: int = 512
    """Size, MiB, of one flattened weight-transfer bucket (trainer -> vLLM, every sync)."""
    verify_weight_sync: bool = True
    """After every sync, check that every engine rank holds, bit for bit, what the trainer sent it (per-tensor digests,
    engine/rollout/weight_digest.py: a WeightSyncError names any tensor that differs, and the engine rank), and log
    the log-prob probe's health metrics (`weight_sync/logprob_diff_p50/_p90/_max`, never a gate)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    reward_funcs: list[str] = field(default_factory=lambda: ["accuracy"])
    """Built-in names (engine/train/rewards.py), `module:function` import paths, or reward-model paths."""
    reward_weights: list[float] | None = None
    """One weight per reward function; None = all 1.0."""
    multi_objective_aggregation: MultiObjectiveAggregation = "sum_then_normalize"
    """Several rewards: weighted sum then normalise, or normalise each then sum."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """Megatron's optimizer, with TrainingArguments names (TRL changes learning_rate to 1e-6)."""

    optim: Literal["adam", "sgd"] = "adam"
    """Megatron's optimizer: `adam` is AdamW (decoupled weight decay), `sgd` plain SGD."""
    learning_rate: float = 1e-6
    """Peak learning rate, reached after warmup (TRL's GRPO default 1e-6)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam's decay rate of the first-moment (gradient mean) estimate."""
    adam_beta2: float = 0.999
    """Adam's decay rate of the second-moment (squared gradient) estimate."""
    adam_epsilon: float = 1e-8
    """Adam's term added to the denominator sqrt(v) for numerical stability."""
    max_grad_norm: float = 1.0
    """Clip the global gradient L2 norm (all ranks) to this before each step; 0 = no clipping."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "linear"
    """Learning-rate decay after warmup (Megatron's OptimizerParamScheduler)."""
    warmup_steps: int = 0
    """Linear warmup steps; 0 = use warmup_ratio."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of the run's optimizer steps."""
    use_distributed_optimizer: bool = True
    """Megatron's distributed optimizer: optimizer states sharded over data-parallel ranks."""
    optimizer_state_dtype: Literal["float32", "bfloat16"] = "float32"
    """Adam's moments (exp_avg, exp_avg_sq) in float32 or bfloat16. bfloat16 halves the Adam memory (8 B to 4 B per
    parameter; HF's `adamw_anyprecision` with bf16 momentum / variance). Cost: the moments are rounded to bf16 once per
    step (to nearest), so a shrinking second moment decays later. Main weights and grads stay float32. Needs
    optim=adam; no Transformer Engine needed (engine/policy/state_dtype_adam.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    dataset_name: str = "builtin:arithmetic"
    """A hub name, a local json/jsonl/parquet/arrow file or directory, or `builtin:arithmetic`."""
    dataset_config: str | None = None
    """The dataset's configuration name (hub datasets)."""
    dataset_train_split: str = "train"
    """Split the train prompts come from."""
    dataset_test_split: str | None = "test"
    """Split of the held-out evaluation; None = no evaluation."""
    max_prompt_length: int | None = None
    """Tokens; None = no limit. Longer prompts are handled by `overlong_prompt_policy`, never silently cut."""
    overlong_prompt_policy: Literal["error", "drop"] = "error"
    """Prompts longer than max_prompt_length: `error` (refuse the dataset) or `drop`."""
    eval_max_prompts: int | None = None
    """Held-out evaluation (before and after training, engine/train/sampling.py `evaluate`) on the first this many
    prompts of the eval set (a printed line says when it cuts); None = all. Engine-only (TRL evaluates on a
    schedule)."""
    dynamic_prompts_fn: str | None = None
    """Curriculum hook (a TRL fork's `dynamic_prompts_fn`): `f(prompts, completions, rewards, metas) ->` the next
    prompts to train next, four lists with one element per sample (engine/grpo/dynamic_prompts.py); every prompt it
    returns gets G completions of its own: they are queued, and each round takes its P prompts from the queue before
    the dataset (engine/train/prompt_queue.py); a `module:function` import path. Any callable object travels in
    memory instead (`GRPOConfig(dynamic_prompts_fn=...)`, `train(cfg, dynamic_prompts_fn=...)`) and is recorded here
    as its description (`describe_callable`)."""
    dynamic_prompts_queue_rounds: int = 8
    """The curriculum queue holds at most this many rounds of prompts (x prompts per round); prompts the hook returns
    past it are dropped, counted in `curriculum/dropped` and warned about once (engine/train/prompt_queue.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    save_steps: int = 500
    """Optimizer steps between checkpoints; 0 = only at the end."""
    save_total_limit: int | None = None
    """Keep the newest K checkpoints; None = keep all."""
    resume_from_checkpoint: str | None = None
    """A checkpoint directory, or `latest` for the newest one in the run directory."""
    save_hf_at_end: bool = True
    """Export the final policy as a Hugging Face checkpoint to `<output_dir>/hf` (not after a SIGUSR1 stop)."""
    export_quantization: Literal["none", "source"] = "none"
    """HF exports: `none` = every weight in model.dtype; `source` = the source's FP8 / MXFP4 weights in its format."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelsConfig:
    loss_implementation: Literal["auto", "triton", "torch_chunked", "reference"] = "auto"
    """`auto` = the Triton kernel on GPU, the chunked torch path on CPU. `reference` materialises the logits."""
    loss_terms_implementation: TermsImplementation = "auto"
    """The GRPO loss's per-token terms (ratio, clipping, masks, KL and their gradient): `triton` = one fused kernel
    (kernels/grpo_token_terms.py), `torch` = the reference torch code of engine/grpo/policy_loss.py; `auto` = triton
    on GPU, torch on CPU (where the Triton interpreter is far slower: benchmarks/results/grpo_token_terms.csv)."""
    loss_workspace_mb: int = 1024
    """Bound, MiB, on the fused log-prob's tile temporaries (token x vocab chunks) per rank; passed to
    kernels.lm_head_logprob_entropy as workspace_mb. Per-token statistics and (bf16) the float32 dX accumulator
    come on top (kernels/chunked_logprob.py)."""
    loss_pass: Literal["auto", "one", "two"] = "auto"
    """`one`: each row chunk's logits formed once, the loss gradient taken in the forward (token-local losses only,
    engine/grpo/onepass.py); `two`: statistics forward, recomputed backward; `auto`: one wherever the loss allows it
    (a log line and the `lm_head/one_pass` metric say which)."""
    onepass_implementation: Literal["auto", "torch_chunked", "cublas_triton", "triton_fused"] = "auto"
    """The one-pass kernels: cuBLAS GEMMs + Triton row kernels (`cublas_triton`, auto on GPU), three Triton GEMMs with
    the row work fused into them (`triton_fused`: no dz buffer) or torch (CPU's auto)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    """LoRA on the frozen policy (engine/policy/lora.py; TRL ModelConfig's names; GRPOTrainer's peft_config sets it)."""

    use_peft: bool = False
    """Train LoRA adapters on a frozen base instead of every weight; the other lora_* fields need it."""
    lora_r: int = 16
    """The adapters' rank r (A: r x in, B: out x r), at most the smaller side of every adapted linear."""
    lora_alpha: int = 32
    """The adapters' scale numerator: delta W = lora_alpha / r * B A (lora_alpha / sqrt(r) with use_rslora)."""
    lora_dropout: float = 0.05
    """Dropout probability on each adapter's input (training forwards only)."""
    lora_target_modules: list[str] | None = None
    """HF module names (q/k/v/o_proj, gate/up/down_proj) or ['all-linear']; None = PEFT's default, q_proj + v_proj."""
    lora_target_parameters: list[str] | None = None
    """PEFT's target_parameters: MoE expert tensors (mlp.experts.gate_up_proj / down_proj), adapted per expert."""
    use_rslora: bool = False
    """Rank-stabilised scale lora_alpha / sqrt(r) (arXiv:2312.03732) instead of lora_alpha / r."""
    lora_modules_to_save: list[str] | None = None
    """Modules trained in full next to the adapters (PEFT's modules_to_save): 'lm_head' and/or 'embed_tokens'."""
    lora_adapter_dtype: Literal["float32", "model"] = "float32"
    """The adapters' dtype: float32 (PEFT's: fp32 adapters, grads, Adam state over the base) or model (fp32 masters)."""
    lora_weight_sync: Literal["merged", "adapter"] = "merged"
    """How vLLM gets the adapters, verified: merged (W + scale * B A in fp32, all weights) or adapter (vLLM's LoRA)."""
    lora_save_merged: bool = False
    """Final export: `<output_dir>/hf` holds the PEFT adapter; this also writes the merged model to `hf_merged`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    logging_steps: int = 10
    """Optimizer steps between logged records (metrics.jsonl, progress, report_to); the last step always."""
    report_to: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)
    """Metric sinks besides the JSONL file, which is always written (metrics.jsonl); [] = JSONL only."""
    run_name: str | None = None
    """Name of the run for W&B / TensorBoard."""
    log_completions: bool = False
    """Log a table of prompts, completions, rewards and advantages."""
    num_completions_to_print: int | None = None
    """Rows of the completions table (log_completions) printed; None = all."""
    verbose: bool = False
    """Show vLLM's INFO logs and the known-harmless library warnings (engine/log_filters.py); the environment
    variable GRPO_ENGINE_VERBOSE=1 does the same whatever this says. TRL's `log_level` 'info' / 'debug' sets it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    grpo: GRPOConfigSection = field(default_factory=GRPOConfigSection)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


# ---------------------------------------------------------------------------------------------------------------
# building from plain data, with the full dotted path in every error


REMOVED_SETTINGS = {
    "rollout.weight_sync_tolerance": "the weight-sync check is exact now (per-tensor digests of what each engine rank "
                                     "holds against what the trainer sent, engine/rollout/weight_digest.py): there is no "
                                     "log-prob tolerance to set; the probe's differences are logged as "
                                     "weight_sync/logprob_diff_p50/_p90/_max. Delete the key",
    "rollout.weight_sync_quantile": "the weight-sync check is exact now (per-tensor digests, engine/rollout/"
                                    "weight_digest.py): no log-prob quantile is checked; the probe's p50 / p90 / max "
                                    "are logged as weight_sync/logprob_diff_*. Delete the key",
}
"""Settings this engine once accepted and no longer does: dotted path -> why, and what to do (the error says it)."""


def build_config(data: dict | None = None, cls: type = EngineConfig, path: str = "") -> Any:
    """Build a config dataclass from nested plain data (YAML's output), refusing unknown keys and wrong types.

    Args:
        data: nested dict; missing keys take the defaults.
        cls: the dataclass to build.
        path: dotted prefix for error messages.
    Returns:
        an instance of `cls`.
    Raises:
        ConfigError naming the full dotted path of the first unknown key or badly typed value.
    """
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping of fields, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields and dotted in REMOVED_SETTINGS:
            raise ConfigError(f"config key '{dotted}' was removed: {REMOVED_SETTINGS[dotted]}")
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key '{dotted}'{hint}")
        aliases = fields[key].metadata.get("aliases", {})
        alias_key = str(value).lower() if isinstance(value, bool) else None
        if alias_key in aliases:
            value = aliases[alias_key]
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check (and minimally convert) one value against a type annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build_config(value, tp, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(repr(a) for a in args)}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        # NOTE: YAML 1.1 reads `1e-6` (no dot) as a string; accept any string Python parses as a float.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"{path}: unsupported annotation {tp!r} in the config tree")


# ---------------------------------------------------------------------------------------------------------------
# files, overrides, the run directory (apply_overrides, config_to_dict, describe_callable, write_resolved_config:
# engine/config_files.py, re-exported above)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> EngineConfig:
    """Read a YAML file (or nothing: all defaults), apply dotted overrides, build and type-check the tree.

    Cross-field checks are separate (`engine.validation.validate`), because some need the world size.
    """
    data: dict = {}
    if path is not None:
        text = Path(path).read_text()
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    try:
        return build_config(apply_overrides(data, overrides or []))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}" if path is not None else str(exc)) from None


def find_field(name: str) -> tuple[str, str]:
    """The (section, field) that holds a flat TRL-style field name, e.g. 'beta' -> ('grpo', 'beta').

    Raises:
        KeyError if no section has it.
    """
    return _FLAT_INDEX[name]


def _flat_index() -> dict[str, tuple[str, str]]:
    index: dict[str, tuple[str, str]] = {}
    for section in dataclasses.fields(EngineConfig):
        for leaf in dataclasses.fields(section.default_factory()):  # type: ignore[misc]
            if leaf.name in index:
                raise TypeError(f"field name '{leaf.name}' is in both {index[leaf.name][0]} and {section.name}")
            index[leaf.name] = (section.name, leaf.name)
    return index


_FLAT_INDEX = _flat_index()
