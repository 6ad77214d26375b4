"""The curriculum hook of the TRL fork that documents `GRPOConfig(dynamic_prompts_fn=curriculum_fn)` ("GRPO Dynamic
Prompt Adjustment"; TRL itself has no such hook): after each generation the trainer calls
`curriculum_fn(prompts, completions, rewards, metas)` with flat per-sample lists (B = prompts x num_generations,
group by group; `metas[i]` = the row's other columns) and generates the prompts it returns next.

This curriculum moves each group up a level when the model solved its question at least half the time, and asks a
fresh question at the same level otherwise; the new rows carry their `answer` and `level` columns, which reach the
reward function as the dataset's do. `curriculum_log` keeps what the hook saw and chose at each generation.

Changes from a TRL(-fork) script: the import line (engine instead of trl), model="builtin:tiny-qwen2-arith", a
local dataset, sizes (max_steps, per_device_train_batch_size, num_generations, max_completion_length).

Run: `python examples/guides/curriculum.py` (2 CPU cores: ~25 s). Writes runs/curriculum/.
"""

import random

from datasets import Dataset

from engine import GRPOConfig, GRPOTrainer

rng = random.Random(0)


def question(level):
    """A level-`level` arithmetic row: operands up to 10**level."""
    a, b = rng.randint(1, 10**level), rng.randint(1, 10**level)
    if rng.random() < 0.5:
        return {"prompt": f"Question: what is {a} + {b}? Answer:", "answer": str(a + b), "level": level}
    a, b = max(a, b), min(a, b)
    return {"prompt": f"Question: what is {a} - {b}? Answer:", "answer": str(a - b), "level": level}


dataset = Dataset.from_list([question(1) for _ in range(8)])


def accuracy(completions, answer, **kwargs):
    """1.0 for `<answer>N</answer>` with the right N, else 0.0."""
    return [1.0 if f"<answer>{a}</answer>" in c else 0.0 for c, a in zip(completions, answer)]


curriculum_log = []


def curriculum_fn(prompts, completions, rewards, metas):
    """One new row per group: a level up if the group's mean reward is >= 0.5, the same level otherwise."""
    g = training_args.num_generations
    groups = range(0, len(prompts), g)
    solved = [sum(rewards[i:i + g]) / g >= 0.5 for i in groups]
    rows = [question(metas[i]["level"] + 1 if ok else metas[i]["level"]) for i, ok in zip(groups, solved)]
    curriculum_log.append({"prompts": [prompts[i] for i in groups], "solved": solved,
                           "returned": [row["prompt"] for row in rows]})
    return rows


training_args = GRPOConfig(
    output_dir="runs/curriculum",
    max_steps=3,
    per_device_train_batch_size=8,  # completions per step: 2 prompts x 4 generations
    num_generations=4,
    max_completion_length=32,
    dynamic_prompts_fn=curriculum_fn,
)
trainer = GRPOTrainer(
    model="builtin:tiny-qwen2-arith",
    reward_funcs=accuracy,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
