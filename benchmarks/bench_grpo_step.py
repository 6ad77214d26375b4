"""GRPO train-step benchmark: one optimizer step of the Megatron policy (forward, fused-loss backward, Adam) on one
device, random weights, writing step time, completion tokens/s and peak memory to `benchmarks/results/grpo_step.csv`.

Shapes: `tiny` (the project's tiny Qwen2, float32: what a CPU can run), `qwen2.5-1.5b` (Qwen2.5-1.5B's shape:
hidden 1536, 28 layers, 12 heads / 2 KV heads, MLP 8960, vocab 151936, tied embeddings; bf16, for a GPU) and
`qwen2.5-7b` (Qwen2.5-7B's shape: hidden 3584, 28 layers, 28 heads / 4 KV heads, MLP 18944, vocab 152064, untied;
bf16); `--num-layers` trims the layer count (every other dimension stays exact). The batch
is `--batch` completions of `--prompt-len` + `--completion-len` tokens in micro-batches of `--micro-batch`; the
loss is DAPO with off-policy old log-probs (clipping active), the log-prob path is `--implementation` (auto = the
Triton kernel on CUDA, the chunked torch path on CPU). Absolute times count only on a GPU.

    python -m benchmarks.bench_grpo_step                                         # CPU, tiny shape
    python -m benchmarks.bench_grpo_step --shape qwen2.5-1.5b --batch 16 --micro-batch 4 \\
        --prompt-len 256 --completion-len 1024                                    # one GPU
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import torch

from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row, peak_memory_fn, time_fn

if TYPE_CHECKING:
    from engine.policy.microbatch import MicroBatch

MIB = 2**20


SHAPES = ("tiny", "qwen2.5-1.5b", "qwen2.5-7b")


def model_config(shape: str, num_layers: int | None = None):
    """The HF config of a benchmark shape; `num_layers` trims the layer count (None = the model's own)."""
    from transformers import Qwen2Config

    from engine.models.tiny_model import tiny_model_config

    if shape == "tiny":
        config = tiny_model_config("qwen2")
    elif shape == "qwen2.5-1.5b":
        config = Qwen2Config(
            hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
            intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
            rms_norm_eps=1e-6, tie_word_embeddings=True,
        )
    elif shape == "qwen2.5-7b":
        config = Qwen2Config(
            hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
            intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
        )
    else:
        raise ValueError(f"unknown shape {shape!r}; one of {SHAPES}")
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    return config


def build_policy_and_optimizer(hf_config, dtype: str, ps, attention: str = "sdpa", recompute: bool = True):
    """Megatron chunks with random weights and their optimizer (lr 1e-6): (PolicyOptimizer, chunks); `attention` is
    `model.attention_implementation` (the local spec's core attention), `recompute` the activation recompute
    (`train.gradient_checkpointing`: TRL's default and the engine's, full recompute)."""
    from engine.config import ModelConfig, OptimizerConfig, TrainConfig
    from engine.policy.model import build_policy, init_weights_by_name
    from engine.policy.optimizer import build_optimizer

    chunks = build_policy(hf_config, ModelConfig(dtype=dtype, attention_implementation=attention), ps,
                          TrainConfig(gradient_checkpointing=recompute))
    init_weights_by_name(chunks, ps, seed=0)
    return build_optimizer(OptimizerConfig(learning_rate=1e-6), chunks, ps, total_steps=1_000_000), chunks


def build_batch(vocab_size: int, batch: int, prompt_len: int, completion_len: int, seed: int = 0) -> MicroBatch:
    """Random prompt + completion tokens, advantages and off-policy old log-probs (clipping active), on the CPU.

    The same seed gives the same tokens whatever the consumer (the TRL benchmark feeds TRL the same batch).
    Returns pack_completions' MicroBatch with `advantages` (B,) and `old_logprobs` (B, C).
    """
    from engine.policy.batch import pack_completions

    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab_size, (batch, prompt_len), generator=gen).tolist()
    completions = torch.randint(0, vocab_size, (batch, completion_len), generator=gen).tolist()
    packed = pack_completions(prompts, completions, pad_token_id=0)
    mask = packed.completion_mask
    packed.advantages = torch.randn(batch, generator=gen)  # (B,)
    packed.old_logprobs = (-11.0 + 0.3 * torch.randn(mask.shape, generator=gen)) * mask  # (B, C)
    return packed


ONEPASS_PREFIX = "onepass_"


def kernels_for(implementation: str):
    """The `kernels` config of a step variant: "onepass_<impl>" = the one-pass LM head on kernels/onepass_logprob.py's
    <impl>; any other name = that two-pass `loss_implementation` (the pass pinned, so the rows keep their meaning)."""
    from engine.config import KernelsConfig

    if implementation.startswith(ONEPASS_PREFIX):
        return KernelsConfig(loss_pass="one", onepass_implementation=implementation.removeprefix(ONEPASS_PREFIX))
    return KernelsConfig(loss_implementation=implementation, loss_pass="two")


def make_step(popt, ps, batch: MicroBatch, micro_batch: int, vocab_size: int, implementation: str):
    """The zero-argument GRPO optimizer step (zero_grad, DAPO forward/backward over micro-batches, Adam step)."""
    from engine.config import GenerationConfig, GRPOConfigSection
    from engine.grpo.policy_loss import LossNormalizer, PolicyLossConfig
    from engine.policy.batch import split_microbatches
    from engine.policy.step import LogprobSettings, grpo_forward_backward

    mask = batch.completion_mask
    micro = split_microbatches(batch.to(ps.device), micro_batch)
    normalizer = LossNormalizer(num_tokens=float(mask.sum()), num_sequences=float(mask.shape[0]))
    settings = LogprobSettings(vocab_size=vocab_size, temperature=1.0, kernels=kernels_for(implementation))
    loss_config = PolicyLossConfig.from_sections(GRPOConfigSection(loss_type="dapo", epsilon_high=0.28),
                                                 GenerationConfig())

    def step():
        popt.zero_grad()
        grpo_forward_backward(popt.model, ps, micro, loss_config, normalizer, settings)
        popt.step()

    return step


def build_step(args, attention: str = "sdpa"):
    """Everything one step needs; returns (step function, completion tokens per step, device, config extras)."""
    from engine.config import ParallelConfig
    from engine.policy.parallel import init_parallel

    hf_config = model_config(args.shape, getattr(args, "num_layers", None))
    ps = init_parallel(ParallelConfig(), seed=0)
    dtype = "float32" if args.shape == "tiny" else "bfloat16"
    popt, _ = build_policy_and_optimizer(hf_config, dtype, ps, attention)
    batch = build_batch(hf_config.vocab_size, args.batch, args.prompt_len, args.completion_len)
    step = make_step(popt, ps, batch, args.micro_batch, hf_config.vocab_size, args.implementation)
    return step, int(batch.completion_mask.sum()), ps.device, {"dtype": dtype, "attention": attention}


def train_step_rows(env, key: dict, timing, peak_mib: float, completion_tokens: int) -> list:
    """The three rows of one step: `time` (ms), `tokens_per_s` (completion tokens / step time; p20 from the p80
    time) and `peak_memory` (MiB); `key` holds make_row's bench, variant, mode, x_name, x_value and config."""
    return [
        make_row(env, **key, metric="time", unit="ms", p20=timing.p20_ms, p50=timing.p50_ms, p80=timing.p80_ms,
                 n_iters=timing.n_iters),
        make_row(env, **key, metric="tokens_per_s", unit="tokens/s", p20=completion_tokens / (timing.p80_ms / 1e3),
                 p50=completion_tokens / (timing.p50_ms / 1e3), p80=completion_tokens / (timing.p20_ms / 1e3),
                 n_iters=timing.n_iters),
        make_row(env, **key, metric="peak_memory", unit="MiB", p20=peak_mib, p50=peak_mib, p80=peak_mib, n_iters=1),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one GRPO optimizer step -> benchmarks/results/grpo_step.csv")
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--num-layers", type=int, help="trim the model to this many layers (default: its own)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=96)
    parser.add_argument("--implementation", default="auto")
    parser.add_argument("--attention", default="sdpa", type=lambda s: s.split(","),
                        help="model.attention_implementation values, comma-separated: one set of rows each")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--csv", default=str(RESULTS_DIR / "grpo_step.csv"), help="where rows are appended")
    args = parser.parse_args(argv)

    from engine.policy.parallel import destroy_parallel

    for attention in args.attention:
        _measure(args, attention)
        destroy_parallel(keep_process_group=True)  # the next variant builds its policy afresh


def _measure(args, attention: str) -> None:
    """One attention implementation's rows (the policy built afresh, the same weights and tokens)."""
    step, completion_tokens, device, extra = build_step(args, attention)
    timing = time_fn(step, device=device, warmup=args.warmup, n_iters=args.iters)
    memory = peak_memory_fn(step, device=device)
    env = capture_env(device)
    config = {"shape": args.shape, "batch": args.batch, "micro_batch": args.micro_batch, "prompt_len": args.prompt_len,
              "completion_len": args.completion_len, "implementation": args.implementation, **extra}
    if args.num_layers is not None:
        config["num_layers"] = args.num_layers
    key = dict(bench="grpo_step", variant=f"megatron-{args.shape}", mode="train_step", x_name="completion_tokens",
               x_value=completion_tokens, config=config)
    rows = train_step_rows(env, key, timing, memory.peak_bytes / MIB, completion_tokens)
    path = append_rows(args.csv, rows, overwrite=args.overwrite)
    print(f"{args.shape} {attention}: step p50 {timing.p50_ms:.1f} ms, {completion_tokens / (timing.p50_ms / 1e3):.0f} completion "
          f"tokens/s, peak {memory.peak_bytes / MIB:.0f} MiB ({env.device}) -> {path}")


if __name__ == "__main__":
    main()
