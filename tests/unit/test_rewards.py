"""engine/train/rewards.py and engine/train/builtin_rewards.py: built-in rewards, name resolution, and TRL's calling
contract (sync, async, None, errors)."""

from __future__ import annotations

import asyncio
import functools
import math
import threading

import pytest
import torch

from engine.config import GenerationConfig, RewardConfig
from engine.train.builtin_rewards import (
    SoftOverlongPunishment,
    accuracy_reward,
    exact_match_reward,
    think_answer_format_reward,
    think_format_reward,
)
from engine.train.rewards import (
    RewardFunctionError,
    RewardFunctions,
    build_reward_funcs,
    get_callable_name,
    resolve_reward_func,
)
from tests.helpers.grpo_settings import compute_default_advantages

GOOD = " <think> 12 + 7 = 19 </think> <answer>19</answer>"


def _call(funcs, completions, columns=None, **kwargs):
    """Score completions of the prompt 'Q' (B = len(completions))."""
    num_rows = len(completions)
    return funcs(["Q"] * num_rows, completions, [[1, 2]] * num_rows, columns or {}, **kwargs)


def test_builtin_names_resolve_to_functions_with_trls_metric_names():
    funcs = build_reward_funcs(RewardConfig(reward_funcs=["accuracy", "think_format", "length", "exact_match",
                                                          "think_answer_format"]),
                               GenerationConfig(max_completion_length=10))
    assert funcs.names == ["accuracy_reward", "think_format_reward", "soft_overlong_punishment_reward",
                           "exact_match_reward", "think_answer_format_reward"]


def test_accuracy_reward_verifies_the_answer_tag_or_a_boxed_answer_and_skips_unparseable_references():
    completions = [GOOD, " <think> 12 + 7 = 20 </think> <answer>20</answer>", "<answer>19.0</answer>",
                   r"so the result is $\boxed{19}$", "19 is my guess", GOOD,
                   [{"role": "assistant", "content": GOOD}]]
    answers = ["19"] * 5 + ["not a number"] + ["19"]
    assert accuracy_reward(completions, answer=answers) == [1.0, 0.0, 1.0, 1.0, 0.0, None, 1.0]
    with pytest.raises(KeyError, match="'answer' \\(or 'solution'\\) column; columns: \\['level'\\]"):
        accuracy_reward([GOOD], level=[1])


def test_accuracy_reward_matches_trls_on_completions_without_answer_tags():
    from trl.rewards import accuracy_reward as trl_accuracy_reward

    completions = [[{"role": "assistant", "content": text}] for text in
                   [r"The answer is $\boxed{\frac{1}{3}}$", r"$\boxed{0.5}$", r"$\boxed{2}$", "no latex here 3"]]
    solutions = [r"\frac{1}{3}", r"\frac{1}{2}", "3", "3"]
    assert accuracy_reward(completions, solution=solutions) == trl_accuracy_reward(completions, solutions)


def test_exact_match_reward_compares_the_last_answer_tag_as_text_or_number():
    completions = [GOOD, "<answer>19.0</answer>", "<answer>18</answer> <answer>19</answer>", "19", "<answer>x</answer>"]
    assert exact_match_reward(completions, answer=["19", "19", "19", "19", "x"]) == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert exact_match_reward([GOOD], answer=[None]) == [None]


def test_format_rewards_follow_trls_think_pattern_after_leading_whitespace():
    from trl.rewards import think_format_reward as trl_think_format_reward

    trl_cases = [[{"content": "<think>\nThis is my reasoning.\n</think>\nThis is my answer."}],
                 [{"content": "<think>\nThis is my reasoning.\nThis is my answer."}],
                 [{"content": "<think>a</think><think>b</think>"}]]
    assert think_format_reward(trl_cases) == trl_think_format_reward(trl_cases) == [1.0, 0.0, 0.0]
    assert think_format_reward([GOOD, "19 <think> x </think>"]) == [1.0, 0.0]
    assert think_answer_format_reward([GOOD, "<think> x </think>", GOOD + " more", "<answer>19</answer>"]) == [
        1.0, 0.0, 0.0, 0.0]


def test_length_reward_is_dapos_soft_overlong_punishment():
    punish = SoftOverlongPunishment(max_completion_len=100, soft_punish_cache=20)
    assert punish([[1] * 80, [1] * 90, [1] * 100, [1] * 101]) == [0.0, -0.5, -1.0, -1.0]
    length = resolve_reward_func("length", GenerationConfig(max_completion_length=10))  # cache = 2 tokens
    assert length([[1] * 8, [1] * 9, [1] * 11]) == [0.0, -0.5, -1.0]
    with pytest.raises(RewardFunctionError, match="max_completion_length"):
        resolve_reward_func("length")


def test_every_function_gets_trls_keyword_arguments_with_columns_aligned_to_rows():
    seen = {}

    def record(prompts, completions, completion_ids, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        return [0.0] * len(prompts)

    state = object()
    funcs = RewardFunctions([record])
    funcs(["p0", "p0", "p1", "p1"], ["c0", "c1", "c2", "c3"], [[1], [2], [3], [4]],
          {"answer": ["3", "3", "8", "8"], "completion": ["dropped"] * 4, "prompt": ["dropped"] * 4},
          trainer_state=state)
    assert seen["prompts"] == ["p0", "p0", "p1", "p1"] and seen["completions"] == ["c0", "c1", "c2", "c3"]
    assert seen["completion_ids"] == [[1], [2], [3], [4]] and seen["answer"] == ["3", "3", "8", "8"]
    assert seen["trainer_state"] is state and callable(seen["log_extra"]) and callable(seen["log_metric"])
    assert set(seen) == {"prompts", "completions", "completion_ids", "answer", "trainer_state", "log_extra",
                         "log_metric"}


def test_none_becomes_nan_in_a_b_by_k_float32_tensor_that_compute_advantages_accepts():
    funcs = RewardFunctions([lambda completions, **kw: [1.0, None, 0.0, 1.0],
                             lambda completions, **kw: [None, None, 2, True]], reward_weights=[1.0, 0.5])
    rewards = _call(funcs, ["a", "b", "c", "d"])
    assert rewards.dtype == torch.float32 and rewards.shape == (4, 2)
    assert torch.equal(torch.isnan(rewards), torch.tensor([[False, True], [True, True], [False, False],
                                                           [False, False]]))
    assert rewards[2:].tolist() == [[0.0, 2.0], [1.0, 1.0]]
    with pytest.warns(UserWarning, match="All reward functions returned None"):
        result = compute_default_advantages(rewards, num_generations=4, reward_weights=funcs.weights)
    assert result.advantages[1] == 0.0


def test_sync_functions_run_one_after_the_other_in_the_callers_thread():
    events = []

    def first(completions, **kwargs):
        events.append(("first", threading.current_thread()))
        return [1.0] * len(completions)

    def second(completions, **kwargs):
        events.append(("second", threading.current_thread()))
        return [2.0] * len(completions)

    assert _call(RewardFunctions([first, second]), ["a"]).tolist() == [[1.0, 2.0]]
    assert events == [("first", threading.current_thread()), ("second", threading.current_thread())]


def test_async_functions_partials_and_async_instances_run_concurrently_on_one_event_loop():
    # each waits for the other to have started: a sequential runner would time out instead of passing
    started = {name: asyncio.Event() for name in ("a", "b", "c")}

    async def rendezvous(name, completions, **kwargs):
        started[name].set()
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), timeout=5)
        return [float(ord(name))] * len(completions)

    class Judge:
        async def __call__(self, completions, **kwargs):
            return await rendezvous("c", completions)

    async def a(completions, **kwargs):
        return await rendezvous("a", completions)

    with RewardFunctions([a, functools.partial(rendezvous, "b"), lambda completions, **kw: [0.5], Judge()]) as funcs:
        assert funcs._thread is not None
        assert _call(funcs, ["x"]).tolist() == [[97.0, 98.0, 0.5, 99.0]]
        assert funcs.names == ["a", "rendezvous", "<lambda>", "Judge"]
    assert funcs._thread is None
    assert RewardFunctions([lambda completions, **kw: [0.0]])._thread is None  # no loop without async functions


def test_names_follow_trls_get_callable_name_and_repeats_get_a_suffix():
    # TRL 1.16 trl.trainer.utils.get_callable_name: unwrap partials, then __name__, else the class name (importing
    # trl.trainer takes ~10 s on 2 cores, so the expected names are written out)
    class Scorer:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    candidates = [think_format_reward, functools.partial(functools.partial(accuracy_reward)), Scorer(),
                  SoftOverlongPunishment(4, 1)]
    assert [get_callable_name(f) for f in candidates] == ["think_format_reward", "accuracy_reward", "Scorer",
                                                          "soft_overlong_punishment_reward"]
    assert RewardFunctions([think_format_reward, "think_format"]).names == ["think_format_reward",
                                                                            "think_format_reward_2"]


def test_a_raising_function_is_reported_with_its_name_and_the_failing_row():
    def picky(completions, answer, **kwargs):
        return [float(int(a)) for a in answer]

    funcs = RewardFunctions([think_format_reward, picky])
    with pytest.raises(RewardFunctionError, match=r"'picky' \(reward_funcs\[1\]\) raised ValueError: .* on row 2 "
                                                  r"of 3 \(prompt 'Q', completion 'c'\); dataset columns it "
                                                  r"received: \['answer'\]") as info:
        _call(funcs, ["a", "b", "c"], {"answer": ["1", "2", "x"]})
    assert isinstance(info.value.__cause__, ValueError)


def test_an_async_function_that_raises_is_reported_with_its_row():
    async def judge(completions, **kwargs):
        if "boom" in completions:
            raise RuntimeError("judge down")
        return [1.0] * len(completions)

    with RewardFunctions([judge]) as funcs:
        with pytest.raises(RewardFunctionError, match=r"'judge' .* raised RuntimeError: judge down on row 1 of 2"):
            _call(funcs, ["fine", "boom"])


@pytest.mark.parametrize("output, message", [
    ([1.0, 2.0], r"'bad' \(reward_funcs\[0\]\) returned 2 rewards for 3 completions"),
    ([1.0, "high", 0.0], r"'bad' \(reward_funcs\[0\]\) returned 'high' for row 1"),
    ([1.0, 0.0, math.inf], r"returned inf for row 2; a reward must be a finite number"),
    (1.0, r"'bad' \(reward_funcs\[0\]\) returned a float; it must return a list of 3 floats"),
])
def test_a_wrong_return_value_names_the_function_and_the_row(output, message):
    def bad(completions, **kwargs):
        return output

    with pytest.raises(RewardFunctionError, match=message):
        _call(RewardFunctions([bad]), ["a", "b", "c"])


def test_log_extra_and_log_metric_reach_the_callers_hooks():
    extra, metrics = {}, {}

    def chatty(completions, log_extra, log_metric, **kwargs):
        log_extra("length", [len(c) for c in completions])
        log_metric("chatty/calls", 1.0)
        return [0.0] * len(completions)

    _call(RewardFunctions([chatty]), ["ab", "abc"], log_extra=extra.__setitem__, log_metric=metrics.__setitem__)
    assert extra == {"length": [2, 3]} and metrics == {"chatty/calls": 1.0}
    _call(RewardFunctions([chatty]), ["ab"])  # without hooks the values are dropped, not an error


def test_a_dataset_column_named_like_a_reward_keyword_is_refused():
    with pytest.raises(RewardFunctionError, match="column 'trainer_state' collides"):
        _call(RewardFunctions([think_format_reward]), ["a"], {"trainer_state": [1]})


def test_import_paths_resolve_and_unknown_names_fail_with_a_suggestion():
    assert resolve_reward_func("engine.train.builtin_rewards:think_format_reward") is think_format_reward
    assert (resolve_reward_func("engine.train.builtin_rewards:SoftOverlongPunishment.__call__")
            is SoftOverlongPunishment.__call__)
    with pytest.raises(RewardFunctionError, match=r"unknown reward function 'acuracy'\. Did you mean 'accuracy'\?"):
        RewardFunctions(["acuracy"])
    with pytest.raises(RewardFunctionError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward_func("no_such_module_xyz:f")
    with pytest.raises(RewardFunctionError, match="'engine.train.rewards' has no attribute 'nope'"):
        resolve_reward_func("engine.train.rewards:nope")
    with pytest.raises(RewardFunctionError, match="2 reward_weights for 1 reward functions"):
        RewardFunctions(["accuracy"], reward_weights=[1.0, 2.0])


def test_a_local_reward_model_directory_scores_prompt_plus_completion_with_logit_zero(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from engine.models.tiny_model import build_tiny_tokenizer, tiny_model_config

    tokenizer = build_tiny_tokenizer()
    config = tiny_model_config("qwen2")
    config.num_labels = 1
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    model_dir = tmp_path / "tiny-rm"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    funcs = RewardFunctions([str(model_dir)])
    assert funcs.names == ["tiny-rm"]
    prompts, completions = ["Question: what is 1 + 2? Answer:", "Q:"], [" <answer>3</answer>", " no"]
    rewards = funcs(prompts, completions, [[1], [1]])
    with torch.inference_mode():
        expected = [model(**tokenizer(text=p + c, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                    for p, c in zip(prompts, completions)]  # one at a time: no padding involved
    torch.testing.assert_close(rewards[:, 0], torch.tensor(expected), rtol=1e-4, atol=1e-4)
    chat = funcs([[{"role": "user", "content": "1 + 2?"}]], [[{"role": "assistant", "content": "3"}]], [[1]])
    assert torch.isfinite(chat).all()
