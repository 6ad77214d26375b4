"""The PEFT adapter directory a TRL user loads: `adapter_config.json` + `adapter_model.safetensors` with PEFT's keys.

Owns: `save_peft_adapter` (collective: TP shards gathered, pipeline stages' tensors collected on rank 0, written by
rank 0 to `<dir>.tmp` and renamed into place) and `peft_config_of` (the peft.LoraConfig describing LoraSettings).
`peft.PeftModel.from_pretrained(hf_base, dir)` then holds the engine's adapters.

Must not: merge adapters into the base (engine/policy/lora.py `merged_lora` with the HF export does that), know vLLM.

Test: tests/distributed/test_lora_layouts.py (peft loads the adapter; its logits equal the engine's).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist

from engine.lora_settings import LoraSettings
from engine.policy.lora import lora_tensors_for_peft

ADAPTER_FILE = "adapter_model.safetensors"


def peft_config_of(settings: LoraSettings, base_model_name_or_path: str | None = None):
    """The peft.LoraConfig equivalent to `settings` (task CAUSAL_LM, bias none)."""
    from peft import LoraConfig

    return LoraConfig(r=settings.r, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                      target_modules=list(settings.target_modules), use_rslora=settings.use_rslora, bias="none",
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
    from safetensors.torch import save_file

    tensors = lora_tensors_for_peft(chunks, ps)
    stage_tensors = tensors if ps.tp_rank == 0 and ps.dp_rank == 0 else {}
    per_rank: list = [None] * ps.world_size
    dist.all_gather_object(per_rank, {k: v.cpu() for k, v in stage_tensors.items()})
    out_dir = Path(out_dir)
    if ps.rank == 0:
        merged = {k: (v.to(dtype) if dtype else v).contiguous() for part in per_rank for k, v in part.items()}
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(merged, tmp / ADAPTER_FILE, metadata={"format": "pt"})
        peft_config_of(settings, base_model_name_or_path).save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    dist.barrier()
    return out_dir if ps.rank == 0 else None
