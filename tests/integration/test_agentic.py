"""Agentic GRPO end to end on CPU: GRPOTrainer with `tools` and an `environment_factory` together,
real in-process vLLM and real Megatron, one run (~1-1.5 min on 2 cores) that checks several behaviours:

- multi-turn rows: every tool call is executed and its message appended as token ids (the reward function gets the
  conversation: assistant turns and tool messages), at most `max_tool_calling_iterations` tool rounds per sample;
- a tool that raises, one that hangs past `tool_call_timeout_s`, an unknown tool, one returning a dict: the model
  sees {"error": ...} or str(value), `tools/failure_frequency` counts them, the run goes on (that calls of
  different samples overlap is tests/unit/test_agent_tools.py's);
- the environment pool: instances reused across rounds (reset once per rollout), their method a tool, `get_reward`
  a reward function (named after the class), `environments=` passed to the reward functions, reset()'s
  observation in the prompt;
- the completion-length metrics count the model's tokens only;
- `rollout_func` (a second run): its rows train, `env_mask` is the tool mask, its extra keys reach the rewards;
  through a subclass overriding TRL's `_generate`, whose rows train, and `_generate_single_turn` on the engine.

The tiny model knows no tool-call format, so `vllm_structured_outputs_regex` makes every turn a Hermes tool call:
what is tested is the engine's machinery, not the model's skill. The shipped tool-calling model
(`builtin:tiny-qwen2-calc`, examples/004_agentic_calculator.py) calls its tool without a regex; with it, float32:
- the engine's sampling log-probs of the model's tokens on rows with tool messages equal the trainer's, colocated
  and in server (split) mode against a server of its own;
- a run resumed from checkpoint-1 logs step 2 as the uninterrupted run did (environments rebuilt and reset: their
  state is not checkpointed);
- colocated at vLLM TP 2 (trainer TP 2, world 2): rank 0 drives, rank 1 mirrors its engine steps; every row's tokens
  are the chat template's rendering of its conversation, the tool mask keeps the model's tokens only, the log-probs
  equal the trainer's, and the first round's rows are the TP 1 run's;
- server mode with rounds generated one ahead (max_staleness=1): staleness exactly 1, the tool mask in the
  off-policy correction, environments leased per round, and resume generating the round ahead again; abort safety
  (a reward function raising at step 2 while the round ahead is driven): no engine thread left, every environment
  instance back in the pool, a second trainer in the same process trains; and survives the server SIGKILLed (and
  restarted) with a multi-turn round in flight; rollout_func at max_staleness=1 (background thread, a view of the
  trainer); DAPO's dynamic sampling with tools at max_staleness=1.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.distributed.launcher import run_distributed

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2.0
NAMES = ["add", "boom", "hang", "pair", "bead", "nope"]
REGEX = (r'<tool_call>\{"name": "(' + "|".join(NAMES) + r')", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>')


def add(a: int, b: int) -> int:
    """Add two digits.

    Args:
        a: first
        b: second
    """
    return a + b


def boom(a: int, b: int) -> str:
    """Raise.

    Args:
        a: first
        b: second
    """
    raise ValueError(f"boom {a}")


def hang(a: int, b: int) -> str:
    """Hang.

    Args:
        a: first
        b: second
    """
    time.sleep(4 * TIMEOUT_S)
    return "late"


async def pair(a: int, b: int) -> dict:
    """Pair two digits.

    Args:
        a: first
        b: second
    """
    return {"a": a, "b": b}


class Abacus:
    """An environment: beads moved so far; rewarded when any were."""

    built = 0

    def __init__(self):
        type(self).built += 1
        self.total, self.resets = 0, 0

    def reset(self, **row) -> str:
        self.total = 0
        self.resets += 1
        return " (abacus ready)"

    def bead(self, a: int, b: int) -> str:
        """Move beads.

        Args:
            a: first
            b: second
        """
        self.total += a + b
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total > 0)


def _record(path: str):
    def seen(prompts, completions, completion_ids, environments, **kwargs):
        with open(path, "a") as f:
            f.write(json.dumps({"prompts": prompts, "completions": completions,
                                "environments": [id(e) for e in environments],
                                "resets": [e.resets for e in environments]}) + "\n")
        return [0.0] * len(completions)
    return seen


def _train(output_dir: str) -> dict:
    import datasets
    from transformers import AutoTokenizer

    from engine import GRPOConfig, GRPOTrainer
    from engine.models.tiny_model import TOOL_CHAT_TEMPLATE, resolve_builtin_model

    source = resolve_builtin_model("builtin:tiny-qwen2-arith", Path(output_dir) / "cache")
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    dataset = datasets.load_dataset("json", data_files=str(REPO / "examples/data/math_conversational.jsonl"),
                                    split="train").select(range(8))
    record = str(Path(output_dir) / "rewards.jsonl")
    args = GRPOConfig(output_dir=str(Path(output_dir) / "run"), max_steps=2, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=200, learning_rate=1e-5, logging_steps=1,
                      vllm_gpu_memory_utilization=0.15, vllm_max_model_length=512, report_to="none",
                      vllm_structured_outputs_regex=REGEX, max_tool_calling_iterations=2,
                      tool_call_timeout_s=TIMEOUT_S, max_concurrent_tool_calls=16)
    trainer = GRPOTrainer(model=str(source), reward_funcs=_record(record), args=args, train_dataset=dataset,
                          processing_class=tokenizer, tools=[add, boom, hang, pair], environment_factory=Abacus)
    start = time.perf_counter()
    trainer.train()
    rows = [json.loads(line) for line in open(record)]
    history = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    return {"rows": rows, "history": history, "built": Abacus.built, "seconds": time.perf_counter() - start,
            "reward_names": trainer.reward_func_names}


@pytest.mark.slow
def test_tools_and_environments_in_a_real_run(tmp_path):
    (result,) = run_distributed(_train, 1, str(tmp_path))
    rows, history = result["rows"], result["history"]
    assert result["reward_names"][-1] == "Abacus"  # get_reward appended, named after the class
    assert len(history) == 2 and all(h["tools/call_frequency"] > 0 for h in history)
    assert all(0 < h["tools/failure_frequency"] < 1 for h in history)
    completions = [c for r in rows for c in r["completions"]]
    tool_texts = [m["content"] for c in completions for m in c if m["role"] == "tool"]
    assert any("boom 1" in t or "ValueError: boom" in t for t in tool_texts) or not any('"boom"' in json.dumps(c)
                                                                                        for c in completions)
    joined = "\n".join(tool_texts)
    for name, seen in (("hang", "timed out after 2.0 s"), ("nope", "unknown tool 'nope'"), ("pair", "{'a': ")):
        if any(f'"name": "{name}"' in m["content"] for c in completions for m in c if m["role"] == "assistant"):
            assert seen in joined, (name, joined[:2000])
    for c in completions:  # at most 2 tool rounds: assistant, tool, assistant, tool, assistant
        assert [m["role"] for m in c][:5] == ["assistant", "tool", "assistant", "tool", "assistant"][: len(c)]
        assert sum(m["role"] == "tool" for m in c) <= 2
    # the environment pool: 8 rollouts a round, 8 instances reused (+1 built at construction), each reset per round
    assert result["built"] <= 8 + 1
    assert [max(r["resets"]) for r in rows] == [1, 2]
    assert "(abacus ready)" in json.dumps(rows[0]["prompts"])
    assert all(h["completions/mean_length"] < 200 for h in history)


def _rollout_func_rows(tokenizer_dir: str):
    """A user's rollout_func: fixed rows (prompt, a model turn, 3 context tokens masked by env_mask, a model turn
    ending in EOS), one per incoming prompt, with an extra per-row key for the reward function."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    calls = []
    turn = tokenizer("<answer>4</answer>", add_special_tokens=False)["input_ids"]
    completion = turn + [5, 6, 7] + turn + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    mask = [1] * len(turn) + [0, 0, 0] + [1] * (len(turn) + 1)

    def rollout_func(prompts, trainer):
        calls.append((len(prompts), trainer.args.max_steps))
        ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
               for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [completion] * len(prompts),
                "logprobs": [[-1.0] * len(completion)] * len(prompts), "env_mask": [mask] * len(prompts),
                "row": list(range(len(prompts)))}

    return rollout_func, calls, sum(mask)


def _train_with_rollout_func(output_dir: str) -> dict:
    import datasets

    from engine import GRPOConfig, GRPOTrainer
    from engine.models.tiny_model import resolve_builtin_model

    source = resolve_builtin_model("builtin:tiny-qwen2-arith", Path(output_dir) / "cache")
    rollout_func, calls, num_model_tokens = _rollout_func_rows(str(source))
    seen = []

    def reward(completions, row, **kwargs):
        seen.append(list(row))
        return [float(r % 2) for r in row]

    dataset = datasets.load_dataset("json", data_files=str(REPO / "examples/data/math_conversational.jsonl"),
                                    split="train").select(range(8))
    args = GRPOConfig(output_dir=str(Path(output_dir) / "run"), max_steps=1, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=64, learning_rate=1e-5, logging_steps=1,
                      vllm_gpu_memory_utilization=0.15, vllm_max_model_length=256, report_to="none")
    single_turn = []

    class Overriding(GRPOTrainer):
        """A user's trainer overriding TRL's `_generate`: TRL's own (rollout_func's rows) with the extra column
        reversed, and the engine's single-turn generation of the same prompts (recorded, not trained)."""

        def _generate(self, prompts):
            prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = \
                super()._generate(prompts)
            ids, lps = self._generate_single_turn(prompt_ids, None, {}, 4)
            single_turn.extend((len(c), len(lp), max(lp)) for c, lp in zip(ids, lps))
            extra = {"row": extra["row"][::-1]}
            return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images

    trainer = Overriding(model=str(source), reward_funcs=reward, args=args, train_dataset=dataset,
                         rollout_func=rollout_func)
    trainer.train()
    record = next(h for h in trainer.state.log_history if "completions/mean_length" in h)
    return {"calls": calls, "seen": seen, "mean_length": record["completions/mean_length"],
            "num_model_tokens": num_model_tokens, "loss": record.get("loss"), "single_turn": single_turn}


@pytest.mark.slow
def test_rollout_func_rows_train_with_env_mask_and_extra_keys(tmp_path):
    """rollout_func's rows are what trains: called once per round with one prompt per row (P * G) and the trainer,
    its extra key reaches the reward function row by row, env_mask is the tool mask (the length metric counts only
    its 1s). Through a subclass overriding TRL's `_generate` (engine/api/trl_generate.py): the override's rows are
    what trains (its reversed extra column reaches the rewards), and `_generate_single_turn` called from it
    generates one completion per row with the run's vLLM engine (log-probs one per token, <= 0)."""
    (result,) = run_distributed(_train_with_rollout_func, 1, str(tmp_path))
    assert result["calls"] == [(8, 1)]
    assert result["seen"] == [list(range(8))[::-1]]
    assert len(result["single_turn"]) == 8
    assert all(1 <= n == m <= 64 and top <= 0.0 for n, m, top in result["single_turn"]), result["single_turn"]
    assert result["mean_length"] == result["num_model_tokens"]
    assert result["loss"] is not None


class Calculator:
    """examples/004_agentic_calculator.py's environment, as the shipped tool-calling tiny model was taught it."""

    def reset(self, **row) -> None:
        self.calls = []

    def calculate(self, expression: str) -> str:
        """Compute a + b or a - b.

        Args:
            expression: two integers and + or -, e.g. "482 + 317".
        """
        self.calls.append(expression)
        left, op, right = expression.split()
        return str(int(left) + int(right) if op == "+" else int(left) - int(right))

    def get_reward(self) -> float:
        return float(len(self.calls) > 0)


def _calculator_args(output_dir: str, **more):
    """The calculator runs' settings (`more` overrides them): the shipped tool-calling model, float32, no structured
    output."""
    from engine import GRPOConfig

    settings = dict(max_steps=2, bf16=False, per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=160, max_tool_calling_iterations=2, learning_rate=1e-4, logging_steps=1,
                    vllm_gpu_memory_utilization=0.15, vllm_max_model_length=512, report_to="none")
    return GRPOConfig(output_dir=output_dir, **(settings | more))


def _calculator_runs(output_dir: str) -> dict:
    """The shipped tool-calling model, float32, no structured output: run A (2 steps, a checkpoint after each, its
    rows recorded), then run B resumed from A's checkpoint-1 (a new trainer, new environments: their state is not
    checkpointed)."""
    from engine import GRPOTrainer
    from engine.demo.tool_warm_start import calculator_dataset

    histories, rows = [], []
    for name, resume in (("a", None), ("b", str(Path(output_dir) / "a" / "checkpoint-1"))):
        rewards = [_any_answer] + ([_row_layouts(rows)] if name == "a" else [])
        trainer = GRPOTrainer(model=CALC_MODEL, reward_funcs=rewards, args=_calculator_args(
                              str(Path(output_dir) / name), save_steps=1),
                              train_dataset=calculator_dataset("train", 64), environment_factory=Calculator)
        trainer.train(resume_from_checkpoint=resume)
        histories.append([h for h in trainer.state.log_history if "tools/call_frequency" in h])
    return {"a": histories[0], "b": histories[1], "tool_results": len(TOOL_RESULTS), "rows": rows}


def _calculator_at_engine_tp2(output_dir: str) -> dict:
    """Run A's first step at world 2, trainer TP 2 (DP 1: the same prompts and seeds as run A) and a colocated
    vLLM engine at TP 2: rank 0 drives every sample's turns and tools, rank 1 mirrors its engine steps
    (engine/rollout/colocated_turns.py). Rank 0 returns its rows (as run A records them) and history. A
    `rollout_func` generating through `trainer._generate_single_turn` takes the same mirrored path (the round's
    turn channel); it was checked by a launch of its own (8 rows, one call, log-prob gap < 1e-3), not kept: ~60-90 s
    of CI for the same plumbing."""
    import os

    from engine import GRPOTrainer
    from engine.demo.tool_warm_start import calculator_dataset

    rows: list = []
    trainer = GRPOTrainer(model=CALC_MODEL, reward_funcs=[_any_answer, _row_layouts(rows)],
                          args=_calculator_args(str(Path(output_dir) / "tp2"), max_steps=1, save_steps=100, tp_size=2,
                                                vllm_tensor_parallel_size=2),
                          train_dataset=calculator_dataset("train", 64), environment_factory=Calculator)
    trainer.train()
    return {"rank": int(os.environ["RANK"]), "rows": rows, "step": trainer.state.global_step,
            "history": [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/min" in h]}


def _row_layouts(rows: list):
    """A reward function (0.0 for every row) recording each row: its step, completion ids, model tokens and whether
    its tokens are the chat template's rendering of its conversation (`_layout`)."""
    def layouts(prompts, completions, completion_ids, trainer_state, **kwargs):
        from transformers import AutoTokenizer

        from engine.agent.environments import environment_tools
        from engine.agent.toolbox import tool_schema
        from engine.models.tiny_model import resolve_builtin_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_builtin_model(CALC_MODEL, "unused: shipped"))
        schemas = [tool_schema(m) for m in environment_tools(kwargs["environments"][0]).values()]
        for prompt, ids in zip(prompts, completion_ids):
            rows.append({"step": trainer_state.global_step, "ids": list(ids)} | _layout(tokenizer, schemas, prompt, ids))
        return [0.0] * len(completions)
    return layouts


def _layout(tokenizer, schemas: list, prompt: list, completion_ids: list[int]) -> dict:
    """Split a multi-turn completion into the model's turns (each through the stop token `<|im_end|>`) and the tool
    messages between them (the template's tokens for the `tool` messages whose contents the `<tool_response>` blocks
    hold, then the next assistant header: engine/agent/chat_tokens.py `tool_suffix_ids`, itself equal to the whole
    conversation's rendering, tests/unit/test_agent_tokens.py); then the decoded row (prompt ids as the template
    renders the prompt with the tools, + the completion) must be the template's rendering of the conversation.
    Returns the model's token count (what the tool mask keeps) and "" or what differs."""
    import re

    from engine.agent.chat_tokens import tool_suffix_ids

    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt_ids = list(tokenizer.apply_chat_template(prompt, tools=schemas, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
    messages, pos, model_tokens = list(prompt), 0, 0
    while pos < len(completion_ids):
        end = completion_ids.index(stop, pos) + 1 if stop in completion_ids[pos:] else len(completion_ids)
        text = tokenizer.decode(completion_ids[pos:end], skip_special_tokens=False)
        messages.append({"role": "assistant", "content": text.removesuffix("<|im_end|>")})
        model_tokens, pos = model_tokens + end - pos, end
        if pos == len(completion_ids):
            break
        rest = tokenizer.decode(completion_ids[pos:], skip_special_tokens=False)
        head = rest.split("<|im_start|>assistant")[0]
        tools = [{"role": "tool", "name": "calculate", "content": c}
                 for c in re.findall(r"<tool_response>\n(.*?)\n</tool_response>", head, re.S)]
        suffix = tool_suffix_ids(tokenizer, tools, stop, {"tools": schemas}) if tools else []
        if not tools or completion_ids[pos:pos + len(suffix)] != suffix:
            return {"model_tokens": model_tokens, "differs": f"tool tokens at {pos}: {rest[:300]!r}"}
        messages += tools
        pos += len(suffix)
    rendered = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False)
    decoded = tokenizer.decode(prompt_ids + list(completion_ids), skip_special_tokens=False)
    ok = rendered.startswith(decoded) and rendered[len(decoded):] in ("", "\n", "<|im_end|>\n")
    return {"model_tokens": model_tokens, "differs": "" if ok else f"rendered {rendered!r} vs row {decoded!r}"}


CALC_MODEL = "builtin:tiny-qwen2-calc"
TOOL_RESULTS: list[str] = []
"""The tool messages the reward function saw (the rank's process): rows where a tool result reached the model."""


class QuietCalculator:
    """The calculator environment without `get_reward` (whose scores would make every group informative)."""

    reset = Calculator.reset
    calculate = Calculator.calculate


def _any_answer(completions, **kwargs):
    TOOL_RESULTS.extend(m["content"] for c in completions for m in c if m.get("role") == "tool")
    return [float("<answer>" in c[-1]["content"]) for c in completions]


@pytest.mark.slow
def test_tool_rows_logprobs_match_the_trainer_and_a_resumed_run_continues(tmp_path):
    """Without a structured-output regex, the shipped tool-calling model (engine/demo/tool_warm_start.py) calls the
    calculator on its own: on those rows (model turns + tool messages, tool mask applied) vLLM's sampling log-probs
    of the model's tokens equal the trainer's in float32 (the tolerance of tests/integration/test_trainer.py's
    float32 run: mean gap < 1e-3 nats, IS weights > 0.99). The budget is 160 tokens: a tool call (~75 tokens of the
    tiny tokenizer) and its tool message (~39) must fit, or every row ends at the call and holds no tool tokens (at
    96, until git 980065e, none did: the test now counts the tool messages the rewards saw). The zero gradient on
    tool tokens is tests/unit/test_agent_loss_mask.py's. Resume: a run resumed from checkpoint-1 logs step 2 as the uninterrupted
    run did (environments are rebuilt and reset, their state is not checkpointed).
    Colocated at vLLM TP 2 (trainer TP 2, DP 1: the prompts and seeds of run A): rank 0 drives every sample and runs
    the tools, rank 1 mirrors each engine step (engine/rollout/colocated_turns.py); both runs' rows are the chat
    template's rendering of their conversations (`_layout`: prompt and tool-message tokens token for token, the whole
    row as text), `completions/mean_length` counts exactly the model's tokens of the layout (the tool mask), the
    engine's log-probs equal the trainer's, and round 0 (the checkpoint's weights) samples the TP 1 run's rows token
    for token (vLLM's seeded sampling at TP 2 in float32: measured equal). The TP 2 launch adds ~80 s (the loaded
    2-core machine, load average ~18-20: this test took 59 s before it, ~150 s with it)."""
    (result,) = run_distributed(_calculator_runs, 1, str(tmp_path))
    a, b = result["a"], result["b"]
    assert result["tool_results"] > 0, "no tool result reached the model: the rows hold no tool tokens"
    assert [h["step"] for h in a] == [1, 2] and [h["step"] for h in b] == [2], (a, b)
    for record in a + b:
        assert record["tools/call_frequency"] > 0.2, record  # tool rows in every round
        assert record["sampling/sampling_logp_difference/mean"] < 1e-3, record
        assert record["sampling/sampling_logp_difference/max"] < 1e-4, record  # measured 1e-6 to 4e-6
        assert record["sampling/importance_sampling_ratio/min"] > 0.99, record
    keys = ("reward", "loss", "tools/call_frequency", "completions/mean_length")
    assert {k: b[0][k] for k in keys} == {k: a[1][k] for k in keys}
    # colocated vLLM TP 2 (trainer TP 2): rank 0 drives every sample, rank 1 mirrors its engine steps; a wave not
    # mirrored stalls vLLM's TP collectives, which the launcher's timeout bounds (it fails the test)
    tp2 = run_distributed(_calculator_at_engine_tp2, 2, str(tmp_path), timeout_s=480)
    assert [r["step"] for r in tp2] == [1, 1] and tp2[1]["rows"] == [], "rank 0 drives and scores every row"
    rows, history = tp2[0]["rows"], tp2[0]["history"]
    assert [h["step"] for h in history] == [1], history
    for name, run_rows, run_history in (("tp1", result["rows"], a), ("tp2", rows, history)):
        assert all(r["differs"] == "" for r in run_rows), (name, [r["differs"] for r in run_rows if r["differs"]])
        for step, record in enumerate(run_history):  # the tool mask is the layout's: the metric counts model tokens
            mine = [r for r in run_rows if r["step"] == step]
            assert len(mine) == 8 and record["completions/mean_length"] == pytest.approx(
                sum(r["model_tokens"] for r in mine) / 8), (name, step, record)
    assert sum(len(r["ids"]) > r["model_tokens"] for r in rows) > 0, "no TP 2 row holds tool tokens"
    for record in history:
        assert record["tools/call_frequency"] > 0.2, record
        assert record["sampling/sampling_logp_difference/mean"] < 1e-3, record
        assert record["sampling/importance_sampling_ratio/min"] > 0.99, record
    # round 0 (the checkpoint's weights, the same prompts and seeds): the TP 1 run's samples
    assert [r["ids"] for r in rows if r["step"] == 0] == [r["ids"] for r in result["rows"] if r["step"] == 0]


def _calculator_in_server_mode(output_dir: str, url: str, token: str, group_port: int, name: str) -> dict:
    """The calculator run against a rollout server (server / split mode) at DP=2 (8 rows a round, 4 per rank),
    each turn its own request (engine/rollout/server_rollout.py `submit_turn`), rounds generated one ahead
    (max_staleness=1: rank 0's background thread drives every row's turns and tools, round r+1's while round r
    trains, and broadcasts the round): run "a", 2 steps, a checkpoint after each; run "b" resumed from a's
    checkpoint-1, which recorded round 1 (generated ahead) by its prompts and seeds. One run per launcher call:
    each rendezvouses on a fresh MASTER_PORT."""
    import os
    import warnings

    from engine import GRPOConfig, GRPOTrainer
    from engine.demo.tool_warm_start import calculator_dataset

    os.environ["GRPO_ENGINE_TOKEN"] = token
    seen = []

    def record(prompts, completions, completion_ids, environments, trainer_state, **kwargs):
        seen.append({"step": trainer_state.global_step, "prompts": prompts,
                     "environments": [id(e) for e in environments],
                     "tool_messages": sum(m["role"] == "tool" for c in completions for m in c),
                     "mean_tokens": sum(map(len, completion_ids)) / len(completion_ids)})
        return [0.0] * len(completions)

    resume = str(Path(output_dir) / "a" / "checkpoint-1") if name == "b" else None
    args = GRPOConfig(output_dir=str(Path(output_dir) / name), max_steps=2, save_steps=1, bf16=False,
                      vllm_mode="server", vllm_server_base_url=url, vllm_group_port=group_port, max_staleness=1,
                      per_device_train_batch_size=8 // int(os.environ["WORLD_SIZE"]), num_generations=4,
                      max_completion_length=128, max_tool_calling_iterations=2, learning_rate=1e-4, logging_steps=1,
                      report_to="none")
    trainer = GRPOTrainer(model=CALC_MODEL, reward_funcs=[_any_answer, record], args=args,
                          train_dataset=calculator_dataset("train", 64), environment_factory=Calculator)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    return {"history": [h for h in trainer.state.log_history if "tools/call_frequency" in h], "seen": seen,
            "warnings": [str(w.message) for w in warned if "generated ahead of the checkpoint" in str(w.message)],
            "step": trainer.state.global_step}


ENGINE_THREADS = ("agentic-ahead", "rollout-turn", "rollout-async", "rollout-request", "tool")
"""Name prefixes of the engine's threads (a round generated ahead, turn requests, single-turn requests, tools)."""


def _fails_then_trains(output_dir: str, url: str, token: str, ports: list[int], server_pid: int, marker: str) -> dict:
    """Abort safety (DP=1, rounds generated one ahead): a reward function raises at step 2 (round 1, while round 2
    is driven by rank 0's background thread); then the engine's threads still alive, the environment pool's leased
    instances, and a second trainer in the same process against the same server, 3 steps, whose reward function
    SIGKILLs the server at step 2 (round 2's turns in flight) and leaves `marker` for the test, which restarts it."""
    import os
    import signal
    import threading

    from engine import GRPOConfig, GRPOTrainer
    from engine.demo.tool_warm_start import calculator_dataset

    os.environ["GRPO_ENGINE_TOKEN"] = token

    def fails_at_step_2(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1:
            raise RuntimeError("reward fails at step 2")
        return [0.0] * len(completions)

    def args(name: str, max_steps: int, port: int, max_completion_length: int = 128, **more) -> GRPOConfig:
        return GRPOConfig(output_dir=str(Path(output_dir) / name), max_steps=max_steps, save_steps=100, bf16=False,
                          vllm_mode="server", vllm_server_base_url=url, vllm_group_port=port, max_staleness=1,
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=max_completion_length,
                          max_tool_calling_iterations=2, learning_rate=1e-4, logging_steps=1, report_to="none",
                          **more)

    trainer = GRPOTrainer(model=CALC_MODEL, reward_funcs=[fails_at_step_2], args=args("c", 4, ports[0]),
                          train_dataset=calculator_dataset("train", 64), environment_factory=Calculator)
    error = ""
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - what the test looks at
        error = f"{type(e).__name__}: {e}"
    engine_threads = lambda: [t.name for t in threading.enumerate() if t.name.startswith(ENGINE_THREADS)]  # noqa: E731
    deadline = time.monotonic() + 5.0  # idle pool workers leave on their own after shutdown
    while engine_threads() and time.monotonic() < deadline:
        time.sleep(0.1)
    pool = trainer._agentic.loop_inputs["environment_factory"]
    out = {"error": error, "alive": engine_threads(), "leased": pool.num_leased(), "instances": pool.num_instances()}

    def kills_the_server_at_step_2(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1 and not Path(marker).exists():
            os.kill(server_pid, signal.SIGKILL)
            Path(marker).write_text("killed")
        return [0.0] * len(completions)

    second = GRPOTrainer(model=CALC_MODEL, reward_funcs=[_any_answer, kills_the_server_at_step_2],
                         args=args("d", 3, ports[1]), train_dataset=calculator_dataset("train", 64),
                         environment_factory=Calculator)
    second.train()
    out |= {"second_step": second.state.global_step,
            "second_history": [h for h in second.state.log_history if "tools/call_frequency" in h]}
    calls = []

    def rollout_func(prompts, trainer):  # TRL's contract, generating with the engine through the trainer
        tokenizer = trainer.processing_class
        ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
               for p in prompts]
        completion_ids, logprobs = trainer._generate_single_turn(ids, None, {}, 4)
        calls.append({"thread": threading.current_thread().name, "step": trainer.state.global_step,
                      "rows": len(prompts), "view": trainer is not third and isinstance(trainer, GRPOTrainer),
                      "own_tokenizer": tokenizer is not third.processing_class})
        return {"prompt_ids": ids, "completion_ids": completion_ids, "logprobs": logprobs}

    third_args = args("e", 2, ports[2], max_completion_length=32)
    third = GRPOTrainer(model=CALC_MODEL, reward_funcs=lambda completions, **kw: [len(c[-1]["content"]) / 100.0
                                                                                for c in completions],
                        args=third_args, train_dataset=calculator_dataset("train", 64), rollout_func=rollout_func)
    third.train()
    out |= {"rollout_func_calls": calls,
            "rollout_func_history": [h for h in third.state.log_history if "rollout/staleness_mean" in h]}
    scored = []

    def informative_on_second_attempts(completions, **kwargs):  # every round's first attempt all 0: DAPO asks again
        scored.append(len(completions))
        if len(scored) % 2:
            return [0.0] * len(completions)
        return [len(json.dumps(c)) / 1000.0 for c in completions]

    dapo = args("f", 2, ports[3], use_dynamic_sampling=True, dynamic_sampling_max_rounds=2)
    fourth = GRPOTrainer(model=CALC_MODEL, reward_funcs=[informative_on_second_attempts], args=dapo,
                         train_dataset=calculator_dataset("train", 64), environment_factory=QuietCalculator)
    fourth.train()
    return out | {"dapo_scored": scored, "dapo_leased": fourth._agentic.loop_inputs["environment_factory"].num_leased(),
                  "dapo_history": [h for h in fourth.state.log_history if "tools/call_frequency" in h]}


@pytest.mark.slow
def test_tool_rows_at_dp2_in_server_mode_one_round_ahead_match_the_trainer_and_resume_regenerates_it(tmp_path):
    """Server (split) mode with tools at DP=2, rounds generated one ahead (max_staleness=1): the multi-turn rows
    come from a rollout server (a server of its own: the session's replica pair serves 128 positions, a calculator
    conversation needs ~250), tool calls run in rank 0's process (it drives every DP rank's rows and broadcasts the
    round, as the reward functions and environments live there; driving costs 0.3 ms CPU per turn, 0.3% of a
    round's wall time: benchmarks/bench_agentic_rollout.py `driver_cpu_ms_per_turn`); both ranks train every step.
    - round 0 (sampled by the weights it trains) has the server's sampling log-probs of the model's tokens equal to
      the trainer's (float32, as in the colocated test above); round 1 was generated while round 0 trained: its
      staleness is exactly 1, its rows keep their tool mask through the background thread and the broadcast (the
      rewards see tool messages, the length metric counts the model's tokens only, fewer than the rows hold);
    - round 1's environments are other instances than round 0's (round 0's get_reward is read after round 1 has
      reset its own: the pool leases them per round);
    - resume: checkpoint-1 held round 1 by its prompts and seeds only (environments are not checkpointed), so run B
      warns, generates round 1 again from the restored weights (staleness 0) with the same prompts, and trains step 2;
    - abort (a third launch, DP=1: a reward function raising on rank 0 would leave rank 1 in its broadcast): the
      reward raises at step 2 while round 2 is driven ahead; after the error no engine thread is alive (the round
      ahead cancelled and joined), the pool has every instance back, and a second trainer in the same process trains
      3 steps against the same server;
    - a server lost during a round ahead: that second trainer's reward function SIGKILLs the server at step 2 (round
      2's turns in flight), the test restarts it on its port; as a single-turn round in flight
      (tests/integration/test_async_rollout.py), the round is asked again once the restarted server is synced with
      the current weights (staleness 0 at step 3, one restart counted) and the run completes.
    - rollout_func with rounds generated one ahead (a third trainer, 2 steps, generating through
      `trainer._generate_single_turn`): called in rank 0's background thread on a view of the trainer at the step
      the round was issued, with its own tokenizer; staleness [0, 1]; its log-probs drive the correction (round 0's
      gap to the trainer < 1e-3, round 1's above).
    - DAPO's dynamic sampling with tools at max_staleness=1 (a fourth trainer, 2 steps): the further attempt of
      each round is driven from the trainer's thread while the round ahead is driven in the background, each
      through a turn channel of its own (engine/rollout/server_rollout.py `TurnChannel`).
    The third launch (four trainers, a server restart) adds ~90 s: the whole test took 199 s against 107 s before it
    (both measured the same hour on the shared 2-core machine, load average 13-17). Mutation-checked: `abort`
    not cancelling the pipeline ('agentic-ahead_0' alive), the agentic abort not releasing the leases (8 leased:
    round 1's, never scored), `PendingAgenticRound.result` re-raising the lost server (the run fails), the round
    ahead's rollout_func bound to the live trainer (not a view, the trainer's tokenizer, and round 1 saw step 1:
    the trainer had moved on while it ran), the DAPO round ahead on the engine's own turn channel (KeyError: a turn
    of the other driver taken).
    max_completion_length 128: a tool call (~75 tokens of the tiny tokenizer) and its tool message (~39) must fit,
    or the sample ends at the call and no row holds tool tokens (measured at 96: 0 tool messages in every round).
    Measured (2 cores): round 1 at staleness 1 has min IS ratio 0.76, mean |log-prob gap| 0.006 (at DP=1); ~2 min.
    Mutation-checked: the pool handing out leased instances (environment ids overlap), the round's tool mask
    dropped in `PendingAgenticRound.result` (min IS ratio 0.0: tool tokens, sampled log-prob 0.0, enter the
    correction), checkpoints storing multi-turn rounds ahead (the resumed round's rewards lack `environments`:
    the run fails)."""
    import secrets

    from tests.integration.test_rollout_server import Server, _group_port

    server = Server(tmp_path, secrets.token_hex(16), "rollout.vllm_max_model_length=256")
    try:
        runs = {name: run_distributed(_calculator_in_server_mode, 2, str(tmp_path), server.url, server.token,
                                      _group_port(), name) for name in ("a", "b")}
        marker = tmp_path / "killed"
        restarted = []  # the server restarted on its port once the second trainer's reward killed it

        def restart():
            while not marker.exists() and len(restarted) == 0:
                time.sleep(0.2)
            if marker.exists():
                server.proc.wait(timeout=30)
                restarted.append(Server(tmp_path, server.token, "rollout.vllm_max_model_length=256", port=server.port))

        watcher = threading.Thread(target=restart, daemon=True)
        watcher.start()
        try:
            (aborted,) = run_distributed(_fails_then_trains, 1, str(tmp_path), server.url, server.token,
                                         [_group_port() for _ in range(4)], server.proc.pid, str(marker))
        finally:
            restarted.append(None) if not marker.exists() else watcher.join(timeout=120)
    finally:
        for each in [server, *(r for r in restarted if r is not None)]:
            each.stop()
    # abort safety: the failed run cancelled its round ahead (no engine thread left), gave every environment
    # instance back, and a second trainer in the same process trains against the same server
    assert "reward fails at step 2" in aborted["error"], aborted
    assert aborted["alive"] == [] and aborted["leased"] == 0 and aborted["instances"] >= 8, aborted
    # a server lost while a multi-turn round is driven ahead: as a single-turn round in flight, the round is asked
    # again once the restarted server is synced with the current weights (staleness 0), and the run completes
    second = aborted["second_history"]
    assert aborted["second_step"] == 3 and [h["step"] for h in second] == [1, 2, 3], aborted
    assert [h["rollout/staleness_mean"] for h in second] == [0.0, 1.0, 0.0], second
    assert second[-1]["weight_sync/server_restarts"] == 1.0, second[-1]
    assert all(h["tools/call_frequency"] > 0.2 for h in second), second
    # rollout_func at max_staleness=1: called in the background thread for each round, one prompt per row, on a view
    # of the trainer at the step the round was issued (0 for both: round 1 is issued before round 0 trains), with a
    # tokenizer of its own; the log-probs it returns are the behaviour log-probs of the off-policy correction
    calls, history = aborted["rollout_func_calls"], aborted["rollout_func_history"]
    assert [(c["step"], c["rows"]) for c in calls] == [(0, 8), (0, 8)], calls
    assert all(c["thread"].startswith("agentic-ahead") and c["view"] and c["own_tokenizer"] for c in calls), calls
    assert [h["rollout/staleness_mean"] for h in history] == [0.0, 1.0], history
    gaps = [h["sampling/sampling_logp_difference/mean"] for h in history]
    assert gaps[0] < 1e-3 < gaps[1], gaps  # the engine's log-probs, by the weights it trains / one step stale
    # DAPO's dynamic sampling with tools at max_staleness=1: every round's first attempt is uninformative, so a second
    # attempt is driven from the trainer's thread while the round ahead drives its own turns (turn channels of their
    # own); both rounds train from their second attempts, tool rows in them, every environment given back
    dapo = aborted["dapo_history"]
    assert aborted["dapo_scored"] == [8, 8, 8, 8], aborted["dapo_scored"]
    assert [h["dynamic_sampling/rounds"] for h in dapo] == [2, 2], dapo
    assert all(h["tools/call_frequency"] > 0.0 for h in dapo) and aborted["dapo_leased"] == 0, (dapo, aborted)
    a, b = runs["a"][0]["history"], runs["b"][0]["history"]
    by_run = {name: ranks[0]["seen"] for name, ranks in runs.items()}
    assert [h["step"] for h in a] == [1, 2] and [h["step"] for h in b] == [2], (a, b)
    assert all(r["step"] == 2 for ranks in runs.values() for r in ranks)  # rank 1 trains every step too
    assert not runs["a"][1]["seen"] and not runs["b"][1]["seen"]  # rank 0 drives and scores every row
    assert [h["rollout/staleness_mean"] for h in a] == [0.0, 1.0] and b[0]["rollout/staleness_mean"] == 0.0
    for record in a + b:
        assert record["weight_sync/servers"] == 1, record
        assert record["tools/call_frequency"] > 0.2, record
        assert record["sampling/importance_sampling_ratio/min"] > 0.5, record
    for record in (a[0], b[0]):  # sampled by the weights they train
        assert record["sampling/sampling_logp_difference/mean"] < 1e-3, record
        assert record["sampling/importance_sampling_ratio/min"] > 0.99, record
    assert [r["step"] for r in by_run["a"]] == [0, 1] and [r["step"] for r in by_run["b"]] == [1], by_run
    assert not set(by_run["a"][0]["environments"]) & set(by_run["a"][1]["environments"])
    for record, rewarded in zip(a + b, by_run["a"] + by_run["b"]):  # the tool mask: in the rewards and the loss
        assert rewarded["tool_messages"] > 0 and record["completions/mean_length"] < rewarded["mean_tokens"], (
            {k: v for k, v in rewarded.items() if k != "prompts"}, record)
    assert by_run["b"][0]["prompts"] == by_run["a"][1]["prompts"]  # round 1 again, its own prompts
    assert not runs["a"][0]["warnings"] and len(runs["b"][0]["warnings"]) == 1, runs["b"][0]["warnings"]
    assert "rounds [1]" in runs["b"][0]["warnings"][0]
