"""The GPU proof in one command: every part a GPU can show, most valuable first, each bounded in time.

Parts (each a subprocess, so a crash, a CUDA error or an out-of-memory in one leaves the next untouched; each
killed at its time limit, keeping the rows it already wrote):
  a. kernel_tests: `pytest tests/kernels tests/gpu` (on a GPU: real Triton at the tests' shapes, then the kernel and
     the Megatron GRPO step at real sizes: `make test-gpu`'s tests; the CPU smoke runs only the LM head's agreement
     tests, enough to prove the part's plumbing: tests/kernels runs in full on its own tier);
  b. lm_head: the bf16 GEMM floor, Triton tile and one-pass row-tile choices per H (written as a tuned-tile table,
     <results>/tuned/<device>.json), the fused log-prob sweep (two-pass Triton at default and tuned tiles, one-pass
     cuBLAS + Triton and cuBLAS-chunked torch) against the torch reference and Liger (benchmarks/gpu/lm_head.py);
  c. megatron_step: Megatron-core GRPO step, two-pass and one-pass LM heads vs materialised logits, and the LM
     head's share of the step, at Qwen2.5-1.5B and at Qwen2.5-7B trimmed to `TRIMMED_7B_LAYERS` layers
     (benchmarks/gpu/policy_step.py);
  d. trl_step: the same batch through TRL's GRPOTrainer loss path, use_liger_kernel off / on
     (benchmarks/gpu/trl_step.py);
  e. packing: benchmarks/bench_packing.py (skipped, saying so, where the module is missing);
  f. long_tail: a long-tailed batch, the engine at its defaults (fused layer kernels and varlen attention on / off)
     against TRL at its defaults (use_liger_kernel off / on), useful completion tokens/s (benchmarks/gpu/long_tail.py).
A part whose packages do not import (megatron-core, trl, datasets) is skipped with the reason; so is one that the
remaining `--budget-s` cannot hold.

Every part appends rows (benchmarks/harness.py's CSV: device, git sha, torch / vLLM / Megatron / Triton versions)
to a CSV in the results folder: `$OUT` when set (the lent GPU machine), else benchmarks/results/, or
`--results-dir`. The suite adds `suite.csv`: one `wall_time` row per part (config: status ok / failed / timeout /
skipped, the reason, the parts' `SUITE-NOTE:` lines, rows written, CPU seconds) and one `environment` row (config: transformers,
trl, liger-kernel, datasets, CUDA and Python versions). The whole output is also in `suite.log`. A short table is
printed last.

    python -m benchmarks.gpu.suite                        # GPU: every part (see PLAN.md for the 10-minute split)
    python -m benchmarks.gpu.suite --parts a,b            # some parts
    python -m benchmarks.gpu.suite --cpu --results-dir /tmp/suite   # CPU smoke: tiny sizes, TRITON_INTERPRET=1

Must not: create a CUDA context itself (the parts own the GPU), install anything (run.sh does), or judge numbers.

On the lent machine, benchmarks/gpu/run.sh installs the carried wheels first and then runs this. Test:
tests/integration/test_gpu_suite.py runs the CPU smoke and checks its rows.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import os
import platform
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch

from benchmarks.gpu.summary import print_summary
from benchmarks.harness import (
    CSV_COLUMNS,
    REPO_ROOT,
    RESULTS_DIR,
    append_rows,
    capture_env,
    make_row,
    package_version,
    read_rows,
)

TRIMMED_7B_LAYERS = 6
"""Qwen2.5-7B with 6 of its 28 layers (every other dimension exact): 2.49e9 parameters x 18 bytes (bf16 weights, fp32
gradient buffer, fp32 main weights and Adam states) = 41.7 GiB, leaving ~36 GiB of an H100's ~78 GiB for
activations (the whole model would need 127.7 GiB)."""
MIN_PART_S = 30
"""A part is not started with less time left than this."""
NOTE_PREFIX = "SUITE-NOTE: "


@dataclass(frozen=True)
class Part:
    """One part: a module run as `python -m module args` on the GPU or in the CPU smoke."""

    key: str
    name: str
    module: str
    gpu_args: tuple[str, ...]
    cpu_args: tuple[str, ...]
    gpu_timeout_s: int
    cpu_timeout_s: int
    csv_names: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    """Modules that must import for the part to run."""


STEP_IMPLEMENTATIONS = "triton,onepass_cublas_triton,onepass_triton_fused,onepass_torch_chunked,reference"
"""Part c's LM-head paths: the two-pass Triton kernel, the one-pass loss on cuBLAS + Triton row kernels, on fused
Triton GEMMs and on torch ops (cuBLAS-chunked), the materialised logits."""
FIT = ("--fit-lengths", "1024,2048,3072,4096,6144,8192,12288,16384,24576,32768")
CPU_STEP = ("--shape", "tiny", "--batch", "4", "--micro-batch", "2", "--prompt-len", "8", "--completion-len", "16",
            "--fit-lengths", "32", "--iters", "1", "--warmup", "0")
PARTS = (
    Part("a", "kernel_tests", "pytest",
         ("tests/kernels", "tests/gpu", "-q", "-rfE", "-p", "no:cacheprovider", "-o", "addopts="),
         ("tests/kernels/test_lm_head_logprob.py", "-k", "agrees", "-q", "-p", "no:cacheprovider", "-o", "addopts="),
         240, 180),
    Part("b", "lm_head", "benchmarks.gpu.lm_head", ("--results-dir", "{results}"),
         ("--cpu", "--results-dir", "{results}"), 560, 300, ("gemm.csv", "fused_logprob.csv")),
    Part("c", "megatron_step", "benchmarks.gpu.policy_step",
         ("--shape", "qwen2.5-1.5b", "--implementations", STEP_IMPLEMENTATIONS, "--csv", "{results}/grpo_step.csv",
          "--budget-s", "120", *FIT),
         ("--implementations", "torch_chunked,onepass_torch_chunked,reference", "--csv", "{results}/grpo_step.csv",
          *CPU_STEP), 260, 300, ("grpo_step.csv",), ("megatron.core",)),
    Part("c7", "megatron_step_7b", "benchmarks.gpu.policy_step",
         ("--shape", "qwen2.5-7b", "--num-layers", str(TRIMMED_7B_LAYERS), "--implementations",
          STEP_IMPLEMENTATIONS, "--csv", "{results}/grpo_step.csv", "--budget-s", "120", *FIT), (), 260, 0,
         ("grpo_step.csv",), ("megatron.core",)),
    Part("d", "trl_step", "benchmarks.gpu.trl_step",
         ("--shape", "qwen2.5-1.5b", "--csv", "{results}/trl_grpo_step.csv", "--budget-s", "150", *FIT),
         ("--csv", "{results}/trl_grpo_step.csv", *CPU_STEP), 300, 300, ("trl_grpo_step.csv",), ("trl", "datasets")),
    Part("e", "packing", "benchmarks.bench_packing", (), (), 120, 180, ("packing.csv",), ("benchmarks.bench_packing",)),
    Part("f", "long_tail", "benchmarks.gpu.long_tail",
         ("--shape", "qwen2.5-1.5b", "--csv", "{results}/long_tail.csv", "--iters", "2", "--warmup", "1",
          "--budget-s", "330"),
         ("--shape", "tiny", "--batch", "4", "--median", "12", "--p99", "40", "--cap", "48", "--prompt-len", "8",
          "--micro-batch", "2", "--iters", "1", "--warmup", "0", "--engine-variants", "engine",
          "--csv", "{results}/long_tail.csv"), 540, 300, ("long_tail.csv",), ("megatron.core",)),
)
"""In order of value. c7 (the trimmed 7B) runs on a GPU only: the CPU smoke has one tiny shape and does the least
work that still writes every row the GPU run writes (one longest-fit probe, two tile candidates at the smallest
shape, one timed call). The CPU limits are generous (the smoke takes about 150 s of CPU in all, some 70 s of it
importing torch, Megatron and TRL in each part's process; `cpu_s` in suite.csv) because a loaded shared 2-core
machine stretches that several times (15 to 20 minutes of wall time on one)."""


@dataclass
class Outcome:
    """What one part did: status ok / failed / timeout / skipped, why, its notes, wall seconds, CPU seconds (user +
    system of the part's processes: what a shared machine's load does not stretch) and rows written."""

    status: str
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    rows: int = 0


def count_rows(results_dir: Path, csv_names: tuple[str, ...]) -> int:
    """Data rows currently in the part's CSVs (to report how many it wrote)."""
    total = 0
    for name in csv_names:
        path = results_dir / name
        if path.exists():
            total += max(sum(1 for _ in path.open()) - 1, 0)
    return total


def missing_module(part: Part) -> str | None:
    """The first of the part's needed modules that is not installed, else None."""
    for name in part.needs:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ModuleNotFoundError:
            return name
    return None


def skip_reason(part: Part, cpu: bool, remaining_s: float, packing_flags: str = "") -> str | None:
    """Why a part cannot run here, or None."""
    if cpu and not part.cpu_args and part.key != "e":
        return "GPU only (the CPU smoke runs one tiny shape in part c)"
    name = missing_module(part)
    if name == "benchmarks.bench_packing":
        return "benchmarks/bench_packing.py does not exist yet: this slot runs it once it lands"
    if name is not None:
        return f"{name} is not installed (benchmarks/gpu/fetch_wheels.sh carries it to the GPU machine)"
    if part.key == "e" and cpu and "--csv" not in packing_flags:
        return ("benchmarks/bench_packing.py has no --csv option: the CPU smoke would append to the checked-in "
                "benchmarks/results/packing.csv (on a GPU the suite copies the run's rows to the results folder)")
    if remaining_s < MIN_PART_S:
        return f"{remaining_s:.0f} s left of --budget-s: run this part in its own command (benchmarks/gpu/PLAN.md)"
    return None


PACKING_CPU_ARGS = (("--distributions", "demo"), ("--batch", "4"), ("--iters", "1"), ("--demo-iters", "1"),
                    ("--warmup", "0"))
"""bench_packing's flags for the CPU smoke, each passed only where its --help lists it."""


def packing_help() -> str:
    """benchmarks/bench_packing.py's --help text (its flags decide what the suite can pass)."""
    return subprocess.run([sys.executable, "-m", "benchmarks.bench_packing", "--help"], capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=120).stdout


def part_command(part: Part, cpu: bool, results_dir: Path, packing_flags: str = "") -> list[str]:
    """`python -m module args` with `{results}` filled in; bench_packing gets --csv and the CPU flags it accepts."""
    args = [a.replace("{results}", str(results_dir)) for a in (part.cpu_args if cpu else part.gpu_args)]
    if part.key == "e":
        if "--csv" in packing_flags:
            args += ["--csv", str(results_dir / "packing.csv")]
        if cpu:
            args += [item for flag, value in PACKING_CPU_ARGS if flag in packing_flags for item in (flag, value)]
    return [sys.executable, "-m", part.module, *args]


def move_packing_rows(results_dir: Path, since: float) -> None:
    """bench_packing without --csv writes benchmarks/results/packing.csv: copy this run's rows to `results_dir`."""
    source = RESULTS_DIR / "packing.csv"
    if results_dir.resolve() == RESULTS_DIR.resolve() or not source.exists():
        return
    rows = [r for r in read_rows(source) if datetime.fromisoformat(r["timestamp"]).timestamp() >= int(since)]
    target = results_dir / "packing.csv"
    is_new = not target.exists()
    with target.open("a", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        if is_new:
            writer.writerow(CSV_COLUMNS)
        writer.writerows([r[c] for c in CSV_COLUMNS] for r in rows)


def run_part(part: Part, cpu: bool, results_dir: Path, timeout_s: float, log, packing_flags: str = "") -> Outcome:
    """Run one part in its own process group, echo and log its output, kill the group at `timeout_s`."""
    command = part_command(part, cpu, results_dir, packing_flags)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cpu:
        env["TRITON_INTERPRET"] = "1"
    print(f"\n=== part {part.key} ({part.name}), limit {timeout_s:.0f} s: {' '.join(command[1:])}", flush=True)
    log.write(f"\n=== part {part.key} ({part.name}): {' '.join(command)}\n")
    start, cpu_before = time.monotonic(), children_cpu_s()
    proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    outcome = Outcome(status="ok")
    last_lines: list[str] = []
    timer = _Deadline(proc, timeout_s)
    for line in proc.stdout:
        sys.stdout.write(line)
        log.write(line)
        stripped = line.strip()
        if stripped.startswith(NOTE_PREFIX):
            outcome.notes.append(stripped[len(NOTE_PREFIX):])
        if part.key == "a" and (" passed" in stripped or " failed" in stripped) and " in " in stripped:
            outcome.notes.append(stripped.strip("= "))
        if stripped:
            last_lines = (last_lines + [stripped])[-3:]
    returncode = proc.wait()
    timer.cancel()
    outcome.wall_s, outcome.cpu_s = time.monotonic() - start, children_cpu_s() - cpu_before
    if timer.fired:
        outcome.status, outcome.reason = "timeout", f"killed at its {timeout_s:.0f} s limit"
    elif returncode != 0:
        outcome.status, outcome.reason = "failed", f"exit {returncode}: {' | '.join(last_lines)[-300:]}"
    return outcome


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished (waited-for) children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _Deadline:
    """Kills a process group when its time is up (checked by a timer thread)."""

    def __init__(self, proc: subprocess.Popen, timeout_s: float):
        self.fired = False
        self._proc = proc
        self._timer = threading.Timer(timeout_s, self._kill)
        self._timer.daemon = True
        self._timer.start()

    def _kill(self) -> None:
        self.fired = True
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cancel(self) -> None:
        self._timer.cancel()


def suite_env(cpu: bool):
    """harness.capture_env, with the GPU's name read in a child process: the suite process itself never creates a
    CUDA context, which would hold device memory through every part (and shift their longest fits)."""
    env = capture_env("cpu")
    if cpu:
        return env
    name = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                          capture_output=True, text=True, timeout=120).stdout.strip()
    return dataclasses.replace(env, device=name or "cuda (name unread)", num_gpus=torch.cuda.device_count())


def extra_versions() -> dict[str, str]:
    """Versions the harness's columns do not hold."""
    return {
        "python": platform.python_version(),
        "cuda": torch.version.cuda or "",
        "transformers": package_version("transformers"),
        "trl": package_version("trl"),
        "liger_kernel": package_version("liger-kernel", "liger_kernel"),
        "datasets": package_version("datasets"),
    }


def suite_rows(env, mode: str, outcomes: dict[str, Outcome], versions: dict) -> list:
    """One wall_time row per part (status in its config) and the environment row."""
    rows = []
    for part in PARTS:
        if part.key not in outcomes:
            continue
        o = outcomes[part.key]
        config = {"part": part.name, "status": o.status, "reason": o.reason, "notes": o.notes, "rows": o.rows,
                  "cpu_s": round(o.cpu_s, 1)}
        rows.append(make_row(env, bench="gpu_suite", variant=f"{part.key}_{part.name}", mode=mode, metric="wall_time",
                             unit="s", x_name="part", x_value=part.key, p20=o.wall_s, p50=o.wall_s, p80=o.wall_s,
                             n_iters=1, config=config))
    rows.append(make_row(env, bench="gpu_suite", variant="environment", mode=mode, metric="versions", unit="",
                         x_name="part", x_value="env", p20=0, p50=0, p80=0, n_iters=1, config=versions))
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU smoke: tiny sizes, TRITON_INTERPRET=1")
    parser.add_argument("--parts", default=",".join(p.key for p in PARTS),
                        help=f"comma-separated keys, in the order given ({', '.join(p.key for p in PARTS)})")
    out = os.environ.get("OUT")
    parser.add_argument("--results-dir", type=Path, default=Path(out) if out else RESULTS_DIR,
                        help="where the CSVs go (default: $OUT when set, else benchmarks/results)")
    parser.add_argument("--budget-s", type=float, help="total seconds for all parts (default 570 GPU, 1200 CPU)")
    args = parser.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 1200.0 if args.cpu else 570.0
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --cpu for the CPU smoke")
    known = {p.key: p for p in PARTS}
    unknown = [k for k in args.parts.split(",") if k not in known]
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {list(known)}")
    args.parts = [known[k] for k in args.parts.split(",")]
    return args


def main(argv: list[str] | None = None) -> dict[str, Outcome]:
    """Run the chosen parts in order, write suite.csv, print the table; returns the outcomes by part key."""
    args = parse_args(argv)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    mode = "cpu" if args.cpu else "gpu"
    env = suite_env(args.cpu)
    versions = extra_versions()
    started, start_clock = time.time(), time.monotonic()
    print(f"GPU suite ({mode}) on {env.device}: git {env.git_sha or '?'}, results -> {args.results_dir}")
    outcomes: dict[str, Outcome] = {}
    with (args.results_dir / "suite.log").open("a") as log:
        for part in args.parts:
            remaining = args.budget_s - (time.monotonic() - start_clock)
            packing_flags = packing_help() if part.key == "e" and missing_module(part) is None else ""
            reason = skip_reason(part, args.cpu, remaining, packing_flags)
            if reason is not None:
                outcomes[part.key] = Outcome(status="skipped", reason=reason)
                print(f"\n=== part {part.key} ({part.name}) skipped: {reason}", flush=True)
                log.write(f"\n=== part {part.key} ({part.name}) skipped: {reason}\n")
                continue
            before = count_rows(args.results_dir, part.csv_names)
            limit = min(part.cpu_timeout_s if args.cpu else part.gpu_timeout_s, remaining)
            part_start = time.time()
            outcomes[part.key] = run_part(part, args.cpu, args.results_dir, limit, log, packing_flags)
            if part.key == "e" and "--csv" not in packing_flags:
                move_packing_rows(args.results_dir, part_start)
            outcomes[part.key].rows = count_rows(args.results_dir, part.csv_names) - before
    append_rows(args.results_dir / "suite.csv", suite_rows(env, mode, outcomes, versions))
    print_summary(args.results_dir, env, versions, outcomes, PARTS, since=started)
    return outcomes


if __name__ == "__main__":
    main()
