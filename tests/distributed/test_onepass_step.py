"""The GRPO step through Megatron's schedule with the one-pass LM head equals the two-pass step: the same losses and
the same gradients in every parameter's grad buffer, over several micro-batches (Megatron's 1 / num_microbatches
and our micro-batch scale reach the one-pass gradients through the kernel's anchor), at TP=1, TP=2 (per-chunk
statistics all-gathered) and PP=2 (the loss on the last stage only); and the chosen path is reported in the
`lm_head/one_pass` metric."""

import pytest
import torch

from tests.distributed.launcher import run_distributed


def _step_both_ways(model_dir: str, tp: int, pp: int) -> dict:
    import dataclasses

    from engine.config import KernelsConfig, OptimizerConfig, ParallelConfig
    from engine.policy.optimizer import build_optimizer
    from engine.policy.packing import MicrobatchSpec, round_microbatches
    from engine.policy.step import LogprobSettings, grpo_forward_backward
    from tests.helpers.grpo_settings import build_loss_config
    from tests.helpers.policy import GLOBAL_BATCH, build_from_hf, global_batch

    ps, hf_config, chunks, _ = build_from_hf(model_dir, ParallelConfig(tp_size=tp, pp_size=pp))
    popt = build_optimizer(OptimizerConfig(learning_rate=1e-3, lr_scheduler_type="constant"), chunks, ps,
                           total_steps=1)
    spec = MicrobatchSpec(padding_free=False, max_tokens=None, max_logprob_tokens=None, micro_batch_size=2,
                          multiple=1)
    ((micro, normalizer),) = round_microbatches(global_batch(), spec, global_batch_size=GLOBAL_BATCH,
                                                dp_size=ps.dp_size, dp_rank=ps.dp_rank)
    loss_config = build_loss_config(loss_type="grpo", beta=0.04, epsilon_high=0.28, use_bias_correction_kl=True,
                                    entropy_coef=0.01)
    base = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=0.9,
                           kernels=KernelsConfig(loss_implementation="torch_chunked", loss_workspace_mb=1))
    results = {}
    for loss_pass in ("two", "one"):
        settings = dataclasses.replace(base, kernels=dataclasses.replace(base.kernels, loss_pass=loss_pass))
        popt.zero_grad()
        outputs = grpo_forward_backward(popt.model, ps, micro, loss_config, normalizer, settings)
        grads = {name: p.main_grad.detach().clone() for chunk in popt.model for name, p in chunk.named_parameters()}
        results[loss_pass] = {"loss": [float(o.loss) for o in outputs], "grads": grads,
                              "one_pass": [o.sums["lm_head/one_pass"].tolist() for o in outputs]}
    results["num_microbatches"] = len(micro)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_one_pass_step_equals_two_pass_step(tmp_path, tp, pp):
    from engine.models.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "qwen2", "qwen2", seed=5)
    ranks = run_distributed(_step_both_ways, tp * pp, str(model_dir), tp, pp)
    assert ranks[0]["num_microbatches"] > 1
    for rank, result in enumerate(ranks):
        one, two = result["one"], result["two"]
        assert one["loss"] == pytest.approx(two["loss"], rel=1e-6, abs=1e-7)
        assert all(flag == [1.0, 1.0] for flag in one["one_pass"]) and all(f == [0.0, 1.0] for f in two["one_pass"])
        assert one["grads"].keys() == two["grads"].keys()
        for name, want in two["grads"].items():
            assert want.abs().sum() > 0 or "lm_head" not in name, name
            torch.testing.assert_close(one["grads"][name], want, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=f"rank {rank} {name}": f"{n}: {m}")
