"""Megatron GPTModel of the tiny model: forward + backward through get_forward_backward_func at TP=2, PP=2,
TP=2 x PP=2 (and interleaved virtual PP) on gloo equals the single-process run.

Every layout holds slices of the same global weights (`init_weights_by_name`), so the loss and each parameter's full
gradient (TP shards gathered back into the TP=1 layout) must equal the TP=1 x PP=1 run. fp32; the tolerance allows
only the reordering of floating-point sums that TP reductions and pipelining introduce.
"""

import math

import pytest
import torch

from engine.policy.microbatch import MicroBatch
from tests.distributed.launcher import run_distributed

SEED, BATCH, SEQ, NUM_MICROBATCHES = 7, 4, 16, 2


def _batches(vocab_size: int) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ + 1), generator=gen)  # (B, T+1)
    position_ids = torch.arange(SEQ).expand(BATCH // NUM_MICROBATCHES, SEQ)  # (b, T)
    return [
        MicroBatch(tokens=chunk[:, :-1], labels=chunk[:, 1:], position_ids=position_ids)
        for chunk in tokens.chunk(NUM_MICROBATCHES)  # NUM_MICROBATCHES x (b, T+1)
    ]


def _run_layout(tp: int, pp: int, vpp: int | None) -> dict:
    import torch.distributed as dist

    from engine.config import ModelConfig, ParallelConfig
    from engine.models.tiny_model import tiny_model_config
    from engine.policy.model import build_policy, global_param_names, init_weights_by_name, merge_tp_shards
    from engine.policy.parallel import init_parallel
    from engine.policy.step import lm_forward_backward

    ps = init_parallel(ParallelConfig(tp_size=tp, pp_size=pp, virtual_pipeline_size=vpp), seed=1234)
    hf_config = tiny_model_config("qwen2")
    chunks = build_policy(hf_config, ModelConfig(dtype="float32"), ps)
    init_weights_by_name(chunks, ps, seed=SEED)
    losses = lm_forward_backward(chunks, ps, _batches(hf_config.vocab_size))
    result = {"pp_rank": ps.pp_rank, "tp_rank": ps.tp_rank, "losses": losses}
    grads = {}
    tp_group = ps.groups.tp
    for chunk in chunks:
        names = global_param_names(chunk)
        for name, param in chunk.named_parameters():
            assert param.grad is not None, f"no gradient for {names[name]}"
            shards = [torch.empty_like(param.grad) for _ in range(ps.tp_size)]
            dist.all_gather(shards, param.grad.contiguous(), group=tp_group)
            grads[names[name]] = merge_tp_shards(shards, param)
    result["grads"] = grads if ps.tp_rank == 0 else {}
    return result


def _merge(results: list[dict]) -> tuple[list[float], dict]:
    """The last stage's losses (identical on its TP ranks) and the union of all stages' gradients."""
    last = max(r["pp_rank"] for r in results)
    losses = [r["losses"] for r in results if r["pp_rank"] == last]
    assert all(l == losses[0] for l in losses), f"TP ranks of the last stage disagree on the loss: {losses}"
    grads = {}
    for r in results:
        grads.update(r["grads"])
    return losses[0], grads


@pytest.fixture(scope="module")
def reference():
    return _merge(run_distributed(_run_layout, 1, 1, 1, None))


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,vpp",
    [(2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)],
    ids=["tp2_pp1", "tp1_pp2", "tp2_pp2", "tp1_pp2_vpp2"],
)
def test_megatron_forward_backward_matches_single_process(reference, tp, pp, vpp):
    ref_losses, ref_grads = reference
    losses, grads = _merge(run_distributed(_run_layout, tp * pp, tp, pp, vpp))
    assert len(ref_losses) == NUM_MICROBATCHES and all(torch.isfinite(torch.tensor(ref_losses)))
    # Near-uniform random init over the 512 padded logits: the reported loss is the per-micro-batch mean, ~ln 512.
    assert all(abs(loss - math.log(512)) < 0.3 for loss in ref_losses), ref_losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert sorted(grads) == sorted(ref_grads), "the layout does not hold the same parameters as TP=1 x PP=1"
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, f"{name}: zero gradient in the reference"
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
