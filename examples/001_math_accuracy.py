"""Math with a verifier: a conversational dataset (system + user messages) with a `solution` column, the model's
chat template, an accuracy reward (math-verify) and a format reward weighted by `reward_weights`. The format reward
is "Example 2: Reward completions with a specific format" of TRL's GRPO Trainer guide (huggingface.co/docs/trl/
grpo_trainer#example-2-reward-completions-with-a-specific-format), its reward over conversational completions.

Under TRL the same script runs with only these two lines changed:
    from trl import GRPOConfig, GRPOTrainer
    MODEL = "Qwen/Qwen2.5-0.5B-Instruct"        # any chat model from the hub (here: the shipped tiny model)

The prompts are lists of messages, so the tokenizer's chat template renders them (with `chat_template_kwargs`; the
tiny model's ChatML template has no `enable_thinking` switch and ignores it, Qwen3's reads it) and completions reach
the reward functions as [{"role": "assistant", "content": ...}]. The shipped tiny model was warm-started on plain
text ("Question: ... Answer: <think> ... </think> <answer>N</answer>"), never on chats: inside the chat template it
mostly ends its turn at once, so here both rewards stay at 0 and there is nothing to learn. The script shows the
API; with a chat model (the TRL line above) the rewards vary and it trains.

Run: `python examples/001_math_accuracy.py` (2 CPU cores: ~30 s). Writes runs/001_math_accuracy/.
"""

import re
from pathlib import Path

from datasets import load_dataset
from math_verify import parse, verify

from engine import GRPOConfig, GRPOTrainer

MODEL = "builtin:tiny-qwen2-arith"
DATA = Path(__file__).resolve().parent / "data" / "math_conversational.jsonl"

dataset = load_dataset("json", data_files=str(DATA), split="train")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def accuracy_reward(completions, solution, **kwargs):
    """1.0 when the <answer> is mathematically equal to the solution; None when the solution does not parse."""
    rewards = []
    for completion, sol in zip(completions, solution):
        gold = parse(sol)
        if not gold:
            rewards.append(None)
            continue
        found = ANSWER.findall(completion[0]["content"])
        predicted = parse(found[-1]) if found else []
        rewards.append(float(verify(gold, predicted)) if predicted else 0.0)
    return rewards


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


training_args = GRPOConfig(
    output_dir="runs/001_math_accuracy",
    max_steps=3,
    per_device_train_batch_size=8,  # completions per step: 2 prompts x 4 generations
    num_generations=4,
    max_completion_length=32,
    temperature=1.0,
    learning_rate=1e-5,
    beta=0.04,  # KL to the reference model (TRL's default is 0.0)
    reward_weights=[1.0, 0.5],  # accuracy, format
    chat_template_kwargs={"enable_thinking": False},
    logging_steps=1,
    log_completions=True,
    use_vllm=True,
    vllm_mode="colocate",
    report_to="none",
)
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=[accuracy_reward, format_reward_func],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
