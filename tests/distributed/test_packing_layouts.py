"""Packed and token-budget micro-batches give the padded path's GRPO step, at TP=1, TP=2, PP=2 and DP=2 on gloo.

One global batch of 12 completions (3 prompts x G=4) with long-tailed completion lengths (most 1-12 tokens, two of
40 and 64), DAPO loss with beta > 0 and off-policy old log-probs (the model's own plus fixed noise, so clipping and
the KL are active), Megatron's distributed optimizer. Each launch runs one optimizer step per variant from the same
checkpoint, old log-probs included (engine/policy/packing.py `sequence_logprobs`, the forward-only budget):
- padded: per_device_train_batch_size=2 right-padded rows (engine/policy/batch.py), the reference;
- packed: train.padding_free with a 60-token budget (several sequences per row, groups across micro-batches and DP
  ranks balanced by tokens), forward-only budget at its default (2 x 60); the engine's default attention for it
  (`varlen`: the rows carry their sequences, no mask);
- masked: the same rows with the block-diagonal mask (`model.packed_attention_implementation: masked`; one process
  and TP2);
- budget: token-budget micro-batches of 48 padded slots without packing (length-sorted rows), forward-only 100;
- singletons (DP2 only): packed with a 10-token budget, one sequence per micro-batch; the DP ranks hold 5 and 7
  sequences, so one runs 2 empty micro-batches (a zero loss that still reaches every parameter).
Every variant at every layout must equal the padded TP=1 step: the summed loss and the gradient norm (rel 1e-5), every
updated weight (rtol 1e-5, atol 1e-6, as tests/distributed/test_grpo_step_layouts.py) and every old log-prob (atol
1e-5; measured max 5e-7: RoPE rotates a packed sequence by its offset in the row, and its relative positions are
unchanged). The TP=1 launch also checks that the fused log-prob kernel receives exactly the real completion tokens
and that packing computes fewer token slots than padding.

bf16 (TRL's default), TP=1: packed vs padded within bf16 rounding, for the reason and with the bounds of
test_grpo_step_layouts.py's bf16 test: a sequence packed into another row meets other matmul shapes and summation
orders, so bf16 hidden states round differently (relative 2^-8 per rounding). Loss and grad norm rel 2e-2; old
log-probs atol 2e-2 nats (the kernel computes in fp32 from bf16 hidden states); weights within 2 * lr + one bf16 step
(Adam's first update is about lr whatever the gradient), at most 5% of a tensor beyond lr / 2 (Adam turns the rounding
noise of near-zero gradients into +-lr). Measured on this batch: log-probs max 3.7e-3, loss rel 8e-4, grad norm rel
2e-3, at most 1.8% of a tensor beyond lr / 2; the same step with the block-diagonal mask replaced by a plain causal
one (packed sequences attending to each other) gave log-probs 0.76 and 19%: the bounds catch that.
"""

import pytest
import torch

from engine.policy.microbatch import MicroBatch
from tests.distributed.launcher import run_distributed
from tests.helpers.policy import hf_tensors

NUM_SEQUENCES, MICRO_BATCH, VOCAB = 12, 2, 400
PROMPTS = [3, 3, 3, 3, 5, 5, 5, 5, 4, 4, 4, 4]
COMPLETIONS = [2, 40, 5, 3, 1, 9, 4, 64, 6, 3, 12, 2]  # long-tailed
VARIANTS = {
    "padded": dict(padding_free=False),
    "packed": dict(padding_free=True, max_tokens_per_microbatch=60),
    "masked": dict(padding_free=True, max_tokens_per_microbatch=60),  # packed with the mask (MODEL_VARIANTS)
    "budget": dict(padding_free=False, max_tokens_per_microbatch=48, max_tokens_per_logprob_microbatch=100),
    # DP2: one sequence per micro-batch; LPT gives the ranks 5 and 7 sequences, so one rank runs 2 empty ones
    "singletons": dict(padding_free=True, max_tokens_per_microbatch=10, max_tokens_per_logprob_microbatch=10),
}


MODEL_VARIANTS = {"masked": dict(packed_attention_implementation="masked")}
"""`packed` runs the engine's default (`auto`: the qwen2 layers take the sequences, no mask), `masked` the mask."""


def _global_batch() -> tuple[MicroBatch, torch.Tensor]:
    from engine.policy.batch import pack_completions

    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPTS]
    completions = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in COMPLETIONS]
    batch = pack_completions(prompts, completions, pad_token_id=0)
    mask = batch.completion_mask
    batch.advantages = torch.randn(NUM_SEQUENCES, generator=gen)  # (B,)
    old_noise = 0.3 * torch.randn(mask.shape, generator=gen) * mask  # (B, C): makes the step off-policy
    batch.ref_logprobs = (-6.0 + 0.5 * torch.randn(mask.shape, generator=gen)) * mask  # (B, C)
    batch.seq_index = torch.arange(NUM_SEQUENCES)  # travels with each row through every plan
    return batch, old_noise


def _packing_steps(tp: int, pp: int, dp: int, model_dir: str, out_root: str, dtype: str, variants: list[str]) -> dict:
    import kernels
    from engine.config import ModelConfig, ParallelConfig, TrainConfig
    from engine.policy.parallel import init_parallel

    ps = init_parallel(ParallelConfig(tp_size=tp, pp_size=pp, dp_size=dp), seed=0)
    kernel, onepass, seen = kernels.lm_head_logprob_entropy, kernels.onepass_logprob_entropy, []

    def counting(entry):  # the real kernel entry; records how many token rows it was given
        def counting_kernel(x, *args, **kwargs):
            seen.append(x.shape[0])
            return entry(x, *args, **kwargs)
        return counting_kernel

    kernels.lm_head_logprob_entropy = counting(kernel)  # forward-only (old log-probs) and two-pass training
    kernels.onepass_logprob_entropy = counting(onepass)  # the one-pass training loss (dapo: token-local)
    results = {}
    for name in variants:
        seen.clear()
        spec_cfg = TrainConfig(per_device_train_batch_size=MICRO_BATCH, **VARIANTS[name])
        model_cfg = ModelConfig(dtype=dtype, **MODEL_VARIANTS.get(name, {}))
        results[name] = _one_step(ps, model_dir, f"{out_root}/{name}", model_cfg, spec_cfg)
        results[name]["kernel_rows"] = sum(seen)
    kernels.lm_head_logprob_entropy, kernels.onepass_logprob_entropy = kernel, onepass
    return results


def _one_step(ps, model_dir: str, out_dir: str, model_cfg, train_cfg) -> dict:
    from transformers import AutoConfig

    from engine.config import KernelsConfig, OptimizerConfig
    from engine.policy.hf_checkpoint import export_hf_checkpoint, load_hf_checkpoint
    from engine.policy.hf_map import ModelDims
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.optimizer import build_optimizer
    from engine.policy.packing import build_microbatch_spec, round_microbatches, sequence_logprobs
    from engine.policy.sdpa_attention import serves_varlen
    from engine.policy.step import LogprobSettings, forward_logprobs, grpo_forward_backward
    from tests.helpers.grpo_settings import build_loss_config

    hf_config = AutoConfig.from_pretrained(model_dir)
    chunks = build_policy(hf_config, model_cfg, ps)
    dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, model_cfg, ps.tp_size).padded_vocab_size)
    load_hf_checkpoint(chunks, ps, model_dir, dims)
    opt_cfg = OptimizerConfig(learning_rate=1e-3, adam_epsilon=1e-4, lr_scheduler_type="constant", max_grad_norm=1.0)
    popt = build_optimizer(opt_cfg, chunks, ps, total_steps=1)
    settings = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=0.9,
                               kernels=KernelsConfig(loss_implementation="torch_chunked"))
    loss_config = build_loss_config(loss_type="dapo", beta=0.04, epsilon_high=0.28, use_bias_correction_kl=True)

    spec = build_microbatch_spec(train_cfg, model_cfg, ps, micro_batch_size=MICRO_BATCH, pad_token_id=0,
                                 varlen=serves_varlen(chunks))  # as engine/train/round_batch.py microbatch_spec
    batch, old_noise = _global_batch()
    [(micro, normalizer)] = round_microbatches(batch, spec, global_batch_size=NUM_SEQUENCES,
                                               dp_size=ps.dp_size, dp_rank=ps.dp_rank)
    old = sequence_logprobs(lambda mbs: forward_logprobs(popt.model, ps, mbs, settings), micro, spec)
    logprobs = {}
    for mb, lp in zip(micro, old):
        mb.old_logprobs = lp + old_noise[mb.seq_index]
        logprobs |= {int(i): row for i, row in zip(mb.seq_index, lp)}
    popt.zero_grad()
    outputs = grpo_forward_backward(popt.model, ps, micro, loss_config, normalizer, settings)
    stats = popt.step()
    export_hf_checkpoint(chunks, ps, out_dir, hf_config, dims)
    reports = ps.is_last_stage and ps.tp_rank == 0
    return {"loss": float(sum(o.loss for o in outputs)) if reports else None, "grad_norm": stats["grad_norm"],
            "logprobs": logprobs if reports else {}, "num_microbatches": len(micro),
            "num_empty": sum(mb.completion_ids.shape[0] == 0 for mb in micro),
            "token_slots": sum(mb.model_input_ids.numel() for mb in micro), "layout": spec.layout,
            "mask_elements": sum(mb.attention_mask.numel() for mb in micro if mb.attention_mask is not None)}


def _merge(results: list[dict], name: str) -> dict:
    """One variant's loss, grad norms and old log-probs (B, C) over every rank's report."""
    parts = [r[name] for r in results]
    logprobs = {}
    for p in parts:
        logprobs |= p["logprobs"]
    assert sorted(logprobs) == list(range(NUM_SEQUENCES)), f"{name}: log-probs of sequences {sorted(logprobs)}"
    return {"loss": sum(p["loss"] for p in parts if p["loss"] is not None), "grad_norms": [p["grad_norm"] for p in parts],
            "logprobs": torch.stack([logprobs[i] for i in range(NUM_SEQUENCES)])}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("packing")
    model_dir = build_tiny_model(root / "qwen2", "qwen2", seed=5)
    fp32 = run_distributed(_packing_steps, 1, 1, 1, 1, str(model_dir), str(root / "fp32"), "float32",
                           ["padded", "packed", "masked", "budget"])
    bf16 = run_distributed(_packing_steps, 1, 1, 1, 1, str(model_dir), str(root / "bf16"), "bfloat16",
                           ["padded", "packed", "masked"])
    return model_dir, root, fp32[0], bf16[0]


def _assert_equal_to_reference(merged: dict, weights: dict, reference: dict, ref_weights: dict, what: str) -> None:
    assert merged["loss"] == pytest.approx(reference["loss"], rel=1e-5), what
    assert all(g == pytest.approx(reference["grad_norms"][0], rel=1e-5) for g in merged["grad_norms"]), what
    torch.testing.assert_close(merged["logprobs"], reference["logprobs"], rtol=0, atol=1e-5, msg=lambda m: f"{what}: {m}")
    assert sorted(weights) == sorted(ref_weights)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


def test_packed_and_token_budget_steps_equal_the_padded_step_in_one_process(single_process):
    model_dir, root, fp32, _ = single_process
    reference = _merge([fp32], "padded")
    ref_weights = hf_tensors(root / "fp32" / "padded")
    assert reference["grad_norms"][0] > 1.0, "the batch should need clipping at max_grad_norm=1.0"
    for name in ("packed", "masked", "budget"):
        _assert_equal_to_reference(_merge([fp32], name), hf_tensors(root / "fp32" / name), reference, ref_weights, name)
    # the default packs without a W x W mask (the sequences instead); `masked` builds it
    assert (fp32["packed"]["layout"], fp32["packed"]["mask_elements"]) == ("varlen", 0), fp32["packed"]
    assert fp32["masked"]["layout"] == "mask" and fp32["masked"]["mask_elements"] > 0, fp32["masked"]
    num_completion_tokens = sum(COMPLETIONS)
    for name, result in fp32.items():  # old log-probs + the training pass: each real completion token twice
        assert result["kernel_rows"] == 2 * num_completion_tokens, f"{name}: the kernel saw {result['kernel_rows']}"
    assert fp32["packed"]["token_slots"] * 2 <= fp32["padded"]["token_slots"], {k: v["token_slots"] for k, v in fp32.items()}
    assert fp32["budget"]["token_slots"] < fp32["padded"]["token_slots"]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "dp2"])
def test_packed_and_token_budget_steps_equal_the_padded_single_process_step(single_process, tmp_path, tp, pp, dp):
    model_dir, root, fp32, _ = single_process
    reference = _merge([fp32], "padded")
    ref_weights = hf_tensors(root / "fp32" / "padded")
    variants = ["packed", "budget"] + (["singletons"] if dp > 1 else []) + (["masked"] if tp > 1 else [])
    results = run_distributed(_packing_steps, tp * pp * dp, tp, pp, dp, str(model_dir), str(tmp_path), "float32",
                              variants)
    for name in variants:
        if dp > 1:
            assert len({r[name]["num_microbatches"] for r in results}) == 1, "DP ranks ran different micro-batch counts"
        if name == "singletons":
            assert sorted(r[name]["num_empty"] for r in results) == [0, 2], "the empty micro-batch path is not covered"
        _assert_equal_to_reference(_merge(results, name), hf_tensors(tmp_path / name), reference, ref_weights,
                                   f"{name} at tp{tp} pp{pp} dp{dp}")


@pytest.mark.parametrize("variant", ["packed", "masked"], ids=["varlen", "mask"])
def test_bf16_packed_step_equals_the_padded_step_within_bf16_rounding(single_process, variant):
    model_dir, root, _, bf16 = single_process
    padded, packed = _merge([bf16], "padded"), _merge([bf16], variant)
    assert packed["loss"] == pytest.approx(padded["loss"], rel=2e-2)
    assert packed["grad_norms"][0] == pytest.approx(padded["grad_norms"][0], rel=2e-2)
    diff = (packed["logprobs"] - padded["logprobs"]).abs().max()
    assert diff <= 2e-2, f"old log-probs differ by {float(diff):.3g} nats"
    ref_weights, weights, lr = hf_tensors(root / "bf16" / "padded"), hf_tensors(root / "bf16" / variant), 1e-3
    for name, ref in ref_weights.items():
        diff = (weights[name].double() - ref.double()).abs()
        assert (diff <= 2 * lr + ref.double().abs() * 2.0**-8).all(), f"{name}: max |diff| {float(diff.max()):.3g}"
        far = float((diff > lr / 2).double().mean())  # measured: at most 0.018 (layer 0 v_proj)
        assert far <= 0.05, f"{name}: {far:.1%} of the weights moved differently (cross-sequence attention: 19%)"
