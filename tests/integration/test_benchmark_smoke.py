"""Every benchmark the README's headline table quotes runs at HEAD: each at its smallest size, its rows appended to
a CSV of the test's own (benchmarks/results/ is never touched). A headline figure whose program no longer runs would
otherwise stay on the front page until someone tried to reproduce it.

Which benchmarks: those of benchmarks/results_page.py `HEADLINES` (a test below fails when a headline's benchmark
has no smoke run here). Sizes are the smallest each program accepts. Measured on the shared 2-core machine: the
four in-process benchmarks about 80 s together; the async-rollout run (a rollout server and a trainer, each starting
vLLM or Megatron) about a minute when the machine is quiet, several when other jobs load it.
"""

import csv
import sys
from pathlib import Path

import pytest

from benchmarks import results_page
from tests.helpers import warm_python

ROOT = Path(__file__).resolve().parents[2]

SMOKE = {
    "fused_logprob": ["--cpu", "--tokens", "64", "--hidden", "32", "--vocab", "128", "--iters", "1", "--warmup", "0"],
    "lora": ["--layers", "1", "--hidden", "64", "--ffn", "128", "--rank", "4", "--iters", "1"],
    "packing": ["--distributions", "lognormal", "--batch", "4", "--micro-batch", "2", "--iters", "1", "--warmup", "0"],
    "grpo_step": ["--batch", "4", "--micro-batch", "2", "--prompt-len", "8", "--completion-len", "16", "--iters", "1",
                  "--warmup", "0"],
    # one server, k = 1: the trainer and the server sample with min_tokens = the completion length (both must be
    # started with it, or the client refuses the server's log-prob mode)
    "async_rollout": ["--servers", "1", "--ks", "1", "--steps", "3", "--warmup", "1", "--num-prompts", "2",
                      "--num-generations", "2", "--max-completion-length", "8", "--micro-batch", "4"],
}
"""CSV stem -> the smallest arguments of `python -m benchmarks.bench_<stem>`."""


def test_every_headline_benchmark_has_a_smoke_run():
    missing = sorted({h.stem for h in results_page.HEADLINES} - set(SMOKE))
    assert not missing, f"headline benchmarks without a smoke run in this file: {missing}"


@pytest.mark.parametrize("stem", sorted(SMOKE))
def test_benchmark_runs_at_its_smallest_size(stem, tmp_path):
    out = tmp_path / f"{stem}.csv"
    result = warm_python.run([sys.executable, "-m", f"benchmarks.bench_{stem}", *SMOKE[stem], "--csv", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"bench_{stem} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    rows = list(csv.DictReader(out.open()))
    assert rows and all(row["bench"] == stem for row in rows), f"bench_{stem} appended no rows of its own to {out}"
    headline_variants = {v for h in results_page.HEADLINES if h.stem == stem for v in (h.fast, h.slow) if v}
    measured = {row["variant"] for row in rows}
    if stem in ("fused_logprob", "grpo_step"):  # GPU-only variants (Triton, the GPU shapes) are absent on CPU
        headline_variants &= {"reference", "torch_chunked"}
    if stem == "lora":
        headline_variants = {"full"}  # the smoke run's rank is 4: lora_r4
    if stem == "async_rollout":
        headline_variants = {"k1"}  # only k = 1 here (k = 0 is the same program without the overlap)
    assert headline_variants <= measured, f"bench_{stem}: variants {headline_variants - measured} not measured"
