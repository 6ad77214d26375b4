"""Equality with TRL 1.16's GRPOTrainer on the same inputs: advantages, masks, IS ratios, metrics, loss and gradient.

TRL is a test-only dependency (the dev extra pins trl==1.16.0). We call its real code without a model: a bare
`GRPOTrainer` built with `object.__new__` carries only the attributes `_generate_and_score_completions` and
`_compute_loss` read, and the model-facing methods (`_tokenize_prompts`, `_generate_single_turn`,
`_calculate_rewards`, `_get_per_token_logps_and_entropies`) are replaced by functions returning our tensors. An
accelerate stand-in plays one process. If TRL renames an attribute these tests fail with an AttributeError, which is
the signal to re-read its source. They are skipped (with the import error) only if trl does not import.

The matrix test walks every loss type x level x beta x IS mode x entropy mask x truncation mask x off-policy mask;
the loss, d loss / d logprobs (and d loss / d entropy when the bonus is on) must agree to 1e-6 in float64.

Run: `pytest tests/unit/test_trl_parity.py` (~15 s on 2 cores, most of it importing trl and vLLM).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from engine.grpo.advantages import compute_advantages
from engine.grpo.metrics import (
    compute_completion_metrics,
    compute_loss_metrics,
    compute_reward_metrics,
    compute_sampling_metrics,
)
from engine.grpo.policy_loss import (
    PolicyLossBatch,
    TRLNormalizer,
    build_loss_normalizer,
    compute_policy_loss,
    compute_vllm_importance_sampling_ratio,
    entropy_coef_to_apply,
    find_truncated_completions,
    mask_truncated_completions,
    update_entropy_coef,
)
from engine.grpo.settings import IS_MODES, LOSS_TYPES
from tests.helpers.grpo_settings import build_loss_config

ATOL = 1e-6
EOS, PAD = 1, 0


@pytest.fixture(scope="module")
def trl_grpo():
    try:
        from trl.trainer import grpo_trainer
    except Exception as error:  # noqa: BLE001 - any import failure means "TRL unavailable"
        pytest.skip(f"trl==1.16.0 (test-only dependency, the dev extra) does not import: {error!r}")
    return grpo_trainer


class _OneProcess:
    """The accelerate.Accelerator methods TRL's GRPO code calls, for a single process."""

    def __init__(self, num_processes: int = 1):
        self.num_processes, self.process_index, self.device, self.sync_gradients = num_processes, 0, "cpu", True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _bare_trainer(trl_grpo):
    trainer = object.__new__(trl_grpo.GRPOTrainer)
    trainer.model = SimpleNamespace(training=True, is_gradient_checkpointing=False)
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return trainer


# ---------------------------------------------------------------------------------------------------------------------
# Generation side: advantages, truncation mask, num_items_in_batch, vLLM IS ratio, reward/completion/sampling metrics


def _trl_generate_and_score(trl_grpo, monkeypatch, *, rewards_per_func, num_generations, completion_ids, **options):
    """Run TRL's `_generate_and_score_completions` on given completions and rewards; (output dict, metrics)."""
    monkeypatch.setattr(trl_grpo, "gather_object", lambda x: x)
    num_rows = len(completion_ids)
    sampling_logps, old_logps = options.get("sampling_logps"), options.get("old_logps")
    t = _bare_trainer(trl_grpo)
    t.accelerator = _OneProcess()
    t.environment_factories, t.environments, t.tools, t.rollout_func = None, None, None, None
    t.num_generations = t.num_generations_eval = num_generations
    t._tokenize_prompts = lambda prompts: ([[7, 8, 9]] * len(prompts), None, {})
    t._generate_single_turn = lambda prompt_ids, images, fields, n: (completion_ids, sampling_logps)
    t.processing_class = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: [str(x) for x in ids])
    t.state, t.eos_token_ids = SimpleNamespace(num_input_tokens_seen=0), [EOS]
    t._tokenizer = SimpleNamespace(pad_token_id=PAD)
    t.pad_to_multiple_of, t.mask_truncated_completions = None, options.get("mask_truncated", False)
    t.args = SimpleNamespace(
        per_device_train_batch_size=num_rows, gradient_checkpointing_kwargs=None, steps_per_generation=1,
        gradient_accumulation_steps=1,
    )
    t.num_iterations, t.beta, t.use_vllm = 1, 0.0, sampling_logps is not None
    t.vllm_importance_sampling_correction = True
    t.vllm_importance_sampling_mode = options.get("is_mode", "sequence_mask")
    t.vllm_importance_sampling_clip_min = options.get("clip_min")
    t.vllm_importance_sampling_clip_max = options.get("clip_max", 3.0)
    t._get_per_token_logps_and_entropies = lambda *args, **kwargs: (old_logps, None, None)
    t._calculate_rewards = lambda inputs, prompts, completions, ids: rewards_per_func.clone()
    num_funcs = rewards_per_func.shape[1]
    t.reward_funcs, t.reward_func_names = [None] * num_funcs, [f"f{k}" for k in range(num_funcs)]
    weights = options.get("reward_weights")
    t.reward_weights = torch.ones(num_funcs) if weights is None else weights
    t.scale_rewards = options.get("scale_rewards", "group")
    t.multi_objective_aggregation = options.get("aggregation", "sum_then_normalize")
    t._logs = {"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list), "images": []}
    t._pending_extra_logs, t._pending_metrics, t.log_multimodal = {}, {}, False
    output = t._generate_and_score_completions([{"prompt": f"p{i // num_generations}"} for i in range(num_rows)])
    metrics = {key: values[-1] for key, values in t._metrics["train"].items()}
    return output, metrics


def _random_rewards(seed, num_rows, num_funcs, none_fraction):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 4, (num_rows, num_funcs), generator=gen).float() / 2  # (B, K) ties on purpose
    rewards[torch.rand(num_rows, num_funcs, generator=gen) < none_fraction] = float("nan")
    rewards[-1] = float("nan")  # an unscorable row
    rewards[:4] = 1.0  # group 0 has zero std
    return rewards


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_and_reward_metrics_match_trl(trl_grpo, monkeypatch, scale_rewards, aggregation):
    num_generations, num_rows = 4, 16
    rewards = _random_rewards(1, num_rows, 3, none_fraction=0.3)  # (B, K)
    weights = torch.tensor([1.0, 0.5, -2.0])
    completion_ids = [[3] * (1 + i % 3) + [EOS] for i in range(num_rows)]
    with pytest.warns(UserWarning, match="All reward functions returned None"):
        ours = compute_advantages(rewards, num_generations, weights, scale_rewards, aggregation)
    output, trl_metrics = _trl_generate_and_score(
        trl_grpo, monkeypatch, rewards_per_func=rewards, num_generations=num_generations, completion_ids=completion_ids,
        reward_weights=weights, scale_rewards=scale_rewards, aggregation=aggregation,
    )
    torch.testing.assert_close(ours.advantages, output["advantages"], atol=ATOL, rtol=0)
    assert ours.advantages[-1] == 0.0
    metrics = compute_reward_metrics(rewards, ["f0", "f1", "f2"], ours.is_std_zero, weights)
    for key, value in metrics.items():
        assert value == pytest.approx(trl_metrics[key], abs=ATOL, nan_ok=True), key


def test_truncation_mask_completion_metrics_and_token_count_match_trl(trl_grpo, monkeypatch):
    completion_ids = [[3, 4, EOS], [3, 3, 3, 3], [5], [2, 2, EOS], [6, 6, 6], [EOS]]  # rows 1, 2, 4 never stopped
    rewards = torch.arange(6.0).unsqueeze(1)  # (B, 1)
    output, trl_metrics = _trl_generate_and_score(
        trl_grpo, monkeypatch, rewards_per_func=rewards, num_generations=2, completion_ids=completion_ids,
        mask_truncated=True,
    )
    lengths = torch.tensor([len(ids) for ids in completion_ids])
    is_truncated = find_truncated_completions(torch.tensor([ids[-1] for ids in completion_ids]), [EOS, PAD])
    assert is_truncated.tolist() == [False, True, True, False, True, False]
    mask = (torch.arange(4).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (B, T)
    masked = mask_truncated_completions(mask, is_truncated)
    assert torch.equal(masked, output["completion_mask"])
    assert build_loss_normalizer(masked).num_tokens == output["num_items_in_batch"].item() == 7
    for key, value in compute_completion_metrics(lengths, is_truncated).items():
        assert value == pytest.approx(trl_metrics[key]), key


@pytest.mark.parametrize("clip_min, clip_max", [(None, 3.0), (0.5, 1.5), (0.8, None)])
@pytest.mark.parametrize("is_mode", IS_MODES)
def test_vllm_importance_sampling_ratio_and_sampling_metrics_match_trl(
    trl_grpo, monkeypatch, is_mode, clip_min, clip_max
):
    gen = torch.Generator().manual_seed(3)
    completion_ids = [[3] * n + [EOS] for n in (0, 1, 2, 3, 4, 2)]
    num_tokens = max(len(ids) for ids in completion_ids)
    sampling = [(-torch.rand(len(ids), generator=gen) * 2).tolist() for ids in completion_ids]
    sampling[3][1] = None  # vLLM could not score this token
    old_logps = -torch.rand(6, num_tokens, generator=gen, dtype=torch.float64) * 2  # (B, T)
    output, trl_metrics = _trl_generate_and_score(
        trl_grpo, monkeypatch, rewards_per_func=torch.arange(6.0).unsqueeze(1), num_generations=3,
        completion_ids=completion_ids, sampling_logps=sampling, old_logps=old_logps, is_mode=is_mode,
        clip_min=clip_min, clip_max=clip_max,
    )
    mask = output["completion_mask"]
    ratio = compute_vllm_importance_sampling_ratio(
        old_logps, output["sampling_per_token_logps"], mask, is_mode, clip_min, clip_max
    )
    torch.testing.assert_close(ratio, output["importance_sampling_ratio"], atol=ATOL, rtol=0)
    metrics = compute_sampling_metrics(old_logps, output["sampling_per_token_logps"], mask, ratio)
    for key, value in metrics.items():
        assert value == pytest.approx(trl_metrics[key], abs=ATOL), key


# ---------------------------------------------------------------------------------------------------------------------
# Loss side


def _trl_compute_loss(trl_grpo, config, logprobs, entropy, batch, normalizer, last_world_entropy=math.inf):
    """TRL's `_compute_loss` on our tensors; returns (loss, the bare trainer) for its metrics and entropy state."""
    t = _bare_trainer(trl_grpo)
    t._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logprobs, entropy, None)
    t.aux_loss_enabled, t.loss_type, t.beta = False, config.loss_type, config.beta
    t.top_entropy_quantile, t.off_policy_mask_threshold = config.top_entropy_quantile, config.off_policy_mask_threshold
    t.importance_sampling_level = config.importance_sampling_level
    t.epsilon_low, t.epsilon_high = config.epsilon_low, config.resolved_epsilon_high
    t.args = SimpleNamespace(
        use_bias_correction_kl=config.use_bias_correction_kl, delta=config.delta,
        sapo_temperature_pos=config.sapo_temperature_pos, sapo_temperature_neg=config.sapo_temperature_neg,
        vespo_k_pos=config.vespo_k_pos, vespo_lambda_pos=config.vespo_lambda_pos, vespo_k_neg=config.vespo_k_neg,
        vespo_lambda_neg=config.vespo_lambda_neg, steps_per_generation=normalizer.steps_per_generation,
        entropy_target=0.9, entropy_coef_delta=0.01, entropy_coef_min=0.0, entropy_coef_max=0.05,
    )
    t.use_vllm, t.vllm_importance_sampling_correction = batch.importance_sampling_ratio is not None, True
    t.current_gradient_accumulation_steps = normalizer.gradient_accumulation_steps
    t.max_completion_length, t.accelerator = config.max_completion_length, _OneProcess(normalizer.num_processes)
    t.entropy_coef, t.use_adaptive_entropy = config.entropy_coef, config.use_adaptive_entropy
    t._entropy_bonus_enabled = config.is_entropy_bonus_enabled
    t._last_world_entropy, t._entropy_window_stats = last_world_entropy, None
    num_rows, num_tokens = logprobs.shape
    inputs = {
        "prompt_ids": torch.zeros(num_rows, 1, dtype=torch.long),
        "prompt_mask": torch.ones(num_rows, 1, dtype=torch.long),
        "completion_ids": torch.zeros(num_rows, num_tokens, dtype=torch.long), "completion_mask": batch.mask.long(),
        "advantages": batch.advantages, "num_items_in_batch": torch.tensor(normalizer.num_items_in_batch),
    }
    optional = {"old_per_token_logps": batch.old_logprobs, "ref_per_token_logps": batch.ref_logprobs,
                "sampling_per_token_logps": batch.sampling_logprobs,
                "importance_sampling_ratio": batch.importance_sampling_ratio}
    inputs.update({key: value for key, value in optional.items() if value is not None})
    return t._compute_loss(None, inputs), t


def _random_loss_inputs(seed, num_rows=6, num_tokens=5, truncate=False, is_mode=None):
    """Float64 inputs; entropies are float32-representable (TRL takes the quantile in float32)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, num_tokens + 1, (num_rows,), generator=gen)
    mask = (torch.arange(num_tokens).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (B, T)
    if truncate:
        mask = mask_truncated_completions(mask, torch.rand(num_rows, generator=gen) < 0.3)
    logprobs = -torch.rand(num_rows, num_tokens, generator=gen, dtype=torch.float64) * 2 - 0.05  # (B, T)
    old = logprobs + 0.4 * torch.randn(num_rows, num_tokens, generator=gen, dtype=torch.float64)
    sampling = old + 0.3 * torch.randn(num_rows, num_tokens, generator=gen, dtype=torch.float64)
    ratio = None if is_mode is None else compute_vllm_importance_sampling_ratio(old, sampling, mask, is_mode, 0.6, 1.8)
    advantages = torch.randn(num_rows, generator=gen, dtype=torch.float64)  # (B,)
    advantages[1] = 0.0  # the A >= 0 / A > 0 boundaries of the masks and clip metrics
    batch = PolicyLossBatch(
        mask=mask, advantages=advantages, old_logprobs=old,
        ref_logprobs=logprobs + 0.3 * torch.randn(num_rows, num_tokens, generator=gen, dtype=torch.float64),
        sampling_logprobs=sampling, importance_sampling_ratio=ratio,
    )
    entropy = (torch.rand(num_rows, num_tokens, generator=gen) * 3).double()  # (B, T)
    return logprobs, entropy, batch


def _compare(trl_grpo, config, logprobs, entropy, batch, normalizer, *, our_normalizer=None, label=""):
    """Assert loss, gradients and loss metrics equal TRL's for one configuration."""
    leaves = [x.clone().requires_grad_(True) for x in (logprobs, entropy, logprobs, entropy)]
    coef = entropy_coef_to_apply(config.entropy_coef, math.inf, 0.9) if config.use_adaptive_entropy else None
    ours = compute_policy_loss(leaves[0], batch, config, our_normalizer or normalizer, entropy=leaves[1],
                               entropy_coef=coef, terms_implementation="torch")
    trl_loss, trainer = _trl_compute_loss(trl_grpo, config, leaves[2], leaves[3], batch, normalizer)
    torch.testing.assert_close(ours.loss, trl_loss, atol=ATOL, rtol=0, msg=lambda m: f"{label} loss: {m}")
    ours.loss.backward()
    trl_loss.backward()
    grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
    torch.testing.assert_close(grads[0], grads[2], atol=ATOL, rtol=0, msg=lambda m: f"{label} d/dlogprobs: {m}")
    torch.testing.assert_close(grads[1], grads[3], atol=ATOL, rtol=0, msg=lambda m: f"{label} d/dentropy: {m}")
    trl_metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    for key, value in compute_loss_metrics(ours, include_policy_loss=config.is_entropy_bonus_enabled).items():
        assert value == pytest.approx(trl_metrics[key], abs=ATOL, nan_ok=True), f"{label} metric {key}"
    return ours, trainer


@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_match_trl_for_every_option(trl_grpo, loss_type, importance_sampling_level):
    options = itertools.product([0.0, 0.04], [None, *IS_MODES], [1.0, 0.4], [False, True], [None, 0.05])
    for seed, (beta, is_mode, quantile, truncate, off_policy) in enumerate(options):
        logprobs, entropy, batch = _random_loss_inputs(seed, truncate=truncate, is_mode=is_mode)
        config = build_loss_config(
            loss_type=loss_type, importance_sampling_level=importance_sampling_level, beta=beta,
            epsilon_high=5.0 if loss_type == "cispo" else 0.28, top_entropy_quantile=quantile,
            off_policy_mask_threshold=off_policy, max_completion_length=5, use_bias_correction_kl=False,
        )
        normalizer = TRLNormalizer(num_items_in_batch=float(batch.mask.sum() * 3), gradient_accumulation_steps=2,
                                   steps_per_generation=4)
        label = f"beta={beta} is_mode={is_mode} quantile={quantile} truncate={truncate} off_policy={off_policy}"
        _compare(trl_grpo, config, logprobs, entropy, batch, normalizer, label=label)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_matches_trl_with_delta_bias_corrected_kl_on_policy_and_several_processes(trl_grpo, loss_type):
    for seed, level in enumerate(["token", "sequence"]):
        logprobs, entropy, batch = _random_loss_inputs(100 + seed, is_mode="token_truncate")
        config = build_loss_config(loss_type=loss_type, importance_sampling_level=level, beta=0.1, delta=1.5,
                                  use_bias_correction_kl=True, epsilon=0.1, epsilon_high=0.2)
        normalizer = TRLNormalizer(num_items_in_batch=40.0, num_processes=2, gradient_accumulation_steps=3,
                                   steps_per_generation=6)
        _compare(trl_grpo, config, logprobs, entropy, batch, normalizer, label=f"{level} off-policy")
        on_policy = PolicyLossBatch(mask=batch.mask, advantages=batch.advantages, ref_logprobs=batch.ref_logprobs)
        _compare(trl_grpo, config, logprobs, entropy, on_policy, normalizer, label=f"{level} on-policy")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("use_adaptive_entropy", [False, True])
def test_entropy_bonus_and_adaptive_coefficient_match_trl(trl_grpo, loss_type, use_adaptive_entropy):
    for seed, quantile in enumerate([1.0, 0.5]):
        logprobs, entropy, batch = _random_loss_inputs(200 + seed)
        config = build_loss_config(loss_type=loss_type, entropy_coef=0.03, use_adaptive_entropy=use_adaptive_entropy,
                                  top_entropy_quantile=quantile, beta=0.02,
                                   use_bias_correction_kl=False)
        normalizer = TRLNormalizer(num_items_in_batch=float(batch.mask.sum()), gradient_accumulation_steps=2,
                                   steps_per_generation=2)
        ours, trainer = _compare(trl_grpo, config, logprobs, entropy, batch, normalizer, label=f"quantile={quantile}")
        if use_adaptive_entropy:
            world_entropy = (ours.entropy_window[0] / ours.entropy_window[1].clamp(min=1.0)).item()
            new_coef = update_entropy_coef(config.entropy_coef, world_entropy, entropy_target=0.9,
                                           entropy_coef_delta=0.01, entropy_coef_min=0.0, entropy_coef_max=0.05)
            assert new_coef == pytest.approx(trainer.entropy_coef)
            assert trainer._last_world_entropy == pytest.approx(world_entropy)


@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_default_global_normalizer_equals_trl_on_one_micro_batch(trl_grpo, loss_type, importance_sampling_level):
    logprobs, entropy, batch = _random_loss_inputs(300, is_mode="sequence_mask")
    config = build_loss_config(loss_type=loss_type, importance_sampling_level=importance_sampling_level, beta=0.05,
                              entropy_coef=0.01, max_completion_length=5, use_bias_correction_kl=False)
    trl_normalizer = TRLNormalizer(num_items_in_batch=float(batch.mask.sum()))  # one rank, GA = 1, one micro-batch
    ours = build_loss_normalizer(batch.mask)
    _compare(trl_grpo, config, logprobs, entropy, batch, trl_normalizer, our_normalizer=ours)
