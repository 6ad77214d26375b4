"""SFT warm start that teaches the shipped tiny Qwen2 to use a tool: the shipped `builtin:tiny-qwen2-calc`, the model
of examples/004_agentic_calculator.py.

The shipped `builtin:tiny-qwen2-arith` knows 2-digit sums but no tool-call format. This module fine-tunes it (a
copy; the shipped model is never written) on whole tool conversations of the calculator task: 3-digit sums and
differences that the 4-layer model cannot compute itself but can copy. A conversation, as the chat template
(`TOOL_CHAT_TEMPLATE`, which lists the tools in a system message) renders it:

    user       Question: what is 482 + 317? Answer:
    assistant  <tool_call>{"name": "calculate", "arguments": {"expression": "482 + 317"}}</tool_call>
    tool       799
    assistant  <answer>799</answer>

In a fraction `skip_fraction` of the conversations the call is left out (the model answers at once), a habit GRPO
has to remove, as the demo's unclosed tag (engine/demo/warm_start.py `UNCLOSED_TEMPLATE`): a guessed 3-digit answer
is rarely right, a copied one nearly always, and whether to call is one early decision shared by every prompt.
Loss: cross-entropy on the assistant turns' tokens only (their `<|im_end|>` included), the prompt and the tool
messages masked, exactly the tokens GRPO's tool mask trains.

Owns: the calculator task's data (`calculator_dataset`), its tool (`calculate`, whose schema the prompts show), its
conversations and the SFT recipe (`ToolWarmStart`). Must not: import vLLM, touch the network, or write outside its
output directory. Not deterministic across machines (unlike engine/demo/warm_start.py): the shipped weights are the
record (`warm_start.json` next to them holds the recipe and the time).

Run: `python -m engine.demo.tool_warm_start engine/models/assets/tiny-qwen2-calc` (about 250 steps of 16
conversations from `builtin:tiny-qwen2-arith`; 20-30 min on a shared 2-core machine).
Test: tests/integration/test_agentic.py (the shipped model calls the tool on its own; its log-probs) and
tests/integration/test_trl_examples.py (the example).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PROMPT = "Question: what is {a} {op} {b}? Answer:"
"""The calculator task's question (the builtin arithmetic task's wording, with 3-digit operands)."""
ANSWER = "<answer>{answer}</answer>"
"""The final turn's text (the reward function reads the number in it)."""
NUM_TEST = 64
"""Held-out rows: the first problems drawn; the train split takes the next `POOL`."""
POOL = 4000
"""Train problems at most."""


def calculator_dataset(split: str, num_rows: int, seed: int = 0):
    """`num_rows` conversational rows of 3-digit `a + b` / `a - b` (a >= b) problems with their `answer` (a string);
    the test split is the first `NUM_TEST` distinct problems a seeded generator draws, the train split the next ones,
    so they never overlap and every process builds the same rows."""
    import datasets

    rng = random.Random(seed)
    problems: dict[tuple[int, str, int], None] = {}  # in draw order, without repeats
    while len(problems) < NUM_TEST + POOL:
        a, b = sorted((rng.randint(100, 999), rng.randint(100, 999)), reverse=True)
        problems.setdefault((a, rng.choice("+-"), b))
    ordered = list(problems)
    chosen = ordered[:NUM_TEST][:num_rows] if split == "test" else ordered[NUM_TEST:][:num_rows]
    return datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": PROMPT.format(a=a, op=op, b=b)}] for a, op, b in chosen],
        "answer": [str(a + b if op == "+" else a - b) for a, op, b in chosen],
    })


@dataclass(frozen=True)
class ToolWarmStart:
    """The recipe: AdamW (betas 0.9/0.95), lr linear warmup then constant, gradient clip 1.0, float32, seeded."""

    steps: int = 300
    """Optimizer steps."""
    lr: float = 2.0e-3
    """AdamW learning rate after the warmup."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    batch_size: int = 16
    """Conversations per step."""
    skip_fraction: float = 0.6
    """Conversations that answer without calling the calculator (the habit GRPO removes)."""
    num_train_rows: int = 2000
    """Train problems the conversations are drawn from."""
    seed: int = 0
    """Seeds the problems, the batches and the skipped calls."""


def calculate(expression: str) -> str:
    """Compute a + b or a - b.

    Args:
        expression: two integers and + or -, e.g. "482 + 317".
    """
    left, op, right = expression.split()
    if op not in "+-" or not (left.isdigit() and right.isdigit()):
        raise ValueError(f"cannot evaluate {expression!r}")
    return str(int(left) + int(right) if op == "+" else int(left) - int(right))


def conversation(question: str, answer: str, skip: bool) -> list[dict]:
    """The messages after the user's question (module docstring); `skip`: without the calculator call."""
    expression = question.removeprefix("Question: what is ").removesuffix("? Answer:")
    final = {"role": "assistant", "content": ANSWER.format(answer=answer)}
    if skip:
        return [final]
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": answer}, final]


def tokenize_conversation(tokenizer, prompt: list[dict], turns: list[dict], tools: list) -> tuple[list[int], list[int]]:
    """(input token ids, labels): the whole conversation as the chat template renders it; labels are the ids on the
    assistant turns' tokens up to their `<|im_end|>` and -100 elsewhere (the prompt, tool messages, newlines)."""
    def render(messages, generation_prompt=False):
        return list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                                  add_generation_prompt=generation_prompt))

    messages = list(prompt) + turns
    ids = render(messages)
    labels = [-100] * len(ids)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render(messages[:i], generation_prompt=True))
        stop = ids.index(end, start) + 1
        labels[start:stop] = ids[start:stop]
    return ids, labels


def warm_start_tool_use(source: str | Path, output_dir: str | Path, recipe: ToolWarmStart = ToolWarmStart(),
                        tools: list = (calculate,)) -> Path:
    """Fine-tune the model at `source` on calculator conversations whose prompts list `tools` (the chat template
    shows each one's name, arguments and docstring's first line) and save it with `TOOL_CHAT_TEMPLATE` and a
    `warm_start.json` record to `output_dir`; returns `output_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.tiny_model import TOOL_CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    rows = calculator_dataset("train", recipe.num_train_rows, recipe.seed)
    rng = random.Random(recipe.seed)
    torch.manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    start, losses = time.perf_counter(), []
    for step in range(recipe.steps):
        batch = [rows[rng.randrange(len(rows))] for _ in range(recipe.batch_size)]
        examples = [tokenize_conversation(tokenizer, r["prompt"], conversation(r["prompt"][-1]["content"], r["answer"],
                                                                               rng.random() < recipe.skip_fraction),
                                          tools) for r in batch]
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr * min(1.0, (step + 1) / recipe.warmup_steps)
        loss = conversation_loss(model, examples, tokenizer.pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 25 == 0 or step + 1 == recipe.steps:  # saved as it goes: a cut-short run keeps its steps
            print(f"[tool warm start] step {step + 1}/{recipe.steps}  loss {sum(losses[-25:]) / len(losses[-25:]):.4f}"
                  f"  {time.perf_counter() - start:.0f} s", flush=True)
            _save(model, tokenizer, Path(output_dir), {
                "script": "python -m engine.demo.tool_warm_start", "source": str(source), "recipe": asdict(recipe), "steps_done": step + 1,
                "final_loss": round(sum(losses[-25:]) / len(losses[-25:]), 4),
                "train_s": round(time.perf_counter() - start), "torch": torch.__version__})
    model.eval()
    return Path(output_dir)


def _save(model, tokenizer, output_dir: Path, record: dict) -> None:
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    (output_dir / "warm_start.json").write_text(json.dumps(record, indent=2) + "\n")


def conversation_loss(model, examples: list[tuple[list[int], list[int]]], pad_id: int) -> torch.Tensor:
    """Token-mean cross-entropy of the labelled tokens of (ids, labels) conversations.

    The conversations share a prefix (the system message with the tools and the question's first words, about half
    of each): it runs once, without gradient, and its keys and values serve every row, which halves the work; the
    prefix holds no labelled token; what is left out is the gradient through its keys and values.
    """
    shared = 0
    while all(len(ids) > shared + 1 and ids[shared] == examples[0][0][shared] for ids, _ in examples):
        shared += 1
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([examples[0][0][:shared]]), use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(examples))
    rest = [(ids[shared:], labels[shared:]) for ids, labels in examples]
    width = max(len(ids) for ids, _ in rest)
    input_ids = torch.full((len(rest), width), pad_id, dtype=torch.long)  # (B, W), right-padded
    targets = torch.full((len(rest), width), -100, dtype=torch.long)  # (B, W): target of position t is token t + 1
    for row, (ids, labels) in enumerate(rest):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        targets[row, : len(ids) - 1] = torch.tensor(labels[1:])
    logits = model(input_ids=input_ids, past_key_values=cache).logits  # (B, W, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.demo.tool_warm_start OUTPUT_DIR [--steps N ...]`: every `ToolWarmStart` field an option."""
    from engine.models.tiny_model import resolve_builtin_model

    parser = argparse.ArgumentParser(prog="python -m engine.demo.tool_warm_start")
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--source", default="builtin:tiny-qwen2-arith", help="the model to start from (a builtin "
                        "name or a saved model directory, e.g. an earlier run's output to train it further)")
    for name, value in asdict(ToolWarmStart()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    options = vars(parser.parse_args(argv))
    output_dir, source = options.pop("output_dir"), options.pop("source")
    if source.startswith("builtin:"):
        source = resolve_builtin_model(source, output_dir / "cache")
    torch.set_num_threads(1)  # as engine/demo/warm_start.py: a tiny model gains nothing from a second thread
    warm_start_tool_use(source, output_dir, ToolWarmStart(**options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
