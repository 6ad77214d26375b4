"""Reward functions that use the rest of TRL's contract: extra dataset columns (`answer`, `task`, `difficulty`),
`trainer_state` (a curriculum), an `async` reward (e.g. a remote judge; async functions run concurrently), and
`None` for rows a function does not apply to (it is left out of that function's mean, not counted as 0).

Under TRL the same script runs with only these two lines changed:
    from trl import GRPOConfig, GRPOTrainer
    MODEL = "Qwen/Qwen2.5-0.5B-Instruct"        # any causal LM from the hub (here: the shipped tiny model)

Run: `python examples/003_async_rewards_extra_columns.py` (2 CPU cores: ~30 s). Writes
runs/003_async_rewards_extra_columns/.
"""

import asyncio
import re
from pathlib import Path

from datasets import load_dataset

from engine import GRPOConfig, GRPOTrainer

MODEL = "builtin:tiny-qwen2-arith"
DATA = Path(__file__).resolve().parent / "data" / "mixed_tasks.jsonl"

dataset = load_dataset("json", data_files=str(DATA), split="train")
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def exact_answer(completions, answer, task, difficulty, **kwargs):
    """Arithmetic rows: 1.0 for the right number (2.0 on hard rows); other tasks: None (not applicable)."""
    rewards = []
    for completion, ref, kind, level in zip(completions, answer, task, difficulty):
        if kind != "arithmetic":
            rewards.append(None)
            continue
        found = ANSWER.search(completion)
        rewards.append(float(level) if found and found.group(1) == ref else 0.0)
    return rewards


async def judge_brevity(prompts, completions, trainer_state, **kwargs):
    """A stand-in for a remote judge: awaits a (simulated) network call per completion, all at once; the wanted
    length shrinks as training goes on (trainer_state.global_step)."""
    target = max(8, 24 - 4 * trainer_state.global_step)

    async def judge(text):
        await asyncio.sleep(0.01)  # the request to the judge
        return 1.0 - min(abs(len(text) - target) / target, 1.0)

    return list(await asyncio.gather(*(judge(c) for c in completions)))


training_args = GRPOConfig(
    output_dir="runs/003_async_rewards_extra_columns",
    max_steps=3,
    per_device_train_batch_size=8,  # completions per step: 2 prompts x 4 generations
    num_generations=4,
    max_completion_length=32,
    learning_rate=1e-5,
    scale_rewards="batch",
    logging_steps=1,
    log_completions=True,  # the table in output_dir/completions/ shows None (not applicable) per row
    use_vllm=True,
    vllm_mode="colocate",
    report_to="none",
)
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=[exact_answer, judge_brevity],
    args=training_args,
    train_dataset=dataset,
)
result = trainer.train()
print(f"steps {result.global_step}, mean loss {result.training_loss:.4f}")
