"""Forward-only log-probs on gloo at TP=2: bitwise deterministic and bitwise equal to the training pass (so the
on-policy ratio is exactly 1); the frozen reference starts equal to the policy and stays put when the policy steps;
TR-DPO mixing with alpha=1 makes it the policy; after further optimizer steps (distributed optimizer, reference
offloaded to CPU) with the loop's sync rule, the reference equals TRL's formula applied to the policy's weights saved
at each sync step (fp32, 1e-6); dropout from the HF config acts in training forwards unless `model.disable_dropout`,
and never in the forward-only log-prob pass. The GRPO step's per-token terms on the Triton kernel
(`LogprobSettings.terms_implementation`, from kernels.loss_terms_implementation) give the torch terms' loss."""

import dataclasses

import torch

from tests.distributed.launcher import run_distributed


def _check(tp: int, model_dir: str) -> dict:
    from transformers import AutoConfig

    from engine.config import KernelsConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from engine.grpo.policy_loss import LossNormalizer
    from engine.policy.batch import pack_completions, split_microbatches
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_map import ModelDims
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.optimizer import build_optimizer
    from engine.policy.parallel import init_parallel
    from engine.policy.reference import ReferencePolicy
    from engine.policy.step import (
        LogprobSettings,
        completion_logprobs,
        forward_logprobs,
        grpo_forward_backward,
        run_schedule,
    )
    from tests.helpers.grpo_settings import build_loss_config

    ps = init_parallel(ParallelConfig(tp_size=tp), seed=0)
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_cfg = ModelConfig(dtype="float32", offload_reference=True)
    dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, model_cfg, tp).padded_vocab_size)
    chunks = build_policy(hf_config, model_cfg, ps)
    load_hf_checkpoint(chunks, ps, model_dir, dims)
    reference = ReferencePolicy.build(hf_config, model_cfg, ps, model_dir, dims)
    popt = build_optimizer(OptimizerConfig(learning_rate=1e-2, lr_scheduler_type="constant"), chunks, ps, total_steps=5)

    gen = torch.Generator().manual_seed(2)
    batch = pack_completions([[5, 6, 7], [8, 9]] * 2, [torch.randint(3, 400, (n,), generator=gen).tolist() for n in (4, 2, 5, 3)], 0)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    micro = split_microbatches(batch, 2)
    settings = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=0.7,
                               kernels=KernelsConfig(loss_implementation="torch_chunked"))

    first = forward_logprobs(popt.model, ps, micro, settings)
    second = forward_logprobs(popt.model, ps, micro, settings)
    ref_before = reference.logprobs(ps, micro, settings)

    def train_mode_logprobs(model, hidden, mb):
        logprobs, _ = completion_logprobs(model, hidden, mb, ps, settings)
        return logprobs.sum() * 0, {"logprobs": logprobs.detach().clone()}

    popt.zero_grad()
    in_training = run_schedule(popt.model, ps, micro, train_mode_logprobs)
    popt.zero_grad()
    micro_old = [dataclasses.replace(mb, old_logprobs=lp) for mb, (lp, _) in zip(micro, first)]
    normalizer = LossNormalizer(num_tokens=float(batch.completion_mask.sum()), num_sequences=4.0)
    loss_config = build_loss_config(loss_type="dapo", beta=0.04, use_bias_correction_kl=False)
    micro_old = [dataclasses.replace(mb, ref_logprobs=lp + 0.1) for mb, (lp, _) in zip(micro_old, first)]
    def with_terms(name: str):
        return dataclasses.replace(settings, kernels=dataclasses.replace(settings.kernels, loss_terms_implementation=name))

    triton_terms = grpo_forward_backward(popt.model, ps, micro_old, loss_config, normalizer, with_terms("triton"))
    try:  # the setting reaches the loss: a bad name is refused there
        grpo_forward_backward(popt.model, ps, micro_old, loss_config, normalizer, with_terms("fused"))
        is_refused = False
    except ValueError as error:
        is_refused = "terms_implementation" in str(error)
    popt.zero_grad()
    torch_terms = grpo_forward_backward(popt.model, ps, micro_old, loss_config, normalizer, settings)
    popt.step()
    after_policy = forward_logprobs(popt.model, ps, micro, settings)
    ref_after = reference.logprobs(ps, micro, settings)
    reference.mix_from(popt.model, alpha=1.0)
    ref_mixed = reference.logprobs(ps, micro, settings)
    mixing_follows_trl = _mix_over_steps(popt, reference, ps, micro, settings,
                                         float(batch.completion_mask.sum()))
    on_cpu = all(p.device.type == "cpu" for c in reference.chunks for p in c.parameters())
    return _dropout_follows_disable_dropout(hf_config, ps, micro, settings) | {
        "deterministic": all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second)),
        "train_equals_forward": all(torch.equal(a[0], b["logprobs"]) for a, b in zip(first, in_training)),
        "ref_equals_policy": all(torch.equal(a[0], b[0]) for a, b in zip(first, ref_before)),
        "policy_moved": any(not torch.equal(a[0], b[0]) for a, b in zip(first, after_policy)),
        "ref_unchanged": all(torch.equal(a[0], b[0]) for a, b in zip(ref_before, ref_after)),
        "ref_mixed_is_policy": all(torch.allclose(a[0], b[0], atol=1e-6) for a, b in zip(after_policy, ref_mixed)),
        "ref_offloaded": on_cpu,
        "triton_terms_equal_torch_terms": all(torch.allclose(a.loss, b.loss, rtol=1e-6, atol=1e-9)
                                              for a, b in zip(triton_terms, torch_terms)) and len(torch_terms) == 2,
        "bad_terms_implementation_refused": is_refused,
        "mixing_follows_trl": mixing_follows_trl,
        "masked_are_zero": all(float((lp * (1 - mb.completion_mask)).abs().sum()) == 0 for (lp, _), mb in zip(first, micro)),
    }


def _dropout_follows_disable_dropout(hf_config, ps, micro, settings) -> dict:
    """The tiny model with attention dropout 0.5 in its HF config: two training-mode forwards differ with
    `model.disable_dropout` false (the config's dropout in Megatron's TransformerConfig) and agree with it true;
    the forward-only log-prob pass (old / reference / sync probe) runs without dropout either way."""
    import copy

    from engine.config import ModelConfig
    from engine.policy.model import build_policy
    from engine.policy.step import completion_logprobs, forward_logprobs, run_schedule

    noisy = copy.deepcopy(hf_config)
    noisy.attention_dropout = 0.5

    def in_train_mode(chunks):
        def keep(model, hidden, mb):
            logprobs, _ = completion_logprobs(model, hidden, mb, ps, settings)
            return logprobs.sum() * 0, {"logprobs": logprobs.detach().clone()}

        with torch.no_grad():
            return [v["logprobs"] for v in run_schedule(chunks, ps, micro, keep, forward_only=True)]

    on = build_policy(noisy, ModelConfig(dtype="float32"), ps)
    off = build_policy(noisy, ModelConfig(dtype="float32", disable_dropout=True), ps)
    forward = [lp for lp, _ in forward_logprobs(on, ps, micro, settings)]
    again = [lp for lp, _ in forward_logprobs(on, ps, micro, settings)]
    return {
        "dropout_acts_in_training": any(not torch.equal(a, b) for a, b in zip(in_train_mode(on), in_train_mode(on))),
        "disable_dropout_agrees": all(torch.equal(a, b) for a, b in zip(in_train_mode(off), in_train_mode(off))),
        "logprob_pass_without_dropout": all(torch.equal(a, b) for a, b in zip(forward, again))
                                        and all(chunk.training for chunk in on),
    }


def _mix_over_steps(popt, reference, ps, micro, settings, num_tokens: float, *, num_steps: int = 4,
                    sync_steps: int = 2, alpha: float = 0.6) -> bool:
    """Optimizer steps with engine/train/loop.py's TR-DPO rule (mix after every sync_steps-th step); the reference
    must end as ref <- alpha * policy_s + (1 - alpha) * ref applied at each sync step s, from the saved weights."""
    from engine.config import GRPOConfigSection
    from engine.grpo.policy_loss import LossNormalizer
    from engine.policy.reference import mix_reference_if_due
    from engine.policy.step import forward_logprobs, grpo_forward_backward, unwrap
    from tests.helpers.grpo_settings import build_loss_config

    gr = GRPOConfigSection(beta=0.04, sync_ref_model=True, ref_model_sync_steps=sync_steps, ref_model_mixup_alpha=alpha)
    expected = [p.detach().clone() for c in reference.chunks for p in c.parameters()]
    moved = False
    for step in range(1, num_steps + 1):
        old = forward_logprobs(popt.model, ps, micro, settings)
        popt.zero_grad()
        grpo_forward_backward(popt.model, ps, [dataclasses.replace(mb, old_logprobs=lp) for mb, (lp, _) in zip(micro, old)],
                              build_loss_config(loss_type="dapo"),
                              LossNormalizer(num_tokens=num_tokens, num_sequences=4.0),
                              settings)
        popt.step()
        mix_reference_if_due(reference, popt.model, gr, step)
        if step % sync_steps == 0:
            policy = [p.detach().clone() for c in popt.model for p in unwrap(c).parameters()]
            moved = moved or max(float((e - q).abs().max()) for e, q in zip(expected, policy)) > 1e-3
            expected = [alpha * q + (1 - alpha) * e for e, q in zip(expected, policy)]
    actual = [p.detach() for c in reference.chunks for p in c.parameters()]
    return moved and all(torch.allclose(a, e, rtol=0, atol=1e-6) for a, e in zip(actual, expected))


def test_logprobs_deterministic_on_policy_and_reference_frozen(tmp_path):
    from engine.models.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "qwen2", "qwen2", seed=4)
    for result in run_distributed(_check, 2, 2, str(model_dir)):
        assert result == {key: True for key in result}, {k: v for k, v in result.items() if not v}
