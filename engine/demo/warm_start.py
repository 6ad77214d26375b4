"""SFT warm start of the tiny Qwen2 on the builtin arithmetic task: the shipped `builtin:tiny-qwen2-arith` model.

A randomly initialised tiny model never writes `<answer>66</answer>`, so every GRPO reward is 0 and every group
advantage is 0: no signal. This script gives the demo a policy that GRPO can improve within its budget (20 steps of
16 completions on 2 CPU cores): a short supervised fine-tune of the tiny Qwen2 (engine/models/tiny_model.py) on the
TRAIN split of `builtin:arithmetic` (engine/train/data.py), leaving one habit (an unclosed answer tag) for GRPO to
remove. Why this habit and not an early stop, with the measurements: `UNCLOSED_TEMPLATE`; the recipe: `WarmStartArgs`;
the format and loss: `tokenize_example`, `train`; the evaluation and vLLM's agreement: `evaluate_held_out`.

Owns: the SFT recipe, the training-text format, the held-out evaluation and the record (`warm_start.json`).

Must not: touch the network, import vLLM, train on the test split, or write outside the output directory.

Run (3.5 to 4 minutes of training on one thread of a shared 2-core machine, evaluation 3 s):
    python -m engine.demo.warm_start engine/models/assets/tiny-qwen2-arith
Test: `pytest tests/unit/test_warm_start.py` (the shipped model, and a 3-step run of this script).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CLOSED_TEMPLATE = " <answer>{answer}</answer>"
"""The completion the `accuracy` reward scores (then eos)."""
UNCLOSED_TEMPLATE = " <answer>{answer}"
"""The habit GRPO has to remove: the same answer without the closing tag (then eos); `accuracy` scores it 0.

The model learns the sums well, but most of the time it writes " <answer>66" and stops without closing the tag,
which `accuracy` (it reads the last <answer>...</answer>) scores 0. At temperature 1 it closes the tag about 30% of
the time, so a group of 4 samples often mixes right and wrong answers (non-zero group-relative advantages), and GRPO
with the accuracy reward raises the held-out reward by teaching it to close the tag, a one-token decision after the
digits that is the same for every prompt.

Why not simply stop the SFT early (a model that is partly right because it knows only part of the arithmetic)?
We tried: the tiny model learns 2-digit sums suddenly (held-out T=1 accuracy about 5% at SFT step 500, 60-75% at
step 800, lr 1e-3), and early stops at 20-40% T=1 accuracy moved by -8 to +12 points after 20 GRPO steps of 16
completions at lr 1e-4, and collapsed at lr >= 2e-4: 320 samples carry too little signal to teach arithmetic.
The closing tag is one decision shared by every prompt: after the same 20 steps the shipped model's held-out T=1
accuracy goes from 23% to 64-77% at lr 1e-4 (5 seeds) and to 75-77% at lr 5e-5 (4 seeds); at 2e-4 the tag is
learnt but the sums degrade (42-46%). These numbers come from a plain-torch GRPO loop outside the repository
(HF generate at T=1, on-policy, group-normalised advantages, DAPO token-mean loss, beta 0, AdamW with betas
0.9/0.999 or 0.9/0.99 (same results), gradient clip 1.0, 4 prompts x 4 completions per step from the train
split, 200 held-out prompts x 4 samples); the demo reports the engine's own.
"""
CLOSED_PATTERN = re.compile(r"^ <answer>(\d+)</answer>$")
"""A completion in exactly the closed format (decoded without special tokens)."""
WELL_FORMED_PATTERN = re.compile(r"^ <answer>(\d+)(?:</answer>)?$")
"""A closed or an unclosed answer; group 1 holds the number."""


@dataclass(frozen=True)
class WarmStartArgs:
    """The SFT recipe; every default is the shipped model's (`engine/models/assets/tiny-qwen2-arith/warm_start.json`
    records the run).

    The tiny Qwen2 built with seed 0, all 2000 train rows, batches of 64 drawn from seeded permutations, AdamW (betas
    0.9/0.95, no weight decay, gradient clip 1.0), lr 2e-3 with a 30-step linear warmup and cosine decay to 2e-4 over
    900 steps, the last 100 of which teach the unclosed habit. float32, one thread, deterministic: fixed torch
    seeds, `torch.use_deterministic_algorithms(True)` and a fixed thread count (CPU float reductions depend on it), so
    the same arguments on the same CPU type and torch version give the same weights; other machines may differ in
    the last bits, hence in a few held-out answers.
    """

    steps: int = 900
    """Optimizer steps in all."""
    lr: float = 2.0e-3
    """Peak AdamW learning rate."""
    batch_size: int = 64
    """Sequences (prompt + completion) per step."""
    num_train_rows: int = 2000
    """How many rows of the TRAIN split to fine-tune on (the first N; the split has 2000)."""
    warmup_steps: int = 30
    """Linear warmup steps, then cosine decay to `min_lr_ratio` * lr at `steps`."""
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    unclosed_steps: int = 100
    """The last this many steps draw unclosed completions (the rest always close the tag)."""
    unclosed_fraction: float = 0.65
    """In those steps, the probability that a sequence's completion is " <answer>66" instead of the closed one."""
    seed: int = 0
    """Seeds the model initialisation (`build_tiny_model`), the batches and the evaluation sampling."""
    num_threads: int = 1
    """torch intra-op threads during the run; part of the determinism contract (CPU reductions depend on it)."""
    num_eval_prompts: int = 200
    """Held-out (TEST split) prompts evaluated at the end; 0 skips the evaluation."""
    num_samples: int = 4
    """T=1 samples per held-out prompt (the demo's G)."""


@dataclass(frozen=True)
class HeldOutMetrics:
    """A model on held-out prompts; every rate is a fraction in [0, 1]."""

    num_prompts: int
    greedy_accuracy: float
    """Greedy completions the `accuracy` reward scores 1."""
    sampled_accuracy: float
    """The same over every T=1 sample: the mean reward GRPO starts from."""
    mixed_group_fraction: float
    """Prompts whose T=1 samples are neither all right nor all wrong (non-zero GRPO advantages)."""
    greedy_number_accuracy: float
    """Greedy completions whose number is right, tag closed or not: the arithmetic the model knows."""
    sampled_closed_rate: float
    """T=1 samples that close the tag (`CLOSED_PATTERN`)."""
    well_formed_rate: float
    """Completions (greedy and T=1) that are exactly a closed or an unclosed answer."""
    stop_rate: float
    """Completions that ended with eos before the length limit."""


def format_completion(answer: str, closed: bool = True) -> str:
    """The trained completion text for a reference answer: " <answer>66</answer>" or " <answer>66" (no eos)."""
    return (CLOSED_TEMPLATE if closed else UNCLOSED_TEMPLATE).format(answer=answer)


def is_correct(completion: str, answer: str) -> bool:
    """Whether the last <answer>...</answer> in `completion` is the integer `answer` (the `accuracy` reward)."""
    from engine.train.builtin_rewards import extract_answer

    predicted = extract_answer(completion)
    if predicted is None or not re.fullmatch(r"-?\d+", predicted):
        return False
    return int(predicted) == int(answer)


def number_of(completion: str) -> int | None:
    """The number of a well-formed completion (closed or unclosed), else None."""
    match = WELL_FORMED_PATTERN.match(completion)
    return None if match is None else int(match.group(1))


def tokenize_example(tokenizer, prompt: str, answer: str, closed: bool = True) -> tuple[list[int], list[int]]:
    """(prompt_ids, completion_ids + [eos]); the prompt is tokenized alone, as the rollout does.

    The prompt is the dataset's standard (non-chat) prompt, tokenized without a template (as TRL 1.16 tokenizes a standard prompt); the
    completion is " <answer>{answer}</answer>" (8 to 9 tokens) or, in the last `unclosed_steps` steps with
    probability `unclosed_fraction`, " <answer>{answer}" (5 to 6 tokens); then `<|endoftext|>` (eos: the saved
    generation_config stops at it or at `<|im_end|>`). Both stay far inside the demo's max_completion_length of 32.
    No think block: the 4-layer model cannot use one, it only costs generation time.
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(format_completion(answer, closed), add_special_tokens=False)["input_ids"]
    return prompt_ids, completion_ids + [tokenizer.eos_token_id]


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and next-token labels (-100 on prompt and padding positions).

    Args:
        examples: B (prompt_ids, completion_ids) pairs.
        pad_id: the padding token id.
    Returns:
        input_ids (B, T) int64 and labels (B, T) int64, labels[b, t] being the target for position t.
    """
    seq_len = max(len(p) + len(c) for p, c in examples) - 1  # T: the last token is only a target
    input_ids = torch.full((len(examples), seq_len), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(examples), seq_len), -100, dtype=torch.long)  # (B, T)
    for row, (prompt, completion) in enumerate(examples):
        tokens = prompt + completion
        input_ids[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
        labels[row, len(prompt) - 1 : len(tokens) - 1] = torch.tensor(completion)
    return input_ids, labels


def learning_rate(step: int, args: WarmStartArgs) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay from lr to min_lr_ratio * lr at `steps`."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, tokenizer, prompts: Sequence[str], answers: Sequence[str], args: WarmStartArgs,
          log_every: int = 100) -> list[float]:
    """Fine-tune `model` in place on the (prompt, answer) rows for `args.steps` AdamW steps.

    Loss: token-mean cross-entropy over the completion tokens (eos included); prompt tokens are masked out.

    Args:
        model: the causal LM (float32).
        tokenizer: its tokenizer.
        prompts: N training prompts.
        answers: N reference answers.
        args: the recipe (schedule, batch size, the unclosed steps and fraction, seed).
        log_every: print the mean loss every this many steps.
    Returns:
        The per-step losses.
    """
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    order: list[int] = []
    losses = []
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        if len(order) < args.batch_size:  # a fresh permutation per epoch; the leftover rows go first
            order += torch.randperm(len(prompts), generator=generator).tolist()
        batch, order = order[: args.batch_size], order[args.batch_size :]
        unclosed_fraction = args.unclosed_fraction if step >= args.steps - args.unclosed_steps else 0.0
        closed = (torch.rand(len(batch), generator=generator) >= unclosed_fraction).tolist()
        examples = [tokenize_example(tokenizer, prompts[i], answers[i], c) for i, c in zip(batch, closed)]
        input_ids, labels = collate(examples, tokenizer.pad_token_id)  # (B, T) each
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        logits = model(input_ids=input_ids).logits  # (B, T, V); right padding: default positions are right
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == args.steps:
            recent = losses[-log_every:]
            print(f"[warm_start] step {step + 1:4d}/{args.steps}  loss {sum(recent) / len(recent):.4f}  "
                  f"lr {learning_rate(step, args):.2e}  {time.perf_counter() - start:.0f} s", flush=True)
    model.eval()
    return losses


@torch.no_grad()
def generate_completions(model, tokenizer, prompts: Sequence[str], *, do_sample: bool, num_samples: int = 1,
                         max_new_tokens: int = 16, seed: int = 0) -> list[list[tuple[str, bool]]]:
    """Complete each prompt `num_samples` times with HF generate (greedy, or T=1 sampling without top-k / top-p).

    Prompts of equal token length are batched together, so there is no padding and positions start at 0 as in an
    unpadded rollout.

    Args:
        model: a causal LM in eval mode.
        tokenizer: its tokenizer.
        prompts: N prompt strings.
        do_sample: False = greedy (then use num_samples=1).
        num_samples: completions per prompt.
        max_new_tokens: generation limit.
        seed: torch seed for the sampling (the global RNG state is restored afterwards).
    Returns:
        N lists of `num_samples` (text without special tokens, cut at the first stop token; whether one came).
    """
    stop_ids = set(model.generation_config.eos_token_id or [tokenizer.eos_token_id])
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    by_length: dict[int, list[int]] = {}
    for index, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(index)
    results: list[list[tuple[str, bool]]] = [[] for _ in prompts]
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for length in sorted(by_length):
            indices = by_length[length]
            input_ids = torch.tensor([encoded[i] for i in indices])  # (n, L)
            output = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                num_return_sequences=num_samples, pad_token_id=tokenizer.pad_token_id, **sampling,
            )  # (n * num_samples, L + new); the samples of one prompt are adjacent
            for row, sequence in enumerate(output[:, length:].tolist()):
                stop = next((k for k, t in enumerate(sequence) if t in stop_ids), None)
                text = tokenizer.decode(sequence[:stop], skip_special_tokens=True)
                results[indices[row // num_samples]].append((text, stop is not None))
    return results


def evaluate_held_out(model, tokenizer, num_prompts: int = 200, num_samples: int = 4, seed: int = 0) -> HeldOutMetrics:
    """Greedy and T=1 accuracy on the first `num_prompts` rows of the builtin arithmetic TEST split.

    Printed, and written to warm_start.json: greedy accuracy and T=1 sampled accuracy (`num_samples` per prompt, no
    top-k / top-p, as vLLM's defaults) as the `accuracy` reward scores them, the fraction of prompts whose samples
    disagree ("mixed groups"), and the diagnostics: greedy answers whose number is right (closed tag or not: the
    arithmetic the model knows), how often T=1 samples close the tag, and how often a completion is well formed and
    stops. HF `generate`, prompts of equal token length batched together (no padding, so positions match an unpadded
    vLLM rollout). Correctness is integer equality of the last <answer>...</answer> with the reference, which is what
    math-verify gives on integers. vLLM 0.32 on CPU agrees: its log-probs of the shipped model are within 2e-5 of
    HF's, and its T=1 samples of the 200 held-out prompts (4 each) score 23.4% with the `accuracy` reward (60-65%
    mixed groups, 30% closed tags).

    Args:
        model: the causal LM (eval mode).
        tokenizer: its tokenizer.
        num_prompts: held-out prompts (at most 200).
        num_samples: T=1 samples per prompt.
        seed: sampling seed.
    Returns:
        `HeldOutMetrics`.
    """
    from engine.train.data import build_arithmetic_dataset

    test = build_arithmetic_dataset("test").select(range(num_prompts))
    prompts, answers = test["prompt"], test["answer"]
    greedy = [outs[0] for outs in generate_completions(model, tokenizer, prompts, do_sample=False)]
    sampled = generate_completions(model, tokenizer, prompts, do_sample=True, num_samples=num_samples, seed=seed)
    sampled_ok = [[is_correct(text, a) for text, _ in outs] for outs, a in zip(sampled, answers, strict=True)]
    samples = [text for outs in sampled for text, _ in outs]
    every = greedy + [pair for outs in sampled for pair in outs]
    return HeldOutMetrics(
        num_prompts=num_prompts,
        greedy_accuracy=sum(is_correct(text, a) for (text, _), a in zip(greedy, answers)) / num_prompts,
        sampled_accuracy=sum(map(sum, sampled_ok)) / len(samples),
        mixed_group_fraction=sum(0 < sum(group) < num_samples for group in sampled_ok) / num_prompts,
        greedy_number_accuracy=sum(number_of(text) == int(a) for (text, _), a in zip(greedy, answers)) / num_prompts,
        sampled_closed_rate=sum(bool(CLOSED_PATTERN.match(text)) for text in samples) / len(samples),
        well_formed_rate=sum(bool(WELL_FORMED_PATTERN.match(text)) for text, _ in every) / len(every),
        stop_rate=sum(stopped for _, stopped in every) / len(every),
    )


def run_warm_start(output_dir: str | Path, args: WarmStartArgs) -> HeldOutMetrics | None:
    """Build the tiny Qwen2 into `output_dir`, fine-tune it, overwrite its weights, evaluate and record the run.

    Sets torch's thread count and deterministic mode for the run and restores both afterwards.

    Args:
        output_dir: created if missing; receives the model (config.json, generation_config.json,
            model.safetensors in float32), the tokenizer files and `warm_start.json` (recipe and metrics).
        args: the recipe.
    Returns:
        The held-out metrics (None when `args.num_eval_prompts` is 0).
    """
    num_threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(args.num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _run(Path(output_dir), args)
    finally:
        torch.set_num_threads(num_threads)
        torch.use_deterministic_algorithms(deterministic)


def _run(output_dir: Path, args: WarmStartArgs) -> HeldOutMetrics | None:
    """`run_warm_start` under its torch settings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.tiny_model import build_tiny_model
    from engine.train.data import build_arithmetic_dataset

    build_tiny_model(output_dir, "qwen2", seed=args.seed)  # random init, tokenizer, generation_config
    model = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    train_rows = build_arithmetic_dataset("train").select(range(args.num_train_rows))
    print(f"[warm_start] {len(train_rows)} train rows, {args.steps} steps x {args.batch_size} sequences "
          f"(the last {args.unclosed_steps} with {args.unclosed_fraction:.0%} unclosed), lr {args.lr:g}, "
          f"{args.num_threads} thread(s)", flush=True)
    start = time.perf_counter()
    losses = train(model, tokenizer, train_rows["prompt"], train_rows["answer"], args)
    train_s = time.perf_counter() - start
    model.save_pretrained(output_dir, safe_serialization=True)
    metrics = None
    if args.num_eval_prompts > 0:
        start = time.perf_counter()
        metrics = evaluate_held_out(model, tokenizer, args.num_eval_prompts, args.num_samples, seed=args.seed)
        print(f"[warm_start] held-out ({metrics.num_prompts} test prompts, {time.perf_counter() - start:.0f} s): "
              f"accuracy greedy {metrics.greedy_accuracy:.1%}, T=1 {metrics.sampled_accuracy:.1%}; mixed groups "
              f"of {args.num_samples} {metrics.mixed_group_fraction:.1%}; greedy number right "
              f"{metrics.greedy_number_accuracy:.1%}; T=1 closes the tag {metrics.sampled_closed_rate:.1%}; "
              f"well formed {metrics.well_formed_rate:.1%}; stopped {metrics.stop_rate:.1%}", flush=True)
    record = {
        "script": "python -m engine.demo.warm_start",
        "args": asdict(args),
        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4) if losses else None,
        "train_s": round(train_s, 1),
        "held_out": asdict(metrics) if metrics else None,
        "torch": torch.__version__,
    }
    (output_dir / "warm_start.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"[warm_start] saved to {output_dir} (training {train_s:.0f} s)", flush=True)
    return metrics


def parse_args(argv: Sequence[str] | None = None) -> tuple[Path, WarmStartArgs]:
    """Command line -> (output directory, recipe); every `WarmStartArgs` field is a `--dashed-name` option."""
    defaults = WarmStartArgs()
    parser = argparse.ArgumentParser(prog="python -m engine.demo.warm_start",
                                     description="SFT warm start of the tiny Qwen2 on builtin:arithmetic.")
    parser.add_argument("output_dir", type=Path)
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    namespace = vars(parser.parse_args(argv))
    output_dir = namespace.pop("output_dir")
    args = WarmStartArgs(**namespace)
    if not 0 < args.num_train_rows <= 2000 or not 0 <= args.num_eval_prompts <= 200:
        parser.error("--num-train-rows must be in 1..2000 and --num-eval-prompts in 0..200 (the split sizes)")
    if not 0 <= args.unclosed_steps <= args.steps or not 0.0 <= args.unclosed_fraction <= 1.0:
        parser.error("--unclosed-steps must be in 0..--steps and --unclosed-fraction in [0, 1]")
    return output_dir, args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m engine.demo.warm_start`."""
    output_dir, args = parse_args(argv)
    run_warm_start(output_dir, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
