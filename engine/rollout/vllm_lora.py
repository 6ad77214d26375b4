"""Adapter-only weight sync into vLLM's LoRA support (`lora.lora_weight_sync=adapter`), the vLLM side.

Owns: `lora_engine_options` (the `vllm.LLM` keywords that turn its LoRA support on for one adapter of rank r),
`policy_lora_request` (the request generations name once an adapter is loaded) and `LoraReceiver`, mixed into the
worker extension (engine/rollout/vllm_engine.py `WeightReceiverExtension`): `grpo_load_lora` builds vLLM's
`LoRAModel` from the tensors given in memory (PEFT key names; no directory is written) and puts it in the adapter
slot in place of the last one, `grpo_receive_lora` (server mode) first receives them over the transfer group;
`grpo_lora_digests` digests the adapter tensors as the LoRA layers hold them (their stacked slot buffers: B with
vLLM's scale folded in, each engine rank its share), which engine/rollout/adapter_sync.py compares with what it sent.
Server mode's engine calls: `receive_policy_adapter` (a new adapter version each sync) and `name_policy_adapter`
(the version a request names, or AdapterNotHeld).

Must not: know Megatron's layout (engine/policy/lora.py `lora_tensors_for_peft` gives PEFT's tensors), run a
collective of the trainer's.

Test: tests/integration/test_lora_adapter_sync.py (real vLLM on CPU, colocated and a rollout server at engine TP 2:
the engine's log-probs with the adapter equal the trainer's; a stale adapter is caught, its tensors named; without
the adapter named in requests the log-probs differ), tests/integration/test_lora_run.py (the loop, engine TP 2).
"""

from __future__ import annotations

import math

import torch

from engine.lora_settings import vllm_max_lora_rank

LORA_ID = 1
"""vLLM's integer id of the colocated policy's adapter (one slot: each sync replaces it; server mode: the version)."""
LORA_NAME = "policy"


def lora_engine_options(rank: int) -> dict:
    """`vllm.LLM` keywords for one adapter of rank `rank` (max_lora_rank: the smallest allowed value >= rank)."""
    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(rank), "max_loras": 1}


def policy_lora_request(lora_id: int = LORA_ID):
    """The LoRARequest naming the adapter `grpo_load_lora` put in vLLM's slot under `lora_id` (its path is never
    read: the adapter is already registered when a request names it)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"{LORA_NAME}-{lora_id}", lora_id, "in-memory:grpo-policy-adapter")


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

    def grpo_load_lora(self, tensors: dict[str, torch.Tensor], peft_config: dict, lora_id: int = LORA_ID) -> int:
        """Replace the policy's adapter (whatever id it had) by `tensors` ({PEFT key: tensor}, not modified) with
        `peft_config` (a `peft.LoraConfig.to_dict()`) under vLLM's id `lora_id`; returns the number of tensors vLLM
        took."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager
        adapters = manager._adapter_manager
        helper = PEFTHelper.from_dict(peft_config | {"vllm_max_position_embeddings": None})
        helper.validate_legal(manager.lora_config)
        mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
        # NOTE: vLLM scales B in place (LoRALayerWeights.optimize): it gets its own copies, never the caller's
        model = LoRAModel.from_lora_tensors(lora_id, {k: v.clone() for k, v in tensors.items()}, helper, device="cpu",
                                            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
                                            weights_mapper=mapper.get_rename_mapper() if mapper else None)
        for old in list(adapters.list_adapters()):  # one slot: the last adapter goes, whatever its id
            adapters.remove_adapter(old)
        adapters.add_adapter(model)
        adapters.activate_adapter(lora_id)
        return len(tensors)

    def grpo_receive_lora(self, *, version: int, names: list[str], shapes: list[list[int]], dtype: str,
                          peft_config: dict, verify: bool = True) -> dict:
        """Server mode: receive the adapter's tensors (`names`, `shapes`, in `dtype`, concatenated flat) from the
        trainer over the transfer group this worker joined (engine/rollout/weight_transport.py `receive_flat`), load
        them as vLLM adapter id `version` (`grpo_load_lora`); with `verify` the answer holds their digests as held."""
        from engine.rollout.weight_transport import receive_flat

        group = getattr(self, "_grpo_group", None)
        if group is None:
            raise RuntimeError("no weight-transfer group: call /weights/init before /lora/update")
        sizes = [math.prod(shape) for shape in shapes]
        try:
            flat = receive_flat(group, self._grpo_plan, self._grpo_engine_rank, sum(sizes), getattr(torch, dtype),
                                version).cpu()
        except BaseException:
            self.grpo_close_weight_group()  # a broken group cannot be reused: the next sync joins a fresh one
            raise
        tensors = {name: part.view(shape) for name, part, shape in zip(names, flat.split(sizes), shapes)}
        stats = {"tensors": self.grpo_load_lora(tensors, peft_config, lora_id=version)}
        return stats | self.grpo_lora_digests(version) if verify else stats

    def grpo_lora_digests(self, lora_id: int = LORA_ID) -> dict:
        """{"engine_rank", "digests": {`model.layers.<i>.<parent>.<hf module>.lora_A|B`: [digest, dtype held]}} of
        adapter `lora_id`'s slot in every LoRA layer (engine/rollout/weight_digest.py); {} digests when none."""
        from engine.rollout.weight_digest import box_digest

        adapters = self.model_runner.lora_manager._adapter_manager
        if lora_id not in adapters.lora_index_to_id:
            return {"engine_rank": self.grpo_engine_rank(), "digests": {}}
        slot = adapters.lora_index_to_id.index(lora_id)
        rank = adapters._registered_adapters[lora_id].rank
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


def receive_policy_adapter(engine, *, version: int, names: list[str], shapes: list[list[int]], dtype: str,
                           peft_config: dict, verify: bool = True) -> list[dict]:
    """Server mode (engine/rollout/server.py `/lora/update`): every worker receives the trainer's adapter over the
    transfer group and loads it as adapter `version` (`LoraReceiver.grpo_receive_lora`); requests naming that
    version then run with it (`name_policy_adapter`). Per worker: {"tensors"} and, with `verify`, its digests."""
    if not engine.max_lora_rank:
        raise ValueError("this rollout server's vLLM runs without LoRA support: start it with the trainer's config "
                         "(lora.use_peft=true lora.lora_weight_sync=adapter lora.lora_r=R)")
    engine.adapter_version = None  # until every worker holds the new one
    stats = engine.llm.collective_rpc("grpo_receive_lora", kwargs=dict(
        version=version, names=names, shapes=shapes, dtype=dtype, peft_config=peft_config, verify=verify))
    engine.adapter_version = version
    if engine.llm.reset_prefix_cache() is False:
        raise RuntimeError("vLLM refused to reset its prefix cache after an adapter load (requests still running?)")
    return stats


class AdapterNotHeld(Exception):
    """A request names a LoRA adapter version this server does not hold (the server answers 410). Not a LookupError:
    the server's handler answers a KeyError from a malformed body with 400."""


def name_policy_adapter(engine, version: int | None) -> None:
    """Server mode: the next requests run with adapter `version` (None = the base alone). Raises AdapterNotHeld when
    the engine holds another version (or none): a restarted server, or a sync that failed."""
    if version is None:
        engine.lora_request = None
        return
    if engine.adapter_version != version:
        raise AdapterNotHeld(f"the request names LoRA adapter version {version}; this server holds "
                             f"{'none' if engine.adapter_version is None else engine.adapter_version} (restarted, "
                             "or the last adapter sync failed): sync the adapter again")
    engine.lora_request = policy_lora_request(version)
