"""engine/dynamic_prompts.py: the dynamic_prompts_fn call contract and the validation of what it returns."""

from __future__ import annotations

import pytest
import torch

from engine.dynamic_prompts import DynamicPromptsError, call_dynamic_prompts_fn, validate_dynamic_prompts

PROMPTS = ["2+2?", "3*3?"]
COMPLETIONS = [["4", "5"], ["9", "6"]]
REWARDS = torch.tensor([[1.0, 0.0], [1.0, float("nan")]])
METAS = [{"answer": "4"}, {"answer": "9"}]


def test_hook_gets_aligned_inputs_and_its_prompts_come_back_as_rows():
    calls = []

    def harder_on_solved(prompts, completions, rewards, metas):
        calls.append((prompts, completions, rewards, metas))
        solved = [p for p, r in zip(prompts, rewards.nan_to_num(0).mean(dim=1).tolist(), strict=True) if r > 0.4]
        return [{"prompt": p + " Show your work.", "answer": m["answer"]} for p, m in zip(solved, metas, strict=False)]

    rows = call_dynamic_prompts_fn(harder_on_solved, PROMPTS, COMPLETIONS, REWARDS, METAS)
    assert rows == [{"prompt": "2+2? Show your work.", "answer": "4"},
                    {"prompt": "3*3? Show your work.", "answer": "9"}]
    prompts, completions, rewards, metas = calls[0]
    assert prompts == PROMPTS and completions == COMPLETIONS and metas == METAS and rewards is REWARDS


def test_plain_and_conversational_prompts_are_accepted():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rows = validate_dynamic_prompts(("plain", chat), num_prompts=2)
    assert rows == [{"prompt": "plain"}, {"prompt": chat}]


@pytest.mark.parametrize(
    "returned, message",
    [
        (None, "it returned NoneType"),
        ("one prompt", "it returned str"),
        ({"prompt": "x"}, "it returned dict"),
        ([], "it returned an empty list"),
        (["ok", 5], "element 1 is int: 5"),
        (["ok", ""], "element 1 is an empty string"),
        ([[{"content": "no role"}]], "element 0 is a message list whose message 0 is not a"),
        ([{"question": "x"}], r"element 0 is a dict without a 'prompt' key \(keys \['question'\]\)"),
    ],
)
def test_a_bad_return_value_is_a_clear_error(returned, message):
    with pytest.raises(DynamicPromptsError, match=message):
        call_dynamic_prompts_fn(lambda *args: returned, PROMPTS, COMPLETIONS, REWARDS, METAS)


def test_a_wrong_number_of_prompts_is_an_error_when_a_count_is_required():
    with pytest.raises(DynamicPromptsError, match="returned 1 prompts, but the next generation needs 2"):
        call_dynamic_prompts_fn(lambda *args: ["only one"], PROMPTS, COMPLETIONS, REWARDS, METAS, num_prompts=2)
    assert len(call_dynamic_prompts_fn(lambda *args: ["only one"], PROMPTS, COMPLETIONS, REWARDS, METAS)) == 1


def test_misaligned_inputs_are_rejected_before_the_hook_runs():
    def never(*args):
        raise AssertionError("called")

    with pytest.raises(DynamicPromptsError, match=r"rewards must be \(P=2, G\)"):
        call_dynamic_prompts_fn(never, PROMPTS, COMPLETIONS, REWARDS[:1], METAS)
    with pytest.raises(DynamicPromptsError, match="completions must be P=2 lists of G=2"):
        call_dynamic_prompts_fn(never, PROMPTS, [["4"], ["9", "6"]], REWARDS, METAS)
    with pytest.raises(DynamicPromptsError, match="one dict per prompt"):
        call_dynamic_prompts_fn(never, PROMPTS, COMPLETIONS, REWARDS, METAS[:1])
