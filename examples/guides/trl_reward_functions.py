"""TRL's GRPO Trainer guide, "Using a custom reward function" (huggingface.co/docs/trl/grpo_trainer#using-a-custom-
reward-function) and "Option 2: Colocate mode": every reward-function example of the guide for the standard (plain
text) format, passed together as one list with `reward_weights`, in one run.

    Example 1    reward_func(completion_ids)          longer completions, in tokens      -> `reward_num_tokens`
    Example 1.1  reward_func(completions)             longer completions, in characters  -> `reward_num_chars`
    Example 3    reward_func(completions, ground_truth)  \\boxed{} equal to a column      -> `reward_ground_truth`
    Example 4    math_reward_func / coding_reward_func  one task each, None for the other task's rows
    Example 5    async_reward_func                     an `async def` reward (awaited concurrently)
    "Passing the reward function to the trainer": a list of sync and async functions, summed with `reward_weights`
    "Option 2: Colocate mode": GRPOConfig(..., use_vllm=True, vllm_mode="colocate")

Example 2 (a format reward over conversational completions) needs a conversational dataset: examples/001_*.

Changes from the guide:
    from trl import GRPOConfig, GRPOTrainer    ->  from engine import GRPOConfig, GRPOTrainer
    model="Qwen/Qwen2-0.5B-Instruct"           ->  "builtin:tiny-qwen2-arith" (the shipped tiny model)
    the dataset                                 ->  Dataset.from_list with the guide's columns (`ground_truth` of
                                                    Example 3, `task` of Example 4), arithmetic in the tiny model's
                                                    format for the math rows
    GRPOConfig(...)'s "..."                     ->  sizes: max_steps, per_device_train_batch_size, num_generations,
                                                    max_completion_length
Examples 1, 1.1 and 3 are all called `reward_func` in the guide; here they carry names of their own (metrics are
logged per function name). The guide leaves `check_math_solution` and `test_code_solution` to the reader: defined
below. Its Example 4 checks `t == "coding"` against a dataset whose rows say "code" (so its coding reward never
applies); here both say "code".

Run: `python examples/guides/trl_reward_functions.py` (2 CPU cores: ~25 s). Writes runs/trl_reward_functions/.
"""

import asyncio
import re

from datasets import Dataset

from engine import GRPOConfig, GRPOTrainer

dataset = Dataset.from_list(
    [
        {"prompt": "Question: what is 41 - 19? Answer:", "ground_truth": "22", "task": "math"},
        {"prompt": "Write a function that returns the sum of two numbers.", "ground_truth": "", "task": "code"},
        {"prompt": "Question: what is 83 + 6? Answer:", "ground_truth": "89", "task": "math"},
        {"prompt": "Write a function that returns the product of two numbers.", "ground_truth": "", "task": "code"},
    ]
)


# Example 1: reward longer completions (in tokens)
def reward_num_tokens(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


# Example 1.1: reward longer completions (in characters)
def reward_num_chars(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]


# Example 3: reward completions based on a reference (the `ground_truth` column)
def reward_ground_truth(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


# Example 4: multi-task reward functions (None for the rows of the other task)
def check_math_solution(prompt, completion):
    a, op, b = re.search(r"(\d+) ([+-]) (\d+)", prompt).groups()
    expected = int(a) + int(b) if op == "+" else int(a) - int(b)
    found = re.search(r"<answer>\s*(-?\d+)\s*</answer>", completion)
    return found is not None and int(found.group(1)) == expected


def test_code_solution(prompt, completion):
    try:  # compiled, never run
        compile(completion, "<completion>", "exec")
    except (SyntaxError, ValueError):
        return False
    return "def " in completion and "return" in completion


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards


def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "code":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards


# Example 5: asynchronous reward functions
async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


# Option 2: colocate mode, with one weight per reward function
training_args = GRPOConfig(
    output_dir="runs/trl_reward_functions",
    max_steps=3,
    per_device_train_batch_size=8,  # completions per step: 2 prompts x 4 generations
    num_generations=4,
    max_completion_length=32,
    reward_weights=[0.1, 0.02, 1.0, 1.0, 1.0, 0.5],
    use_vllm=True,
    vllm_mode="colocate",
)

# Passing the reward functions to the trainer: sync and async ones in one list
trainer = GRPOTrainer(
    model="builtin:tiny-qwen2-arith",
    reward_funcs=[reward_num_tokens, reward_num_chars, reward_ground_truth, math_reward_func, coding_reward_func,
                  async_reward_func],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
