"""The PEFT adapter directory a TRL user loads: `adapter_config.json` + `adapter_model.safetensors` with PEFT's keys.

Owns: `save_peft_adapter` (collective: TP shards gathered, pipeline stages' tensors collected on rank 0, written by
rank 0 to `<dir>.tmp` and renamed into place: `write_peft_adapter`), `peft_config_of` (the peft.LoraConfig describing
LoraSettings) and `initial_peft_tensors` / `write_initial_adapter` (the adapters a run starts from, without the
policy: save_model() before train()).
`peft.PeftModel.from_pretrained(hf_base, dir)` then holds the engine's adapters.

Must not: merge adapters into the base (engine/policy/lora.py `merged_lora` with the HF export does that), know vLLM.

Test: tests/distributed/test_lora_layouts.py (peft loads the adapter; its logits equal the engine's; the initial
adapter = apply_lora's), tests/unit/test_trl_api.py (save_model() before train() writes it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from engine.lora_settings import LoraSettings
from engine.policy.lora import HF_PARENT, PEFT_PREFIX, PEFT_SAVED_KEYS, initial_lora_a, lora_tensors_for_peft

ADAPTER_FILE = "adapter_model.safetensors"


def peft_config_of(settings: LoraSettings, base_model_name_or_path: str | None = None):
    """The peft.LoraConfig equivalent to `settings` (task CAUSAL_LM, bias none)."""
    from peft import LoraConfig

    experts = [f"mlp.experts.{name}" for name in settings.target_parameters] or None  # PEFT's ParamWrapper
    return LoraConfig(r=settings.r, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                      target_modules=list(settings.target_modules), use_rslora=settings.use_rslora, bias="none",
                      modules_to_save=list(settings.modules_to_save) or None, target_parameters=experts,
                      task_type="CAUSAL_LM", base_model_name_or_path=base_model_name_or_path)


def save_peft_adapter(chunks, ps, out_dir: str | Path, settings: LoraSettings,
                      base_model_name_or_path: str | None = None, dtype=None) -> Path | None:
    """Write the adapters as a PEFT adapter directory (collective: every rank calls it).

    Args:
        chunks: this rank's model chunks (DDP-wrapped or not) carrying adapters (engine/policy/lora.py apply_lora).
        settings: the adapter setting, written as adapter_config.json.
        base_model_name_or_path: recorded in adapter_config.json (PEFT loads the base from it when asked).
        dtype: the tensors' dtype in the file (None: as held).
    Returns:
        The directory on rank 0, None elsewhere.
    """
    tensors = lora_tensors_for_peft(chunks, ps)
    stage_tensors = tensors if ps.tp_rank == 0 and ps.dp_rank == 0 else {}
    per_rank: list = [None] * ps.world_size
    dist.all_gather_object(per_rank, {k: v.cpu() for k, v in stage_tensors.items()})
    out_dir = Path(out_dir)
    if ps.rank == 0:
        merged = {k: (v.to(dtype) if dtype else v) for part in per_rank for k, v in part.items()}
        write_peft_adapter(merged, out_dir, settings, base_model_name_or_path)
    dist.barrier()
    return out_dir if ps.rank == 0 else None


def write_peft_adapter(tensors: dict, out_dir: str | Path, settings: LoraSettings,
                       base_model_name_or_path: str | None = None, *, replace_dir: bool = True) -> Path:
    """Write {PEFT key: tensor} and `settings` as a PEFT adapter directory (to `<dir>.tmp`, renamed into place; with
    `replace_dir` False its files are moved into `out_dir`, whose other files stay)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / ADAPTER_FILE, metadata={"format": "pt"})
    peft_config_of(settings, base_model_name_or_path).save_pretrained(tmp)
    if not replace_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        for item in tmp.iterdir():
            os.replace(item, out_dir / item.name)
        tmp.rmdir()
    else:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    return out_dir


def initial_peft_tensors(settings: LoraSettings, hf_config, seed: int,
                         model_dir: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The adapters `apply_lora(..., seed=seed)` starts from, under PEFT's key names, without building the policy:
    A from engine/policy/lora.py `initial_lora_a`, B zero (float32), and the modules of modules_to_save as
    `model_dir`'s checkpoint holds them (needed then). What save_model() writes before train()."""
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    hidden, ffn = hf_config.hidden_size, hf_config.intermediate_size
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden),
              "v_proj": (kv * head_dim, hidden), "o_proj": (hidden, heads * head_dim), "gate_proj": (ffn, hidden),
              "up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for name in settings.target_modules:
            out, in_features = shapes[name]
            key = f"{PEFT_PREFIX}{layer}.{HF_PARENT[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = initial_lora_a(layer, name, settings.r, in_features, seed)
            tensors[f"{key}.lora_B.weight"] = torch.zeros(out, settings.r)
    if settings.target_parameters:  # expert adapters (PEFT's target_parameters) on the MoE layers
        from engine.models.families import dense_layers
        from engine.policy.expert_lora import initial_expert_tensors

        moe_layers = list(range(dense_layers(hf_config), hf_config.num_hidden_layers))
        tensors |= initial_expert_tensors(settings, hf_config, moe_layers, seed, initial_lora_a)
    if settings.modules_to_save:
        from engine.policy.hf_checkpoint import SafetensorsSource

        source = SafetensorsSource(model_dir)
        hf_names = {"embed_tokens": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}
        for name in settings.modules_to_save:
            tensors[PEFT_SAVED_KEYS[name]] = source.read(hf_names[name], (slice(None),)).clone()
    return tensors


def write_initial_adapter(cfg, target: str | Path) -> Path:
    """Write the PEFT adapter the run of `cfg` (engine/config.py EngineConfig, `lora.use_peft`) starts from into
    `target` (its other files stay): what TRL's save_model() of a PEFT model writes before train()."""
    from transformers import AutoConfig

    from engine.lora_settings import lora_settings_from_config
    from engine.models.tiny_model import resolve_builtin_model

    name = cfg.model.name_or_path  # a builtin model: built where the run builds it (engine/train/run.py)
    model_dir = resolve_builtin_model(name, Path(cfg.train.output_dir) / "models") if name.startswith("builtin:") \
        else Path(name)
    settings = lora_settings_from_config(cfg.lora)
    tensors = initial_peft_tensors(settings, AutoConfig.from_pretrained(model_dir), cfg.train.seed, model_dir)
    return write_peft_adapter(tensors, target, settings, base_model_name_or_path=str(model_dir), replace_dir=False)
