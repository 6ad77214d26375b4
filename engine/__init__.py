"""GRPO post-training engine: Megatron-core policy, fused loss, vLLM rollout. See README.md.

`from engine import GRPOConfig, GRPOTrainer` gives the TRL-compatible API (engine/api/trl_trainer.py), and
`GFPOConfig, GFPOTrainer` TRL's experimental GFPO names (also at `engine.experimental.gfpo`, the path of
`trl.experimental.gfpo`), imported on first use so that `import engine` stays light (no torch, Megatron or vLLM at
import time).
"""

__all__ = ["GFPOConfig", "GFPOTrainer", "GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str):
    if name in __all__:
        from engine.api import trl_trainer as trl_api

        return getattr(trl_api, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
