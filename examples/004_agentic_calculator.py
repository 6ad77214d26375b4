"""Agentic GRPO in TRL's style: a calculator environment (`environment_factory=Calculator`: its `calculate` method
is the model's tool, its `get_reward` scores how the tool was used) and an answer reward, on 3-digit arithmetic.

The tiny model cannot add 3-digit numbers, but it can call the calculator and copy the result. The shipped
`builtin:tiny-qwen2-calc` was taught the tool-call format on these conversations (engine/demo/tool_warm_start.py,
from the demo's tiny model), leaving a habit: most of the time it answers with a guess without calling the
calculator. GRPO then teaches it to call the calculator first. The held-out reward (64 test problems, 4 samples
each, multi-turn as in training) is printed before and after training.

Under TRL the same script runs with only these two lines changed:
    from trl import GRPOConfig, GRPOTrainer
    MODEL = "Qwen/Qwen3-0.6B"                   # a tool-calling model from the hub (here: the shipped tiny model)

Run: `python examples/004_agentic_calculator.py` (2 CPU cores: a few minutes). Writes runs/004_agentic_calculator/
(metrics.jsonl, metrics.png). Environment state (the calculator's calls) is not checkpointed: a resumed run resets
every environment at its next rollout.
"""

import os
import re

from engine import GRPOConfig, GRPOTrainer
from engine.demo.tool_warm_start import calculator_dataset

MODEL = "builtin:tiny-qwen2-calc"
MAX_STEPS = int(os.environ.get("EXAMPLE_MAX_STEPS", "20"))  # the test runs it shorter

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


class Calculator:
    """One rollout's calculator: `reset` gets the row (its prompt), the model calls `calculate` as a tool."""

    def __init__(self):
        self.question, self.calls = None, []

    def reset(self, prompt, **row) -> None:
        self.question, self.calls = prompt[-1]["content"], []

    def calculate(self, expression: str) -> str:
        """Compute a + b or a - b.

        Args:
            expression: two integers and + or -, e.g. "482 + 317".
        """
        self.calls.append(expression)
        left, op, right = expression.split()
        if op not in "+-" or not (left.isdigit() and right.isdigit()):
            raise ValueError(f"cannot evaluate {expression!r}")
        return str(int(left) + int(right) if op == "+" else int(left) - int(right))

    def get_reward(self) -> float:
        """0.5 when the calculator was asked the question's own expression (the work shown), else 0."""
        return 0.5 * any(f"what is {expression}?" in self.question for expression in self.calls)


def correct_answer(completions, answer, **kwargs):
    """1.0 when the last turn's <answer>N</answer> is the reference number, else 0."""
    found = [ANSWER.search(c[-1]["content"]) for c in completions]
    return [float(m is not None and m.group(1) == a) for m, a in zip(found, answer)]


training_args = GRPOConfig(
    output_dir="runs/004_agentic_calculator",
    max_steps=MAX_STEPS,
    per_device_train_batch_size=16,  # completions per step: 4 prompts x 4 generations
    num_generations=4,
    max_completion_length=160,  # model turns and tool messages together: a call (~75 tokens) + its result (~39)
    max_tool_calling_iterations=2,
    learning_rate=5e-5,
    beta=0.0,
    loss_type="dapo",
    eval_strategy="steps",
    eval_steps=MAX_STEPS,
    eval_on_start=True,
    logging_steps=1,
    use_vllm=True,
    vllm_mode="colocate",
    vllm_max_model_length=512,
    report_to="none",
)
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=correct_answer,  # the environment's get_reward is appended as a second reward function (TRL)
    args=training_args,
    train_dataset=calculator_dataset("train", 2000),
    eval_dataset=calculator_dataset("test", 64),
    environment_factory=Calculator,
)
trainer.train()
evals = [h for h in trainer.state.log_history if "eval_reward" in h]
print(f"held-out reward (64 problems x 4 samples): before {evals[0]['eval_reward']:.3f}, "
      f"after {evals[-1]['eval_reward']:.3f}")
