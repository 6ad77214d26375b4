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


def lm_forward_backward(
    chunks: list[torch.nn.Module], ps: ParallelState, microbatches: list[dict], *, forward_only: bool = False
) -> list[float]:
    """Next-token loss of each micro-batch through Megatron's schedule; gradients accumulate in `.grad`.

    Args:
        chunks: this rank's model chunks (build_policy), in virtual-stage order.
        ps: this process's parallel state.
        microbatches: dicts with `tokens` and `labels` (int64, (b, T)) and `position_ids` ((b, T)); every rank
            passes the same list (only the first and last stage read it).
        forward_only: no backward pass.
    Returns:
        the mean per-token loss of every micro-batch on the last pipeline stage, [] on other stages.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])

        def loss_func(per_token_loss):  # (b, T) on the last stage
            loss = per_token_loss.float().mean()
            # NOTE: clone: the schedule divides `loss` in place by num_microbatches, and detach() shares storage.
            return loss, {"lm_loss": loss.detach().clone()}

        return output, loss_func

    seq_length = microbatches[0]["tokens"].shape[1]
    forward_backward = get_forward_backward_func(pp_size=ps.pp_size, vp_size=ps.vpp_size)
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=[iter(microbatches) for _ in chunks],
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=microbatches[0]["tokens"].shape[0],
        forward_only=forward_only,
    )
    return [float(x["lm_loss"]) for x in losses] if ps.is_last_stage else []
