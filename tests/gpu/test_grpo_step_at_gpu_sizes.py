"""A Megatron-core GRPO step on CUDA at a real model's width (gpu-marked: `make test-gpu`, or part a of
`benchmarks/gpu/run.sh` on the lent machine, where megatron-core travels as a wheel; skipped where it does not
import).

Qwen2.5-1.5B's shape (hidden 1536, 12 heads, 2 KV heads, vocabulary 151936, tied embeddings) trimmed to 2 layers,
random weights, Megatron's local spec: one GRPO forward/backward (DAPO, clipping active) with the fused two-pass
Triton log-prob kernel (`implementation="triton"`) and with the one-pass loss on cuBLAS + Triton row kernels (what
"auto" picks on CUDA for DAPO) against the same step through materialised logits (`"reference"`, two passes), same
weights and tokens. fp32: loss and every parameter's gradient equal to fp32 rounding
(the kernel accumulates in fp32 like the reference; gradients to 1e-4 of each tensor's largest entry); bf16 (TRL's
default): the reference computes bf16 logits (a
model's own lm_head), the kernel fp32 ones, so the bound is bf16 rounding: loss within 1%, every gradient within
cosine 0.999 of the reference's.

The check is a plain function of (device, shape), smoke-run on CPU with the tiny shape under TRITON_INTERPRET=1
(`python -m tests.gpu.test_grpo_step_at_gpu_sizes`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")]


def _step_gradients(popt, ps, batch: dict, vocab_size: int, implementation: str) -> tuple[float, dict]:
    """One GRPO forward/backward: (loss, {parameter name: gradient in float32})."""
    from benchmarks.bench_grpo_step import kernels_for
    from engine.grpo.policy_loss import LossNormalizer
    from engine.policy.batch import split_microbatches
    from engine.policy.step import LogprobSettings, grpo_forward_backward
    from tests.helpers.grpo_settings import build_loss_config

    mask = batch.completion_mask
    micro = split_microbatches(batch.to(ps.device), 2)
    normalizer = LossNormalizer(num_tokens=float(mask.sum()), num_sequences=float(mask.shape[0]))
    settings = LogprobSettings(vocab_size=vocab_size, temperature=1.0, kernels=kernels_for(implementation))
    popt.zero_grad()
    outputs = grpo_forward_backward(popt.model, ps, micro, build_loss_config(loss_type="dapo", epsilon_high=0.28),
                                    normalizer, settings)
    grads = {}
    for chunk in popt.model:
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            grads[name] = grad.detach().float().clone()
    return float(sum(o.loss for o in outputs)), grads


def check_fused_step_matches_materialised_logits(shape: str, num_layers: int | None, dtype: str,
                                                 batch_shape: tuple[int, int, int]) -> None:
    """The fused-kernel GRPO step against the materialised-logits step on the same weights and tokens."""
    from benchmarks.bench_grpo_step import build_batch, build_policy_and_optimizer, model_config
    from engine.config import ParallelConfig
    from engine.policy.parallel import destroy_parallel, init_parallel

    hf_config = model_config(shape, num_layers)
    ps = init_parallel(ParallelConfig(), seed=0)
    try:
        popt, _ = build_policy_and_optimizer(hf_config, dtype, ps)
        batch = build_batch(hf_config.vocab_size, *batch_shape)
        ref_loss, ref_grads = _step_gradients(popt, ps, batch, hf_config.vocab_size, "reference")
        for fused in ("triton", "onepass_cublas_triton"):  # the two-pass kernel, the one-pass loss
            loss, grads = _step_gradients(popt, ps, batch, hf_config.vocab_size, fused)
            _check_close(dtype, loss, grads, ref_loss, ref_grads, fused)
    finally:
        destroy_parallel()


def _check_close(dtype: str, loss: float, grads: dict, ref_loss: float, ref_grads: dict, label: str) -> None:
    assert sorted(grads) == sorted(ref_grads) and any(g.abs().sum() > 0 for g in grads.values()), label
    if dtype == "float32":
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        for name, grad in grads.items():
            scale = float(ref_grads[name].abs().max())  # fp32 rounding of sums over tokens: relative to the tensor
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-4 * scale,
                                       msg=lambda m, name=name: f"{label} {name}: {m}")
        return
    assert loss == pytest.approx(ref_loss, rel=1e-2)
    for name, grad in grads.items():
        cosine = torch.nn.functional.cosine_similarity(grad.flatten(), ref_grads[name].flatten(), dim=0)
        assert cosine > 0.999, f"{label} {name}: cosine {float(cosine):.5f} with the materialised-logits gradient"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_kernel_grpo_step_equals_materialised_logits_at_qwen2_5_1_5b_width(dtype):
    check_fused_step_matches_materialised_logits("qwen2.5-1.5b", 2, dtype, (8, 128, 384))


if __name__ == "__main__":  # CPU smoke at the tiny shape (TRITON_INTERPRET=1 before triton is imported)
    check_fused_step_matches_materialised_logits("tiny", None, "float32", (4, 6, 10))
    print("CPU smoke of the GPU step check: ok")
