"""Suite part d: the same GRPO step through TRL's `GRPOTrainer` loss path, `use_liger_kernel` off and on.

What runs: a real `trl.GRPOTrainer` (TRL 1.16, no vLLM, no generation) around a Hugging Face Qwen2 model of the
same shape as part c (benchmarks/bench_grpo_step.py's `model_config`, random weights), fed the same tokens
(`bench_grpo_step.build_batch`, same seed: prompts, completions, advantages, off-policy old log-probs); one step is
TRL's `compute_loss` + `backward` per micro-batch, then the trainer's own optimizer (`create_optimizer`, TRL's
default AdamW) steps. DAPO, epsilon_high 0.28, beta 0, as part c. Rows in `trl_grpo_step.csv`: bench
`trl_grpo_step`, variant `trl` / `trl+liger`, mode `train_step` (time, tokens_per_s, peak_memory) and mode
`longest_fit` (benchmarks/gpu/longest_fit.py, micro-batch `--fit-micro-batch`).

What `use_liger_kernel` means in TRL 1.16 (read in trl/trainer/grpo_trainer.py): TRL always scores completions
with its own chunked fused LM head (`add_fused_lm_head`, Triton on CUDA), and `use_liger_kernel=True` only adds
Liger's layer kernels (RMSNorm, RoPE, SwiGLU; `fused_linear_cross_entropy` is refused). It no longer routes the
loss through Liger's `LigerFusedLinearGRPOLoss` (part b times that one directly). As `Trainer.train()` applies the
Liger kernels and this step never calls `train()`, the step applies them the same way
(`transformers.integrations.liger.apply_liger_kernel`).

Differences from part c, stated in every row's config: the HF model is built in bf16 on a GPU (as a bf16 checkpoint
loads), so TRL's AdamW keeps bf16 states (8 bytes per parameter) where Megatron's optimizer keeps fp32 main weights
and fp32 Adam states; HF attention is SDPA, Megatron's local spec materialises the attention scores.
`gradient_checkpointing` is off (TRL's default is on) on both sides (part c passes the same flag to Megatron's
recompute), so both keep all activations; `--gradient-checkpointing` turns it on. (Until git 68db764 part c ran
Megatron with its full recompute while this part ran without: the H200 rows at 68db764 compare unlike steps.)

    python -m benchmarks.gpu.trl_step --shape qwen2.5-1.5b --csv /tmp/trl_grpo_step.csv           # one GPU
    python -m benchmarks.gpu.trl_step --shape tiny --batch 4 --micro-batch 2 --prompt-len 8 --completion-len 16 \\
        --fit-lengths 32 --csv /tmp/trl_grpo_step.csv                                           # CPU smoke

Must not: patch TRL (its own trainer, config and loss code run unchanged) or judge timings.

Run by the suite (benchmarks/gpu/suite.py) as part d; test: tests/integration/test_gpu_suite.py (CPU smoke).
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.bench_grpo_step import SHAPES, build_batch, model_config, train_step_rows
from benchmarks.gpu.longest_fit import (
    add_step_arguments,
    find_longest_fit,
    free_memory,
    rows_unless_out_of_memory,
    search_rows,
)
from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, peak_memory_fn, time_fn

if TYPE_CHECKING:
    from engine.policy.microbatch import MicroBatch

MIB = 2**20
BENCH = "trl_grpo_step"


def build_trainer(hf_config, args, use_liger: bool, output_dir: str):
    """A GRPOTrainer around a random-weight HF model of `hf_config`, on CUDA in bf16 or on the CPU in float32."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from engine.models.tiny_model import build_tiny_tokenizer

    on_gpu = torch.cuda.is_available()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16 if on_gpu else torch.float32)
    num_micro = args.batch // args.micro_batch
    config = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=num_micro,
        num_generations=2, max_completion_length=args.completion_len, use_vllm=False, report_to=[], bf16=on_gpu,
        use_cpu=not on_gpu, gradient_checkpointing=args.gradient_checkpointing, use_liger_kernel=use_liger,
        loss_type="dapo", epsilon_high=0.28, beta=0.0, learning_rate=1e-6, save_strategy="no", seed=0,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=config,
        train_dataset=Dataset.from_dict({"prompt": ["benchmark"] * 8}),
        processing_class=build_tiny_tokenizer(),  # generation never runs; the loss path reads no tokenizer
    )
    if use_liger:
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(trainer.model, trainer.args.liger_kernel_config)  # what Trainer.train() does first
    trainer.model.train()
    trainer.create_optimizer()
    return trainer


def trl_inputs(batch: MicroBatch, prompt_len: int, device: torch.device) -> dict:
    """bench_grpo_step's batch (a MicroBatch) in the dict TRL's `_compute_loss` reads (every prompt is `prompt_len`
    real tokens)."""
    mask = batch.completion_mask.to(device)  # (B, C)
    prompt_ids = batch.tokens[:, :prompt_len].to(device)  # (B, P)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": batch.completion_ids.to(device), "completion_mask": mask.long(),
        "advantages": batch.advantages.to(device), "old_per_token_logps": batch.old_logprobs.to(device),
    }


def make_trl_step(trainer, batch: MicroBatch, prompt_len: int, micro_batch: int):
    """The zero-argument step: TRL's compute_loss + backward per micro-batch, then the trainer's optimizer step."""
    device = trainer.model.device
    inputs = trl_inputs(batch, prompt_len, device)
    num_rows = inputs["prompt_ids"].shape[0]
    num_items = inputs["completion_mask"].sum().float()  # the generation batch's completion tokens (DAPO normaliser)
    micro = [{**{k: v[i: i + micro_batch] for k, v in inputs.items()}, "num_items_in_batch": num_items}
             for i in range(0, num_rows, micro_batch)]
    trainer.current_gradient_accumulation_steps = len(micro)  # set by Trainer's loop; TRL's DAPO normaliser reads it
    trainer.args.steps_per_generation = len(micro)

    def step():
        trainer.optimizer.zero_grad(set_to_none=True)
        for inputs_micro in micro:
            trainer.compute_loss(trainer.model, inputs_micro).backward()
        trainer.optimizer.step()

    return step


def measure_variant(env, args, hf_config, use_liger: bool, config: dict, deadline: float) -> list:
    """Nominal step rows, then the longest-fit rows, of one variant."""
    variant = "trl+liger" if use_liger else "trl"
    rows = []
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(hf_config, args, use_liger, output_dir)
        device = trainer.model.device
        config = {**config, "use_liger_kernel": use_liger, "optim": str(trainer.args.optim),
                  "model_dtype": str(trainer.model.dtype).removeprefix("torch.")}
        batch = build_batch(hf_config.vocab_size, args.batch, args.prompt_len, args.completion_len)
        tokens = int(batch.completion_mask.sum())
        key = dict(bench=BENCH, variant=variant, mode="train_step", x_name="completion_tokens", x_value=tokens,
                   config=config)
        step = make_trl_step(trainer, batch, args.prompt_len, args.micro_batch)

        def nominal() -> list:
            timing = time_fn(step, device=device, warmup=args.warmup, n_iters=args.iters)
            peak = peak_memory_fn(step, device=device).peak_bytes / MIB
            print(f"{variant} {args.shape}: step p50 {timing.p50_ms:.1f} ms, "
                  f"{tokens / (timing.p50_ms / 1e3):.0f} completion tokens/s, peak {peak:.0f} MiB")
            return train_step_rows(env, key, timing, peak, tokens)

        rows += rows_unless_out_of_memory(nominal, f"{variant} {args.shape} nominal step")
        step = None
        free_memory()
        if args.fit_lengths:
            rows += fit_rows(env, args, trainer, hf_config, variant, config, deadline)
        del trainer
    free_memory()
    return rows


def fit_rows(env, args, trainer, hf_config, variant: str, config: dict, deadline: float) -> list:
    """The longest-fit search of one variant: a peak_memory row per length and the max_completion_len row."""

    def run_at_length(length: int) -> float:
        batch = build_batch(hf_config.vocab_size, args.fit_micro_batch, args.prompt_len, length, seed=length)
        step = make_trl_step(trainer, batch, args.prompt_len, args.fit_micro_batch)
        step()
        return peak_memory_fn(step, device=trainer.model.device).peak_bytes / MIB

    search = find_longest_fit(run_at_length, args.fit_lengths, memory_budget_mib=args.memory_budget_mib,
                              deadline=deadline)
    print(f"{variant} {args.shape}: longest completion that fits (micro-batch {args.fit_micro_batch}, prompt "
          f"{args.prompt_len}): {search.longest} ({search.stopped})")
    return search_rows(env, BENCH, variant, search, config, args.fit_micro_batch, args.fit_lengths)


def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.budget_s
    hf_config = model_config(args.shape, args.num_layers)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = capture_env(device)
    print(f"TRL GRPO step on {env.device}: {args.shape} ({hf_config.num_hidden_layers} layers), git "
          f"{env.git_sha or '?'}")
    config = {"shape": args.shape, "batch": args.batch, "micro_batch": args.micro_batch,
              "prompt_len": args.prompt_len, "completion_len": args.completion_len,
              "num_layers": hf_config.num_hidden_layers, "gradient_checkpointing": args.gradient_checkpointing}
    for index, use_liger in enumerate(args.liger):
        if use_liger and importlib.util.find_spec("liger_kernel") is None:
            print("SUITE-NOTE: trl+liger skipped: liger-kernel is not installed")
            continue
        # each variant gets its share of what is left: TRL's own search spent the whole budget before (H100, 799b154)
        share = time.monotonic() + (deadline - time.monotonic()) / (len(args.liger) - index)
        append_rows(args.csv, measure_variant(env, args, hf_config, use_liger, config, share))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen2.5-1.5b")
    parser.add_argument("--num-layers", type=int, help="trim the model to this many layers (default: its own)")
    parser.add_argument("--liger", default="off,on", type=lambda s: [v == "on" for v in s.split(",")],
                        help="use_liger_kernel settings to measure, e.g. 'off,on'")
    add_step_arguments(parser)
    parser.add_argument("--csv", type=Path, default=RESULTS_DIR / f"{BENCH}.csv")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
