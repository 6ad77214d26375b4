"""TRL's GRPO Trainer guide, "Speed up training with vLLM-powered generation", "Option 1: Server mode"
(huggingface.co/docs/trl/grpo_trainer#-option-1-server-mode): vLLM in a process (node) of its own, weights pushed
to it after every optimizer step.

    1. Start the vLLM server:        trl vllm-serve --model <model_name>
       here (one token, shared with the trainer through the environment; the server refuses to start without one):
           export GRPO_ENGINE_TOKEN=$(python -c "import secrets; print(secrets.token_hex(16))")
           grpo-engine vllm-serve --model builtin:tiny-qwen2-arith
       (on a CPU-only machine add --gpu_memory_utilization 0.1: there it is a fraction of host memory)
    2. Enable server mode in your training script: GRPOConfig(..., use_vllm=True, vllm_mode="server"), below.

The trainer reaches the server at TRL's defaults, vllm_server_host "0.0.0.0" and vllm_server_port 8000 (the
server's defaults too).

Changes from the guide: `trl vllm-serve` -> `grpo-engine vllm-serve` (and the token); the import line; the model
(the shipped tiny model, on both sides); the dataset and reward of the guide's quick start on plain-text prompts
(the guide's snippet leaves them as "..."); sizes (max_steps, per_device_train_batch_size, num_generations,
max_completion_length).

Run: `python examples/guides/trl_vllm_server.py` once the server is up (2 CPU cores: ~25 s).
Writes runs/trl_vllm_server/.
"""

from datasets import Dataset

from engine import GRPOConfig, GRPOTrainer

dataset = Dataset.from_list([
    {"prompt": "Question: what is 41 - 19? Answer:"},
    {"prompt": "Question: what is 83 + 6? Answer:"},
])


def reward_len(completions, **kwargs):
    """Completions of about 20 characters are best."""
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(
    output_dir="runs/trl_vllm_server",
    max_steps=3,
    per_device_train_batch_size=8,  # completions per step: 2 prompts x 4 generations
    num_generations=4,
    max_completion_length=32,
    use_vllm=True,
    vllm_mode="server",
)
trainer = GRPOTrainer(
    model="builtin:tiny-qwen2-arith",
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
