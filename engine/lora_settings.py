"""The LoRA adapter setting: which HF modules get adapters, rank, scale, dropout; checked here, from the
`lora` config section or a `peft.LoraConfig` (GRPOTrainer's peft_config).

Owns: `HF_TARGETS` (the HF module names an adapter can target, and the Megatron linear and output part each lives in),
`VLLM_LORA_RANKS` / `vllm_max_lora_rank` (vLLM's LoRA ranks), `LoraSettings`, `resolve_target_modules`,
`resolve_modules_to_save` (PEFT's modules_to_save: lm_head, embed_tokens), `lora_settings_from_config`,
`lora_settings_from_peft` (every PEFT option the engine cannot act on refused by name),
`refuse_expert_adapters` (MLP targets on an MoE model), `EXPERT_TARGETS` / `resolve_target_parameters` (PEFT's
`target_parameters` on the routed experts' 3-D tensors) and `lora_fields_from_peft` (the config section's fields).

Must not: import torch, Megatron or peft (a LoraConfig is read by attribute), or build adapters
(engine/policy/lora.py does).

Test: tests/unit/test_lora.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HF_TARGETS: dict[str, tuple[str, str]] = {
    # HF module -> (Megatron linear inside a layer, part of its output)
    "q_proj": ("self_attention.linear_qkv", "q"),
    "k_proj": ("self_attention.linear_qkv", "k"),
    "v_proj": ("self_attention.linear_qkv", "v"),
    "o_proj": ("self_attention.linear_proj", "all"),
    "gate_proj": ("mlp.linear_fc1", "gate"),
    "up_proj": ("mlp.linear_fc1", "up"),
    "down_proj": ("mlp.linear_fc2", "all"),
}
"""Every linear of a Qwen2 / Llama / Qwen3 layer, by the HF module name PEFT's target_modules uses."""


PEFT_PREFIX = "base_model.model.model.layers."
"""The start of every decoder-layer key in a saved PEFT adapter of a causal LM."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's allowed `max_lora_rank` values (vllm/config/lora.py MaxLoRARanks): adapter-only sync starts vLLM at the
smallest one >= r (`vllm_max_lora_rank`); the planner sizes vLLM's LoRA slot with it."""


def vllm_max_lora_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for an adapter of rank `rank`: the smallest allowed one >= rank (ValueError past 512)."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"lora.lora_r={rank} with lora.lora_weight_sync=adapter: vLLM's LoRA supports ranks up to "
                         f"{VLLM_LORA_RANKS[-1]}; use lora.lora_weight_sync=merged")
    return fitting[0]


@dataclass(frozen=True)
class LoraSettings:
    """A checked adapter setting (from the `lora` config section or a `peft.LoraConfig`)."""

    r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: tuple[str, ...]
    """HF module names, in HF_TARGETS' order."""
    use_rslora: bool = False
    adapter_dtype: str = "float32"
    """The adapters' parameter dtype: "float32" (PEFT's `autocast_adapter_dtype=True`) or "model" (the policy's)."""
    target_parameters: tuple[str, ...] = ()
    """Routed-expert tensors (EXPERT_TARGETS' names, in its order) adapted per expert, as PEFT's ParamWrapper."""
    modules_to_save: tuple[str, ...] = ()
    """HF modules trained in full next to the adapters (PEFT's modules_to_save), in SAVED_MODULES' order."""

    @property
    def scaling(self) -> float:
        """PEFT's scale of B A: lora_alpha / r, or lora_alpha / sqrt(r) with rslora (arXiv:2312.03732)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def resolve_target_modules(target_modules, setting: str = "lora.target_modules") -> tuple[str, ...]:
    """HF module names from PEFT's `target_modules` ("all-linear", a list of names, or one name).

    Raises ValueError naming the setting for a name that matches no linear of the model (a regex string too:
    PEFT's regex form is not supported here; list the names)."""
    if target_modules is None:
        raise ValueError(f"{setting} is not set: name the HF modules to adapt (e.g. ['q_proj', 'v_proj']) or "
                         f"'all-linear'; known: {', '.join(HF_TARGETS)}")
    if isinstance(target_modules, str):
        target_modules = list(HF_TARGETS) if target_modules == "all-linear" else [target_modules]
    names = list(target_modules)
    unknown = [n for n in names if n not in HF_TARGETS]
    if unknown or not names:
        raise ValueError(f"{setting}: {unknown or names} match no linear of the model (regular expressions are not "
                         f"supported); use 'all-linear' or names from: {', '.join(HF_TARGETS)}")
    return tuple(n for n in HF_TARGETS if n in names)


def lora_settings_from_peft(peft_config) -> LoraSettings:
    """A `peft.LoraConfig` checked and turned into LoraSettings; every PEFT option this engine cannot act on is
    refused by its name (modules_to_save other than lm_head / embed_tokens, bias, DoRA, per-layer patterns,
    non-default init, fan_in_fan_out)."""
    refusals = {
        "bias": (getattr(peft_config, "bias", "none") != "none", "only 'none' is supported"),
        "use_dora": (bool(getattr(peft_config, "use_dora", False)), "DoRA is not supported"),
        "layers_to_transform": (getattr(peft_config, "layers_to_transform", None) is not None,
                                "every layer gets adapters"),
        "rank_pattern": (bool(getattr(peft_config, "rank_pattern", None)), "one rank for every module"),
        "alpha_pattern": (bool(getattr(peft_config, "alpha_pattern", None)), "one alpha for every module"),
        "init_lora_weights": (getattr(peft_config, "init_lora_weights", True) is not True,
                              "only PEFT's default init (A Kaiming-uniform, B = 0)"),
        "fan_in_fan_out": (bool(getattr(peft_config, "fan_in_fan_out", False)), "not for these models"),
        "lora_bias": (bool(getattr(peft_config, "lora_bias", False)), "not supported"),
    }
    peft_type = str(getattr(getattr(peft_config, "peft_type", None), "value", getattr(peft_config, "peft_type", "")))
    if peft_type != "LORA":
        kind = " (prompt-learning: virtual tokens)" if getattr(peft_config, "is_prompt_learning", False) else ""
        raise ValueError(f"peft_config: {type(peft_config).__name__} ({peft_type or 'no peft_type'}){kind} is not "
                         "supported; only peft.LoraConfig")
    modules_to_save = resolve_modules_to_save(getattr(peft_config, "modules_to_save", None),
                                              "peft_config.modules_to_save")
    refusals |= {name: (bool(getattr(peft_config, name, None)), "not supported")
                 for name in ("exclude_modules", "layer_replication", "trainable_token_indices",
                              "use_qalora", "layers_pattern")}
    for name, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"peft_config.{name}={getattr(peft_config, name)!r}: {why}")
    targets, params = getattr(peft_config, "target_modules", None), getattr(peft_config, "target_parameters", None)
    params = resolve_target_parameters(params, float(peft_config.lora_dropout), "peft_config")
    # PEFT adapts no module when only target_parameters is set (its default targets apply to target_modules alone)
    targets = () if params and not targets else resolve_target_modules(
        PEFT_DEFAULT_TARGETS if targets is None else (sorted(targets) if isinstance(targets, set) else targets),
        "peft_config.target_modules")
    # float32 adapters (the default): TRL's get_peft_model(model, peft_config) autocasts them to fp32 over a bf16 base
    return LoraSettings(r=int(peft_config.r), lora_alpha=float(peft_config.lora_alpha),
                        lora_dropout=float(peft_config.lora_dropout), target_modules=targets,
                        use_rslora=bool(getattr(peft_config, "use_rslora", False)), modules_to_save=modules_to_save,
                        target_parameters=params)


SAVED_MODULES = ("embed_tokens", "lm_head")
"""The HF modules PEFT's modules_to_save may name here: the input embedding and the LM head, trained in full."""


def resolve_modules_to_save(names, setting: str) -> tuple[str, ...]:
    """PEFT's `modules_to_save` (None, a list or one name) as a tuple in SAVED_MODULES' order.

    Raises ValueError naming the setting and the modules for a name other than lm_head / embed_tokens (the layers'
    linears take adapters, not full copies; other modules are not supported)."""
    names = [names] if isinstance(names, str) else list(names or ())
    unknown = [n for n in names if n not in SAVED_MODULES]
    if unknown:
        raise ValueError(f"{setting}={names}: {unknown} cannot be trained in full next to the adapters; only "
                         f"{list(SAVED_MODULES)} (the LM head and the input embedding) are supported")
    return tuple(n for n in SAVED_MODULES if n in names)


PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")
"""PEFT's default target_modules for Qwen2 / Llama / Qwen3 (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)."""


def lora_settings_from_config(section) -> LoraSettings:
    """LoraSettings from the `lora` config section (engine/config.py LoraConfig; use_peft must be true).

    Raises ValueError naming the field: rank < 1, dropout outside [0, 1), target modules that match nothing."""
    if section.lora_r < 1:
        raise ValueError(f"lora.lora_r={section.lora_r}: the rank must be >= 1")
    if not 0.0 <= section.lora_dropout < 1.0:
        raise ValueError(f"lora.lora_dropout={section.lora_dropout}: must be in [0, 1)")
    targets = section.lora_target_modules
    params = resolve_target_parameters(section.lora_target_parameters, section.lora_dropout, "lora")
    targets = () if params and not targets else resolve_target_modules(
        PEFT_DEFAULT_TARGETS if targets is None else ("all-linear" if targets == ["all-linear"] else targets),
        "lora.lora_target_modules")
    return LoraSettings(r=section.lora_r, lora_alpha=float(section.lora_alpha), lora_dropout=section.lora_dropout,
                        target_modules=targets, use_rslora=section.use_rslora,
                        adapter_dtype=section.lora_adapter_dtype, target_parameters=params,
                        modules_to_save=resolve_modules_to_save(section.lora_modules_to_save,
                                                                "lora.lora_modules_to_save"))


EXPERT_TARGETS: dict[str, str] = {"gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}
"""Routed-expert tensor under `mlp.experts` (transformers 5: (E, 2f, h) / (E, h, f)) -> each Megatron expert's linear."""


def resolve_target_parameters(names, lora_dropout: float, section: str) -> tuple[str, ...]:
    """EXPERT_TARGETS names from PEFT's `target_parameters` (matched as PEFT does: the parameter's full name equals
    the entry or ends with "." + it, e.g. "mlp.experts.gate_up_proj"); () for None / [].

    Raises ValueError naming the setting for an entry that matches no expert tensor, or with lora_dropout > 0 (PEFT's
    ParamWrapper refuses dropout: it adapts the weight, not the input)."""
    if not names:
        return ()
    setting = f"{section}.{'lora_target_parameters' if section == 'lora' else 'target_parameters'}"
    if isinstance(names, str):
        raise ValueError(f"{setting}={names!r}: a list of parameter names, e.g. ['mlp.experts.gate_up_proj']")
    full = {name: f"model.layers.0.mlp.experts.{name}" for name in EXPERT_TARGETS}
    found, unknown = set(), []
    for entry in names:
        hits = [n for n, key in full.items() if key == entry or key.endswith(f".{entry}")]
        found.update(hits)
        unknown += [] if hits else [entry]
    if unknown:
        raise ValueError(f"{setting}: {unknown} match no routed-expert tensor; supported: "
                         f"{[f'mlp.experts.{n}' for n in EXPERT_TARGETS]} (MoE models)")
    if lora_dropout:
        raise ValueError(f"{setting}={list(names)} with {section}.lora_dropout={lora_dropout}: adapters on expert "
                         "tensors adapt the weight (PEFT's ParamWrapper), so input dropout cannot act; set it to 0")
    return tuple(n for n in EXPERT_TARGETS if n in found)


MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def refuse_expert_adapters(settings: LoraSettings, model_type: str, num_experts: int, expert_tp_size: int = 1) -> None:
    """Refuse adapters on the MLP of a model with routed experts (`num_experts` > 0), at any parallel.ep_size, and
    expert-tensor adapters (target_parameters) that cannot be built: on a dense model, at parallel.expert_tp_size > 1.

    NOTE: why MLP target_modules are not built: transformers 5 holds every MoE family's experts as 3-D tensors
    (`mlp.experts.gate_up_proj` (E, 2f, h), `mlp.experts.down_proj`), not as gate_proj / up_proj / down_proj linears,
    so PEFT's target_modules match none of them (PEFT reaches them through `target_parameters`, its ParamWrapper
    layout: `lora.lora_target_parameters`, engine/policy/expert_lora.py). GLM-4.5's dense first layers and shared
    expert are refused with them (one MLP rule per model). Raises ValueError naming the setting, the modules and the
    ways out (attention targets, target_parameters)."""
    _refuse_expert_parameters(settings, model_type, num_experts, expert_tp_size)
    mlp = [name for name in settings.target_modules if name in MLP_TARGETS]
    if not num_experts or not mlp:
        return
    attention = [name for name in settings.target_modules if name not in MLP_TARGETS]
    raise ValueError(
        f"lora.lora_target_modules (peft_config.target_modules) includes {mlp}, but {model_type} routes its MLP "
        f"through {num_experts} experts: adapters on expert linears are not built (at any parallel.ep_size). "
        "transformers 5 holds the experts as 3-D tensors (mlp.experts.gate_up_proj / down_proj), which PEFT's "
        "target_modules do not match, so no loadable PEFT adapter could carry them. Set lora.lora_target_modules="
        f"{attention or ['q_proj', 'k_proj', 'v_proj', 'o_proj']} (the attention; 'all-linear' includes the MLP); "
        "adapt the experts with lora.lora_target_parameters (peft target_parameters) = ['mlp.experts.gate_up_proj', "
        "'mlp.experts.down_proj']")


def lora_fields_from_peft(peft_config) -> dict:
    """The `lora` config section's fields (engine/config.py LoraConfig) for a checked `peft.LoraConfig`."""
    settings = lora_settings_from_peft(peft_config)
    return {"use_peft": True, "lora_r": settings.r, "lora_alpha": peft_config.lora_alpha,
            "lora_dropout": settings.lora_dropout, "lora_target_modules": list(settings.target_modules),
            "use_rslora": settings.use_rslora, "lora_modules_to_save": list(settings.modules_to_save) or None,
            "lora_target_parameters": [f"mlp.experts.{n}" for n in settings.target_parameters] or None}


def _refuse_expert_parameters(settings: LoraSettings, model_type: str, num_experts: int, expert_tp_size: int) -> None:
    if not settings.target_parameters:
        return
    named = f"lora.lora_target_parameters (peft_config.target_parameters)={list(settings.target_parameters)}"
    if not num_experts:
        raise ValueError(f"{named}: {model_type} has no routed experts, so they match no parameter")
    if expert_tp_size > 1:
        raise ValueError(f"{named} at parallel.expert_tp_size={expert_tp_size}: expert adapters are built with "
                         "whole experts per rank only (expert_tp_size 1; ep_size splits the experts)")
