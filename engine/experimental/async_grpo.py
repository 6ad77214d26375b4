"""TRL's asynchronous GRPO by its experimental names: `from engine.experimental.async_grpo import AsyncGRPOConfig,
AsyncGRPOTrainer` (TRL 1.16's `trl.experimental.async_grpo`), over the engine's server mode with bounded staleness.

    # a rollout server first: grpo-engine vllm-serve --model <model> --port 8000
    args = AsyncGRPOConfig(output_dir="out", max_staleness=2, vllm_server_base_url="http://localhost:8000")
    trainer = AsyncGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...)

The mapping of TRL's arguments and what is refused: engine/api/trl_async.py.

Must not: hold any logic (re-exports only). Test: `pytest tests/unit/test_trl_script.py -k async`.
"""

from engine.api.trl_async import AsyncGRPOConfig


def __getattr__(name: str):
    if name == "AsyncGRPOTrainer":  # imports the trainer's stack on first use
        from engine.api import trl_async

        return trl_async.AsyncGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer"]  # noqa: F822 - AsyncGRPOTrainer comes from __getattr__
