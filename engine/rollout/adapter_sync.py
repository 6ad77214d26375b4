"""Adapter-only weight sync (`lora.lora_weight_sync=adapter`), the trainer's side: every LoRA adapter of
the policy, gathered over TP and PP, goes whole into each engine's LoRA slot in memory (engine/rollout/vllm_lora.py),
the frozen base staying as the engine holds it; then every engine rank's digests of the adapter tensors its LoRA
layers hold are checked against what was sent. Colocated: `sync_adapter` (this rank's engine). Server mode:
`sync_adapter_server` (the base once per server process through the full sync, then the adapter alone over the
server's transfer group as a new vLLM adapter version each sync, which every request to that server names).

What vLLM holds: A as sent, and B times the adapter's scale (vLLM folds lora_alpha / r, or / sqrt(r) with rslora, into
B in the engine's dtype), each engine rank its share at engine TP > 1 (`expected_digests`): the expected digests are
computed by the same operations on the sent tensors.

Must not: import vLLM (the engine's adapter calls are vllm_lora.py's), send the base weights after the first sync
(frozen), know Megatron's layout (engine/policy/lora.py `lora_tensors_for_peft`).

Test: tests/integration/test_lora_adapter_sync.py (real vLLM on CPU: colocated; a rollout server at engine TP 2 with
the loop), tests/integration/test_lora_run.py (the loop at TP 2 into one colocated engine at engine TP 2).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from engine.lora_settings import LoraSettings
from engine.policy.lora import lora_tensors_for_peft
from engine.policy.parallel import ParallelState
from engine.rollout.sync_check import check_digests, raise_on_every_rank
from engine.rollout.sync_plan import SyncPlan
from engine.rollout.weight_digest import box_digest

PEFT_MODEL_PREFIX = "base_model.model."


def adapter_tensors(chunks, ps: ParallelState, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every adapter tensor of the policy under PEFT's key names, in `dtype`, on every rank (collective: TP shards
    gathered, pipeline stages' tensors exchanged over the PP group)."""
    tensors = {k: v.to(dtype) for k, v in lora_tensors_for_peft(chunks, ps).items()}
    if ps.pp_size == 1:
        return tensors
    stages: list = [None] * ps.pp_size
    dist.all_gather_object(stages, {k: v.cpu() for k, v in tensors.items()}, group=ps.groups.pp)
    return {k: v.to(ps.device) for stage in stages for k, v in stage.items()}


def expected_digests(tensors: dict[str, torch.Tensor], scaling: float, plan: SyncPlan | None = None,
                     engine_rank: int = 0, held: dict | None = None) -> dict[str, int]:
    """{`model.layers.<i>.<parent>.<module>.lora_A|B`: digest} of what engine rank `engine_rank` holds after loading
    `tensors`: A as sent, B scaled in its own dtype as vLLM does (`LoRALayerWeights.optimize`: `lora_b *= scaling`),
    each cut to that rank's share at engine TP > 1. vLLM's LoRA layers shard a full adapter themselves as they shard
    the base weight (`slice_lora_b` / `slice_lora_a`): B keeps the rows of the base weight's engine box (column
    parallel: q / k / v with the KV heads' replication, gate / up, by part), A its columns (row parallel: o_proj,
    down_proj); the boxes are `plan`'s (engine/rollout/sync_plan.py, the base weights' own), not vLLM's word.
    `held`: the engine rank's digests ({name: [digest, dtype held]}): a tensor vLLM holds in a wider dtype than sent
    (its LoRA dtype is the engine's: a float32 server fed a bf16 trainer's adapter) is cast to it before B is scaled,
    as vLLM does (`LoRAModel.from_lora_tensors(dtype=...)`, then `optimize`); a narrower one is not (an error)."""
    boxes = {t.name: t.engine_boxes[engine_rank] for t in plan.tensors} if plan is not None else {}
    out = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_MODEL_PREFIX).removesuffix(".weight")
        dtype = _held_dtype(held, name)
        value = tensor.to(dtype) if dtype is not None and dtype.itemsize > tensor.dtype.itemsize else tensor
        value = value.clone().mul_(scaling) if name.endswith("lora_B") and scaling != 1 else value
        box = boxes.get(f"{name.rpartition('.')[0]}.weight")
        if box is not None:  # (rows, cols) of the base weight this engine rank holds
            (r0, r1), (c0, c1) = box
            value = value[r0:r1] if name.endswith("lora_B") else value[:, c0:c1]
        out[name] = int(box_digest(value.contiguous()))
    return out


def _held_dtype(held: dict | None, name: str) -> torch.dtype | None:
    """The floating dtype an engine rank says it holds `name` in (its digests' second field), None when unsaid."""
    entry = (held or {}).get(name)
    dtype = getattr(torch, str(entry[1]).removeprefix("torch."), None) if entry else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def sync_adapter(chunks, ps: ParallelState, engine, settings: LoraSettings, peft_config: dict, dtype: torch.dtype,
                 *, verify: bool, load: bool = True, plan: SyncPlan | None = None) -> dict[str, float]:
    """Put the policy's adapters into this rank's colocated engine (collective: every rank calls it).

    Args:
        engine: engine/rollout/vllm_engine.py `ColocatedEngine` started with vllm_lora.py `lora_engine_options`.
        peft_config: the adapter's `peft.LoraConfig.to_dict()` (engine/policy/peft_adapter.py `peft_config_of`).
        dtype: the engine's dtype (vLLM's LoRA dtype: the model's).
        verify: check every engine rank's digests of the adapter it holds against the sent tensors.
        load: False only verifies what the engine holds now (the tests' stale engine).
        plan: the colocated plan (engine/rollout/colocated_sync.py `build_colocated_plan`): each engine rank's box
            of the base weights, which its share of the adapter follows at engine TP > 1 (`expected_digests`).
    Returns:
        {"weight_sync/seconds", "weight_sync/gib", "weight_sync/tensors", "weight_sync/buckets"}, and with `verify`
        "weight_sync/digest_s".
    Raises:
        WeightSyncError on every rank when any engine rank holds another value in any adapter tensor, naming them.
    """
    from engine.rollout.vllm_lora import load_policy_adapter, policy_adapter_digests

    start = time.perf_counter()
    tensors = adapter_tensors(chunks, ps, dtype)
    if load:
        load_policy_adapter(engine, {k: v.cpu() for k, v in tensors.items()}, peft_config)
    stats = {"weight_sync/gib": sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30,
             "weight_sync/tensors": len(tensors), "weight_sync/buckets": 1}
    if verify:
        began = time.perf_counter()
        (held,) = policy_adapter_digests(engine)
        expected = expected_digests(tensors, settings.scaling, plan, int(held["engine_rank"]), held["digests"])
        error = check_digests(expected, held["digests"], str(dtype).replace("torch.", ""),
                              f"engine rank {held['engine_rank']} (its LoRA adapter)")
        raise_on_every_rank(ps, error)
        stats["weight_sync/digest_s"] = time.perf_counter() - began
    return stats | {"weight_sync/seconds": time.perf_counter() - start}


def sync_adapter_server(chunks, ps: ParallelState, dims, engine, link, settings: LoraSettings, peft_config: dict,
                        dtype: torch.dtype, version: int, *, verify: bool) -> dict[str, float]:
    """Server mode: put the policy's adapters into one rollout server as vLLM adapter `version` (collective).

    The server must hold the trainer's frozen base: it gets it once per server process, through the full weight sync
    (engine/rollout/server_sync.py `sync_server`, verified with `verify`), at the first sync and again after a
    restart. Then rank 0 asks the server (`/lora/update`, in a background thread) to receive the adapter over the
    link's transfer group and sends it, whole, to every engine rank (weight_transport.py `send_flat`); vLLM shards it
    itself. Every generate and prompt-log-prob request to that server then names `version` (the server answers 410
    while it holds another, e.g. after a restart: the client's restart recovery syncs again).

    Args:
        engine: the trainer's SharedRolloutClient; link: the server's engine/rollout/server_sync.py `ServerSync`.
    Returns:
        {"weight_sync/seconds", "weight_sync/gib", "weight_sync/tensors", "weight_sync/messages"}, with `verify`
        "weight_sync/digest_s"; after a base sync also "weight_sync/base_gib" and "weight_sync/base_seconds".
    Raises:
        WeightSyncError on every rank when any part failed or any engine rank holds another value in any adapter
        tensor (named); the group is then closed (the next sync joins afresh).
    """
    from engine.rollout.server_sync import _in_background, _result, agree_on_failure, join_server, sync_server
    from engine.rollout.weight_transport import send_flat

    start = time.perf_counter()
    client = engine.clients[link.server] if ps.rank == 0 else None
    stats: dict[str, float] = {}
    error, answer = None, None
    try:  # health (a restarted server: rejoined) and the group
        stats |= join_server(ps, client, link)
    except Exception as exc:  # noqa: BLE001 - every rank learns of any rank's failure below
        error = f"{type(exc).__name__}: {exc}"
    agree_on_failure(ps, link, error, "the server's adapter is not known to be current")
    # rank 0 knows the server process (link.instance): one that has not had the trainer's base gets it now
    needs_base = torch.tensor([float(ps.rank == 0 and link.base_instance != link.instance)], device=ps.device)
    dist.broadcast(needs_base, src=0)
    if float(needs_base):
        base = sync_server(chunks, ps, dims, engine, link, verify=verify)  # frozen: the adapters are not merged
        stats |= {"weight_sync/base_gib": base["weight_sync/gib"],
                  "weight_sync/base_seconds": base["weight_sync/seconds"]}
        link.base_instance = link.instance
    tensors = adapter_tensors(chunks, ps, dtype)
    names = list(tensors)
    try:
        if ps.rank == 0:
            request = dict(version=version, names=names, shapes=[list(tensors[k].shape) for k in names],
                           dtype=str(dtype).removeprefix("torch."), verify=verify,  # JSON: PEFT's sets as lists
                           peft_config={k: sorted(v) if isinstance(v, set) else v for k, v in peft_config.items()})
            http = _in_background(lambda: client.update_adapter(**request))
            try:
                flat = torch.cat([tensors[k].reshape(-1) for k in names])
                stats |= send_flat(link.group, link.plan, flat, version)
            finally:
                answer = _result(http, link.timeout_s, "loading the adapter")
            client.lora_version = version
            engine.synced_instance[link.server] = answer.get("instance_id", link.instance)
    except Exception as exc:  # noqa: BLE001 - every rank learns of any rank's failure below
        error = f"{type(exc).__name__}: {exc}"
    agree_on_failure(ps, link, error, "the server's adapter is not known to be current")
    stats["weight_sync/tensors"] = len(tensors)
    if verify:
        began = time.perf_counter()
        message = ""
        if ps.rank == 0:
            for held in answer["workers"]:
                expected = expected_digests(tensors, settings.scaling, link.plan, int(held["engine_rank"]),
                                            held["digests"])
                message += check_digests(expected, held["digests"], str(dtype).removeprefix("torch."),
                                         f"engine rank {held['engine_rank']} of {client.base_url} (its LoRA adapter)")
        raise_on_every_rank(ps, message)
        stats["weight_sync/digest_s"] = time.perf_counter() - began
    return stats | {"weight_sync/seconds": time.perf_counter() - start}
