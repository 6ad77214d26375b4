"""Tools, environments and rollout_func without an engine (engine/agent/toolbox.py, environments.py,
rollout_func.py, engine/api/trl_agentic.py): schemas and construction errors naming the culprit, what the model
sees of a call (a value, an exception, an unknown tool, bad arguments, a timeout, a non-string), calls of different
samples overlapping in the pool, the environment pool reused, get_reward, rollout_func's contract."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from engine.agent.chat_tokens import ToolCall
from engine.agent.environments import EnvironmentPool, environment_tools
from engine.agent.rollout_func import call_rollout_func
from engine.agent.toolbox import Toolbox, outcome, tool_schema
from engine.models.tiny_model import build_tiny_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def fail(x: str) -> str:
    """Always raises.

    Args:
        x: anything
    """
    raise RuntimeError(f"no {x}")


def nap(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


async def async_nap(seconds: float) -> dict:
    """Sleep without a thread, then answer a dict.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return {"slept": seconds}


def _run(box: Toolbox, call: ToolCall, wait_s: float = 5.0):
    future, started = box.start(call)
    deadline = min(box.deadline(started), time.perf_counter() + wait_s)
    while not future.done() and time.perf_counter() < deadline:
        time.sleep(0.01)
    return outcome(call.name, future, started, box.timeout_s)


def test_what_the_model_sees_of_each_kind_of_call():
    box = Toolbox([add, fail, nap, async_nap], max_concurrent=4, timeout_s=0.5)
    try:
        assert _run(box, ToolCall("add", {"a": 2, "b": 3})).content == "5"  # an int: str() of it, as TRL
        assert _run(box, ToolCall("async_nap", {"seconds": 0.01})).content == str({"slept": 0.01})
        cases = {"raises": ToolCall("fail", {"x": "luck"}), "unknown": ToolCall("mul", {"a": 1}),
                 "bad arguments": ToolCall("add", {"a": 1, "c": 2}), "unparsable": ToolCall("", error="not JSON"),
                 "sync timeout": ToolCall("nap", {"seconds": 3.0}), "async timeout": ToolCall("async_nap", {"seconds": 3.0})}
        seen = {k: _run(box, c) for k, c in cases.items()}
        assert all(o.failed for o in seen.values())
        errors = {k: json.loads(o.content)["error"] for k, o in seen.items()}
        assert "no luck" in errors["raises"] and "unknown tool 'mul'" in errors["unknown"]
        assert "TypeError" in errors["bad arguments"] and "not JSON" in errors["unparsable"]
        assert "timed out after 0.5 s" in errors["sync timeout"] and "timed out" in errors["async timeout"]
        assert seen["sync timeout"].seconds < 1.5
    finally:
        box.close()


def test_calls_of_different_samples_run_at_once_in_the_bounded_pool():
    import threading

    barrier = threading.Barrier(4, timeout=10)

    def meet(n: int) -> str:
        """Wait until 4 calls are running at once (a pool that ran them one by one would break the barrier).

        Args:
            n: the caller
        """
        barrier.wait()
        return f"met {n}"

    box = Toolbox([meet], max_concurrent=4, timeout_s=None)
    try:
        futures = [box.start(ToolCall("meet", {"n": i}))[0] for i in range(4)]
        assert [f.result() for f in futures] == [f"met {i}" for i in range(4)]
    finally:
        box.close()


def test_tools_without_hints_or_docstring_are_refused_by_name():
    def no_doc(a: int) -> int:
        return a

    def no_hint(a):
        """Has a docstring.

        Args:
            a: no hint
        """

    for tool in (no_doc, no_hint):
        with pytest.raises(ValueError, match=f"tool '{tool.__name__}'"):
            tool_schema(tool)
    assert tool_schema(add)["function"]["name"] == "add"


class Counter:
    """An environment: counts up; its reward is the count."""

    built = 0

    def __init__(self):
        Counter.built += 1
        self.count = 0

    def reset(self, **row) -> str:
        self.count = row.get("start", 0)
        return f" (start at {self.count})"

    def increment(self, by: int) -> str:
        """Add to the count.

        Args:
            by: how much
        """
        self.count += by
        return str(self.count)

    async def get_reward(self) -> float:
        return float(self.count)


class NoReward:
    """An environment without get_reward."""

    def reset(self, **row) -> None:
        return None


def test_environment_pool_is_reused_and_its_reward_reads_each_rollout():
    Counter.built = 0
    pool = EnvironmentPool(Counter)
    assert Counter.built == 1  # one instance now: its reset and tools checked at construction
    first = pool.take([None] * 3)
    pool.release(first)
    again = pool.take([None] * 2)
    assert Counter.built == 3 and again == first[:2]  # reused, not rebuilt
    # a round generated ahead (max_staleness > 0) while `again` is leased gets other instances: never one whose
    # get_reward is still to be read
    ahead = pool.take([None] * 2)
    assert ahead == first[2:] + [ahead[1]] and Counter.built == 4 and not {id(e) for e in ahead} & {id(e) for e in again}
    pool.release(again + ahead)
    assert sorted(environment_tools(first[0])) == ["increment"]
    assert [s["function"]["name"] for s in pool.schemas[None]] == ["increment"]
    for env, start in zip(first, (1, 2, 3)):
        env.reset(start=start)
    (reward,) = pool.reward_functions()
    assert reward.__name__ == "Counter" and reward(environments=first) == [1.0, 2.0, 3.0]


def test_environment_without_reset_or_with_an_undocumented_tool_is_refused():
    class NoReset:
        def step(self, action: str) -> str:
            """Act.

            Args:
                action: what to do
            """
            return action

    class BadTool:
        def reset(self, **row):
            return None

        def step(self, action):
            return action

    with pytest.raises(TypeError, match="NoReset has no reset"):
        EnvironmentPool(NoReset)
    with pytest.raises(ValueError, match="BadTool.*tool 'step'"):
        EnvironmentPool({"bad": BadTool})
    with pytest.raises(ValueError, match="'other'.* not among the environments"):  # TRL's error and words
        EnvironmentPool({"c": Counter}).take(["other"])
    # two keys building one class with get_reward share one reward column (TRL); a class without it adds none
    assert [f.__name__ for f in EnvironmentPool({"a": Counter, "b": Counter, "n": NoReward}).reward_functions()] == [
        "Counter"]


def test_rollout_func_rows_and_errors_name_the_key_and_the_counts():
    tokenizer = build_tiny_tokenizer()
    eos = tokenizer.eos_token_id
    good = {"prompt_ids": [[1, 2], [3]], "completion_ids": [[4, eos], [5, 6]], "logprobs": [[-0.1, -0.2], [-0.3, -0.4]],
            "env_mask": [[1, 1], [1, 0]], "answer": ["x", "y"], "source": "same"}
    rollout, extra = call_rollout_func(lambda prompts: good, ["p", "q"], tokenizer)
    assert rollout.tool_mask == [[1, 1], [1, 0]] and rollout.is_truncated == [False, True]
    assert extra == {"answer": ["x", "y"], "source": ["same", "same"]}
    with pytest.raises(ValueError, match=r"\['logprobs'\] missing"):
        call_rollout_func(lambda p: {k: v for k, v in good.items() if k != "logprobs"}, ["p", "q"], tokenizer)
    with pytest.raises(ValueError, match="returned 2 rows of 'prompt_ids' for 3 prompts"):
        call_rollout_func(lambda p: good, ["p", "q", "r"], tokenizer)
    with pytest.raises(ValueError, match="row 1 of 'env_mask' has 1 values for its 2 completion tokens"):
        call_rollout_func(lambda p: good | {"env_mask": [[1, 1], [1]]}, ["p", "q"], tokenizer)


def test_multi_turn_layouts_are_accepted_and_a_template_without_tools_is_refused():
    import dataclasses

    from engine.config import EngineConfig
    from engine.train.run import build_agentic

    tokenizer = build_tiny_tokenizer()
    base = EngineConfig()
    asynchronous = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, vllm_mode="server", max_staleness=1))
    assert build_agentic(asynchronous, {"rollout_func": lambda p: {}}, tokenizer, "m") is not None  # runs ahead
    # colocated at vLLM TP > 1: accepted (rank 0's TP group mirrors its turns, tests/integration/test_agentic.py)
    engine_tp = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, vllm_tensor_parallel_size=2))
    assert build_agentic(engine_tp, {"rollout_func": lambda p: {}}, tokenizer, "m") is not None
    assert build_agentic(base, {"tools": None, "environment_factory": None, "rollout_func": None}, tokenizer, "m") is None
    with pytest.raises(ValueError, match="chat template of m cannot render tool calls"):
        build_agentic(base, {"tools": [add]}, tokenizer, "m")
