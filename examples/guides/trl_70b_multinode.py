"""TRL's GRPO Trainer guide, "GRPO at scale: train a 70B+ Model on multiple nodes"
(huggingface.co/docs/trl/grpo_trainer#grpo-at-scale-train-a-70b-model-on-multiple-nodes): Qwen2.5-72B on 4 training
nodes of 8 GPUs, generation on a fifth node. Validated and planned by tests/integration/test_trl_guides.py, never
run there (it needs 40 H100s and the model).

Changes from the guide: the import line (`from engine import ...`, `from engine.rewards import accuracy_reward`).
The model and the dataset stay the guide's (hub names: run it where they can be downloaded).

What the guide's launch lines become here. TRL shards the 72B model with DeepSpeed ZeRO-3, set on the `accelerate
launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml` line, not in this script; the engine shards
it with Megatron tensor and pipeline parallelism, which are GRPOConfig fields (`tp_size`, `pp_size`). So, unlike the
guide, the layout is written into the config, and `per_device_train_batch_size` counts completions per data-parallel
rank (TP x PP GPUs), not per GPU:

    GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=32,   # 4 x 32 = TRL's 4 x 32 GPUs
               tp_size=8, pp_size=4,                                            # in place of ZeRO-3
               use_vllm=True, vllm_mode="server", vllm_tensor_parallel_size=8,
               vllm_server_host=...)

    # node 4 (generation), in place of `trl vllm-serve --model Qwen/Qwen2.5-72B --tensor_parallel_size 8`:
    grpo-engine vllm-serve --model Qwen/Qwen2.5-72B --tensor_parallel_size 8
    # nodes 0-3 (training), in place of `accelerate launch --config_file ...deepspeed_zero3.yaml --num_processes 32
    # --num_machines 4 ...`:
    srun --nodes=4 --ntasks=4 torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint ${NODELIST[0]}:29500 train_grpo.py --vllm_server_host $VLLM_NODE

`grpo-engine plan` prints what this layout costs per GPU (launch/grpo_72b.slurm does the same split from a YAML
config). Two slips of the guide are kept as they are: the SLURM line passes `--server_ip` while the script parses
`--vllm_server_host`, and the script does not set `vllm_mode="server"` although TRL's default is "colocate".
"""

import argparse

from datasets import load_dataset

from engine import GRPOConfig, GRPOTrainer
from engine.rewards import accuracy_reward


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm_server_host", type=str, default="", help="The server IP")
    args = parser.parse_args()

    dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

    training_args = GRPOConfig(
        per_device_train_batch_size=4,
        use_vllm=True,
        vllm_server_host=args.vllm_server_host.replace("ip-", "").replace("-", "."),  # from ip-X-X-X-X to X.X.X.X
    )

    trainer = GRPOTrainer(
        model="Qwen/Qwen2.5-72B",
        args=training_args,
        reward_funcs=accuracy_reward,
        train_dataset=dataset
    )
    trainer.train()


if __name__ == "__main__":
    main()
