"""One round of agentic rollouts, whichever of TRL's three entry points the run uses: `tools`,
`environment_factory` (engine/agent/environments.py), or the user's `rollout_func` (engine/agent/rollout_func.py).

Owns: `AgenticRollout` (built once by engine/train/run.py on every rank: the toolbox, the environment pool, the
chat template's `tools` and the checks; `generate` makes one round on the rank that drives it), `AgenticRound` (the
round's rollout, its `tools/*` metrics and the per-row values the reward functions receive: `environments`,
`rollout_func`'s extra keys, the conversations as completions).

A sample's prompt is the dataset's prompt rendered with the tools' schemas (`chat_template_kwargs()`); with
environments, `reset(**row)`'s observation is appended to the last user message and the prompt rendered again for
that rollout (each of the G rollouts of a prompt has its own environment, leased to the round until `release`, once
its rewards are computed); with a dict of environments, each rollout's prompt shows the run's tools and its own
environment's only (TRL). The caller (engine/train/sampling.py) runs `generate` on rank 0 only and broadcasts the
rollout: the tools and environments live in rank 0's process, as the reward functions do (colocated at vLLM TP > 1
the other ranks of rank 0's vLLM TP group mirror its engine steps: engine/rollout/colocated_turns.py). With rounds generated
ahead (`rollout.max_staleness` > 0, server mode), `generate` runs in rank 0's background thread while the trainer
trains (engine/train/sampling.py `PendingAgenticRound`).

Must not: import vLLM, touch process groups, or compute rewards.

Test: tests/integration/test_agentic.py.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.agent.chat_tokens import check_renders_tools
from engine.agent.environments import EnvironmentPool, environment_tools
from engine.agent.multi_turn import MultiTurnSettings, Sample, generate_multi_turn
from engine.agent.rollout_func import RoundEngine, call_rollout_func
from engine.agent.toolbox import Toolbox
from engine.config import GenerationConfig
from engine.rollout.protocol import RolloutEngine
from engine.rollout.rollouts import Rollout

PROMPTS_KEY = "prompts"
"""In `AgenticRound.columns`: the rows' prompts as the model saw them (with reset()'s observations); they replace the
dataset's prompts in the reward functions' `prompts`."""


@dataclass
class AgenticRound:
    """A round's rows and what the reward functions receive besides the dataset columns (rank 0)."""

    rollout: Rollout
    columns: dict[str, list] = field(default_factory=dict)
    """Per-row values for the reward functions: `environments`, rollout_func's extra keys."""
    completions: list | None = None
    """Per row, the conversation after the prompt as messages (assistant turns and tool messages); None = the
    decoded completion as single-turn rows have it."""


class AgenticRollout:
    """The run's multi-turn machinery (module docstring)."""

    def __init__(self, *, tools: list | None, environment_factory, rollout_func: Callable | None, tokenizer,
                 generation: GenerationConfig, model_name: str):
        self.tokenizer, self.generation = tokenizer, generation
        self.toolbox = Toolbox(list(tools or []), max_concurrent=generation.max_concurrent_tool_calls,
                               timeout_s=generation.tool_call_timeout_s)
        self.environments = (environment_factory if isinstance(environment_factory, EnvironmentPool) or
                             environment_factory is None else EnvironmentPool(environment_factory))
        self.rollout_func = rollout_func
        env_schemas = [s for schemas in (self.environments.schemas.values() if self.environments else []) for s in schemas]
        self.schemas = self.toolbox.schemas + list({s["function"]["name"]: s for s in env_schemas}.values())
        if self.schemas:
            check_renders_tools(tokenizer, self.schemas, model_name, generation.chat_template_kwargs)
        self._ahead: AgenticRollout | None = None

    def ahead(self) -> AgenticRollout:
        """This rollout for rank 0's background thread (rounds generated ahead): the same tools and environment
        pool, a tokenizer of its own (a fast tokenizer is not safe to share with the trainer's thread)."""
        if self._ahead is None:
            self._ahead = copy.copy(self)
            self._ahead.tokenizer = copy.deepcopy(self.tokenizer)
        return self._ahead

    def for_round_ahead(self) -> AgenticRollout:
        """`ahead()` for one round generated ahead, made when the round is issued (the trainer's thread): a
        `rollout_func` bound to the trainer is bound to a view of it as it is now (engine/api/trl_agentic.py
        `BoundRolloutFunc.for_round_ahead`: its step, the background thread's tokenizer)."""
        ahead = self.ahead()
        if not hasattr(self.rollout_func, "for_round_ahead"):
            return ahead
        ahead = copy.copy(ahead)
        ahead.rollout_func = self.rollout_func.for_round_ahead(ahead.tokenizer)
        return ahead

    def chat_template_kwargs(self) -> dict | None:
        """The generation's template kwargs plus the tools' schemas (the prompts show the tools)."""
        if not self.schemas:
            return self.generation.chat_template_kwargs
        return dict(self.generation.chat_template_kwargs or {}) | {"tools": self.schemas}

    def generate(self, engine: RolloutEngine, prompts: list, prompt_ids: list[list[int]], columns: dict[str, list],
                 num_generations: int, seeds: list[int] | None, cancelled: threading.Event | None = None
                 ) -> AgenticRound:
        """G rollouts per prompt, prompt-major (as `RolloutEngine.generate`). `prompts`: the dataset's prompts
        (text or messages); `columns`: their other dataset columns (P values each). `cancelled`: a round generated
        ahead stops issuing turns once it is set (engine/agent/multi_turn.py). A round that raises (or is
        cancelled) gives its environment instances back before the error leaves."""
        g = num_generations
        rows = [{"prompt": p} | {k: v[i] for k, v in columns.items()} for i, p in enumerate(prompts)]
        if self.rollout_func is not None:
            live = RoundEngine(engine, seeds, g, self.generation.max_completion_length, cancelled)
            repeated = [p for p in prompts for _ in range(g)]
            rollout, extra = call_rollout_func(self.rollout_func, repeated, self.tokenizer, live)
            return AgenticRound(rollout, extra)
        seed_of = lambda i, j: None if seeds is None else (seeds[i] * 1009 + j) % (2**31)  # noqa: E731
        samples = [Sample(prompt_ids[i], seed_of(i, j), {}) for i in range(len(prompts)) for j in range(g)]
        envs, names = [], []
        if self.environments is not None:
            names = [row.get("environment") if self.environments.is_multi else None for row in rows for _ in range(g)]
            envs = self.environments.take(names)
        try:
            return self._multi_turn(engine, samples, rows, envs, names, cancelled)
        except BaseException:
            if envs:
                self.environments.release(envs)
            raise

    def _multi_turn(self, engine: RolloutEngine, samples: list[Sample], rows: list[dict], envs: list,
                    names: list, cancelled: threading.Event | None) -> AgenticRound:
        """The round's samples to their ends, each environment (`envs`: one per sample, or none; `names`: their
        factories) reset first."""
        out_columns, shown = {}, []
        g = len(samples) // len(rows)
        if envs:
            for s, (k, env) in zip(samples, enumerate(envs)):
                row = dict(rows[k // g])
                row.pop("environment", None) if self.environments.is_multi else None
                observation = env.reset(**row)
                s.tools = environment_tools(env)
                prompt = row["prompt"]
                if observation is not None:
                    prompt = _with_observation(prompt, observation)
                if observation is not None or self.environments.is_multi:  # multi: only its environment's tools
                    s.prompt_ids = self._tokenize(prompt, self.toolbox.schemas + self.environments.schemas[names[k]])
                shown.append(prompt)
            out_columns["environments"] = envs
            out_columns[PROMPTS_KEY] = shown
        settings = MultiTurnSettings(self.generation.max_completion_length,
                                     self.generation.max_tool_calling_iterations, self.chat_template_kwargs())
        rollout, metrics = generate_multi_turn(engine, samples, self.tokenizer, self.toolbox, settings, cancelled)
        rollout.stats = metrics
        return AgenticRound(rollout, out_columns)

    def _tokenize(self, messages: list, schemas: list[dict]) -> list[int]:
        """A conversational prompt's ids, rendered as the dataset's are, showing the tools `schemas`."""
        if isinstance(messages, str):
            raise ValueError("environment_factory: reset() returned an observation for a text prompt, or several "
                             "environments need their own tools in it; use conversational prompts (lists of messages)")
        kwargs = dict(self.generation.chat_template_kwargs or {}) | ({"tools": schemas} if schemas else {})
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False, **kwargs)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def release(self, columns: dict) -> None:
        """The round's environments are free again (its rewards were computed; `columns`: `AgenticRound.columns`)."""
        if self.environments is not None and columns.get("environments"):
            self.environments.release(columns["environments"])

    def close(self) -> None:
        self.toolbox.close()

    def abort(self) -> None:
        """After a failed run: every environment instance back in the pool (the rounds that held them will never be
        scored) and the tools' threads stopped."""
        if self.environments is not None:
            self.environments.release_all()
        self.close()


def _with_observation(prompt, observation) -> list:
    """The prompt with reset()'s observation appended to its last user message (TRL's place for it)."""
    if isinstance(prompt, str):
        return prompt + str(observation)
    messages = copy.deepcopy(list(prompt))
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last_user]["content"] = f"{messages[last_user]['content']}{observation}"
    return messages
