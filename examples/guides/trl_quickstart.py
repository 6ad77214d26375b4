"""TRL's GRPO Trainer guide, "Quick start" (huggingface.co/docs/trl/grpo_trainer#quick-start): `accuracy_reward`
on DeepMath-103K's columns (a conversational `prompt`, a `solution`), GRPOTrainer without `args` (every setting at
TRL's defaults: bf16, 8 generations, 512 completion tokens, 3 epochs, colocated vLLM at 0.3 memory utilisation).

Changes from the guide (the allowed ones, nothing else):
    from trl.rewards import accuracy_reward       ->  from engine.rewards import accuracy_reward
    from trl import GRPOTrainer                    ->  from engine import GRPOTrainer
    model="Qwen/Qwen2-0.5B-Instruct"               ->  "builtin:tiny-qwen2-arith" (the shipped tiny model)
    load_dataset("trl-lib/DeepMath-103K", ...)    ->  two rows with its columns (3 epochs x 2 rows = 6 steps)

The tiny model was warm-started on plain text, not chats, and never writes LaTeX: under its chat template the
accuracy is 0 everywhere, every group's rewards are equal and GRPO has nothing to learn (the weights stay as they
were; tests/integration/test_trl_guides.py checks both sides of that). With the guide's model it learns.

Run: `python examples/guides/trl_quickstart.py` (2 CPU cores: ~20 s). Writes builtin-tiny-qwen2-arith-GRPO/.
"""

from datasets import Dataset

from engine import GRPOTrainer
from engine.rewards import accuracy_reward

dataset = Dataset.from_list([
    {"prompt": [{"role": "user", "content": "What is $41 - 19$? Put the final answer in \\boxed{}."}],
     "solution": "22"},
    {"prompt": [{"role": "user", "content": "What is $7 \\times 6$? Put the final answer in \\boxed{}."}],
     "solution": "42"},
])

trainer = GRPOTrainer(
    model="builtin:tiny-qwen2-arith",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
