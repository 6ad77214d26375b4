"""GRPO train-step benchmark: one optimizer step of the Megatron policy (forward, fused-loss backward, Adam) on one
device, random weights, writing step time, completion tokens/s and peak memory to `benchmarks/results/grpo_step.csv`.

Shapes: `tiny` (the project's tiny Qwen2, float32: what a CPU can run) and `qwen2.5-1.5b` (Qwen2.5-1.5B's shape:
hidden 1536, 28 layers, 12 heads / 2 KV heads, MLP 8960, vocab 151936, tied embeddings; bf16, for a GPU). The batch
is `--batch` completions of `--prompt-len` + `--completion-len` tokens in micro-batches of `--micro-batch`; the
loss is DAPO with off-policy old log-probs (clipping active), the log-prob path is `--implementation` (auto = the
Triton kernel on CUDA, the chunked torch path on CPU). Absolute times count only on a GPU.

    python -m benchmarks.bench_grpo_step                                         # CPU, tiny shape
    python -m benchmarks.bench_grpo_step --shape qwen2.5-1.5b --batch 16 --micro-batch 4 \\
        --prompt-len 256 --completion-len 1024                                    # one GPU (issue 5's acceptance)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row, peak_memory_fn, time_fn

MIB = 2**20


def model_config(shape: str):
    from transformers import Qwen2Config

    from engine.models.tiny_model import tiny_model_config

    if shape == "tiny":
        return tiny_model_config("qwen2")
    return Qwen2Config(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )


def build_step(args):
    """Everything one step needs; returns (step function, completion tokens per step, device)."""
    from engine.policy.batch import pack_completions, split_microbatches
    from engine.config import ModelConfig, OptimizerConfig, ParallelConfig
    from engine.policy.model import build_policy, init_weights_by_name
    from engine.policy.optimizer import build_optimizer
    from engine.policy.parallel import init_parallel
    from engine.grpo.policy_loss import LossNormalizer, PolicyLossConfig
    from engine.policy.step import LogprobSettings, grpo_forward_backward

    hf_config = model_config(args.shape)
    ps = init_parallel(ParallelConfig(), seed=0)
    dtype = "float32" if args.shape == "tiny" else "bfloat16"
    chunks = build_policy(hf_config, ModelConfig(dtype=dtype), ps)
    init_weights_by_name(chunks, ps, seed=0)
    popt = build_optimizer(OptimizerConfig(learning_rate=1e-6), chunks, ps, total_steps=1_000_000)
    gen = torch.Generator().manual_seed(0)
    vocab = hf_config.vocab_size
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=gen).tolist()
    completions = torch.randint(0, vocab, (args.batch, args.completion_len), generator=gen).tolist()
    batch = pack_completions(prompts, completions, pad_token_id=0)
    mask = batch["completion_mask"]
    batch["advantages"] = torch.randn(args.batch, generator=gen)  # (B,)
    batch["old_logprobs"] = (-11.0 + 0.3 * torch.randn(mask.shape, generator=gen)) * mask  # (B, C)
    batch = {k: v.to(ps.device) for k, v in batch.items()}
    micro = split_microbatches(batch, args.micro_batch)
    normalizer = LossNormalizer(num_tokens=float(mask.sum()), num_sequences=float(args.batch))
    settings = LogprobSettings(vocab_size=vocab, implementation=args.implementation)
    loss_config = PolicyLossConfig(loss_type="dapo", epsilon_high=0.28)

    def step():
        popt.zero_grad()
        grpo_forward_backward(popt.model, ps, micro, loss_config, normalizer, settings)
        popt.step()

    return step, int(mask.sum()), ps.device, {"dtype": dtype}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one GRPO optimizer step -> benchmarks/results/grpo_step.csv")
    parser.add_argument("--shape", choices=["tiny", "qwen2.5-1.5b"], default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=96)
    parser.add_argument("--implementation", default="auto")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)

    step, completion_tokens, device, extra = build_step(args)
    timing = time_fn(step, device=device, warmup=args.warmup, n_iters=args.iters)
    memory = peak_memory_fn(step, device=device)
    env = capture_env(device)
    config = {"shape": args.shape, "batch": args.batch, "micro_batch": args.micro_batch, "prompt_len": args.prompt_len,
              "completion_len": args.completion_len, "implementation": args.implementation, **extra}
    key = dict(bench="grpo_step", variant=f"megatron-{args.shape}", mode="train_step", x_name="completion_tokens",
               x_value=completion_tokens, config=config)
    rows = [
        make_row(env, **key, metric="time", unit="ms", p20=timing.p20_ms, p50=timing.p50_ms, p80=timing.p80_ms,
                 n_iters=timing.n_iters),
        make_row(env, **key, metric="tokens_per_s", unit="tokens/s", p20=completion_tokens / (timing.p80_ms / 1e3),
                 p50=completion_tokens / (timing.p50_ms / 1e3), p80=completion_tokens / (timing.p20_ms / 1e3),
                 n_iters=timing.n_iters),
        make_row(env, **key, metric="peak_memory", unit="MiB", p20=memory.peak_bytes / MIB,
                 p50=memory.peak_bytes / MIB, p80=memory.peak_bytes / MIB, n_iters=1),
    ]
    path = append_rows(RESULTS_DIR / "grpo_step.csv", rows, overwrite=args.overwrite)
    print(f"{args.shape}: step p50 {timing.p50_ms:.1f} ms, {completion_tokens / (timing.p50_ms / 1e3):.0f} completion "
          f"tokens/s, peak {memory.peak_bytes / MIB:.0f} MiB ({env.device}) -> {path}")


if __name__ == "__main__":
    main()
