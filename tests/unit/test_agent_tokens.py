"""Multi-turn token layout (engine/agent/chat_tokens.py): prompt ids + every model turn + the tool messages' suffix
ids equals the chat template's rendering of the whole conversation, token for token, for the Qwen2.5, Qwen3 and
Llama 3.1 templates (TRL's copies of the models' templates, on the tiny tokenizer with their special tokens added)
and this project's TOOL_CHAT_TEMPLATE; tool-call parsing (Hermes format), and the refusal of a template that cannot
render tools. No model, no engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.agent.chat_tokens import check_renders_tools, completion_messages, parse_tool_calls, tool_suffix_ids
from engine.models.tiny_model import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE, build_tiny_tokenizer

SPECIAL = ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|begin_of_text|>", "<|eom_id|>",
           "<|python_tag|>", "<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>",
           "</tool_response>"]
STOP = {"qwen2_5": "<|im_end|>", "qwen3": "<|im_end|>", "llama3_1": "<|eot_id|>", "tiny": "<|im_end|>"}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def _tokenizer(name: str):
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    if name == "tiny":
        tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    else:
        trl = pytest.importorskip("trl")
        tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()
    return tokenizer


def _ids(tokenizer, messages, **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def _call(a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}


CONVERSATION = [
    {"role": "user", "content": "What is 2 + 3, then plus 4?"},
    {"role": "assistant", "content": "", "tool_calls": [_call(2, 3)]},
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "assistant", "content": "", "tool_calls": [_call(5, 4), _call(1, 1)]},
    {"role": "tool", "name": "add", "content": "9"},
    {"role": "tool", "name": "add", "content": "2"},
    {"role": "assistant", "content": "The answer is 9."},
]
ONE_CALL_PER_TURN = CONVERSATION[:3] + [{"role": "assistant", "content": "", "tool_calls": [_call(5, 4)]},
                                        CONVERSATION[4], {"role": "assistant", "content": "The answer is 9."}]
"""Llama 3.1's template allows one tool call per turn."""


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "llama3_1", "tiny"])
def test_prompt_turns_and_tool_suffixes_equal_the_whole_conversation_rendered(name):
    tokenizer = _tokenizer(name)
    stop = tokenizer.convert_tokens_to_ids(STOP[name])
    kwargs = {"tools": [__import__("transformers").utils.get_json_schema(add)]}
    conversation = ONE_CALL_PER_TURN if name == "llama3_1" else CONVERSATION
    whole = _ids(tokenizer, conversation, **kwargs)
    whole = whole[: len(whole) - whole[::-1].index(stop)]  # up to the last turn's stop token
    assert whole == tokenizer(tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs),
                              add_special_tokens=False)["input_ids"][: len(whole)]  # full-render tokenization
    ids = prompt = _ids(tokenizer, conversation[:1], add_generation_prompt=True, **kwargs)
    mask = []  # the completion's tool mask
    k = 1
    while k < len(conversation):
        # the model's turn: what the whole rendering holds after the ids so far, up to its stop token
        turn = whole[len(ids):]
        turn = turn[: turn.index(stop) + 1]
        ids, mask = ids + turn, mask + [1] * len(turn)
        k += 1
        tools = []
        while k < len(conversation) and conversation[k]["role"] == "tool":
            tools.append(conversation[k])
            k += 1
        if tools:
            suffix = tool_suffix_ids(tokenizer, tools, stop, kwargs)
            ids, mask = ids + suffix, mask + [0] * len(suffix)
    assert ids == whole
    tool_text = tokenizer.decode([t for t, m in zip(ids[len(prompt):], mask) if m == 0])
    model_text = tokenizer.decode([t for t, m in zip(ids[len(prompt):], mask) if m == 1])
    assert all(f"{x}" in tool_text for x in (5, 9)) and "add" not in tool_text  # tool messages only
    assert "add" in model_text and "The answer is 9." in model_text


def test_hermes_tool_calls_are_parsed_and_bad_ones_carry_an_error():
    tokenizer = build_tiny_tokenizer()
    calls = parse_tool_calls(tokenizer, 'x<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                                        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>'
                                        '<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>')
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [("add", {"a": 1, "b": 2}, True),
                                                                        ("add", {"a": 3}, True)]
    assert "not valid JSON" in calls[2].error and "JSON object" in calls[3].error
    assert parse_tool_calls(tokenizer, "no calls here") == []


def test_a_template_that_cannot_render_tools_is_refused_naming_the_model():
    tokenizer = build_tiny_tokenizer()
    assert tokenizer.chat_template == CHAT_TEMPLATE
    schema = __import__("transformers").utils.get_json_schema(add)
    with pytest.raises(ValueError, match="builtin:tiny-qwen2.*cannot render tool calls"):
        check_renders_tools(tokenizer, [schema], "builtin:tiny-qwen2")
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    check_renders_tools(tokenizer, [schema], "builtin:tiny-qwen2")


def test_tool_template_renders_plain_chats_as_the_builtin_template():
    tokenizer = build_tiny_tokenizer()
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    plain = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == plain


def test_completion_messages_split_model_and_tool_tokens():
    tokenizer = build_tiny_tokenizer()
    a, t, b = tokenizer("ab")["input_ids"], tokenizer("tool")["input_ids"], tokenizer("cd")["input_ids"]
    messages = completion_messages(tokenizer, a + t + b, [1] * len(a) + [0] * len(t) + [1] * len(b))
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
    assert [m["content"] for m in messages] == ["ab", "tool", "cd"]
