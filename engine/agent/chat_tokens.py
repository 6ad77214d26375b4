"""What a completion's text asks of tools, and the token ids a tool message adds to the conversation.

Owns: `ToolCall`, `parse_tool_calls` (the tokenizer's response schema, transformers' `parse_response`, where it has
one; else the Hermes / Qwen format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one JSON object per
tag, which Qwen2.5, Qwen3 and this project's tool template emit), `tool_suffix_ids` (the tokens that follow a
finished assistant turn when tool messages are appended: rendered by the chat template, never a re-tokenization of
earlier turns) and `check_renders_tools` (a chat template that cannot show tools is refused, naming the model).

How the suffix is found: a stand-in conversation [user, assistant with a tool call, *tool messages] is rendered
with the generation prompt; the suffix is what follows the assistant turn's `stop_token_id` (the token the model
stopped on; the turns before it, counted by rendering [user] alone, end with it too). The assistant turn is not the
last message there, so it is rendered as the whole conversation renders it (Qwen3's template, e.g., adds an empty
think block to a last assistant turn only). A turn that ended on another stop token than the template's own end of
turn (`<|endoftext|>` where the template writes `<|im_end|>`) is followed by the same suffix, as TRL does. The next turn's prompt is then prompt ids +
completion ids + suffix ids: tests/unit/test_agent_tokens.py checks that this equals the chat template's rendering of
the whole conversation, token for token, for the Qwen2.5, Qwen3 and Llama 3.1 templates.

Must not: run tools or generate (engine/agent/multi_turn.py), or import vLLM.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

HERMES_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
"""The Hermes / Qwen tool-call format: a JSON object {"name", "arguments"} between the tags."""


@dataclass(frozen=True)
class ToolCall:
    """One call a completion asked for; `error` says why it cannot run (unparsable JSON, no name)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(tokenizer, text: str) -> list[ToolCall]:
    """The tool calls in one assistant turn's `text` (decoded with its special tokens), in order; [] = none.

    With a `response_schema` on the tokenizer (transformers 5), its `parse_response`; else the Hermes format. A call
    that cannot be read becomes a `ToolCall` with `error` set (the model is told, the failure counted)."""
    if getattr(tokenizer, "response_schema", None):
        try:
            parsed = tokenizer.parse_response(text)
        except Exception as e:  # noqa: BLE001 - the model wrote something the schema cannot read
            return [ToolCall("", error=f"unparsable tool call: {e}")] if "<tool_call>" in text else []
        return [_from_message_call(call) for call in (parsed or {}).get("tool_calls") or []]
    return [_from_json(body) for body in HERMES_TOOL_CALL.findall(text)]


def _from_message_call(call: dict) -> ToolCall:
    """A message-format call {"type": "function", "function": {"name", "arguments"}} as a `ToolCall`."""
    if call.get("type", "function") != "function":
        return ToolCall(str(call.get("type")), error=f"unsupported tool call type {call.get('type')!r}")
    function = call.get("function", call)
    return _checked(function.get("name"), function.get("arguments", {}))


def _from_json(body: str) -> ToolCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"tool call is not valid JSON ({e.msg} at position {e.pos})")
    if not isinstance(value, dict):
        return ToolCall("", error="tool call must be a JSON object with 'name' and 'arguments'")
    return _checked(value.get("name"), value.get("arguments", {}))


def _checked(name: Any, arguments: Any) -> ToolCall:
    if isinstance(arguments, str):  # some templates carry the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(str(name or ""), error="tool call arguments are not valid JSON")
    if not isinstance(name, str) or not name:
        return ToolCall("", error="tool call has no 'name'")
    if not isinstance(arguments, dict):
        return ToolCall(name, error="tool call 'arguments' must be a JSON object")
    return ToolCall(name, arguments)


def tool_suffix_ids(tokenizer, tool_messages: list[dict], stop_token_id: int,
                    chat_template_kwargs: dict | None = None) -> list[int]:
    """The token ids that follow an assistant turn ending in `stop_token_id` when `tool_messages` are appended,
    up to and including the next assistant generation prompt (module docstring).

    Raises:
        ValueError: the template does not end the assistant's turn with `stop_token_id`.
    """
    kwargs = dict(chat_template_kwargs or {})
    call = {"type": "function", "function": {"name": tool_messages[0].get("name", "tool"), "arguments": {}}}
    stand_in = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    head = _render_ids(tokenizer, stand_in[:1], add_generation_prompt=False, **kwargs)
    full = _render_ids(tokenizer, stand_in + tool_messages, add_generation_prompt=True, **kwargs)
    special = set(tokenizer.all_special_ids)
    turn_end = next((t for t in reversed(head) if t in special), None)  # the template's end of a turn
    for stop in dict.fromkeys(t for t in (stop_token_id, turn_end) if t is not None):
        stops = [i for i, t in enumerate(full) if t == stop]
        num_before = head.count(stop)  # turns before the assistant's (system, user) end with it too
        if len(stops) > num_before and full[: stops[num_before - 1] + 1] == head[: stops[num_before - 1] + 1]:
            return full[stops[num_before] + 1:]
    raise ValueError(f"the chat template ends an assistant turn with neither the token the model stopped on, "
                     f"{stop_token_id} ({tokenizer.convert_ids_to_tokens(stop_token_id)!r}), nor a special token: "
                     "tool results cannot be appended as token ids")


def _render_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def check_renders_tools(tokenizer, schemas: list[dict], model_name: str,
                        chat_template_kwargs: dict | None = None) -> None:
    """ValueError naming `model_name` when its chat template shows neither the tools' names in the prompt nor a
    tool message's content (e.g. a template with no `tools` / `tool` role support)."""
    kwargs = dict(chat_template_kwargs or {})
    name = schemas[0]["function"]["name"]
    probe = "tool-result-probe-7311"
    messages = [{"role": "user", "content": "x"}]
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True,
                                               **kwargs)
        answer = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "y"},
                                                           {"role": "tool", "name": name, "content": probe}],
                                               tools=schemas, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template that raises on tools or the tool role
        raise ValueError(f"the chat template of {model_name} cannot render tool calls ({type(e).__name__}: {e}); "
                         "give a tokenizer (processing_class) whose template renders `tools` and `tool` messages, "
                         "e.g. engine.models.tiny_model.TOOL_CHAT_TEMPLATE") from e
    if name not in prompt or probe not in answer:
        raise ValueError(f"the chat template of {model_name} cannot render tool calls: the prompt "
                         f"{'lacks' if name not in prompt else 'shows'} the tool {name!r}, a tool message's content "
                         f"{'is dropped' if probe not in answer else 'is shown'}; give a tokenizer (processing_class) "
                         "whose template renders `tools` and `tool` messages")


def completion_messages(tokenizer, completion_ids: list[int], tool_mask: list[int]) -> list[dict]:
    """A multi-turn completion as messages for the reward functions: each run of the model's tokens an assistant
    message, each run of tool-message tokens a `tool` message (decoded without special tokens)."""
    out, start = [], 0
    for end in range(1, len(completion_ids) + 1):
        if end == len(completion_ids) or tool_mask[end] != tool_mask[start]:
            text = tokenizer.decode(completion_ids[start:end], skip_special_tokens=True)
            out.append({"role": "assistant" if tool_mask[start] else "tool", "content": text})
            start = end
    return out
