"""TRL's GFPO guide (trl.experimental.gfpo, TRL <= 1.7.1: huggingface.co/docs/trl/v1.7.1/gfpo, "Usage"): GFPO
("Sample More to Think Less", arXiv:2508.09726) samples `num_generations` completions per prompt, scores each group
with the trainer's `group_filter_func` and trains on the `num_remains_in_group` best-scored of each group.

The guide's dummy filter scores each completion by its index in its group, so the last two of every group are
kept. It is a class defined in this script (`__main__`); the engine keeps the instance in memory and calls it.

Changes from the guide:
    from trl.experimental.gfpo import GFPOConfig, GFPOTrainer  ->  from engine.experimental.gfpo import ...
    model="Qwen/Qwen3-0.6B"                                     ->  "builtin:tiny-qwen2-arith" (the shipped tiny model)
    reward_funcs=..., train_dataset=...  (left to the reader)   ->  an answer-checking reward, arithmetic prompts
    sizes                                                       ->  max_steps=3, max_completion_length=32
    GroupFilter                                                 ->  also counts its calls (`num_calls`), so that
                                                                    a run shows it was used
`per_device_train_batch_size=4` counts the completions trained on, the survivors: 4 = 2 prompts x 2 kept, sampled
as 2 x num_generations (TRL's default 8) = 16 completions per step.

Run: `python examples/guides/gfpo.py` (2 CPU cores: ~25 s). Writes Qwen3-0.6B-GFPO/ (the guide's output_dir).
"""

from datasets import Dataset

from engine.experimental.gfpo import GFPOConfig, GFPOTrainer

QUESTIONS = [(41, "-", 19), (83, "+", 6), (68, "-", 12), (25, "+", 37), (90, "-", 45), (14, "+", 58)]
dataset = Dataset.from_list([
    {"prompt": f"Question: what is {a} {op} {b}? Answer:", "answer": str(a + b if op == "+" else a - b)}
    for a, op, b in QUESTIONS
])


def correct_answer(completions, answer, **kwargs):
    """1.0 for `<answer>N</answer>` with the right N, else 0.0."""
    return [1.0 if f"<answer>{a}</answer>" in c else 0.0 for c, a in zip(completions, answer)]


# dummy group filter to scores the completions based on its indice in group
class GroupFilter:
    def __init__(self):
        self.num_calls = 0

    def __call__(self, group_completions, group_rewards, **kwargs):
        self.num_calls += 1
        group_scores = []
        for completions, rewards in zip(group_completions, group_rewards):
            scores = [float(i) for i in range(len(completions))]
            group_scores.append(scores)
        return group_scores


training_args = GFPOConfig(
    output_dir="Qwen3-0.6B-GFPO",
    per_device_train_batch_size=4,
    num_remains_in_group=2,
    bf16=True,
    max_steps=3,
    max_completion_length=32,
)
trainer = GFPOTrainer(
    model="builtin:tiny-qwen2-arith",
    reward_funcs=correct_answer,
    train_dataset=dataset,
    args=training_args,
    group_filter_func=GroupFilter(),
)
trainer.train()
