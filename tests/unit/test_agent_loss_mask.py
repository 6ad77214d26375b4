"""The tool mask reaches the loss (engine/train/loop.py `build_round`): a multi-turn rollout's tool tokens get no
gradient, the model's tokens do; the IS ratio and the length metric see only the model's tokens. Pure tensors: the
round is built from a `Rollout` with a stand-in run (tokenizer pad id and the config fields `build_round` reads)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.config import EngineConfig
from engine.grpo.policy_loss import (
    LossNormalizer,
    PolicyLossBatch,
    compute_policy_loss,
    compute_vllm_importance_sampling_ratio,
)
from engine.policy.microbatch import MicroBatch
from engine.rollout.rollouts import Rollout
from engine.train.loop import build_round
from tests.helpers.grpo_settings import build_loss_config

# row 0: model 3 tokens, tool 2 tokens, model 2 tokens; row 1: a single-turn row of 4 tokens
ROLLOUT = Rollout([[1, 2], [3]], [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]],
                  [[-0.5, -0.6, -0.7, 0.0, 0.0, -0.8, -0.9], [-0.1, -0.2, -0.3, -0.4]], [False, False],
                  tool_mask=[[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1]])


def _round(mask_truncated: bool = False) -> MicroBatch:
    cfg = EngineConfig()
    run = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0), cfg=SimpleNamespace(
        grpo=SimpleNamespace(mask_truncated_completions=mask_truncated), model=cfg.model, train=cfg.train))
    batch = build_round(run, ROLLOUT, torch.tensor([1.0, -1.0]), step=0)
    order = batch.prompt_lengths.argsort(descending=True)  # undo the round's shuffle: row 0 has the longer prompt
    return batch.take(order)


def test_tool_tokens_get_no_gradient_and_model_tokens_do():
    batch = _round()
    expected = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(batch.completion_mask, expected)
    assert batch.num_model_tokens.tolist() == [5.0, 4.0]  # the length metrics: tool tokens are not the model's
    logprobs = batch.sampling_logprobs.clone().double() - 0.1  # a policy a little off the sampler
    leaf = logprobs.clone().requires_grad_(True)
    mask = batch.completion_mask.double()
    ratio = compute_vllm_importance_sampling_ratio(logprobs, batch.sampling_logprobs.double(), mask, "token_truncate",
                                                   0.0, 2.0)
    inputs = PolicyLossBatch(mask=mask, advantages=batch.advantages.double(), old_logprobs=logprobs.detach() + 0.05,
                             sampling_logprobs=batch.sampling_logprobs.double(), importance_sampling_ratio=ratio)
    out = compute_policy_loss(leaf, inputs, build_loss_config(loss_type="dapo"),
                              LossNormalizer(num_tokens=float(mask.sum()), num_sequences=2.0), terms_implementation="torch")
    out.loss.backward()
    grad = leaf.grad
    assert torch.all(grad[0, 3:5] == 0) and torch.all(grad[1, 4:] == 0)  # tool tokens and padding
    assert torch.all(grad[0, [0, 1, 2, 5, 6]] != 0) and torch.all(grad[1, :4] != 0)


def test_rows_without_a_tool_mask_keep_their_completion_mask():
    plain = Rollout(ROLLOUT.prompt_ids, ROLLOUT.completion_ids, ROLLOUT.sampling_logprobs, ROLLOUT.is_truncated)
    cfg = EngineConfig()
    run = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0), cfg=SimpleNamespace(
        grpo=SimpleNamespace(mask_truncated_completions=False), model=cfg.model, train=cfg.train))
    batch = build_round(run, plain, torch.tensor([1.0, -1.0]), step=0)
    assert batch.num_model_tokens is None and float(batch.completion_mask.sum()) == 11.0
    both = Rollout.concat([plain, ROLLOUT])  # a part without a tool mask: all its tokens are the model's
    assert both.tool_mask[:2] == [[1] * 7, [1] * 4] and both.select([2]).tool_mask == [ROLLOUT.tool_mask[0]]
    assert Rollout.from_json(ROLLOUT.to_json()).tool_mask == ROLLOUT.tool_mask
