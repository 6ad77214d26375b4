"""The policy's optimizer: Megatron's DistributedDataParallel wrapper, Megatron's (distributed) optimizer with
gradient clipping, and the learning-rate schedule.

Owns: `build_optimizer(cfg.optimizer, chunks, ps, ...)` -> `PolicyOptimizer` (wrapped model chunks, optimizer,
scheduler) and `PolicyOptimizer.step()`. Gradients are reduced over data-parallel ranks by Megatron's DDP
(finalize_model_grads also all-reduces the tied embedding between first and last stage, and layer-norm gradients
under sequence parallelism); with `use_distributed_optimizer` the optimizer states are sharded over DP ranks.

Gradient convention: Megatron's DDP *averages* gradients over DP ranks and its schedule divides each micro-batch
loss by the number of micro-batches. The GRPO loss is already normalised by global token / sequence counts
(engine/grpo/policy_loss.py), so the step multiplies each micro-batch loss by num_microbatches * dp_size
(`loss_scale_for_sum`) to make the gradient the plain sum the normaliser expects.

Must not: read Megatron's global parallel state (it receives ParallelState), compute losses.

Test: tests/distributed/test_grpo_step_layouts.py.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from engine.config import OptimizerConfig
from engine.policy.parallel import ParallelState

logger = logging.getLogger(__name__)

FP16_INITIAL_LOSS_SCALE, FP16_GROWTH_INTERVAL = 2.0**16, 2000
"""fp16's dynamic loss scale: PyTorch GradScaler's defaults (what TRL's `fp16=True` gets under HF's Trainer: start at
65536, halve on every overflow, double after 2000 clean steps). Megatron's own start, 2**32 with hysteresis 2, would
skip the first ~30 steps of a run."""


@dataclass
class PolicyOptimizer:
    model: list[torch.nn.Module]
    """The DDP-wrapped chunks: run the schedule on these."""
    optimizer: object
    """megatron.core.optimizer.MegatronOptimizer."""
    scheduler: object
    """megatron.core.optimizer_param_scheduler.OptimizerParamScheduler."""
    loss_scaled: bool = False
    """fp16 training: the losses are scaled by Megatron's dynamic loss scaler (`step` says what an overflow does)."""

    def zero_grad(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> dict[str, float]:
        """Clip, step, advance the schedule. Returns `grad_norm` (before clipping) and `learning_rate` (used).

        fp16 (dynamic loss scaling): gradients that overflow at the current loss scale skip the update, lower the scale
        and leave the schedule where it was (Megatron-LM's and PyTorch GradScaler's rule); grad_norm is then NaN and a
        warning says so. Elsewhere non-finite gradients are a FloatingPointError."""
        learning_rate = self.optimizer.param_groups[0]["lr"]
        is_ok, grad_norm, _ = self.optimizer.step()
        if not is_ok and self.loss_scaled:
            logger.warning("fp16: gradients overflowed: the step is skipped, the loss scale is halved to %g",
                           float(self.optimizer.get_loss_scale()))
            return {"grad_norm": math.nan, "learning_rate": learning_rate}
        if not is_ok:
            raise FloatingPointError("optimizer step skipped: gradients are not finite")
        self.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm) if grad_norm is not None else math.nan, "learning_rate": learning_rate}


def loss_scale_for_sum(num_microbatches: int, ps: ParallelState) -> float:
    """Factor that turns Megatron's mean over micro-batches and DP ranks into a sum (see the module docstring)."""
    return float(num_microbatches * ps.dp_size)


def _warmup_steps(cfg: OptimizerConfig, total_steps: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps > 0 else int(math.ceil(cfg.warmup_ratio * total_steps))


def build_optimizer(cfg: OptimizerConfig, chunks: list[torch.nn.Module], ps: ParallelState, *, total_steps: int) -> PolicyOptimizer:
    """Wrap the chunks in Megatron DDP and build Megatron's optimizer and LR schedule from the `optimizer` section.

    Args:
        cfg: the `optimizer` config section (TrainingArguments names; `optim` adam is AdamW).
        chunks: this rank's PolicyGPTModel chunks.
        ps: this process's parallel state.
        total_steps: optimizer steps of the run (for warmup_ratio and the decay length).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = chunks[0].config
    is_mixed = _trains_low_precision_params(chunks)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=cfg.use_distributed_optimizer
    )
    model = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0, pg_collection=ps.groups)
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = functools.partial(finalize_model_grads, pg_collection=ps.groups)
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    optimizer = get_megatron_optimizer(
        MegatronOptimizerConfig(
            optimizer=cfg.optim,
            lr=cfg.learning_rate,
            min_lr=0.0,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_epsilon,
            clip_grad=cfg.max_grad_norm,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            params_dtype=config.params_dtype if is_mixed else torch.float32,
            bf16=config.bf16 and is_mixed,
            fp16=config.fp16,  # fp16 activations need the loss scale even when every trained parameter is fp32
            initial_loss_scale=FP16_INITIAL_LOSS_SCALE,
            loss_scale_window=FP16_GROWTH_INTERVAL,
            hysteresis=1,
        ),
        model,
        use_gloo_process_groups=False,
        pg_collection=ps.groups,
    )
    if cfg.optimizer_state_dtype != "float32":
        if cfg.optim != "adam":
            raise ValueError(f"optimizer.optimizer_state_dtype={cfg.optimizer_state_dtype} needs optimizer.optim=adam "
                             f"(got {cfg.optim}): only Adam's moments have a state dtype")
        from engine.policy.state_dtype_adam import use_state_dtype

        use_state_dtype(optimizer, getattr(torch, cfg.optimizer_state_dtype))
    _count_expert_norms_by_expert_tp(optimizer, ps)
    loss_scaled = bool(config.fp16)
    if loss_scaled:  # the schedule multiplies each backward by the loss scale the optimizer divides out
        config.grad_scale_func = optimizer.scale_loss
    _checkpoint_fp32_params_of_mixed_optimizers(optimizer)
    _index_mixed_distributed_groups(optimizer)
    warmup = _warmup_steps(cfg, total_steps)
    style = {"constant": "constant", "linear": "linear", "cosine": "cosine"}[cfg.lr_scheduler_type]
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else cfg.learning_rate,
        max_lr=cfg.learning_rate,
        min_lr=0.0,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, warmup + 1),
        lr_decay_style=style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
    return PolicyOptimizer(model=model, optimizer=optimizer, scheduler=scheduler, loss_scaled=loss_scaled)


def _trains_low_precision_params(chunks: list[torch.nn.Module]) -> bool:
    """Whether any trained parameter is below float32 (Megatron's mixed-precision optimizers are then needed).

    NOTE: fp32 LoRA adapters on a bf16 base (lora.lora_adapter_dtype=float32) train float32 parameters only: they get
    Megatron's fp32 optimizers, the same maths (an fp32 parameter is its own main copy in the bf16 ones too). The bf16
    non-distributed optimizer (Float16OptimizerWithFloat16Params) of megatron-core 0.16.1 cannot checkpoint them: its
    sharded_state_dict maps optimizer state to parameters through its float16 groups only ("Param id 0 does not match
    any model sharded param")."""
    return any(p.requires_grad and p.dtype != torch.float32 for chunk in chunks for p in chunk.parameters())


def _count_expert_norms_by_expert_tp(optimizer, ps: ParallelState) -> None:
    """Give the expert-parallel sub-optimizer the expert-TP group for its gradient norm.

    NOTE: megatron-core 0.16.1 gives every sub-optimizer the attention's TP group (`get_megatron_optimizer`:
    `setattr(optimizer, 'tp_group', pg_collection.tp)`), and the norm counts a parameter that is not TP-split only on
    rank 0 of that group. An expert parameter that is not split (the experts' fc2 bias: GPT-OSS) is then left out on
    the other TP ranks, which hold other experts: at TP2 x EP2 the grad norm was 0.7% below EP1's (and clipping
    differed). Counted by the expert-TP group (rank 0 there holds the whole bias), it equals EP1's.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if any(group.get("is_expert_parallel") for group in sub.param_groups):
            sub.tp_group = ps.groups.expt_tp


def _checkpoint_fp32_params_of_mixed_optimizers(optimizer) -> None:
    """Let megatron-core 0.16.1's bf16 non-distributed optimizer checkpoint float32 parameters trained next to bf16
    ones (LoRA's fp32 adapters next to the bf16 LM head / embedding of modules_to_save).

    NOTE: its `Float16OptimizerWithFloat16Params.sharded_state_dict` numbers the optimizer's parameters as if every
    one were a float16 parameter (ids over `float16_groups` only), while torch numbers them in the param groups'
    order, float32 parameters included: with both kinds it raised "Optimizer shape ... does not match model shape".
    This version (the same entries) maps ids through the groups' own order; the fp32 main copies of the float16
    parameters keep the list `load_state_dict` reads (float16 parameters only, in their groups' order)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        mixed = isinstance(sub, Float16OptimizerWithFloat16Params) and any(sub.fp32_from_fp32_groups)
        if mixed:
            sub.sharded_state_dict = functools.partial(_mixed_sharded_state_dict, sub)


def _index_mixed_distributed_groups(optimizer) -> None:
    """Let megatron-core 0.16.1's distributed optimizer find the optimizer state of each parameter when a param group
    holds float32 and bf16 / fp16 parameters (LoRA's fp32 adapters next to modules_to_save's bf16 LM head).

    NOTE: its `model_param_group_index_map` numbers a group's parameters in grad-buffer order, while the inner
    optimizer's group lists the float32 shards first and the fp32 main copies of the float16 parameters after
    (`_build_model_and_main_param_groups`): with both kinds, checkpointing copied one parameter's Adam state into
    another's slot ("The size of tensor a (65536) must match the size of tensor b (512)"). The map is rebuilt in the
    inner optimizer's order; groups with one kind keep the numbering they had."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(sub, DistributedOptimizer):
            continue
        for index, (fp32, low) in enumerate(zip(sub.model_fp32_groups, sub.model_float16_groups)):
            if fp32 and low:
                sub.model_param_group_index_map.update({p: (index, order) for order, p in enumerate(fp32 + low)})


def _mixed_sharded_state_dict(sub, model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None):
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    if is_loading:
        sub.init_state_fn(sub.optimizer, sub.config)
    state_dict = sub.state_dict()
    model_of = {id(main): model for mains, models in zip(sub.fp32_from_float16_groups, sub.float16_groups)
                for main, model in zip(mains, models)}  # fp32 main copy -> its bf16 model parameter
    groups = sub.optimizer.param_groups
    ordered = [model_of.get(id(p), p) for group in groups for p in group["params"]]
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, ordered)
    state_dict["fp32_from_fp16_params"] = [
        [make_sharded_optimizer_tensor(id_map[param_id], main, prefix="optimizer.state.fp32_param")
         for param_id, main in zip([i for i, p in zip(saved["params"], group["params"]) if id(p) in model_of], mains)]
        for mains, saved, group in zip(state_dict["fp32_from_fp16_params"], state_dict["optimizer"]["param_groups"],
                                       groups)]
    step = sub._extract_common_per_param_step(state_dict["optimizer"])
    optim_state_to_sharding_state(state_dict["optimizer"], id_map, exclude_keys="step")
    if step:
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict
