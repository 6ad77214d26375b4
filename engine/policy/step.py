"""One pass of Megatron's forward/backward schedule over micro-batches (no pipelining, 1F1B, or interleaved 1F1B).

Owns: the `forward_step` / `loss_func` contract of `get_forward_backward_func` for this engine (`run_schedule`),
and the losses run through it: the GRPO loss (`grpo_forward_backward`: completion log-probs from the fused kernel
entry on the vocab-parallel LM-head shard, engine/grpo/policy_loss.py's maths and layout-independent normaliser), the
forward-only old / reference log-probs (`forward_logprobs`), and the next-token LM loss (the layout tests).

Must not: read Megatron's global parallel state (layout comes from ParallelState), or own the optimizer.

Test: tests/distributed/test_megatron_layouts.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import KernelsConfig
from engine.policy.microbatch import MicroBatch
from engine.policy.parallel import ParallelState

logger = logging.getLogger(__name__)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The PolicyGPTModel inside a Megatron DistributedDataParallel wrapper (or the model itself)."""
    return getattr(model, "module", model)


def gather_lm_head_input(hidden: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """The last stage's hidden states as the LM head needs them: every token on every TP rank, (s, b, H).

    Under sequence parallelism each TP rank holds s / tp of the sequence: all-gather it (the backward reduce-scatters
    the gradient, as Megatron's column-parallel LM head does). Otherwise the input is already replicated; its
    gradient is summed over TP ranks by `copy_to_tensor_model_parallel_region`.
    """
    from megatron.core import tensor_parallel

    if ps.sequence_parallel:
        return tensor_parallel.gather_from_sequence_parallel_region(hidden, group=ps.groups.tp)
    return tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=ps.groups.tp)


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, ps: ParallelState,
                   softcap: float | None = None, logit_scale: float = 1.0) -> torch.Tensor:
    """This TP rank's vocab slice of the logits, (s, b, V_pad / tp), soft-capped (cap tanh(logits / cap), HF's
    `final_logit_softcapping`) when `softcap` is set, then x `logit_scale` (Cohere 2's). Materialises logits: LM-loss
    and test use only; the GRPO path uses the fused kernel instead (`completion_logprobs`)."""
    logits = torch.matmul(gather_lm_head_input(hidden, ps), weight.t())
    logits = logits if softcap is None else torch.tanh(logits / softcap) * softcap
    return logits if logit_scale == 1.0 else logits * logit_scale


def run_schedule(
    chunks: list[torch.nn.Module], ps: ParallelState, microbatches: list[MicroBatch], loss_fn, *, forward_only: bool = False
) -> list[dict]:
    """Run Megatron's schedule (no pipelining, 1F1B or interleaved 1F1B) over `microbatches`.

    Args:
        chunks: this rank's model chunks (build_policy), in virtual-stage order.
        ps: this process's parallel state.
        microbatches: right-padded ones with `tokens` and `position_ids` ((b, T) int64), or packed ones with
            `input_ids` / `position_ids` (rows, W) and `attention_mask`, `packed_sequences` or `packed_seq_params`
            (engine/policy/packing.py); every rank of a pipeline passes the same list (only the first and last stage
            read tokens). Under PP they share one shape.
        loss_fn: `loss_fn(model, hidden (s, b, H), batch) -> (loss scalar, dict of detached values)`, run on the
            last stage. Megatron divides the returned loss by the number of micro-batches before backward.
        forward_only: no backward pass.
    Returns:
        the dicts returned by `loss_fn`, one per micro-batch, on the last pipeline stage; [] elsewhere.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from engine.policy.routing_replay import begin_forward, end_forward, finish_schedule, record_router_agreement

    check_attention_mask(chunks, microbatches)
    finish_schedule(chunks, check=False)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        chunk = unwrap(model)
        # MoE: replay the engine's routes (R3) or record the trainer's to compare, and keep the routes a recomputed
        # forward must take again (engine/policy/routing_replay.py)
        recording = begin_forward(chunk, batch, ps, replay=getattr(chunk, "routing_replay", False),
                                  will_backward=not forward_only)
        # packed micro-batches (engine/policy/packing.py) carry their rows as `input_ids`, a mask, the packed
        # sequences (varlen) or THD params
        hidden = model(batch.model_input_ids, batch.position_ids, attention_mask=batch.model_attention_mask,
                       packed_seq_params=batch.packed_seq_params, padding_mask=moe_padding_mask(chunk, batch, ps))
        if recording:  # (agreeing, total) (token, layer) pairs of this chunk's MoE layers, added to its count
            record_router_agreement(chunk, batch, ps)
        end_forward(chunk)

        def loss_func(last_hidden):  # (s, b, H) on the last stage
            loss, values = loss_fn(model, last_hidden, batch)
            # NOTE: the schedule divides `loss` in place by num_microbatches; values must not share its storage.
            return loss, values

        return hidden, loss_func

    forward_backward = get_forward_backward_func(pp_size=ps.pp_size, vp_size=ps.vpp_size)
    # The groups come from ParallelState, never from Megatron's global parallel_state (the schedules fall back to it
    # when given neither a pg_collection nor a p2p communicator).
    groups = {"pg_collection": ps.groups}
    if ps.pp_size > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.utils import get_model_config

        groups["p2p_communicator"] = P2PCommunicator(pp_group=ps.groups.pp, config=get_model_config(chunks[0]))
    values = forward_backward(
        forward_step_func=forward_step,
        data_iterator=[iter(microbatches) for _ in chunks],
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=microbatches[0].model_input_ids.shape[1],
        micro_batch_size=microbatches[0].model_input_ids.shape[0],
        forward_only=forward_only,
        **groups,
    )
    finish_schedule(chunks, check=True)
    drop_dispatcher_graphs(chunks)
    return list(values) if ps.is_last_stage else []


def drop_dispatcher_graphs(chunks: list[torch.nn.Module]) -> None:
    """Drop the autograd graphs Megatron's MoE token dispatchers keep from the last forward.

    NOTE: upstream, megatron-core 0.16.1: a dispatcher (a plain object on each MoE layer, not a module) keeps the
    last forward's routing probabilities (`probs`, with their graph) until the next forward. That graph reaches the
    parameters' gradient accumulators, whose hooks (Megatron DDP's) reference the model: a cycle through autograd
    nodes that Python's garbage collector cannot see, so a finished MoE model (and every process group it holds)
    was never freed (tests/distributed/test_parallel_state.py counts the threads after rebuilds)."""
    for chunk in chunks:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is None:
                continue
            for name, value in list(vars(dispatcher).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(dispatcher, name, None)


def moe_padding_mask(chunk: torch.nn.Module, batch: MicroBatch, ps: ParallelState) -> torch.Tensor | None:
    """(rows, width) bool, True at padding, for the routers of an MoE model (None for a dense model, or a batch that
    does not say where its sequences end): Megatron then leaves padding out of the load-balancing aux loss and the
    z-loss, as HF's Qwen3-MoE aux loss leaves it out through the attention mask.

    NOTE: without it the aux loss's gradient lands on the padding positions. Measured on the tiny Qwen3-MoE, aux loss
    1e-2, one step of 8 sequences: the gradient of the pad token's embedding row was 12 in padded rows and 3.1e6 in
    packed rows (2.4 with the aux loss off), so gradient clipping shrank the whole packed step by ~1e6.
    Megatron's GPTModel splits the mask over the TP ranks under sequence parallelism on the first pipeline stage only
    (`padding_mask` True = padding, whatever some of its docstrings say): later stages get their slice here.
    Limit (Megatron's): under sequence parallelism the z-loss is the mean over each TP rank's own valid tokens, so with
    padding it weighs the sequence halves unequally (measured rel 8e-5 on the grad norm against TP1, z-loss 1e-3;
    the aux loss counts tokens over the TP group and stays exact).
    """
    if not getattr(chunk.config, "num_moe_experts", None):
        return None
    if batch.padding_mask is not None:  # packed / token-budget rows (engine/policy/packing.py)
        mask = batch.padding_mask
    elif batch.lengths is not None:  # right-padded rows
        mask = torch.arange(batch.tokens.shape[1])[None, :] >= batch.lengths[:, None]
    else:
        return None
    if not chunk.pre_process and ps.sequence_parallel and ps.tp_size > 1:
        step = mask.shape[1] // ps.tp_size
        mask = mask[:, ps.tp_rank * step: (ps.tp_rank + 1) * step]
    return mask.to(ps.device)


def check_attention_mask(chunks: list[torch.nn.Module], microbatches: list[MicroBatch]) -> None:
    """Refuse a block-diagonal mask where Megatron would ignore it: its fused CUDA softmax (local spec,
    `masked_softmax_fusion`) applies the causal mask only, so packed sequences would attend to each other. Refuse
    packed sequences (the `varlen` layout, no mask) where a layer cannot take them."""
    if any(mb.packed_sequences is not None for mb in microbatches):
        from engine.policy.sdpa_attention import serves_varlen

        if not serves_varlen(chunks):
            raise ValueError("micro-batches carry packed sequences instead of the block-diagonal mask, but a layer "
                             "of this model keeps the mask (engine/policy/sdpa_attention.py serves_varlen): build "
                             "them with the mask layout (engine/policy/packing.py build_microbatch_spec varlen=False)")
    if any(mb.attention_mask is not None for mb in microbatches):
        config = unwrap(chunks[0]).config
        if config.masked_softmax_fusion:
            raise ValueError("packed sequences with the local layer spec need masked_softmax_fusion=False (Megatron's "
                             "fused causal softmax ignores the attention mask); use Transformer Engine's THD path")


def lm_forward_backward(
    chunks: list[torch.nn.Module], ps: ParallelState, microbatches: list[MicroBatch], *, forward_only: bool = False
) -> list[float]:
    """Next-token loss of each micro-batch (these also carry `labels`, (b, T)); gradients accumulate in `.grad`.

    Returns:
        the mean per-token loss of every micro-batch on the last pipeline stage, [] on other stages.
    """
    from megatron.core import tensor_parallel

    def loss_fn(model, hidden, batch):
        logits = lm_head_logits(hidden, unwrap(model).lm_head_weight(), ps, unwrap(model).final_logit_softcap,
                                unwrap(model).logit_scale)  # (s, b, V_pad / tp)
        labels = batch.labels.transpose(0, 1).contiguous()  # (s, b)
        # NOTE: Megatron's vocab_parallel_cross_entropy reads its global TP group (it takes none); LM loss only.
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).mean()
        return loss, {"lm_loss": loss.detach().clone()}

    values = run_schedule(chunks, ps, microbatches, loss_fn, forward_only=forward_only)
    return [float(v["lm_loss"]) for v in values]


@dataclass(frozen=True)
class LogprobSettings:
    """How per-token log-probs are computed from the last hidden states."""

    vocab_size: int
    """The real vocabulary; Megatron's padded rows above it are masked."""
    temperature: float
    """Divides the logits: `generation.temperature` (1.0 for the weight-sync probe)."""
    kernels: KernelsConfig
    """The `kernels` config section: the log-prob and loss-terms implementations and the workspace."""


def _completion_rows(hidden: torch.Tensor, batch: MicroBatch, ps: ParallelState, settings: LogprobSettings):
    """(x (N, H), token ids (N,), mask (b, C) bool) of the real completion positions, or None for a micro-batch
    with none; the hidden states gathered over sequence-parallel ranks first."""
    from megatron.core import tensor_parallel

    from engine.policy.batch import check_completion_ids

    if ps.sequence_parallel:
        # The kernel sums dX over the TP group itself, so the backward of this gather only splits (no reduce).
        hidden = tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=False, group=ps.groups.tp
        )
    hidden = hidden.transpose(0, 1)  # (rows, s, H)
    seq_len = hidden.shape[1]
    num_sequences, num_completion = batch.completion_ids.shape
    # sequence i starts at column seq_offset[i] of row seq_row[i] (packed); padded rows: row i, column 0
    device = batch.completion_mask.device  # NOTE: every index tensor on the batch's device (CUDA on a GPU)
    seq_row = torch.arange(num_sequences, device=device) if batch.seq_row is None else batch.seq_row  # (b,)
    seq_offset = (torch.zeros(num_sequences, dtype=torch.long, device=device) if batch.seq_offset is None
                  else batch.seq_offset)  # (b,)
    index = (seq_offset + batch.prompt_lengths - 1)[:, None] + torch.arange(num_completion, device=device)  # (b, C)
    mask = batch.completion_mask.bool()  # (b, C)
    rows = seq_row[:, None].expand_as(index)  # (b, C)
    if not mask.any():
        return None
    check_completion_ids(batch.completion_ids, mask, settings.vocab_size)  # a padded-vocab id would give NaN
    x = hidden[rows[mask], index[mask].clamp(max=seq_len - 1)]  # (N, H)
    return x, batch.completion_ids[mask], mask


def _lm_head_args(model: torch.nn.Module, ps: ParallelState, settings: LogprobSettings) -> dict:
    """The LM-head kernels' keyword arguments shared by the one- and two-pass entries."""
    return dict(temperature=settings.temperature / unwrap(model).logit_scale,  # Cohere 2: softmax(z x scale / T)
                softcap=unwrap(model).final_logit_softcap, vocab_size=settings.vocab_size, tp_group=ps.groups.tp,
                workspace_mb=settings.kernels.loss_workspace_mb)


def completion_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, batch: MicroBatch, ps: ParallelState, settings: LogprobSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of every completion token, (b, C) each, from the last stage's hidden states.

    Only the real completion positions of each sequence go through the LM head (prompt, padding and masked
    positions are skipped), via the fused kernel entry (never the [tokens x vocab] logits). Masked positions hold 0.
    Packed micro-batches say where each sequence starts (`seq_row`, `seq_offset`; engine/policy/packing.py).
    """
    from kernels import lm_head_logprob_entropy

    shape, device = batch.completion_mask.shape, batch.completion_mask.device
    zeros = torch.zeros(shape, dtype=torch.float32, device=device)  # (b, C)
    selected = _completion_rows(hidden, batch, ps, settings)
    if selected is None:  # an empty micro-batch (packing.py) or all-masked rows: zero, still attached to the graph
        zeros = zeros + hidden.sum().float() * 0.0
        return zeros, zeros.detach().clone()
    x, ids, mask = selected
    logprobs, entropy = lm_head_logprob_entropy(
        x, unwrap(model).lm_head_weight(), ids, implementation=settings.kernels.loss_implementation,
        **_lm_head_args(model, ps, settings))  # (N,), (N,)
    zeros = zeros.to(logprobs.dtype)
    return zeros.masked_scatter(mask, logprobs), zeros.masked_scatter(mask, entropy)


def completion_logprobs_onepass(
    model: torch.nn.Module, hidden: torch.Tensor, batch: MicroBatch, ps: ParallelState, settings: LogprobSettings,
    make_token_grads,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`completion_logprobs` on the one-pass kernel (kernels/onepass_logprob.py): (b, C) log-probs and entropies,
    detached, and the 0-dim anchor that carries the loss gradient (add it to the loss).

    Args:
        make_token_grads: mask (b, C) bool -> the micro-batch loss's `TokenGrads` (engine/grpo/onepass.py).
    """
    from kernels import onepass_logprob_entropy

    shape, device = batch.completion_mask.shape, batch.completion_mask.device
    zeros = torch.zeros(shape, dtype=torch.float32, device=device)  # (b, C)
    selected = _completion_rows(hidden, batch, ps, settings)
    if selected is None:  # nothing to score: a zero anchor still attached to the graph
        return zeros, zeros.clone(), hidden.sum().float() * 0.0
    x, ids, mask = selected
    logprobs, entropy, anchor = onepass_logprob_entropy(
        x, unwrap(model).lm_head_weight(), ids, make_token_grads(mask),
        implementation=settings.kernels.onepass_implementation, **_lm_head_args(model, ps, settings))
    zeros = zeros.to(logprobs.dtype)
    return zeros.masked_scatter(mask, logprobs), zeros.masked_scatter(mask, entropy), anchor


def forward_logprobs(
    chunks: list[torch.nn.Module], ps: ParallelState, microbatches: list[MicroBatch], settings: LogprobSettings
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Forward-only (old / reference / weight-sync probe) log-probs and entropies, (b, C) each per micro-batch, on the
    last stage; in eval mode (no dropout, whatever `model.disable_dropout` says), each chunk's mode restored after."""

    def loss_fn(model, hidden, batch):
        logprobs, entropy = completion_logprobs(model, hidden, batch, ps, settings)
        return logprobs.sum() * 0, {"logprobs": logprobs, "entropy": entropy}

    modes = [chunk.training for chunk in chunks]
    try:
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            values = run_schedule(chunks, ps, microbatches, loss_fn, forward_only=True)
    finally:
        for chunk, mode in zip(chunks, modes):
            chunk.train(mode)
    return [(v["logprobs"], v["entropy"]) for v in values]


def grpo_forward_backward(
    model: list[torch.nn.Module], ps: ParallelState, microbatches: list[MicroBatch], loss_config, normalizer,
    settings: LogprobSettings, *, entropy_coef: float | None = None,
) -> list:
    """The GRPO loss of every micro-batch, gradients summed into the DDP buffers (engine/policy/optimizer.py convention).

    Args:
        model: the DDP-wrapped chunks (PolicyOptimizer.model).
        ps: this process's parallel state.
        microbatches: from engine/policy/batch.py or packing.py, with `advantages` (b,) and optionally
            `old_logprobs`, `ref_logprobs`, `sampling_logprobs`, `importance_sampling_ratio` ((b, C) each);
            `completion_mask` is the loss mask.
        loss_config: engine.grpo.policy_loss.PolicyLossConfig.
        normalizer: engine.grpo.policy_loss.LossNormalizer with the optimizer step's global token / sequence counts.
        settings: log-prob settings.
        entropy_coef: the entropy-bonus coefficient for this step (adaptive mode), None = loss_config's.
    Returns:
        the PolicyLossOutput of every micro-batch (detached), on the last stage; [] elsewhere.
    """
    from engine.grpo.onepass import ONE, build_token_grads, choose_loss_pass
    from engine.grpo.policy_loss import PolicyLossBatch, compute_policy_loss
    from engine.policy.optimizer import loss_scale_for_sum

    scale = loss_scale_for_sum(len(microbatches), ps)
    loss_pass, why = choose_loss_pass(loss_config, settings.kernels.loss_pass)
    _log_loss_pass(loss_pass, why)
    terms = settings.kernels.loss_terms_implementation

    def loss_fn(chunk, hidden, batch):
        inputs = PolicyLossBatch(
            mask=batch.completion_mask, advantages=batch.advantages, old_logprobs=batch.old_logprobs,
            ref_logprobs=batch.ref_logprobs, sampling_logprobs=batch.sampling_logprobs,
            importance_sampling_ratio=batch.importance_sampling_ratio,
        )
        if loss_pass == ONE:
            # The loss is evaluated on detached log-probs; its gradient was taken inside the LM-head pass and flows
            # through the anchor (0), which receives this micro-batch's scale and Megatron's 1 / num_microbatches.
            def make_token_grads(mask):
                return build_token_grads(mask, inputs, loss_config, normalizer, entropy_coef=entropy_coef,
                                         terms_implementation=terms)

            logprobs, entropy, anchor = completion_logprobs_onepass(chunk, hidden, batch, ps, settings,
                                                                    make_token_grads)
            out = compute_policy_loss(logprobs, inputs, loss_config, normalizer, entropy=entropy,
                                      entropy_coef=entropy_coef, terms_implementation=terms)
            loss = out.loss.detach() + anchor
        else:
            logprobs, entropy = completion_logprobs(chunk, hidden, batch, ps, settings)
            out = compute_policy_loss(logprobs, inputs, loss_config, normalizer, entropy=entropy,
                                      entropy_coef=entropy_coef, terms_implementation=terms)
            loss = out.loss
        out.sums["lm_head/one_pass"] = loss.new_tensor([float(loss_pass == ONE), 1.0])
        return loss * scale, {"output": _detached(out)}

    return [v["output"] for v in run_schedule(model, ps, microbatches, loss_fn)]


_LOGGED_LOSS_PASS: set[tuple[str, str]] = set()


def _log_loss_pass(loss_pass: str, why: str) -> None:
    """Say once per process which LM-head path the training loss takes, and why."""
    if (loss_pass, why) not in _LOGGED_LOSS_PASS:
        _LOGGED_LOSS_PASS.add((loss_pass, why))
        logger.info("GRPO loss: %s-pass LM head (%s)", loss_pass, why)


def _detached(out):
    from dataclasses import replace

    return replace(out, loss=out.loss.detach().clone(), policy_loss=out.policy_loss.detach().clone())


def take_moe_aux_loss(chunks: list[torch.nn.Module], ps: ParallelState, num_microbatches: int) -> float | None:
    """TRL's `aux_loss` metric: the MoE load-balancing loss (unweighted by its coefficient, as HF models return
    it) of the training forwards since the last call, averaged over layers and this rank's `num_microbatches`,
    then over DP ranks (Megatron's tracker, reduced over PP and TP/CP as Megatron logs it); the tracker is reset.
    None when the policy has no MoE layers or the aux loss is off. Collective when on (every rank calls it).

    The tracker counts each router once per micro-batch: it records only forwards with gradients, and a recomputed
    layer's first forward runs without them (Megatron's checkpoint). Megatron's loss is per layer (switch loss of
    that layer's router); HF's pools every layer's router statistics before the product: close, not equal."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    config = unwrap(chunks[0]).config
    if not getattr(config, "num_moe_experts", None) or not config.moe_aux_loss_coeff or not num_microbatches:
        return None
    name = "load_balancing_loss"
    reduce_aux_losses_tracker_across_ranks([name], pg_collection=ps.groups)
    values = get_moe_layer_wise_logging_tracker()[name]["values"]  # (num_layers,) summed over micro-batches
    value = float(values.sum()) / values.numel() / num_microbatches
    clear_aux_losses_tracker()
    return value


def clear_moe_aux_loss() -> None:
    """Reset Megatron's aux-loss tracker (local), before the training forwards `take_moe_aux_loss` reports."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()
