"""Multi-turn rollouts: every sample advances on its own (generate -> tool calls -> tool message -> generate ...)
through the engine's `submit_turn` / `collect_turns`, the tools of all samples running concurrently.

Owns: `MultiTurnSettings` (the generation settings a multi-turn rollout reads), `Sample` (one conversation's token
ids, log-probs and tool mask so far) and `generate_multi_turn` (a round of samples -> a `Rollout` with `tool_mask`,
and the `tools/*` metrics).

The row a sample becomes: prompt ids + completion ids, where the completion is every model turn and every tool
message's tokens in order (`tool_mask` 1 on the model's tokens, 0 on the tool messages'; their sampled log-probs
0.0, TRL's layout). The next turn's prompt is prompt + completion so far: never a re-tokenization
(engine/agent/chat_tokens.py). Tool tokens count toward `max_completion_length` (TRL): a turn's budget is what is
left of it; a tool answer that would not leave room for one more token ends the sample before it (TRL rolls back the
same way). `max_tool_calling_iterations` bounds the tool rounds of a sample (None = until the budget ends).

Unlike TRL's lock-step loop (every row waits for the slowest row's tools, and the tools of different rows run one
after another), a sample's next turn goes to the engine as soon as its own calls are done, while other samples'
turns generate (vLLM's continuous batching joins it to the running batch) and other samples' tools run (the
toolbox's bounded pool, engine/agent/toolbox.py); a call past its timeout is a failure the model sees, so one slow
tool never holds the others. Rewards stay one scalar per completion (TRL): the reward functions see the whole
conversation once it is finished, and advantages are computed from them as for single-turn rows.

Must not: import vLLM, touch process groups (the caller shares the rollout), or compute rewards.

Test: tests/integration/test_agentic.py (real vLLM and Megatron).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from engine.agent.chat_tokens import parse_tool_calls, tool_suffix_ids
from engine.agent.toolbox import Toolbox, ToolOutcome, outcome
from engine.rollout.protocol import RolloutEngine, TurnRequest
from engine.rollout.rollouts import Rollout

POLL_S = 0.005
"""How long one `collect_turns` waits while tool calls run (server mode: the engine answers on its own time)."""
CANCEL_POLL_S = 0.1
"""With a `cancelled` event (a round generated ahead): the longest wait between two looks at it."""


class RoundCancelled(Exception):
    """A round generated ahead was cancelled (the run failed): no further turn was issued."""


@dataclass(frozen=True)
class MultiTurnSettings:
    """What a multi-turn round reads of the `generation` section."""

    max_completion_length: int
    max_tool_calling_iterations: int | None
    chat_template_kwargs: dict | None = None


@dataclass
class Sample:
    """One conversation: its prompt, the completion so far (model turns and tool messages) and its tool mask."""

    prompt_ids: list[int]
    seed: int | None
    tools: dict[str, Callable] = field(default_factory=dict)
    """Per-sample tools besides the run's (its environment's methods)."""
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    iterations: int = 0
    is_truncated: bool = False
    calls: list[tuple[str, Future, float]] = field(default_factory=list)
    """The tool calls of the last turn in flight: (name, future, started)."""


def generate_multi_turn(engine: RolloutEngine, samples: list[Sample], tokenizer, toolbox: Toolbox,
                        settings: MultiTurnSettings, cancelled: threading.Event | None = None
                        ) -> tuple[Rollout, dict[str, float]]:
    """Run every sample to its end (module docstring); returns the rows in `samples`' order and the metrics
    `tools/call_frequency` (calls per sample) and `tools/failure_frequency` (failed calls per call).
    `cancelled` (a round generated ahead, engine/train/sampling.py): once set, no further turn is issued and
    `RoundCancelled` is raised within `CANCEL_POLL_S` (turns and tool calls in flight are left to end)."""
    budget = settings.max_completion_length
    idle_wait = None if cancelled is None else CANCEL_POLL_S
    outcomes: list[ToolOutcome] = []
    waiting: dict[int, Sample] = {}  # samples whose tool calls run
    engine.wake_up()
    try:
        for key, sample in enumerate(samples):
            engine.submit_turn(TurnRequest(key, sample.prompt_ids, max_tokens=budget, seed=sample.seed))
        in_engine = len(samples)
        while in_engine or waiting:
            if cancelled is not None and cancelled.is_set():
                raise RoundCancelled("the round generated ahead was cancelled: the run failed")
            finished = engine.collect_turns(timeout_s=POLL_S if waiting else idle_wait) if in_engine else []
            in_engine -= len(finished)
            for turn in finished:
                sample = samples[turn.key]
                sample.completion_ids += turn.completion_ids
                sample.logprobs += turn.sampling_logprobs
                sample.tool_mask += [1] * len(turn.completion_ids)
                if _start_calls(sample, turn, tokenizer, toolbox, settings):
                    waiting[turn.key] = sample
                else:
                    sample.is_truncated = turn.is_truncated
            if not finished and not in_engine:  # only tools run: sleep until one is done or a deadline passes
                _wait_for_tools(waiting.values(), toolbox, idle_wait)
            for key in [k for k, s in waiting.items() if _calls_resolved(s, toolbox)]:
                sample = waiting.pop(key)
                results = [outcome(name, f, started, toolbox.timeout_s) for name, f, started in sample.calls]
                outcomes += results
                sample.calls = []
                if _append_tool_messages(sample, results, tokenizer, settings):
                    engine.submit_turn(TurnRequest(key, sample.prompt_ids + sample.completion_ids,
                                                   max_tokens=budget - len(sample.completion_ids),
                                                   seed=_turn_seed(sample)))
                    in_engine += 1
    finally:
        engine.sleep()
    rollout = Rollout([s.prompt_ids for s in samples], [s.completion_ids for s in samples],
                      [s.logprobs for s in samples], [s.is_truncated for s in samples],
                      tool_mask=[s.tool_mask for s in samples])
    num_calls = len(outcomes)
    metrics = {"tools/call_frequency": num_calls / max(len(samples), 1),
               "tools/failure_frequency": sum(o.failed for o in outcomes) / num_calls if num_calls else 0.0}
    return rollout, metrics


def _start_calls(sample: Sample, turn, tokenizer, toolbox: Toolbox, settings: MultiTurnSettings) -> bool:
    """Start the tool calls of the sample's finished turn; False when the sample ends here (no call, truncated,
    out of budget or of tool iterations)."""
    limit = settings.max_tool_calling_iterations
    if turn.is_truncated or not turn.completion_ids or len(sample.completion_ids) >= settings.max_completion_length:
        return False
    if limit is not None and sample.iterations >= limit:
        return False
    calls = parse_tool_calls(tokenizer, tokenizer.decode(turn.completion_ids, skip_special_tokens=False))
    if not calls:
        return False
    sample.iterations += 1
    sample.calls = [(call.name, *toolbox.start(call, sample.tools)) for call in calls]
    return True


def _calls_resolved(sample: Sample, toolbox: Toolbox) -> bool:
    now = time.perf_counter()
    return all(f.done() or now >= toolbox.deadline(started) for _, f, started in sample.calls)


def _wait_for_tools(samples, toolbox: Toolbox, longest: float | None = None) -> None:
    pending = [(f, started) for s in samples for _, f, started in s.calls if not f.done()]
    if pending:
        deadline = min(toolbox.deadline(started) for _, started in pending)
        wait([f for f, _ in pending], timeout=max(0.0, min(deadline - time.perf_counter(), longest or 3600.0)),
             return_when=FIRST_COMPLETED)


def _append_tool_messages(sample: Sample, results: list[ToolOutcome], tokenizer,
                          settings: MultiTurnSettings) -> bool:
    """Append the tool messages' tokens (mask 0); False (the sample ends, without them) when they would leave no
    room for another model token within `max_completion_length`."""
    messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
    suffix = tool_suffix_ids(tokenizer, messages, sample.completion_ids[-1], settings.chat_template_kwargs)
    if len(sample.completion_ids) + len(suffix) >= settings.max_completion_length:
        return False
    sample.completion_ids += suffix
    sample.logprobs += [0.0] * len(suffix)
    sample.tool_mask += [0] * len(suffix)
    return True


def _turn_seed(sample: Sample) -> int | None:
    """A later turn's vLLM seed: the sample's, moved by its tool iteration (None stays None)."""
    return None if sample.seed is None else (sample.seed + 7919 * sample.iterations) % (2**31)
