"""Packing benchmark: the forward+backward of one GRPO optimizer step with right-padded micro-batches, token-budget
micro-batches and packed sequences, over one batch of long-tailed lengths and one of the demo's, in one run.

Variants (engine/policy/packing.py, one GRPO step = every micro-batch of the batch, DP=1):
- `padded`: `per_device_train_batch_size` = `--micro-batch` rows per micro-batch, every row right-padded to the
  batch's longest sequence (the engine's path with `train.padding_free=false`, no token budget);
- `token_budget`: `train.max_tokens_per_microbatch` = micro_batch x the longest sequence (packing's default budget;
  here counted in padded slots), sequences sorted by length, each micro-batch padded to its own longest;
- `packed`: `train.padding_free=true` (the default): several sequences per row, block-diagonal causal mask on CPU
  (Megatron's local spec; the THD path needs Transformer Engine), budget at its default.
Per variant: `tokens_computed` (token slots the model runs on, padding included), p20/p50/p80 of the
forward+backward (zero_grad + grpo_forward_backward; the optimizer step is the same for every variant and is left
out), and peak memory. Variants run interleaved, round by round, so slow spells of a shared machine fall on all alike.

Distributions (`--batch` completions each, fixed seed):
- `lognormal`: completion lengths exp(N(ln 300, `--sigma`)) rounded, clipped to [1, 4096] (median 300, a few long);
  prompts uniform in [32, 96] tokens;
- `demo`: the embedded demo's own prompts (builtin:arithmetic train split, tokenized by the shipped tokenizer) with
  the completion its reward scores as correct (" <think> 12 + 7 = 19 </think> <answer>19</answer>"): short and
  nearly equal lengths, where packing has little to remove.
The model is the project's tiny Qwen2 shape (hidden 128, 4 layers, 4 heads / 2 KV heads, vocab 400) with 8192
positions and random weights, float32, DAPO with off-policy old log-probs; the log-prob path is `auto` (the chunked
torch path on CPU, Triton on CUDA). On CPU the mask path computes attention over whole rows (rows x W^2), so its gain is
the padding it removes; absolute times count only on a GPU, where the THD path (Transformer Engine) also skips
cross-sequence attention. The packed row's variant names its layout: `packed_mask` (CPU), `packed_thd` (TE),
`packed_padded` (local spec with apex's fused softmax on a GPU: no packing there, token-budget rows; see
engine/policy/packing.py).

    python -m benchmarks.bench_packing                 # CPU, both distributions: ~30 min on the loaded shared 2-core VM
    python -m benchmarks.bench_packing --distributions demo --demo-iters 5 --csv /tmp/packing.csv
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row, peak_memory_fn, percentiles

MIB = 2**20
VARIANTS = ("padded", "token_budget", "packed")
MAX_COMPLETION = 4096


def lognormal_lengths(batch: int, sigma: float, seed: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, completion lengths): prompts U[32, 96], completions lognormal, median 300, in [1, 4096]."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(32, 97, (batch,), generator=gen).tolist()
    normal = torch.randn(batch, generator=gen, dtype=torch.float64)
    completions = [min(MAX_COMPLETION, max(1, round(math.exp(math.log(300) + sigma * float(z))))) for z in normal]
    return prompts, completions


def demo_sequences(batch: int) -> tuple[list[list[int]], list[list[int]]]:
    """The demo's first `batch` training prompts and their correct-format completions, as token ids."""
    from engine.models.tiny_model import build_tiny_tokenizer
    from engine.train.data import build_arithmetic_dataset

    tokenizer = build_tiny_tokenizer()
    rows = build_arithmetic_dataset("train").select(range(batch))
    prompts, completions = [], []
    for row in rows:
        problem = row["prompt"].split("what is ")[1].split("?")[0]
        prompts.append(tokenizer(row["prompt"])["input_ids"])
        completion = f" <think> {problem} = {row['answer']} </think> <answer>{row['answer']}</answer>"
        completions.append(tokenizer(completion)["input_ids"])
    return prompts, completions


def build_batch(prompts: list[list[int]], completions: list[list[int]], seed: int) -> dict:
    """pack_completions' dict plus advantages (B,) and off-policy old log-probs (B, C)."""
    from engine.policy.batch import pack_completions

    gen = torch.Generator().manual_seed(seed)
    batch = pack_completions(prompts, completions, pad_token_id=0)
    mask = batch.completion_mask
    batch.advantages = torch.randn(mask.shape[0], generator=gen)  # (B,)
    batch.old_logprobs = (-6.0 + 0.3 * torch.randn(mask.shape, generator=gen)) * mask  # (B, C)
    return batch


def random_tokens(lengths: list[int], vocab_size: int, gen: torch.Generator) -> list[list[int]]:
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def distribution_batch(name: str, args, vocab_size: int) -> dict:
    if name == "lognormal":
        prompt_lengths, completion_lengths = lognormal_lengths(args.batch, args.sigma, args.seed)
        gen = torch.Generator().manual_seed(args.seed + 1)
        return build_batch(random_tokens(prompt_lengths, vocab_size, gen),
                           random_tokens(completion_lengths, vocab_size, gen), args.seed)
    return build_batch(*demo_sequences(args.batch), args.seed)


def make_pass(popt, ps, micro: list[dict], normalizer, vocab_size: int):
    """The zero-argument forward+backward of one step over `micro` (zero_grad + grpo_forward_backward)."""
    from engine.config import GenerationConfig, GRPOConfigSection, KernelsConfig
    from engine.grpo.policy_loss import PolicyLossConfig
    from engine.policy.step import LogprobSettings, grpo_forward_backward

    settings = LogprobSettings(vocab_size=vocab_size, temperature=1.0,
                               kernels=KernelsConfig(loss_implementation="auto"))  # Triton on CUDA, chunked torch on CPU
    loss_config = PolicyLossConfig.from_sections(GRPOConfigSection(loss_type="dapo", epsilon_high=0.28),
                                                 GenerationConfig())

    def forward_backward():
        popt.zero_grad()
        grpo_forward_backward(popt.model, ps, micro, loss_config, normalizer, settings)

    return forward_backward


def run_distribution(name: str, args, popt, ps, hf_config, env) -> list:
    """Every variant on one distribution's batch, interleaved; returns the CSV rows."""
    from engine.config import ModelConfig, TrainConfig
    from engine.policy.packing import build_microbatch_spec, round_microbatches

    batch = distribution_batch(name, args, hf_config.vocab_size)
    passes, slots, layouts = {}, {}, {}
    # the packed default budget, micro_batch x the longest sequence; without packing it has to be given (None = rows)
    budget = args.micro_batch * int(batch.lengths.max())
    fields = {"padded": dict(padding_free=False), "packed": dict(padding_free=True),
              "token_budget": dict(padding_free=False, max_tokens_per_microbatch=budget)}
    for variant in VARIANTS:
        train_cfg = TrainConfig(per_device_train_batch_size=args.micro_batch, **fields[variant])
        spec = build_microbatch_spec(train_cfg, ModelConfig(), ps, micro_batch_size=args.micro_batch, pad_token_id=0)
        [(micro, normalizer)] = round_microbatches(batch, spec, global_batch_size=args.batch, dp_size=1, dp_rank=0)
        micro = [mb.to(ps.device) for mb in micro]
        passes[variant] = make_pass(popt, ps, micro, normalizer, hf_config.vocab_size)
        slots[variant] = sum(mb.model_input_ids.numel() for mb in micro)
        layouts[variant] = "rows" if spec.uses_rows else spec.layout
    samples = {variant: [] for variant in VARIANTS}
    iters = args.demo_iters if name == "demo" else args.iters
    for i in range(args.warmup + iters):
        for variant, fn in passes.items():
            start = time.perf_counter()
            fn()
            if i >= args.warmup:
                samples[variant].append((time.perf_counter() - start) * 1e3)
    lengths = batch.lengths
    config = {"model": "tiny-qwen2 (hidden 128, 4 layers, vocab 400, 8192 positions)", "dtype": "float32",
              "batch": args.batch, "micro_batch": args.micro_batch, "seed": args.seed,
              "lognormal": {"median": 300, "sigma": args.sigma, "max": MAX_COMPLETION, "prompt": [32, 96]}}
    rows = []
    for variant in VARIANTS:
        p20, p50, p80 = percentiles(samples[variant])
        memory = peak_memory_fn(passes[variant], device=ps.device)
        label = variant if variant != "packed" else f"packed_{layouts[variant]}"  # mask (CPU), thd (TE), padded
        key = dict(bench="packing", variant=label, mode="forward_backward", x_name="distribution", x_value=name,
                   config=config)
        rows += [
            make_row(env, **key, metric="time", unit="ms", p20=p20, p50=p50, p80=p80, n_iters=iters),
            make_row(env, **key, metric="tokens_computed", unit="tokens", p20=slots[variant], p50=slots[variant],
                     p80=slots[variant], n_iters=1),
            make_row(env, **key, metric="peak_memory", unit="MiB", p20=memory.peak_bytes / MIB,
                     p50=memory.peak_bytes / MIB, p80=memory.peak_bytes / MIB, n_iters=1),
        ]
        print(f"{name:9s} {label:12s}: {slots[variant]:7d} tokens computed ({int(lengths.sum())} real), "
              f"p50 {p50:9.1f} ms, x{slots['padded'] / slots[variant]:.2f} fewer tokens and "
              f"x{percentiles(samples['padded'])[1] / p50:.2f} faster than padded, peak {memory.peak_bytes / MIB:.0f} MiB")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="padded vs token-budget vs packed -> benchmarks/results/packing.csv")
    parser.add_argument("--distributions", default="lognormal,demo")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3, help="timed rounds of the lognormal batch")
    parser.add_argument("--demo-iters", type=int, default=15, help="timed rounds of the demo batch (fast, noisier)")
    parser.add_argument("--csv", default=str(RESULTS_DIR / "packing.csv"), help="where rows are appended")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)

    from benchmarks import plot
    from benchmarks.bench_grpo_step import build_policy_and_optimizer
    from engine.config import ParallelConfig
    from engine.models.tiny_model import tiny_model_config
    from engine.policy.parallel import init_parallel

    torch.manual_seed(args.seed)
    hf_config = tiny_model_config("qwen2")
    hf_config.max_position_embeddings = 8192
    ps = init_parallel(ParallelConfig(), seed=0)
    popt, _ = build_policy_and_optimizer(hf_config, "float32", ps)
    env = capture_env(ps.device)
    rows = []
    for name in args.distributions.split(","):
        rows += run_distribution(name, args, popt, ps, hf_config, env)
    path = append_rows(args.csv, rows, overwrite=args.overwrite)
    plot.redraw(path)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
