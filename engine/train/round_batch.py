"""One round as micro-batches: the round's tensors (`build_round`), split per optimizer step and DP rank
(`per_step_microbatches`, `microbatch_spec`, `step_schedule`), the old and reference log-probs each step trains
against (`add_old_and_ref_logprobs`), and the held-out loss of an evaluation batch built the same way (`eval_loss`).

The loop (engine/train/loop.py) calls these between its named steps; they hold no loop state.

Must not: hold maths (engine/grpo/), import vLLM, or read Megatron's global state (the run's layout is `run.ps`).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from engine.grpo.policy_loss import compute_vllm_importance_sampling_ratio
from engine.policy.batch import pack_completions
from engine.policy.microbatch import MicroBatch
from engine.policy.packing import build_microbatch_spec, round_microbatches, sequence_logprobs
from engine.policy.routing_replay import (
    clear_router_agreement,
    pad_routes,
    routes_dtype,
    take_router_agreement,
)
from engine.policy.step import forward_logprobs
from engine.rollout.rollouts import Rollout
from engine.train.prompt_rounds import shuffle_order
from engine.train.run import (
    Run,
)
from engine.train.step_schedule import OptimizerStep, StepSchedule, deferred_save_warning, uses_carried_slices


def build_round(run: Run, rollout: Rollout, advantages: torch.Tensor, step: int) -> MicroBatch:
    """The round as one MicroBatch (engine/policy/batch.py layout) with advantages, vLLM log-probs and the loss mask; rows
    shuffled with a permutation seeded by (seed, the round's first step): the same on every rank, and on resume."""
    from engine.grpo.policy_loss import mask_truncated_completions

    pad = run.tokenizer.pad_token_id or 0
    batch = pack_completions(rollout.prompt_ids, rollout.completion_ids, pad)
    mask = batch.completion_mask
    sampling = torch.zeros_like(mask)  # (B, C)
    for i, row in enumerate(rollout.sampling_logprobs):
        sampling[i, : len(row)] = torch.tensor(row)
    is_truncated = torch.tensor(rollout.is_truncated, dtype=torch.bool)  # (B,)
    if rollout.tool_mask is not None:  # multi-turn: tool tokens are context only (TRL's completion_mask * tool_mask)
        mask = batch.completion_mask = mask * pad_rows(rollout.tool_mask, mask.shape[1])  # (B, C)
        batch.num_model_tokens = mask.sum(1)  # (B,) the length metrics count the model's tokens only
    if run.cfg.grpo.mask_truncated_completions:
        batch.completion_mask = mask_truncated_completions(mask, is_truncated)
    batch.advantages, batch.sampling_logprobs, batch.is_truncated = advantages.float(), sampling, is_truncated
    if rollout.routed_experts is None and run.cfg.model.moe_enable_routing_replay:
        raise RuntimeError("model.moe_enable_routing_replay is on but the engine returned no routed experts: the "
                           "model has no MoE layers, or the rollout server(s) run with rollout.vllm_return_routed_experts"
                           "=false (leave it unset in their config)")
    if rollout.routed_experts is not None:  # MoE: the engine's routes, (B, T, L, k) in the narrowest dtype
        num_layers, top_k = next((r.shape[1:] for r in rollout.routed_experts if r.size), (0, 0))
        batch.routed_experts = pad_routes(rollout.routed_experts, batch.tokens.shape[1], num_layers, top_k,
                                          routes_dtype(rollout.routed_experts))
    order = shuffle_order(mask.shape[0], run.cfg.train.seed, step)
    return batch.take(order)


def pad_rows(rows: list[list[int]], width: int) -> torch.Tensor:
    """(B, width) float32: each row's values, right-padded with 0."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def microbatch_spec(run: Run):
    """How this run cuts rows into micro-batches (padded, or packed by tokens: engine/policy/packing.py); packed rows
    carry their sequences instead of a mask where every layer of the policy takes them (the reference model is built
    from the same `model` section)."""
    from engine.policy.sdpa_attention import serves_varlen

    return build_microbatch_spec(run.cfg.train, run.cfg.model, run.ps, micro_batch_size=run.derived.micro_batch_size,
                                 pad_token_id=run.tokenizer.pad_token_id or 0, varlen=serves_varlen(run.chunks))


def step_schedule(run: Run) -> StepSchedule:
    """The run's schedule: whole optimizer steps per unit when a round's micro-steps fill whole steps, else one
    micro-step slice per unit and gradient_accumulation_steps of them per step, carried across rounds; with a
    warning on rank 0 where that defers scheduled checkpoints."""

    train, grpo, derived = run.cfg.train, run.cfg.grpo, run.derived
    if not uses_carried_slices(derived.steps_per_generation, grpo.num_iterations, train.gradient_accumulation_steps):
        return StepSchedule(1, grpo.num_iterations)
    message = deferred_save_warning(run.cfg.checkpoint.save_steps, derived.steps_per_generation, grpo.num_iterations,
                                    train.gradient_accumulation_steps)
    if message and run.ps.rank == 0:
        warnings.warn(message, stacklevel=2)
    return StepSchedule(train.gradient_accumulation_steps, grpo.num_iterations)


def per_step_microbatches(run: Run, batch: MicroBatch, *, slices: bool = False) -> list[OptimizerStep]:
    """For each optimizer step of the round (`slices`: each micro-step slice of per_device * dp completions, when
    steps span rounds): this DP rank's micro-batches and the step's (slice's) global normaliser.

    TRL's batch semantics: per_device_train_batch_size counts completions per data-parallel rank per micro-batch; a
    round holds per_device * dp * steps_per_generation completions (shuffled by `build_round`), cut into optimizer
    steps of per_device * dp * gradient_accumulation_steps; groups are never split across rounds. The normaliser
    counts the tokens and sequences of each optimizer step over all ranks (layout-independent,
    engine/grpo/policy_loss.py)."""
    derived, ps = run.derived, run.ps
    rows = batch.take(slice(derived.generation_batch_size))
    spec = microbatch_spec(run)
    size = derived.micro_batch_size * ps.dp_size if slices else derived.global_batch_size
    steps = round_microbatches(rows, spec, global_batch_size=size, dp_size=ps.dp_size, dp_rank=ps.dp_rank)
    return [OptimizerStep(microbatches, normalizer) for microbatches, normalizer in steps]


def add_old_and_ref_logprobs(run: Run, steps: list[OptimizerStep]) -> dict:
    """Old log-probs (and the vLLM IS ratio), reference log-probs when beta > 0, added to every micro-batch on the
    last stage (the only stage that computes the loss). Packed: over micro-batches of the forward-only budget.
    Returns `moe/router_agreement` where the engine's routes were compared with the trainer's (MoE, replay off)."""
    grpo = run.cfg.grpo
    spec = microbatch_spec(run)
    micro = [mb for optimizer_step in steps for mb in optimizer_step.microbatches]
    routed = micro[0].routed_experts is not None
    if routed:
        clear_router_agreement(run.optimizer.model)  # what the last round's training forwards recorded
    old = sequence_logprobs(lambda mbs: forward_logprobs(run.optimizer.model, run.ps, mbs, run.settings), micro, spec)
    agreement = take_router_agreement(run.optimizer.model, run.ps) if routed else None
    ref = [] if run.reference is None else sequence_logprobs(
        lambda mbs: run.reference.logprobs(run.ps, mbs, run.settings), micro, spec)
    for i, logprobs in enumerate(old):
        mb = micro[i]
        mb.old_logprobs = logprobs
        if grpo.vllm_importance_sampling_correction:
            mb.importance_sampling_ratio = compute_vllm_importance_sampling_ratio(
                logprobs, mb.sampling_logprobs, mb.completion_mask, grpo.vllm_importance_sampling_mode,
                grpo.vllm_importance_sampling_clip_min, grpo.vllm_importance_sampling_clip_max)
        if ref:
            mb.ref_logprobs = ref[i]
    return {} if agreement is None else {"moe/router_agreement": agreement}


def eval_loss(run: Run, rollout: Rollout, advantages: torch.Tensor) -> float:
    """TRL's eval loss: the GRPO loss of held-out completions under the current policy (old log-probs = the
    policy's, so the ratio is 1; the vLLM IS correction and beta's KL as in training) of one evaluation batch
    (engine/train/evaluation.py `batch_mean_loss` averages the batches), its rows padded with masked copies to whole
    micro-batches of every DP rank. Collective; every rank gets it."""
    from engine.grpo.policy_loss import PolicyLossBatch, compute_policy_loss

    ps = run.ps
    batch = build_round(run, rollout, advantages, 0)
    num_rows = batch.num_sequences
    pad = -num_rows % (ps.dp_size * run.derived.micro_batch_size)
    if pad:
        batch = batch.map_rows(lambda v: torch.cat([v, v[:1].expand(pad, *v.shape[1:])]))
        batch.completion_mask[num_rows:] = 0
    spec = microbatch_spec(run)
    steps = [OptimizerStep(micro, normalizer) for micro, normalizer in round_microbatches(
        batch, spec, global_batch_size=num_rows + pad, dp_size=ps.dp_size, dp_rank=ps.dp_rank)]
    add_old_and_ref_logprobs(run, steps)
    total = torch.zeros(1, dtype=torch.float64, device=ps.device)
    if ps.is_last_stage and ps.tp_rank == 0:
        for optimizer_step in steps:
            for mb in optimizer_step.microbatches:
                inputs = PolicyLossBatch(
                    mask=mb.completion_mask, advantages=mb.advantages, old_logprobs=mb.old_logprobs,
                    ref_logprobs=mb.ref_logprobs, sampling_logprobs=mb.sampling_logprobs,
                    importance_sampling_ratio=mb.importance_sampling_ratio)
                out = compute_policy_loss(mb.old_logprobs, inputs, run.loss_config, optimizer_step.normalizer,
                                          terms_implementation=run.settings.kernels.loss_terms_implementation)
                total += out.loss.detach().double().to(ps.device)
    dist.all_reduce(total)  # the last stage's DP ranks hold the parts; every other rank adds 0
    return float(total)
