"""TRL's rollout-dispatch seam without an engine (engine/api/trl_generate.py): `_generate` with a `rollout_func`
(TRL's 8-tuple, `env_mask` as the tool mask, the key check, the weight-sync bookkeeping) on a trainer built by
`__init__` and on one built with `object.__new__` (TRL's unit-test pattern); a subclass overriding `_generate` /
`_generate_single_turn` becomes the rollout the loop calls, its rows checked as rollout_func's are; the refusals.
The real-engine half (`super()._generate_single_turn` inside a round of train()) is
tests/integration/test_agentic.py's rollout_func run."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import datasets
import pytest

from engine import GRPOConfig, GRPOTrainer
from engine.agent.rollout_func import call_rollout_func

TINY = "builtin:tiny-qwen2-arith"


class _Tokenizer:
    """Enough of a tokenizer for decoding and the EOS check: token t decodes to 't<t>'."""

    eos_token_id = 9

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(f"t{t}" for t in row) for row in ids]


def _rows(n: int, with_mask: bool = True) -> dict:
    out = {"prompt_ids": [[1, 2]] * n, "completion_ids": [[3, 9]] * n, "logprobs": [[-0.5, -0.25]] * n,
           "score_hint": list(range(n))}
    return out | ({"env_mask": [[1, 0]] * n} if with_mask else {})


def _trainer(tmp_path, cls=GRPOTrainer, **kwargs):
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=2,
                      max_steps=1, report_to="none")
    prompts = datasets.Dataset.from_dict({"prompt": [f"q{i}" for i in range(4)]})
    return cls(model=TINY, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
               train_dataset=prompts, **kwargs)


def test_generate_with_rollout_func_returns_trls_tuple_and_syncs_when_the_step_moved():
    calls, syncs = [], []
    trainer = object.__new__(GRPOTrainer)  # TRL's tests build the trainer this way to test _generate alone
    stand_in = SimpleNamespace(is_main_process=True, gather=lambda t: t)
    trainer.accelerator = stand_in  # HF Trainer's accelerator is a plain attribute: TRL's tests assign one
    assert trainer.accelerator is stand_in
    assert type(object.__new__(GRPOTrainer).accelerator).__name__ == "Accelerator"  # unassigned: the engine's
    trainer.state = SimpleNamespace(global_step=3)
    trainer.processing_class = _Tokenizer()
    trainer._last_loaded_step = 1
    trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: syncs.append(trainer.state.global_step))
    trainer.rollout_func = lambda prompts, t: calls.append((prompts, t)) or _rows(len(prompts))
    result = trainer._generate(["a", "b"])
    assert len(result) == 8
    prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = result
    assert (prompt_ids, completion_ids, logprobs) == ([[1, 2]] * 2, [[3, 9]] * 2, [[-0.5, -0.25]] * 2)
    assert tool_mask == [[1, 0]] * 2 and extra == {"score_hint": [0, 1]}
    assert completions == ["t3 t9"] * 2 and images is None and tool_images == []
    assert calls == [(["a", "b"], trainer)] and syncs == [3] and trainer._last_loaded_step == 3
    trainer._generate(["c"])
    assert syncs == [3]  # the step did not move: no second sync
    trainer.rollout_func = lambda prompts, t: {"prompt_ids": [[1]], "completion_ids": [[2]]}
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        trainer._generate(["d"])
    with pytest.raises(AttributeError, match="model was never assigned"):
        trainer.model  # noqa: B018


def test_built_trainer_generate_uses_rollout_func_and_refuses_engine_generation_outside_a_round(tmp_path):
    trainer = _trainer(tmp_path, rollout_func=lambda prompts, t: _rows(len(prompts), with_mask=False))
    assert trainer.use_vllm and trainer.rollout_func is not None
    prompt_ids, completion_ids, tool_mask, completions, *_ = trainer._generate([[{"role": "user", "content": "q"}]])
    assert tool_mask is None and completions[0][0]["role"] == "assistant"
    with pytest.raises(AttributeError, match="TrainerState"):
        trainer.state = SimpleNamespace()
    trainer.rollout_func = None  # then TRL's _generate generates with the engine, which runs only in train()
    with pytest.raises(RuntimeError, match="only inside a round of train"):
        trainer._generate(["q0", "q0"])


class _Override(GRPOTrainer):
    """A user's trainer: its `_generate` reverses the rows' extra column and records its calls."""

    def _generate(self, prompts):
        self.seen = getattr(self, "seen", []) + [list(prompts)]
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = \
            super()._generate(prompts)
        extra = {"score_hint": extra["score_hint"][::-1]}
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images


def test_a_subclass_override_of_generate_is_the_rollout_the_loop_calls(tmp_path):
    trainer = _trainer(tmp_path, _Override, rollout_func=lambda prompts, t: _rows(len(prompts)))
    engine_func = trainer._agentic.loop_inputs["rollout_func"]  # what engine/train/run.py's AgenticRollout calls
    rollout, extra = call_rollout_func(engine_func, ["x", "x", "y", "y"], _Tokenizer())
    assert trainer.seen == [["x", "x", "y", "y"]]
    assert extra == {"score_hint": [3, 2, 1, 0]}  # the override's rows, not rollout_func's
    assert rollout.tool_mask == [[1, 0]] * 4 and rollout.is_truncated == [False] * 4

    class Broken(GRPOTrainer):
        def _generate(self, prompts):
            return [[1]], [[2]]

    from unittest.mock import patch

    plain = _trainer(tmp_path)  # built without an override: its rollout is the engine's own
    with patch.object(plain, "_generate_single_turn", lambda *args: None), \
            pytest.raises(RuntimeError, match="_generate_single_turn changed on the trainer after"):
        plain.train()  # refused before anything starts
    with patch.object(GRPOTrainer, "_generate", lambda self, prompts: None), \
            pytest.raises(RuntimeError, match="_generate changed on the trainer after"):
        plain.evaluate(eval_dataset=datasets.Dataset.from_dict({"prompt": ["q"] * 4}))
    broken = _trainer(tmp_path, Broken)
    with pytest.raises(ValueError, match="Broken._generate must return TRL's 8-tuple"):
        call_rollout_func(broken._agentic.loop_inputs["rollout_func"], ["x"], _Tokenizer())


def test_an_override_with_tools_is_refused_and_with_rounds_ahead_runs_on_a_view_of_the_trainer(tmp_path):
    class SingleTurn(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kw):
            return [[9]] * len(prompt_ids), [[-1.0]] * len(prompt_ids)

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first.
            b: the second.
        """
        return a + b

    with pytest.raises(ValueError, match="SingleTurn._generate_single_turn overrides TRL's rollout dispatch"):
        _trainer(tmp_path, SingleTurn, tools=[add])
    # rounds generated ahead (server mode, max_staleness=1): accepted; the override runs in rank 0's background
    # thread on a view of the trainer as it was when the round was issued, with a tokenizer of its own
    args = GRPOConfig(output_dir=str(tmp_path / "async"), per_device_train_batch_size=4, num_generations=2,
                      max_steps=1, report_to="none", max_staleness=1, vllm_mode="server")
    trainer = SingleTurn(model=TINY, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                         train_dataset=datasets.Dataset.from_dict({"prompt": ["q"] * 4}))
    bound = trainer._agentic.loop_inputs["rollout_func"]
    own_tokenizer = copy.deepcopy(trainer.processing_class)
    view = bound.for_round_ahead(own_tokenizer).trainer
    trainer.state.global_step = 3  # the trainer trains on: the view keeps the step the round was issued at
    assert isinstance(view, SingleTurn) and view.state.global_step == 0 and view.processing_class is own_tokenizer
    assert trainer.processing_class is not own_tokenizer and view.args is trainer.args
    # any engine layout: colocated at vLLM TP > 1 the override drives rank 0's engine, its TP group mirroring the
    # steps (engine/rollout/colocated_turns.py; the run: tests/integration/test_agentic.py)
    from engine.api import trl_generate

    assert trl_generate.dispatch_override(trainer, None, None, None) is trl_generate._as_rollout_func
