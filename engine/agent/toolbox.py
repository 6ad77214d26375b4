"""The tools of a run: their JSON schemas for the chat template, and their calls run concurrently with a timeout.

Owns: `tool_schema` (transformers' `get_json_schema` from type hints and the Google-style docstring; a tool without
them is refused at construction, naming it), `Toolbox` (name -> tool, schemas, and `start(call)`: a call runs in a
bounded thread pool (`generation.max_concurrent_tool_calls` calls of all samples at once), coroutine tools on one
event-loop thread), `ToolOutcome`, and `outcome` (a started call's result as the model sees it).

What the model sees (TRL's meaning): the tool's return value as `str(value)` (a string as it is); an unknown tool, bad
arguments, an exception, or a call past `generation.tool_call_timeout_s` become `{"error": "..."}` and count in
`tools/failure_frequency`; the run goes on. A timed-out coroutine is cancelled; a timed-out plain function cannot be
stopped by Python: its thread keeps its pool slot until the function returns (say so in the tool if it can hang).
A call's timeout counts from its start request, so a call queued behind a full pool can time out unrun.

Must not: generate, tokenize, or know samples (engine/agent/multi_turn.py).

Test: tests/unit/test_agent_tools.py.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from engine.agent.chat_tokens import ToolCall


def tool_schema(tool: Callable) -> dict:
    """TRL's / transformers' tool schema {"type": "function", "function": {name, description, parameters}}.

    Raises:
        ValueError: naming the tool, when it has no docstring, an argument has no type hint or no `Args:` line.
    """
    from transformers.utils import get_json_schema

    name = getattr(tool, "__name__", type(tool).__name__)
    if not callable(tool):
        raise TypeError(f"tools: {tool!r} is not callable")
    try:
        return get_json_schema(tool)
    except Exception as e:  # noqa: BLE001 - transformers' TypeHintParsingException / DocstringParsingException
        raise ValueError(f"tool {name!r}: {e} (a tool needs a type hint on every argument and a Google-style "
                         "docstring: a description, then `Args:` with one line per argument)") from e


@dataclass(frozen=True)
class ToolOutcome:
    """What the model sees of one call (`content`), whether it failed, and the call's seconds."""

    name: str
    content: str
    failed: bool
    seconds: float


class Toolbox:
    """The run's tools by name (and per-sample extra tools: an environment's methods), run concurrently."""

    def __init__(self, tools: list[Callable], *, max_concurrent: int, timeout_s: float | None):
        """
        Args:
            tools: the user's callables (sync or async), each with type hints and a docstring.
            max_concurrent: calls running at once, over all samples (`generation.max_concurrent_tool_calls`).
            timeout_s: seconds one call may take (`generation.tool_call_timeout_s`); None = no limit.
        """
        self.tools = {}
        for tool in tools:
            schema = tool_schema(tool)
            name = schema["function"]["name"]
            if name in self.tools:
                raise ValueError(f"tools: two tools are named {name!r}")
            self.tools[name] = tool
        self.schemas = [tool_schema(t) for t in tools]
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="tool")
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, call: ToolCall, extra: dict[str, Callable] | None = None) -> tuple[Future, float]:
        """Start `call` (looked up in `extra`, an environment's tools, then the run's); returns its future (the
        tool's return value, or its exception) and when it was started (time.perf_counter)."""
        started = time.perf_counter()
        future: Future = Future()
        tool = (extra or {}).get(call.name, self.tools.get(call.name))
        if call.error is not None:
            future.set_exception(ValueError(call.error))
        elif tool is None:
            known = sorted(set(self.tools) | set(extra or {}))
            future.set_exception(KeyError(f"unknown tool {call.name!r}; the tools are {known}"))
        elif inspect.iscoroutinefunction(tool) or inspect.iscoroutinefunction(getattr(tool, "__call__", None)):
            future = asyncio.run_coroutine_threadsafe(self._bounded(tool, call.arguments), self._event_loop())
        else:
            future = self._pool.submit(tool, **call.arguments)
        return future, started

    async def _bounded(self, tool: Callable, arguments: dict):
        return await asyncio.wait_for(tool(**arguments), timeout=self.timeout_s)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """One daemon thread runs every coroutine tool of the run."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="tool-loop", daemon=True).start()
        return self._loop

    def deadline(self, started: float) -> float:
        return float("inf") if self.timeout_s is None else started + self.timeout_s

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None


def outcome(name: str, future: Future, started: float, timeout_s: float | None) -> ToolOutcome:
    """The model's view of a started call: its value as a string, or {"error": ...} (failed, timed out when the
    future is not done)."""
    seconds = time.perf_counter() - started
    if not future.done():
        future.cancel()
        return ToolOutcome(name, json.dumps({"error": f"tool {name!r} timed out after {timeout_s} s"}), True, seconds)
    try:
        value = future.result()
    except (TimeoutError, asyncio.TimeoutError):
        return ToolOutcome(name, json.dumps({"error": f"tool {name!r} timed out after {timeout_s} s"}), True, seconds)
    except Exception as e:  # noqa: BLE001 - whatever the tool raised is the model's to see
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        return ToolOutcome(name, json.dumps({"error": f"{type(e).__name__}: {message}"}), True, seconds)
    return ToolOutcome(name, value if isinstance(value, str) else str(value), False, seconds)
