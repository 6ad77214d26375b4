"""Suite part f: one GRPO optimizer step on a long-tailed batch, each side at its defaults: the engine (recompute on,
packing on, token-budget micro-batches) with its fused layer kernels and varlen attention on and off, and TRL 1.16
(gradient checkpointing on, `use_liger_kernel` off and on).

The batch (`long_tail_batch`, the same tokens for every variant): `--batch` completions (64) whose lengths are drawn
from a log-normal with median `--median` (600) and 99th percentile `--p99` (8000), capped at `--cap` (8192), each
after a `--prompt-len` (256) prompt; advantages and off-policy old log-probs as benchmarks/bench_grpo_step.py's.

What each side does with it, as at its defaults:
- engine: engine/policy/packing.py's plan for `TrainConfig()` (padding_free, token budget = micro-batch x the
  longest sequence), Megatron's full recompute, `model.layer_kernel_implementation` and
  `model.packed_attention_implementation` per variant (`ENGINE_VARIANTS`);
- TRL: micro-batches of `--micro-batch` completions (TRL's per_device_train_batch_size, 8), each padded to its own
  longest completion (the generation batch is padded to its longest; trimming each micro-batch is TRL's best case),
  gradient checkpointing on, bf16 model and AdamW states (benchmarks/gpu/trl_step.py's trainer).
Rows (`long_tail.csv`, bench `long_tail_step`, mode `train_step`): time, `tokens_per_s` = useful (unpadded)
completion tokens per second, peak memory; the config names the variant's settings and the padded token count.

    python -m benchmarks.gpu.long_tail --shape qwen2.5-1.5b --csv /tmp/long_tail.csv     # one GPU
    python -m benchmarks.gpu.long_tail --shape tiny --batch 4 --median 12 --p99 40 --cap 48 --prompt-len 8 \\
        --micro-batch 2 --iters 1 --warmup 0 --csv /tmp/long_tail.csv                    # CPU smoke

Must not: judge timings, or read Megatron's global parallel state (engine/ does that).

Run by the suite (benchmarks/gpu/suite.py) as part f; test: tests/integration/test_gpu_suite.py (CPU smoke),
tests/unit/test_gpu_suite_parts.py (the batch's lengths).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.bench_grpo_step import SHAPES, model_config, train_step_rows
from benchmarks.gpu.longest_fit import free_memory, rows_unless_out_of_memory
from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, peak_memory_fn, time_fn

if TYPE_CHECKING:
    from engine.policy.microbatch import MicroBatch

MIB = 2**20
BENCH = "long_tail_step"
ENGINE_VARIANTS = {
    "engine": {"layer_kernel_implementation": "auto", "packed_attention_implementation": "auto"},
    "engine-no-fused-layers": {"layer_kernel_implementation": "torch", "packed_attention_implementation": "auto"},
    "engine-no-varlen": {"layer_kernel_implementation": "auto", "packed_attention_implementation": "masked"},
}
"""Engine variants: the defaults, then each with one of this part's two features off (each one's share)."""
Z_99 = 2.3263478740408408
"""The standard normal's 99th percentile."""


def long_tail_lengths(n: int, median: float, p99: float, cap: int, seed: int = 0) -> list[int]:
    """n completion lengths from a log-normal with this median and 99th percentile, capped, at least 1."""
    mu, sigma = math.log(median), (math.log(p99) - math.log(median)) / Z_99
    gen = torch.Generator().manual_seed(seed)
    draws = torch.exp(mu + sigma * torch.randn(n, generator=gen, dtype=torch.float64))
    return [max(1, min(cap, int(round(float(x))))) for x in draws]


def long_tail_batch(vocab_size: int, lengths: list[int], prompt_len: int, seed: int = 0) -> dict:
    """pack_completions' MicroBatch of random prompts (`prompt_len` each) and completions of `lengths`, plus advantages
    (B,) and off-policy old log-probs (B, C): the same for every variant."""
    from engine.policy.batch import pack_completions

    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab_size, (len(lengths), prompt_len), generator=gen).tolist()
    completions = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
    packed = pack_completions(prompts, completions, pad_token_id=0)
    mask = packed.completion_mask
    packed.advantages = torch.randn(len(lengths), generator=gen)  # (B,)
    packed.old_logprobs = (-11.0 + 0.3 * torch.randn(mask.shape, generator=gen)) * mask  # (B, C)
    return packed


def _engine_step(hf_config, dtype: str, ps, batch: MicroBatch, micro_batch: int, settings: dict):
    """(step, config extras) of the engine at its defaults with `settings` in the model section."""
    from engine.config import (
        GenerationConfig,
        GRPOConfigSection,
        KernelsConfig,
        ModelConfig,
        OptimizerConfig,
        TrainConfig,
    )
    from engine.grpo.policy_loss import PolicyLossConfig
    from engine.policy.model import build_policy, init_weights_by_name
    from engine.policy.optimizer import build_optimizer
    from engine.policy.packing import build_microbatch_spec, round_microbatches
    from engine.policy.sdpa_attention import serves_varlen
    from engine.policy.step import LogprobSettings, grpo_forward_backward

    model_cfg, train_cfg = ModelConfig(dtype=dtype, **settings), TrainConfig(per_device_train_batch_size=micro_batch)
    chunks = build_policy(hf_config, model_cfg, ps, train_cfg)
    init_weights_by_name(chunks, ps, seed=0)
    popt = build_optimizer(OptimizerConfig(learning_rate=1e-6), chunks, ps, total_steps=1_000_000)
    spec = build_microbatch_spec(train_cfg, model_cfg, ps, micro_batch_size=micro_batch, pad_token_id=0,
                                 varlen=serves_varlen(chunks))
    ((micro, normalizer),) = round_microbatches(batch, spec, global_batch_size=batch.tokens.shape[0], dp_size=1,
                                                dp_rank=0)
    micro = [m.to(ps.device) for m in micro]
    logprob = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=1.0, kernels=KernelsConfig())
    loss_config = PolicyLossConfig.from_sections(GRPOConfigSection(loss_type="dapo", epsilon_high=0.28),
                                                 GenerationConfig())

    def step():
        popt.zero_grad()
        grpo_forward_backward(popt.model, ps, micro, loss_config, normalizer, logprob)
        popt.step()

    row_tokens = sum(int(m.input_ids.numel()) for m in micro)
    flash = importlib.util.find_spec("torch.nn.attention.varlen") is not None and torch.cuda.is_available()
    return step, {"micro_batches": len(micro), "row_tokens": row_tokens, "layout": spec.attention,
                  "flash_varlen_available": flash,
                  "gradient_checkpointing": train_cfg.gradient_checkpointing, "padding_free": spec.padding_free,
                  **settings}


def _measure(env, args, key: dict, step, tokens: int, device, label: str) -> list:
    def nominal() -> list:
        timing = time_fn(step, device=device, warmup=args.warmup, n_iters=args.iters)
        peak = peak_memory_fn(step, device=device).peak_bytes / MIB
        print(f"{label}: step p50 {timing.p50_ms:.1f} ms, {tokens / (timing.p50_ms / 1e3):.0f} useful completion "
              f"tokens/s, peak {peak:.0f} MiB")
        return train_step_rows(env, key, timing, peak, tokens)

    return rows_unless_out_of_memory(nominal, label)


def run_engine(args, hf_config, batch: MicroBatch, tokens: int, config: dict) -> None:
    from engine.config import ParallelConfig
    from engine.policy.parallel import destroy_parallel, init_parallel

    dtype = "float32" if args.shape == "tiny" else "bfloat16"
    for variant in args.engine_variants:
        ps = init_parallel(ParallelConfig(), seed=0)
        env = capture_env(ps.device)
        step, extras = _engine_step(hf_config, dtype, ps, batch, args.micro_batch, ENGINE_VARIANTS[variant])
        key = dict(bench=BENCH, variant=variant, mode="train_step", x_name="completion_tokens", x_value=tokens,
                   config={**config, "dtype": dtype, **extras})
        append_rows(args.csv, _measure(env, args, key, step, tokens, ps.device, f"{variant} {args.shape}"))
        step = None
        destroy_parallel(keep_process_group=True)
        free_memory()


def _trl_step(trainer, batch: MicroBatch, prompt_len: int, micro_batch: int):
    """TRL's compute_loss + backward per micro-batch of `micro_batch` completions, each trimmed to its longest
    completion, then the trainer's optimizer step; returns (step, padded completion tokens)."""
    from benchmarks.gpu.trl_step import trl_inputs

    inputs = trl_inputs(batch, prompt_len, trainer.model.device)
    num_items = inputs["completion_mask"].sum().float()
    micro, padded = [], 0
    for i in range(0, inputs["prompt_ids"].shape[0], micro_batch):
        rows = {k: v[i: i + micro_batch] for k, v in inputs.items()}
        width = int(rows["completion_mask"].sum(1).max())
        for name in ("completion_ids", "completion_mask", "old_per_token_logps"):
            rows[name] = rows[name][:, :width]
        padded += width * rows["prompt_ids"].shape[0]
        micro.append({**rows, "num_items_in_batch": num_items})
    trainer.current_gradient_accumulation_steps = len(micro)
    trainer.args.steps_per_generation = len(micro)

    def step():
        trainer.optimizer.zero_grad(set_to_none=True)
        for inputs_micro in micro:
            trainer.compute_loss(trainer.model, inputs_micro).backward()
        trainer.optimizer.step()

    return step, padded


def run_trl(args, hf_config, batch: MicroBatch, tokens: int, config: dict) -> None:
    from benchmarks.gpu.trl_step import build_trainer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = capture_env(device)
    trainer_args = argparse.Namespace(batch=args.batch, micro_batch=args.micro_batch, completion_len=args.cap,
                                      gradient_checkpointing=True)
    for use_liger in args.liger:
        variant = "trl+liger" if use_liger else "trl"
        if use_liger and importlib.util.find_spec("liger_kernel") is None:
            print(f"SUITE-NOTE: {variant} skipped: liger-kernel is not installed")
            continue
        with tempfile.TemporaryDirectory() as output_dir:
            trainer = build_trainer(hf_config, trainer_args, use_liger, output_dir)
            step, padded = _trl_step(trainer, batch, args.prompt_len, args.micro_batch)
            key = dict(bench=BENCH, variant=variant, mode="train_step", x_name="completion_tokens", x_value=tokens,
                       config={**config, "use_liger_kernel": use_liger, "gradient_checkpointing": True,
                               "padded_completion_tokens": padded,
                               "model_dtype": str(trainer.model.dtype).removeprefix("torch.")})
            append_rows(args.csv, _measure(env, args, key, step, tokens, trainer.model.device,
                                           f"{variant} {args.shape}"))
            step = None
            del trainer
        free_memory()


def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.budget_s
    hf_config = model_config(args.shape, args.num_layers)
    lengths = long_tail_lengths(args.batch, args.median, args.p99, args.cap, seed=args.seed)
    batch = long_tail_batch(hf_config.vocab_size, lengths, args.prompt_len, seed=args.seed)
    tokens = sum(lengths)
    config = {"shape": args.shape, "num_layers": hf_config.num_hidden_layers, "batch": args.batch,
              "micro_batch": args.micro_batch, "prompt_len": args.prompt_len, "median": args.median, "p99": args.p99,
              "cap": args.cap, "seed": args.seed, "longest": max(lengths), "completion_tokens": tokens}
    print(f"long-tailed batch: {args.batch} completions, {tokens} tokens, median {sorted(lengths)[len(lengths) // 2]}"
          f", longest {max(lengths)}, prompts {args.prompt_len}")
    if "engine" in args.sides and importlib.util.find_spec("megatron.core") is not None:
        run_engine(args, hf_config, batch, tokens, config)
    if "trl" in args.sides and time.monotonic() < deadline:
        if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
            print("SUITE-NOTE: trl skipped: trl / datasets are not installed")
        else:
            run_trl(args, hf_config, batch, tokens, config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen2.5-1.5b")
    parser.add_argument("--num-layers", type=int, help="trim the model to this many layers (default: its own)")
    parser.add_argument("--batch", type=int, default=64, help="completions per optimizer step")
    parser.add_argument("--median", type=float, default=600.0)
    parser.add_argument("--p99", type=float, default=8000.0)
    parser.add_argument("--cap", type=int, default=8192)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8, help="TRL's per_device_train_batch_size (its default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="engine,trl", type=lambda s: s.split(","))
    parser.add_argument("--engine-variants", default=",".join(ENGINE_VARIANTS), type=lambda s: s.split(","))
    parser.add_argument("--liger", default="off,on", type=lambda s: [v == "on" for v in s.split(",")])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=400.0, help="TRL is not started after this many seconds")
    parser.add_argument("--csv", type=Path, default=RESULTS_DIR / "long_tail.csv")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
