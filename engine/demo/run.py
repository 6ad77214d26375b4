"""The embedded demo behind the README's first command (`make demo`, i.e. `grpo-engine demo`).

Owns: running GRPO end to end on CPU from `configs/tiny_cpu.yaml`: the shipped warm-started tiny Qwen2
(`builtin:tiny-qwen2-arith`, trained by `python -m engine.demo.warm_start`), the embedded arithmetic task
(`builtin:arithmetic`) with held-out prompts, the `accuracy` reward, real Megatron and real in-process vLLM. It
prints the held-out reward before and after training and where the curves (`metrics.png`) are.

Must not: be imported by other engine modules.

Run: `grpo-engine demo [section.key=value ...]`, or at TP=2 on gloo:
`torchrun --nproc-per-node 2 -m engine demo parallel.tp_size=2`.
"""

from __future__ import annotations

import time
from pathlib import Path

from engine.config import load_config


def run_demo(config_path: Path, overrides: list[str]) -> int:
    """Train on the embedded config, then print the run summary (engine/train/run_summary.py; the held-out reward is
    the mean accuracy on the test split); returns the process exit status."""
    from engine.train.loop import train
    from engine.train.run_summary import format_run_summary

    start = time.perf_counter()
    cfg = load_config(config_path, overrides)
    summary = train(cfg)
    if summary["rank"] == 0:
        print(format_run_summary(cfg, summary, time.perf_counter() - start))
    return 0
