"""engine/grpo/dynamic_prompts.py: the dynamic_prompts_fn call contract (one element per sample, as a TRL fork documents
it) and the validation of what it returns (P or B prompts, columns carried over)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.grpo.dynamic_prompts import DynamicPromptsError, call_dynamic_prompts_fn, rows_for_next_generation
from tests.helpers.curriculum import curriculum_fn  # the seed's documented example, verbatim

PROMPTS = ["2+2?", "3*3?"]  # P = 2 groups
COMPLETIONS = ["4", "5", "9", "6"]  # G = 2 per group, group by group
REWARDS = torch.tensor([1.0, 0.0, 1.0, float("nan")])  # (B,)
METAS = [{"answer": "4"}, {"answer": "9"}]


def _call(hook, prompts=PROMPTS, completions=COMPLETIONS, rewards=REWARDS, metas=METAS):
    return call_dynamic_prompts_fn(hook, prompts, completions, rewards, metas)


def test_hook_gets_one_element_per_sample_as_python_values():
    calls = []

    def record(prompts, completions, rewards, metas):
        calls.append((prompts, completions, rewards, metas))
        return list(prompts)

    _call(record)
    prompts, completions, rewards, metas = calls[0]
    assert prompts == ["2+2?", "2+2?", "3*3?", "3*3?"]  # each group's prompt repeated G times
    assert completions == COMPLETIONS
    assert rewards[:3] == [1.0, 0.0, 1.0] and math.isnan(rewards[3])
    assert all(type(r) is float for r in rewards)  # python floats, not tensors
    assert metas == [{"answer": "4"}, {"answer": "4"}, {"answer": "9"}, {"answer": "9"}]
    metas[0]["answer"] = "changed"  # each sample's dict is its own copy
    assert metas[1] == {"answer": "4"} and METAS[0] == {"answer": "4"}


def test_the_documented_per_sample_curriculum_runs_and_its_answer_gives_each_groups_prompt_once():
    # the docs' shape: a python `if` on each sample's reward (a tensor row here was "ambiguous" before)
    def curriculum_fn(prompts, completions, rewards, metas):
        return [p if r == r and r > 0.5 else p + " Think step by step." for p, r in zip(prompts, rewards, strict=True)]

    rewards = torch.tensor([1.0, 1.0, float("nan"), float("nan")])
    rows = _call(curriculum_fn, rewards=rewards)
    assert rows == [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3*3? Think step by step."}]


def test_one_prompt_per_group_is_accepted_and_keeps_the_rows_columns():
    rows = _call(lambda prompts, completions, rewards, metas: ["3*3?", "2+2?"])
    assert rows == [{"prompt": "3*3?", "answer": "9"}, {"prompt": "2+2?", "answer": "4"}]


def test_columns_carried_over_brought_by_dict_rows_and_absent_for_new_prompts():
    chat = [{"role": "user", "content": "2+2?"}]
    rows = rows_for_next_generation(["a brand-new prompt", {"prompt": "2+2?", "answer": "four", "level": 2}],
                                    PROMPTS, METAS, num_generations=2)
    assert rows == [{"prompt": "a brand-new prompt"}, {"prompt": "2+2?", "answer": "four", "level": 2}]
    rows = rows_for_next_generation([chat, "x"], [chat, "y"], [{"answer": "4"}, {"answer": "?"}], num_generations=2)
    assert rows == [{"prompt": chat, "answer": "4"}, {"prompt": "x"}]


def test_a_repeated_prompt_keeps_the_columns_of_the_row_at_its_own_position():
    prompts, metas = ["same", "same"], [{"answer": "first"}, {"answer": "second"}]
    assert rows_for_next_generation(["same", "same"], prompts, metas, 2) == [
        {"prompt": "same", "answer": "first"}, {"prompt": "same", "answer": "second"}]
    assert rows_for_next_generation(["new", "same"], ["other", "same"], metas, 2)[1]["answer"] == "second"
    assert rows_for_next_generation(["same", "new"], ["other", "same"], metas, 2)[0]["answer"] == "second"


def test_plain_and_conversational_prompts_are_accepted():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rows = rows_for_next_generation(("plain", chat), PROMPTS, METAS, num_generations=2)
    assert rows == [{"prompt": "plain"}, {"prompt": chat}]


def test_the_seeds_example_gives_each_distinct_prompt_once_in_order_when_a_groups_rewards_differ_in_sign():
    hint, nxt = " // Hint: check your color setup in GLSL", " // Next: add moving gradient effect"
    rows = _call(curriculum_fn, rewards=torch.tensor([-1.0, 0.5, 2.0, 1.0]))  # group 0 mixed, group 1 not
    assert rows == [{"prompt": "2+2?" + hint}, {"prompt": "2+2?" + nxt}, {"prompt": "3*3?" + nxt}]
    rows = _call(curriculum_fn, rewards=torch.tensor([0.5, -1.0, -2.0, -1.0]))
    assert [r["prompt"] for r in rows] == ["2+2?" + nxt, "2+2?" + hint, "3*3?" + hint]


def test_per_sample_answers_are_deduplicated_across_groups_and_keep_their_rows_columns():
    rows = _call(lambda prompts, *args: ["3*3?", "x", "3*3?", "x"])
    assert rows == [{"prompt": "3*3?", "answer": "9"}, {"prompt": "x"}]
    chat = [{"role": "user", "content": "hi"}]
    rows = _call(lambda *args: [chat, chat, {"prompt": "y", "level": 1}, {"prompt": "y", "level": 1}])
    assert rows == [{"prompt": chat}, {"prompt": "y", "level": 1}]


@pytest.mark.parametrize("returned", [[], ["one"], ["a", "b", "c"], ["a"] * 5])
def test_a_wrong_number_of_prompts_names_the_hook_and_the_counts(returned):
    with pytest.raises(DynamicPromptsError, match=rf"dynamic_prompts_fn returned {len(returned)} prompts; the next "
                                                  r"generation needs P=2 \(one per group\) or B=P\*G=2\*2=4 \(one per "
                                                  r"sample\)"):
        _call(lambda *args: returned)


def test_wrong_length_message_shows_the_arithmetic_at_p4_g4():
    prompts, metas = [f"q{i}" for i in range(4)], [{}] * 4
    with pytest.raises(DynamicPromptsError, match=r"returned 5 prompts; the next generation needs P=4 \(one per "
                                                  r"group\) or B=P\*G=4\*4=16 \(one per sample\)"):
        call_dynamic_prompts_fn(lambda *args: ["q"] * 5, prompts, ["c"] * 16, torch.zeros(16), metas)


@pytest.mark.parametrize(
    "returned, message",
    [
        (None, "it returned NoneType"),
        ("one prompt", "it returned str"),
        ({"prompt": "x"}, "it returned dict"),
        (torch.zeros(2), "it returned Tensor"),
        (["ok", 5], "element 1 is int: 5"),
        (["ok", ""], "element 1 is an empty string"),
        (["ok", [{"content": "no role"}]], "element 1 is a message list whose message 0 is not a"),
        ([{"question": "x"}, "ok"], r"element 0 is a dict without a 'prompt' key \(keys \['question'\]\)"),
        ([{"prompt": 3}, "ok"], "element 0 is int: 3"),
    ],
)
def test_a_bad_return_value_is_a_clear_error_naming_the_hook(returned, message):
    with pytest.raises(DynamicPromptsError, match=message) as error:
        _call(lambda *args: returned)
    assert str(error.value).startswith("dynamic_prompts_fn must return the next generation's prompts")


def test_misaligned_inputs_are_rejected_before_the_hook_runs():
    def never(*args):
        raise AssertionError("called")

    with pytest.raises(DynamicPromptsError, match=r"rewards must be \(B=4,\)"):
        _call(never, rewards=REWARDS.view(2, 2))
    with pytest.raises(DynamicPromptsError, match="B = P\\*G per-sample completions; got 3 for P=2"):
        _call(never, completions=COMPLETIONS[:3])
    with pytest.raises(DynamicPromptsError, match=r"one dict per group \(P=2\)"):
        _call(never, metas=METAS[:1])
