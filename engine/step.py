"""One pass of Megatron's forward/backward schedule over micro-batches (no pipelining, 1F1B, or interleaved 1F1B).

Owns: the `forward_step` / `loss_func` contract of `get_forward_backward_func` for this engine. Today it runs the
next-token language-model loss (what the foundation's layout tests and the demo use); the GRPO train step of the
Megatron-policy issue (fused loss on vocab-parallel LM-head shards, layout-independent normalisers) lands here too.

Must not: read Megatron's global parallel state (layout comes from ParallelState), or own the optimizer.

Test: tests/distributed/test_megatron_layouts.py.
"""

from __future__ import annotations

import torch

from engine.parallel import ParallelState


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


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """This TP rank's vocab slice of the logits, (s, b, V_pad / tp). Materialises logits: LM-loss and test use only;
    the GRPO path uses the fused kernel instead."""
    return torch.matmul(gather_lm_head_input(hidden, ps), weight.t())


def run_schedule(
    chunks: list[torch.nn.Module], ps: ParallelState, microbatches: list[dict], loss_fn, *, forward_only: bool = False
) -> list[dict]:
    """Run Megatron's schedule (no pipelining, 1F1B or interleaved 1F1B) over `microbatches`.

    Args:
        chunks: this rank's model chunks (build_policy), in virtual-stage order.
        ps: this process's parallel state.
        microbatches: dicts with at least `tokens` and `position_ids` ((b, T) int64); every rank passes the same list
            (only the first and last stage read them).
        loss_fn: `loss_fn(model, hidden (s, b, H), batch) -> (loss scalar, dict of detached values)`, run on the
            last stage. Megatron divides the returned loss by the number of micro-batches before backward.
        forward_only: no backward pass.
    Returns:
        the dicts returned by `loss_fn`, one per micro-batch, on the last pipeline stage; [] elsewhere.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        hidden = model(batch["tokens"], batch["position_ids"], attention_mask=None)

        def loss_func(last_hidden):  # (s, b, H) on the last stage
            loss, values = loss_fn(model, last_hidden, batch)
            # NOTE: the schedule divides `loss` in place by num_microbatches; values must not share its storage.
            return loss, values

        return hidden, loss_func

    forward_backward = get_forward_backward_func(pp_size=ps.pp_size, vp_size=ps.vpp_size)
    values = forward_backward(
        forward_step_func=forward_step,
        data_iterator=[iter(microbatches) for _ in chunks],
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=microbatches[0]["tokens"].shape[1],
        micro_batch_size=microbatches[0]["tokens"].shape[0],
        forward_only=forward_only,
    )
    return list(values) if ps.is_last_stage else []


def lm_forward_backward(
    chunks: list[torch.nn.Module], ps: ParallelState, microbatches: list[dict], *, forward_only: bool = False
) -> list[float]:
    """Next-token loss of each micro-batch (batches also carry `labels`, (b, T)); gradients accumulate in `.grad`.

    Returns:
        the mean per-token loss of every micro-batch on the last pipeline stage, [] on other stages.
    """
    from megatron.core import tensor_parallel

    def loss_fn(model, hidden, batch):
        logits = lm_head_logits(hidden, model.lm_head_weight(), ps)  # (s, b, V_pad / tp)
        labels = batch["labels"].transpose(0, 1).contiguous()  # (s, b)
        # NOTE: Megatron's vocab_parallel_cross_entropy reads its global TP group (it takes none); LM loss only.
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).mean()
        return loss, {"lm_loss": loss.detach().clone()}

    values = run_schedule(chunks, ps, microbatches, loss_fn, forward_only=forward_only)
    return [float(v["lm_loss"]) for v in values]
