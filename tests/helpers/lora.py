"""Scaffolding of the LoRA tests (tests/distributed/test_lora_layouts.py): the adapter setting they use, a
layout-independent perturbation of the adapters' B (PEFT initialises B = 0, which would make every adapter test
trivially pass), and the rank function that returns the policy's logits with adapters and writes the PEFT adapter
and the merged HF export.
Must not: assert what a test checks, or start processes itself.
"""

from __future__ import annotations

import zlib

import torch

from engine.policy.microbatch import MicroBatch

SETTINGS = dict(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"))


def lora_settings(**overrides):
    from engine.lora_settings import LoraSettings

    return LoraSettings(**(SETTINGS | overrides))


@torch.no_grad()
def perturb_lora_b(chunks, ps, seed: int = 7, std: float = 0.05) -> None:
    """Give every adapter's B a global-name-seeded N(0, std) value (this rank's TP shard of it), and add one to the
    weight of every module of modules_to_save (the trained copy moves away from the loaded, frozen original)."""
    from engine.policy.lora import lora_adapters, saved_modules
    from engine.policy.model import take_tp_shard

    for name, module in saved_modules(chunks):
        weight = module.weight
        full_shape = [weight.shape[0] * ps.tp_size, *weight.shape[1:]]  # vocab-parallel rows
        gen = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(f"{name}.saved".encode()))
        weight.add_(take_tp_shard(std * torch.randn(full_shape, generator=gen), weight, ps.tp_rank,
                                  ps.tp_size).to(weight.dtype))

    for layer, adapter in lora_adapters(chunks):
        for name, b in adapter.lora_B.items():
            full_shape = list(b.shape)
            if getattr(b, "tensor_model_parallel", False):
                full_shape[0] *= ps.tp_size
            expert = f"experts.{adapter.expert}." if hasattr(adapter, "expert") else ""  # the global expert
            gen = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(f"{layer}.{expert}{name}.B".encode()))
            full = std * torch.randn(full_shape, generator=gen)
            b.copy_(take_tp_shard(full, b, ps.tp_rank, ps.tp_size).to(b.dtype))


def lora_logits_and_exports(model_dir: str, parallel, out_dir: str, settings_overrides: dict | None = None) -> dict:
    """Rank function: the policy with (perturbed) adapters: its full-vocabulary logits of tests/helpers/policy.py
    `tokens` (last stage, TP rank 0; None elsewhere), the same within `merged_lora` and `adapters_disabled`
    ("disabled": the loaded base, modules_to_save back to their originals), the PEFT adapter written to
    `<out_dir>/adapter` and the merged model exported as an HF checkpoint to `<out_dir>/merged`."""
    from engine.policy.hf_checkpoint import export_hf_checkpoint
    from engine.policy.lora import adapters_disabled, apply_lora, merged_lora
    from engine.policy.peft_adapter import save_peft_adapter
    from engine.policy.step import run_schedule
    from tests.helpers.policy import BATCH, SEQ, build_from_hf, gathered_logits_fn, tokens

    ps, hf_config, chunks, dims = build_from_hf(model_dir, parallel)
    settings = lora_settings(**(settings_overrides or {}))
    apply_lora(chunks, settings, ps)
    perturb_lora_b(chunks, ps)
    for chunk in chunks:
        chunk.eval()
    batch = MicroBatch(tokens=tokens(hf_config.vocab_size), position_ids=torch.arange(SEQ).expand(BATCH, SEQ))
    logits_fn = gathered_logits_fn(ps, hf_config.vocab_size)

    def logits():
        with torch.no_grad():
            values = run_schedule(chunks, ps, [batch], logits_fn, forward_only=True)
        return values[0]["logits"] if values and ps.tp_rank == 0 else None

    with_adapters = logits()
    with adapters_disabled(chunks):
        disabled = logits()
    save_peft_adapter(chunks, ps, f"{out_dir}/adapter", settings, base_model_name_or_path=model_dir)
    with merged_lora(chunks):
        merged = logits()
        export_hf_checkpoint(chunks, ps, f"{out_dir}/merged", hf_config, dims, tokenizer_dir=model_dir)
    return {"logits": with_adapters, "merged_logits": merged, "after_merge": logits(), "disabled": disabled}


def optimizer_state_numel(popt) -> int:
    """Elements of this rank's Adam first-moment state (its DP shard with the distributed optimizer)."""
    from engine.train.checkpoint import _inner_optimizers

    total = 0
    for inner in _inner_optimizers(popt.optimizer):
        for state in inner.optimizer.state.values():
            total += state["exp_avg"].numel() if "exp_avg" in state else 0
    return total


def held_dtypes(chunks, popt) -> dict[str, list[str]]:
    """The dtypes (sorted names) this rank holds: "adapters" (A and B), "frozen" (the base), "main_grads" (the adapters'
    gradient buffers), "optimizer_params" (what the optimizer updates: the adapters or their fp32 main copies) and
    "optimizer_state" (Adam's moments)."""
    from engine.policy.lora import is_lora_param
    from engine.train.checkpoint import _inner_optimizers

    def names(tensors) -> list[str]:
        return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})

    params = [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]
    inner = [opt.optimizer for opt in _inner_optimizers(popt.optimizer)]
    return {"adapters": names(p for n, p in params if is_lora_param(n)),
            "frozen": names(p for n, p in params if not is_lora_param(n)),
            "main_grads": names(p.main_grad for n, p in params if is_lora_param(n)),
            "optimizer_params": names(p for opt in inner for group in opt.param_groups for p in group["params"]),
            "optimizer_state": names(s for opt in inner for state in opt.state.values() for s in state.values()
                                     if torch.is_tensor(s) and s.dim() > 0)}
