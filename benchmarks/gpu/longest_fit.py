"""The longest completion that fits: run a training step at growing completion lengths until one does not fit.

Owns: `find_longest_fit`, shared by the Megatron step (benchmarks/gpu/policy_step.py) and the TRL step
(benchmarks/gpu/trl_step.py), so both are searched by the same rule: lengths in ascending order, one step each; a
length fits when its step ran without running out of memory and its peak stayed within `memory_budget_mib` (when
given); the search stops at the first length that does not fit, or when the deadline has passed (the answer is then
"at least the longest that fitted"). On a GPU, out of memory is the caching allocator's `OutOfMemoryError`; the CPU
has no such signal, so the CPU smoke run passes a memory budget to exercise the same stop.

`search_rows` turns a search into rows (mode `longest_fit`); `add_step_arguments` is the command line both step parts
share (the nominal batch, the search, timing). Must not: time anything (the caller's `run_at_length`
measures) or write files.

Test: tests/unit/test_gpu_suite_parts.py (its stopping rules) and tests/integration/test_gpu_suite.py (the suite's
`--cpu` mode).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.harness import make_row


@dataclass
class FitSearch:
    """What the search found: `longest` (0 when nothing fitted), every length tried and why it stopped."""

    longest: int = 0
    peaks_mib: dict[int, float] = field(default_factory=dict)
    """Peak memory (MiB) of every length that ran."""
    stopped: str = "every length fitted"


def is_out_of_memory(error: BaseException) -> bool:
    """A CUDA allocator OOM, a CPU MemoryError, or a RuntimeError whose message says out of memory."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def free_memory() -> None:
    """Drop garbage and hand cached CUDA blocks back, so the next length starts from the same baseline."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rows_unless_out_of_memory(measure: Callable[[], list], label: str) -> list:
    """`measure()`'s rows, or [] and a `SUITE-NOTE` line when it ran out of memory (a result at that shape, not a
    crash; other errors propagate); memory is freed afterwards either way."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - only out-of-memory errors are an answer
        if not is_out_of_memory(error):
            raise
        print(f"SUITE-NOTE: {label}: out of memory")
        return []
    finally:
        free_memory()


def find_longest_fit(run_at_length: Callable[[int], float], lengths: list[int], *,
                     memory_budget_mib: float | None = None, deadline: float | None = None) -> FitSearch:
    """Longest of `lengths` (ascending) whose step fits.

    Args:
        run_at_length: runs one step at a completion length and returns its peak memory in MiB; raises an
            out-of-memory error (see `is_out_of_memory`) when it does not fit. Other errors propagate.
        lengths: completion lengths to try, ascending.
        memory_budget_mib: a length whose peak exceeds this does not fit; None = only out of memory decides.
        deadline: `time.monotonic()` after which no further length is started; None = no limit.

    Returns:
        FitSearch with the longest length that fitted, the peaks and the reason the search stopped.
    """
    search = FitSearch()
    for length in sorted(lengths):
        if deadline is not None and time.monotonic() > deadline:
            search.stopped = f"time budget spent before {length}"
            break
        oom = None
        try:
            peak = run_at_length(length)
        except Exception as error:  # noqa: BLE001 - only out-of-memory errors are an answer; the rest propagate
            if not is_out_of_memory(error):
                raise
            oom = f"out of memory at {length}: {(str(error).splitlines() or [''])[0][:160]}"
        free_memory()
        if oom is not None:
            search.stopped = oom
            break
        search.peaks_mib[length] = peak
        if memory_budget_mib is not None and peak > memory_budget_mib:
            search.stopped = f"peak {peak:.0f} MiB > budget {memory_budget_mib:.0f} MiB at {length}"
            break
        search.longest = length
    return search


def search_rows(env, bench: str, variant: str, search: FitSearch, config: dict, micro_batch: int,
                lengths: list[int]) -> list:
    """Rows of a search (mode `longest_fit`): `peak_memory` (MiB) per length that ran (x `completion_len`), then
    `max_completion_len` (tokens; 0 = none fitted; x `micro_batch`) whose config adds the lengths tried and why the
    search stopped. `config` is the workload (shape, prompt length, implementation...), without the nominal batch."""
    config = {k: v for k, v in config.items() if k not in ("batch", "completion_len")} | {"micro_batch": micro_batch}
    key = dict(bench=bench, variant=variant, mode="longest_fit")
    rows = [make_row(env, **key, metric="peak_memory", unit="MiB", x_name="completion_len", x_value=length,
                     p20=peak, p50=peak, p80=peak, n_iters=1, config=config)
            for length, peak in search.peaks_mib.items()]
    rows.append(make_row(env, **key, metric="max_completion_len", unit="tokens", x_name="micro_batch",
                         x_value=micro_batch, p20=search.longest, p50=search.longest, p80=search.longest, n_iters=1,
                         config={**config, "tried": lengths, "stopped": search.stopped}))
    return rows


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The step parts' shared flags: the nominal batch, the longest-fit search and the timing."""
    parser.add_argument("--batch", type=int, default=16, help="completions per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=1024)
    parser.add_argument("--fit-micro-batch", type=int, default=1, help="sequences per step in the longest-fit search")
    parser.add_argument("--fit-lengths", default="2048,4096,8192,16384,32768",
                        type=lambda s: [int(x) for x in s.split(",") if x], help="'' skips the search")
    parser.add_argument("--memory-budget-mib", type=float, help="a fit's peak must stay within this (CPU smoke)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="no new fit length after this many seconds")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="activation recompute (TRL's default, and the engine's); off here on both sides")
