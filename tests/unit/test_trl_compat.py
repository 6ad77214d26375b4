"""TRL's behaviour where TRL defines it, without starting the engine: TRL's messages and
warnings word for word, TRL's GRPOTrainer helpers on its own expected values, vespo's IS mode as TRL resolves it, and
reward models by hub id from a temporary Hugging Face cache, offline."""

from __future__ import annotations

import logging

import datasets
import pytest
import torch

from engine import GRPOConfig, GRPOTrainer
from engine.config import ConfigError

TINY = "builtin:tiny-qwen2-arith"


def reward_len(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]


def _args(tmp_path, **kwargs) -> GRPOConfig:
    return GRPOConfig(**(dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4,
                              max_steps=2) | kwargs))


def _prompts(n: int = 8) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"prompt": [f"what is {i} + 1?" for i in range(n)]})


def test_trls_construction_messages(tmp_path):
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(model=TINY, args=_args(tmp_path), train_dataset=_prompts())
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(model=TINY, reward_funcs=[], args=_args(tmp_path), train_dataset=_prompts())
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_args(tmp_path))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "luspo"])
def test_sequence_level_is_with_a_token_summed_loss_logs_trls_warning(tmp_path, caplog, loss_type):
    with caplog.at_level(logging.WARNING):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, train_dataset=_prompts(),
                    args=_args(tmp_path, importance_sampling_level="sequence", loss_type=loss_type))
    assert ("weights each sequence by its completion length" in caplog.text) == (loss_type not in ("grpo", "luspo"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, train_dataset=_prompts(), args=_args(tmp_path, loss_type=loss_type))
    assert ("`importance_sampling_level` should be set to `'sequence'`" in caplog.text) == (loss_type == "luspo")


def test_vespo_gets_the_token_is_mode_trl_requires_unless_one_is_named(tmp_path):
    assert GRPOConfig(output_dir=str(tmp_path), loss_type="vespo").vllm_importance_sampling_mode == "token_truncate"
    assert GRPOConfig(output_dir=str(tmp_path), loss_type="dapo").vllm_importance_sampling_mode == "sequence_mask"
    named = GRPOConfig(output_dir=str(tmp_path), loss_type="vespo", vllm_importance_sampling_mode="token_mask")
    assert named.vllm_importance_sampling_mode == "token_mask"
    GRPOTrainer(model=TINY, reward_funcs=reward_len, train_dataset=_prompts(), args=_args(tmp_path, loss_type="vespo"))
    with pytest.raises(ConfigError, match="VESPO loss requires `vllm_importance_sampling_mode` to be either "
                                          "'token_truncate' or 'token_mask'. Got: sequence_mask"):  # as TRL with vLLM
        GRPOTrainer(model=TINY, reward_funcs=reward_len, train_dataset=_prompts(),
                    args=_args(tmp_path, loss_type="vespo", use_vllm=True))


def test_get_off_policy_mask_keeps_and_drops_as_trl():
    advantages = torch.tensor([[1.0], [-1.0], [-1.0], [-1.0]])
    per_token = torch.tensor([[-2.0] * 4, [-0.5] * 4, [-2.0] * 4, [-2.0, -2.0, -1e4, 1e4]])
    mask = torch.tensor([[1.0] * 4, [1.0] * 4, [1.0] * 4, [1.0, 1.0, 0.0, 0.0]])
    kept = GRPOTrainer.get_off_policy_mask(advantages, per_token, torch.zeros(4, 4), mask, 1.0)
    torch.testing.assert_close(kept, torch.tensor([[1.0], [1.0], [0.0], [0.0]]))  # padding ignored in the mean KL


def test_get_high_entropy_mask_selects_the_top_quantile_of_unmasked_tokens():
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    top = GRPOTrainer.get_high_entropy_mask(None, entropies, mask, 0.8)  # TRL's signature: (self, ...)
    assert top.tolist() == [[False] * 6, [False, False, True, True, False, False]]
    assert GRPOTrainer.get_high_entropy_mask(None, entropies, mask, 0.0).tolist() == mask.bool().tolist()
    assert not GRPOTrainer.get_high_entropy_mask(None, entropies, torch.zeros_like(mask), 0.5).any()


@pytest.mark.parametrize("model_name", [TINY, "builtin:tiny-gemma2"])
def test_per_token_logps_and_entropies_are_the_models_and_carry_grad_only_with_the_entropy_bonus(tmp_path, model_name):
    """TRL's private `_get_per_token_logps_and_entropies` on `trainer.model`: the log-probs and entropies of the
    last `logits_to_keep` tokens under softmax(logits / temperature), as the model's own logits give them (the tiny
    Gemma 2's soft-capped by its `final_logit_softcapping`, which the engine's kernel must apply too); the
    entropies differentiable only while the entropy bonus is on (TRL's test_entropy_bonus_flows_gradients), whose
    switches are the run's settings."""
    trainer = GRPOTrainer(model=model_name, reward_funcs=reward_len, train_dataset=_prompts(),
                          args=_args(tmp_path, entropy_coef=0.1, temperature=0.7))
    model = trainer.model
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0]])
    mask = torch.ones_like(ids)
    logps, entropies, aux = trainer._get_per_token_logps_and_entropies(model, ids, mask, logits_to_keep=4,
                                                                        batch_size=1, compute_entropy=True)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -5:-1].float() / 0.7  # (2, 4, V)
    expected = torch.log_softmax(logits, -1)
    torch.testing.assert_close(logps, expected.gather(-1, ids[:, -4:, None]).squeeze(-1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropies, -(expected.exp() * expected).sum(-1), rtol=1e-4, atol=1e-4)
    assert aux is None and entropies.requires_grad and logps.requires_grad
    trainer.entropy_coef = 0.0
    trainer.use_adaptive_entropy = False
    trainer._entropy_bonus_enabled = False  # agrees with the two settings above
    assert trainer.engine_config.grpo.entropy_coef == 0.0 and not trainer._entropy_bonus_enabled
    _, entropies, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, 4, compute_entropy=True)
    assert not entropies.requires_grad
    with pytest.raises(ValueError, match="_entropy_bonus_enabled=True contradicts entropy_coef=0.0"):
        trainer._entropy_bonus_enabled = True
    with pytest.raises(NotImplementedError, match="compute_aux_loss"):
        trainer._get_per_token_logps_and_entropies(model, ids, mask, 4, compute_aux_loss=True)


def _cache_reward_model(cache, repo_id: str) -> None:
    """A random sequence-classification model in a Hugging Face cache layout (refs/main -> snapshots/<sha>)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from engine.models.tiny_model import resolve_builtin_model

    source = resolve_builtin_model(TINY, cache)
    sha = "1" * 40
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    config = AutoConfig.from_pretrained(source, num_labels=1, architectures=["Qwen2ForSequenceClassification"])
    tokenizer = AutoTokenizer.from_pretrained(source)
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(repo / "snapshots" / sha)
    tokenizer.save_pretrained(repo / "snapshots" / sha)


def test_reward_model_by_hub_id_loads_offline_from_the_hf_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from engine.train.rewards import RewardFunctionError, RewardModelReward

    _cache_reward_model(tmp_path / "hub", "tiny-org/tiny-rm")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer = GRPOTrainer(model=TINY, reward_funcs=["tiny-org/tiny-rm", reward_len], args=_args(tmp_path),
                          train_dataset=_prompts())
    reward = trainer.reward_funcs[0]
    assert isinstance(reward, RewardModelReward) and trainer.reward_func_names == ["tiny-rm", "reward_len"]
    scores = reward(prompts=["a", "b"], completions=["x", "yy"])
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)
    with pytest.raises(RewardFunctionError, match=r"'tiny-org/missing' \(a reward model's hub id\): .*not in the local "
                                                  r"Hugging Face cache and HF_HUB_OFFLINE is set"):
        GRPOTrainer(model=TINY, reward_funcs="tiny-org/missing", args=_args(tmp_path), train_dataset=_prompts())


@pytest.mark.parametrize("method", ["training_step", "_prepare_inputs", "compute_loss"])
def test_overriding_hf_trainers_step_methods_is_refused_with_why(tmp_path, method):
    """HF Trainer's step methods cannot act (the step is Megatron's, in the ranks' processes): a subclass overriding
    one is refused at construction, naming it; `trainer.training_step` exists (as TRL's) and says why if called."""
    subclass = type("MyTrainer", (GRPOTrainer,), {method: lambda self, *args, **kwargs: None})
    with pytest.raises(NotImplementedError, match=f"MyTrainer overrides {method}: not supported.*Megatron"):
        subclass(model=TINY, reward_funcs=reward_len, args=_args(tmp_path), train_dataset=_prompts())
    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_args(tmp_path), train_dataset=_prompts())
    with pytest.raises(NotImplementedError, match="training_step: the engine's training step is Megatron's"):
        trainer.training_step(None, [{"prompt": "p"}], None)
    from unittest.mock import patch

    with patch.object(GRPOTrainer, "training_step", wraps=trainer.training_step), \
            pytest.raises(NotImplementedError, match="GRPOTrainer overrides training_step"):
        trainer.train()  # patched after construction: refused before anything starts


def test_use_liger_kernel_without_liger_installed_raises_trls_import_error(tmp_path):
    """As TRL: `use_liger_kernel=True` without liger-kernel is an ImportError naming the package, at construction."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed here")
    with pytest.warns(UserWarning, match="use_liger_kernel"):
        args = _args(tmp_path, use_liger_kernel=True)
    with pytest.raises(ImportError, match="liger-kernel package is not installed"):
        GRPOTrainer(model=TINY, reward_funcs=reward_len, args=args, train_dataset=_prompts())
    GRPOTrainer(model=TINY, reward_funcs=reward_len, args=_args(tmp_path, use_liger_kernel=False),
                train_dataset=_prompts())
