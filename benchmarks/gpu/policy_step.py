"""Suite part c: a Megatron-core GRPO optimizer step, fused log-prob kernel against materialised logits.

Measures, for one model shape (benchmarks/bench_grpo_step.py's shapes, random weights, Megatron's local layer spec
since Transformer Engine is absent on the lent GPU, its attention through torch's SDPA, activation recompute as
`--gradient-checkpointing` says: off by default, as in part d) and each `--implementations` entry (the log-prob path:
`triton` = the fused kernel, `reference` = logits materialised, `torch_chunked` = the tiled torch path, all two-pass;
`onepass_cublas_triton` / `onepass_triton_fused` / `onepass_torch_chunked` = the one-pass LM head,
kernels/onepass_logprob.py):
- the step at the nominal batch (`--batch` completions of `--prompt-len` + `--completion-len` tokens in
  micro-batches of `--micro-batch`, DAPO, off-policy old log-probs): time, completion tokens/s, peak memory
  (rows exactly as `python -m benchmarks.bench_grpo_step` writes them, bench `grpo_step`, mode `train_step`);
- the LM head's share of that step: the implementation's LM-head forward + backward alone at the step's tokens per
  micro-batch, H and padded V (`_share_rows`), times the micro-batch count, over the step's p50: mode
  `lm_head_share`, metrics `lm_head_time` (ms) and `lm_head_share` (fraction; an estimate from the kernel alone, not
  a profile of the step);
- the longest completion that fits (benchmarks/gpu/longest_fit.py): one micro-batch of `--fit-micro-batch`
  sequences at each of `--fit-lengths`: mode `longest_fit`, a `peak_memory` row per length that ran and one
  `max_completion_len` row (tokens; 0 = none fitted) whose config says why the search stopped.
The model and optimizer are built once and shared by every implementation (same weights, same tokens); the
weights move by lr 1e-6 per step, which changes no timing. Rows are appended after each measurement, so a run
stopped by its time limit keeps what it measured.

    python -m benchmarks.gpu.policy_step --shape qwen2.5-1.5b --csv /tmp/grpo_step.csv       # one GPU
    python -m benchmarks.gpu.policy_step --shape qwen2.5-7b --num-layers 6 --csv /tmp/grpo_step.csv
    python -m benchmarks.gpu.policy_step --shape tiny --implementations torch_chunked,reference --batch 4 \\
        --micro-batch 2 --prompt-len 8 --completion-len 16 --fit-lengths 32 --csv /tmp/grpo_step.csv  # CPU smoke

Must not: judge timings (a program, not a test) or read Megatron's global parallel state (engine/ does that).

Run by the suite (benchmarks/gpu/suite.py) as part c; test: tests/integration/test_gpu_suite.py (CPU smoke).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.bench_grpo_step import (
    SHAPES,
    build_batch,
    build_policy_and_optimizer,
    make_step,
    model_config,
    train_step_rows,
)
from benchmarks.gpu.longest_fit import (
    add_step_arguments,
    find_longest_fit,
    free_memory,
    rows_unless_out_of_memory,
    search_rows,
)
from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row, peak_memory_fn, time_fn

MIB = 2**20


def _nominal_rows(env, args, implementation: str, step, completion_tokens: int, config: dict,
                  device: torch.device, lm_head=None) -> list:
    """time / tokens_per_s / peak_memory rows of the nominal step (bench_grpo_step's row format), then, given
    `lm_head` (hidden_size, vocab rows, dtype, micro-batch count), the LM head's share of the step (`_share_rows`)."""
    timing = time_fn(step, device=device, warmup=args.warmup, n_iters=args.iters)
    peak = peak_memory_fn(step, device=device).peak_bytes / MIB
    key = dict(bench="grpo_step", variant=f"megatron-{args.shape}", mode="train_step", x_name="completion_tokens",
               x_value=completion_tokens, config=config)
    print(f"megatron {args.shape} {implementation}: step p50 {timing.p50_ms:.1f} ms, "
          f"{completion_tokens / (timing.p50_ms / 1e3):.0f} completion tokens/s, peak {peak:.0f} MiB")
    rows = train_step_rows(env, key, timing, peak, completion_tokens)
    if lm_head is not None:
        rows += _share_rows(env, args, implementation, timing.p50_ms, completion_tokens, config, device, *lm_head)
    return rows


def _share_rows(env, args, implementation: str, step_ms: float, completion_tokens: int, config: dict,
                device: torch.device, hidden_size: int, vocab_rows: int, dtype: torch.dtype,
                num_micro: int) -> list:
    """The LM head's share of the step: its forward + backward alone (benchmarks/bench_fused_logprob.py, full mode,
    random inputs) at the step's tokens per micro-batch, H and padded V, times the micro-batch count, over the step's
    p50. Rows `lm_head_time` (ms per step) and `lm_head_share` (fraction), mode `lm_head_share`."""
    from benchmarks import bench_fused_logprob as fused
    from kernels.reference import build_lm_head_problem

    tokens = max(completion_tokens // num_micro, 1)
    x, w, y = build_lm_head_problem(tokens, hidden_size, vocab_rows, dtype=dtype, device=device, seed=1)
    g = torch.randn(tokens, device=device)
    inputs = (x, w, y, g, torch.zeros_like(g))
    workspace_mb = float(fused.ENGINE_WORKSPACE_MB)
    if implementation.startswith("onepass_"):
        call = fused._onepass_modes(implementation, inputs, workspace_mb)["full"]()
    else:
        call = fused._kernel_modes(implementation, inputs, workspace_mb)["full"]()
    timing = time_fn(call, device=device, warmup=args.warmup, n_iters=args.iters)
    head_ms = timing.p50_ms * num_micro
    key = dict(bench="grpo_step", variant=f"megatron-{args.shape}", mode="lm_head_share", x_name="completion_tokens",
               x_value=completion_tokens, config={**config, "lm_head_tokens": tokens, "num_micro": num_micro,
                                                  "hidden": hidden_size, "vocab_rows": vocab_rows,
                                                  "step_p50_ms": step_ms})
    print(f"megatron {args.shape} {implementation}: LM head {head_ms:.1f} ms of the {step_ms:.1f} ms step "
          f"({head_ms / step_ms:.3f})")
    return [make_row(env, **key, metric="lm_head_time", unit="ms", p20=timing.p20_ms * num_micro, p50=head_ms,
                     p80=timing.p80_ms * num_micro, n_iters=timing.n_iters),
            make_row(env, **key, metric="lm_head_share", unit="1", p20=timing.p20_ms * num_micro / step_ms,
                     p50=head_ms / step_ms, p80=timing.p80_ms * num_micro / step_ms, n_iters=timing.n_iters)]


def _fit_rows(env, args, implementation: str, popt, ps, hf_config, config: dict, deadline: float) -> list:
    """The longest-fit search of one implementation: a peak_memory row per length and the max_completion_len row."""

    def run_at_length(length: int) -> float:
        batch = build_batch(hf_config.vocab_size, args.fit_micro_batch, args.prompt_len, length, seed=length)
        step = make_step(popt, ps, batch, args.fit_micro_batch, hf_config.vocab_size, implementation)
        step()  # a first step at this shape: allocator growth, kernel compilation
        return peak_memory_fn(step, device=ps.device).peak_bytes / MIB

    search = find_longest_fit(run_at_length, args.fit_lengths, memory_budget_mib=args.memory_budget_mib,
                              deadline=deadline)
    print(f"megatron {args.shape} {implementation}: longest completion that fits (micro-batch "
          f"{args.fit_micro_batch}, prompt {args.prompt_len}): {search.longest} ({search.stopped})")
    return search_rows(env, "grpo_step", f"megatron-{args.shape}", search, config, args.fit_micro_batch,
                       args.fit_lengths)


def run(args: argparse.Namespace) -> None:
    """Build the model once, then per implementation: the nominal step, then the longest-fit search."""
    from engine.config import ParallelConfig
    from engine.policy.parallel import init_parallel
    from engine.policy.step import unwrap

    deadline = time.monotonic() + args.budget_s
    hf_config = model_config(args.shape, args.num_layers)
    ps = init_parallel(ParallelConfig(), seed=0)
    dtype = "float32" if args.shape == "tiny" else "bfloat16"
    popt, _ = build_policy_and_optimizer(hf_config, dtype, ps, recompute=args.gradient_checkpointing)
    env = capture_env(ps.device)
    print(f"megatron step on {env.device}: {args.shape} ({hf_config.num_hidden_layers} layers), {dtype}, "
          f"mcore {env.mcore_version}, git {env.git_sha or '?'}")
    batch = build_batch(hf_config.vocab_size, args.batch, args.prompt_len, args.completion_len)
    completion_tokens = int(batch.completion_mask.sum())
    weight = unwrap(popt.model[-1]).lm_head_weight()
    lm_head = (hf_config.hidden_size, weight.shape[0], weight.dtype, -(-args.batch // args.micro_batch))
    configs = {}
    for implementation in args.implementations:  # every nominal step first: the fit searches share the deadline
        configs[implementation] = config = {
            "shape": args.shape, "batch": args.batch, "micro_batch": args.micro_batch, "prompt_len": args.prompt_len,
            "completion_len": args.completion_len, "implementation": implementation, "dtype": dtype,
            "num_layers": hf_config.num_hidden_layers, "attention": "sdpa",
            "gradient_checkpointing": args.gradient_checkpointing}
        step = make_step(popt, ps, batch, args.micro_batch, hf_config.vocab_size, implementation)
        append_rows(args.csv, rows_unless_out_of_memory(
            lambda: _nominal_rows(env, args, implementation, step, completion_tokens, config, ps.device, lm_head),
            f"megatron {args.shape} {implementation} nominal step"))
        step = None
        free_memory()
    for implementation in args.implementations if args.fit_lengths else ():
        append_rows(args.csv, _fit_rows(env, args, implementation, popt, ps, hf_config, configs[implementation],
                                        deadline))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen2.5-1.5b")
    parser.add_argument("--num-layers", type=int, help="trim the model to this many layers (default: its own)")
    parser.add_argument("--implementations", default="triton,reference", type=lambda s: s.split(","))
    add_step_arguments(parser)
    parser.add_argument("--csv", type=Path, default=RESULTS_DIR / "grpo_step.csv")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
