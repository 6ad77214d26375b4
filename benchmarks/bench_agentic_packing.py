"""What masks and long multi-turn rows cost in training: one GRPO train step over
agentic rows, padded against packed, with the tool mask on against off, side by side in one run.

The rows: `--batch` multi-turn conversations as engine/agent/multi_turn.py lays them out (prompt, then
`--turns` model turns with a tool message between each two), fixed seed: prompts U[32, 96] tokens, completions
lognormal (median `--median` 600 tokens, sigma 0.5, clipped to [200, 2048]), of which a fraction U[0.2, 0.4] is tool
tokens (the tool messages, split evenly between the turns' gaps). Variants (engine/policy/packing.py, DP=1):
- `padded_*`: `train.padding_free=false`, `--micro-batch` rows per micro-batch, right-padded to the longest row;
- `packed_*`: `train.padding_free=true` (the default), several rows per packed row, block-diagonal causal mask on CPU;
- `*_tool_mask`: the loss mask is completion_mask x tool_mask (engine/train/loop.py `build_round`: tool tokens are
  context only); `*_no_mask`: every completion token trained on (the same rows as if the tools' tokens were the
  model's: what the mask changes).
Per variant: p20/p50/p80 of one train step (zero_grad + grpo_forward_backward + optimizer step), the peak memory
over the step (harness.peak_memory_fn), `tokens_computed` (slots the model runs on, padding included) and
`tokens_trained` (loss-mask tokens). Variants run interleaved, round by round, so slow spells of the shared machine
fall on all alike; CPU times are this machine's: compare the variants of one run. The model is the project's tiny
Qwen2 shape (hidden 128, 4 layers, vocab 400, 8192 positions), random weights, float32, DAPO with off-policy old
log-probs (bench_packing.py's pass).

    python -m benchmarks.bench_agentic_packing               # ~5 min on 2 idle cores
    python -m benchmarks.bench_agentic_packing --batch 8 --iters 2 --csv /tmp/agentic_packing.csv

Rows: benchmarks/results/agentic_packing.csv (benchmarks/harness.py), plots in benchmarks/results/plots/.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

import torch

from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row, peak_memory_fn, percentiles

MIB = 2**20
VARIANTS = ("padded_no_mask", "padded_tool_mask", "packed_no_mask", "packed_tool_mask")


def multi_turn_rows(args, vocab_size: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(prompt ids, completion ids, tool masks) of `args.batch` conversations (module docstring)."""
    gen = torch.Generator().manual_seed(args.seed)
    prompts, completions, masks = [], [], []
    for _ in range(args.batch):
        prompt_len = int(torch.randint(32, 97, (1,), generator=gen))
        z = float(torch.randn(1, generator=gen, dtype=torch.float64))
        total = min(2048, max(200, round(math.exp(math.log(args.median) + 0.5 * z))))
        tool_share = 0.2 + 0.2 * float(torch.rand(1, generator=gen))
        gaps = args.turns - 1
        tool_each = round(total * tool_share / gaps)  # tokens per tool message
        model_each = (total - tool_each * gaps) // args.turns  # tokens per model turn
        mask = []
        for turn in range(args.turns):
            mask += [1] * model_each + ([0] * tool_each if turn < gaps else [])
        prompts.append(torch.randint(3, vocab_size, (prompt_len,), generator=gen).tolist())
        completions.append(torch.randint(3, vocab_size, (len(mask),), generator=gen).tolist())
        masks.append(mask)
    return prompts, completions, masks


def build_batches(args, vocab_size: int) -> dict[str, dict]:
    """The round's batch with the loss mask as the tool mask makes it (`tool_mask`) and without (`no_mask`)."""
    from benchmarks.bench_packing import build_batch

    prompts, completions, masks = multi_turn_rows(args, vocab_size)
    plain = build_batch(prompts, completions, args.seed)
    tool_mask = torch.zeros_like(plain.completion_mask)  # (B, C)
    for i, row in enumerate(masks):
        tool_mask[i, : len(row)] = torch.tensor(row, dtype=tool_mask.dtype)
    masked = replace(plain, completion_mask=plain.completion_mask * tool_mask,  # as engine/train/round_batch.py build_round
                     old_logprobs=plain.old_logprobs * tool_mask)
    return {"no_mask": plain, "tool_mask": masked}


def make_step(popt, ps, micro: list[dict], normalizer, vocab_size: int):
    """One train step over `micro`: bench_packing's forward+backward, then the optimizer step."""
    from benchmarks.bench_packing import make_pass

    forward_backward = make_pass(popt, ps, micro, normalizer, vocab_size)

    def step():
        forward_backward()
        popt.step()

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="agentic rows: padded/packed x tool mask on/off -> "
                                                 "benchmarks/results/agentic_packing.csv")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--median", type=int, default=600, help="median completion tokens (model + tool)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--csv", default=str(RESULTS_DIR / "agentic_packing.csv"), help="where rows are appended")
    args = parser.parse_args(argv)

    from benchmarks import plot
    from benchmarks.bench_grpo_step import build_policy_and_optimizer
    from engine.config import ModelConfig, ParallelConfig, TrainConfig
    from engine.models.tiny_model import tiny_model_config
    from engine.policy.packing import build_microbatch_spec, round_microbatches
    from engine.policy.parallel import init_parallel

    torch.manual_seed(args.seed)
    hf_config = tiny_model_config("qwen2")
    hf_config.max_position_embeddings = 8192
    ps = init_parallel(ParallelConfig(), seed=0)
    popt, _ = build_policy_and_optimizer(hf_config, "float32", ps)
    batches = build_batches(args, hf_config.vocab_size)
    steps, counts = {}, {}
    for variant in VARIANTS:
        layout, mask = variant.split("_", 1)
        batch = batches[mask]
        train_cfg = TrainConfig(per_device_train_batch_size=args.micro_batch, padding_free=layout == "packed")
        spec = build_microbatch_spec(train_cfg, ModelConfig(), ps, micro_batch_size=args.micro_batch, pad_token_id=0)
        [(micro, normalizer)] = round_microbatches(batch, spec, global_batch_size=args.batch, dp_size=1, dp_rank=0)
        steps[variant] = make_step(popt, ps, micro, normalizer, hf_config.vocab_size)
        counts[variant] = {"tokens_computed": sum(mb.model_input_ids.numel() for mb in micro),
                           "tokens_trained": int(batch.completion_mask.sum())}
    samples = {variant: [] for variant in VARIANTS}
    for i in range(args.warmup + args.iters):
        for variant, fn in steps.items():
            start = time.perf_counter()
            fn()
            if i >= args.warmup:
                samples[variant].append((time.perf_counter() - start) * 1e3)
    env = capture_env(ps.device)
    lengths = batches["no_mask"].completion_mask.sum(1)
    config = {"model": "tiny-qwen2 (hidden 128, 4 layers, vocab 400, 8192 positions)", "dtype": "float32",
              "batch": args.batch, "micro_batch": args.micro_batch, "turns": args.turns, "seed": args.seed,
              "completion": {"median": args.median, "sigma": 0.5, "range": [200, 2048], "tool_share": [0.2, 0.4]},
              "completion_tokens": int(lengths.sum())}
    rows = []
    base = percentiles(samples["padded_no_mask"])[1]
    for variant in VARIANTS:
        p20, p50, p80 = percentiles(samples[variant])
        memory = peak_memory_fn(steps[variant], device=ps.device)
        key = dict(bench="agentic_packing", variant=variant, mode="train_step", x_name="turns", x_value=args.turns,
                   config=config)
        rows += [make_row(env, **key, metric="time", unit="ms", p20=p20, p50=p50, p80=p80, n_iters=args.iters),
                 make_row(env, **key, metric="peak_memory", unit="MiB", p20=memory.extra_bytes / MIB,
                          p50=memory.extra_bytes / MIB, p80=memory.extra_bytes / MIB, n_iters=1)]
        rows += [make_row(env, **key, metric=name, unit="tokens", p20=n, p50=n, p80=n, n_iters=1)
                 for name, n in counts[variant].items()]
        print(f"{variant:17s}: {counts[variant]['tokens_computed']:6d} tokens computed, "
              f"{counts[variant]['tokens_trained']:6d} trained, step p50 {p50:8.1f} ms (x{base / p50:.2f} of "
              f"padded_no_mask), peak +{memory.extra_bytes / MIB:.0f} MiB", flush=True)
    path = append_rows(args.csv, rows)
    plot.redraw(path)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
