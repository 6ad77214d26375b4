"""Adapter-only weight sync into vLLM's LoRA support (`lora.lora_weight_sync=adapter`, issue #29), the vLLM side.

Owns: `lora_engine_options` (the `vllm.LLM` keywords that turn its LoRA support on for one adapter of rank r),
`policy_lora_request` (the request every generation names once an adapter is loaded) and `LoraReceiver`, mixed into
the worker extension (engine/rollout/vllm_engine.py `WeightReceiverExtension`): `grpo_load_lora` builds vLLM's
`LoRAModel` from the tensors given in memory (PEFT key names; no directory is written) and puts it in the adapter
slot in place of the last one; `grpo_lora_digests` digests the adapter tensors as the LoRA layers hold them (their
stacked slot buffers, B with vLLM's scale folded in), which engine/rollout/adapter_sync.py compares with what it sent.

Must not: know Megatron's layout (engine/policy/lora.py `lora_tensors_for_peft` gives PEFT's tensors), run a
collective of the trainer's.

Test: tests/integration/test_lora_adapter_sync.py (real vLLM on CPU: the engine's log-probs with the adapter equal
the trainer's; a stale adapter is caught, its tensors named; without the adapter named in requests the log-probs
differ), tests/integration/test_lora_run.py (the loop at TP2).
"""

from __future__ import annotations

import torch

LORA_ID = 1
"""vLLM's integer id of the policy's adapter (one slot: each sync replaces it in place)."""
LORA_NAME = "policy"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's allowed `max_lora_rank` values (vllm/config/lora.py MaxLoRARanks)."""


def lora_engine_options(rank: int) -> dict:
    """`vllm.LLM` keywords for one adapter of rank `rank` (max_lora_rank: the smallest allowed value >= rank)."""
    fitting = [r for r in LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"lora.lora_r={rank} with lora.lora_weight_sync=adapter: vLLM's LoRA supports ranks up to "
                         f"{LORA_RANKS[-1]}; use lora.lora_weight_sync=merged")
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": 1}


def policy_lora_request():
    """The LoRARequest naming the adapter `grpo_load_lora` put in vLLM's slot (its path is never read: the adapter
    is already registered when a request names it)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(LORA_NAME, LORA_ID, "in-memory:grpo-policy-adapter")


def _slot_views(module, slot: int, packed: list[str] | None, prefix: str) -> dict[str, torch.Tensor]:
    """{`<module>.<hf part>.lora_A` / `.lora_B`: the held (r, in) / (out, r) view of slot `slot`} of one LoRA layer.
    vLLM 0.32 stacks a layer's adapters as tuples (one entry per fused part: q, k, v / gate, up), each
    (max_loras, 1, max_rank, in) for A and (max_loras, 1, out, max_rank) for B; rank r fills the leading corner."""
    parts = packed if packed and len(module.lora_a_stacked) == len(packed) else [None]
    out = {}
    for i, part in enumerate(parts):
        name = prefix if part is None else f"{prefix.rpartition('.')[0]}.{part}"
        out[f"{name}.lora_A"] = module.lora_a_stacked[i][slot, 0]
        out[f"{name}.lora_B"] = module.lora_b_stacked[i][slot, 0]
    return out


class LoraReceiver:
    """Worker-extension methods (mixed into `WeightReceiverExtension`) for the policy's adapter in vLLM's LoRA slot."""

    def grpo_load_lora(self, tensors: dict[str, torch.Tensor], peft_config: dict) -> int:
        """Replace the policy's adapter by `tensors` ({PEFT key: tensor}, not modified) with `peft_config` (a
        `peft.LoraConfig.to_dict()`); returns the number of tensors vLLM took."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager
        adapters = manager._adapter_manager
        helper = PEFTHelper.from_dict(peft_config | {"vllm_max_position_embeddings": None})
        helper.validate_legal(manager.lora_config)
        mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
        # NOTE: vLLM scales B in place (LoRALayerWeights.optimize): it gets its own copies, never the caller's
        model = LoRAModel.from_lora_tensors(LORA_ID, {k: v.clone() for k, v in tensors.items()}, helper, device="cpu",
                                            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
                                            weights_mapper=mapper.get_rename_mapper() if mapper else None)
        if LORA_ID in adapters.list_adapters():
            adapters.remove_adapter(LORA_ID)
        adapters.add_adapter(model)
        adapters.activate_adapter(LORA_ID)
        return len(tensors)

    def grpo_lora_digests(self) -> dict:
        """{"engine_rank", "digests": {`model.layers.<i>.<parent>.<hf module>.lora_A|B`: [digest, dtype held]}} of
        the policy adapter's slot in every LoRA layer (engine/rollout/weight_digest.py); {} digests when none."""
        from engine.rollout.weight_digest import box_digest

        adapters = self.model_runner.lora_manager._adapter_manager
        if LORA_ID not in adapters.lora_index_to_id:
            return {"engine_rank": self.grpo_engine_rank(), "digests": {}}
        slot = adapters.lora_index_to_id.index(LORA_ID)
        rank = adapters._registered_adapters[LORA_ID].rank
        packed = getattr(adapters.model, "packed_modules_mapping", {})
        digests = {}
        for name, module in adapters.modules.items():
            if not hasattr(module, "lora_a_stacked"):
                continue
            for key, view in _slot_views(module, slot, packed.get(name.rpartition(".")[2]), name).items():
                held = view[:rank] if key.endswith("lora_A") else view[:, :rank]
                digests[key] = [int(box_digest(held)), str(view.dtype)]
        return {"engine_rank": self.grpo_engine_rank(), "digests": digests}


def load_policy_adapter(engine, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
    """Put `tensors` in the engine's adapter slot (every worker, in place of the last adapter) and make every later
    generation, turn and log-prob request of the engine name it (`VLLMEngine.lora_request`)."""
    engine.llm.collective_rpc("grpo_load_lora", args=(tensors, peft_config))
    engine.lora_request = policy_lora_request()
    if engine.llm.reset_prefix_cache() is False:
        raise RuntimeError("vLLM refused to reset its prefix cache after an adapter load (requests still running?)")


def policy_adapter_digests(engine) -> list[dict]:
    """Per worker (engine TP rank order): `LoraReceiver.grpo_lora_digests`."""
    return engine.llm.collective_rpc("grpo_lora_digests")
