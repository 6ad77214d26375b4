"""TRL's GRPO quickstart on this engine: a prompt dataset, a length reward, GRPOConfig + GRPOTrainer, train().

Under TRL the same script runs with only these two lines changed:
    from trl import GRPOConfig, GRPOTrainer
    MODEL = "Qwen/Qwen2-0.5B-Instruct"          # any causal LM from the hub (here: the shipped tiny model)

Run: `python examples/000_quickstart.py` (2 CPU cores: ~30 s, most of it start-up), or on GPUs
`torchrun --nproc-per-node 8 examples/000_quickstart.py`. Writes runs/000_quickstart/ (metrics.jsonl, metrics.png,
the trained model as a Hugging Face checkpoint).
"""

from pathlib import Path

from datasets import load_dataset

from engine import GRPOConfig, GRPOTrainer

MODEL = "builtin:tiny-qwen2-arith"
DATA = Path(__file__).resolve().parent / "data" / "quickstart_prompts.jsonl"

dataset = load_dataset("json", data_files=str(DATA), split="train")


def reward_len(completions, **kwargs):
    """Completions of about 20 characters are best."""
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(
    output_dir="runs/000_quickstart",
    max_steps=3,
    per_device_train_batch_size=8,  # completions per step: 2 prompts x 4 generations
    num_generations=4,
    max_completion_length=32,
    learning_rate=1e-5,
    logging_steps=1,
    use_vllm=True,
    vllm_mode="colocate",
    report_to="none",
)
trainer = GRPOTrainer(model=MODEL, reward_funcs=reward_len, args=training_args, train_dataset=dataset)
trainer.train()
trainer.save_model(training_args.output_dir)
