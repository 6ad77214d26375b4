"""Colocated weight sync: the trainer's Megatron (TP, PP) shards -> the vLLM engine in the same process, as full HF
tensors in buckets (`sync_colocated`: the steps, `iter_hf_buckets`).

Layouts: knows the trainer's only, through engine/policy/hf_checkpoint.py's `iter_hf_tensors` (gather and convert
to HF names and shapes). The engine's needs no knowledge here: vLLM's loaders narrow full HF tensors themselves, and
the box each engine rank holds (for its digest) is the plan's (engine/rollout/sync_plan.py `_engine_box`). Of
vLLM it knows one behaviour: its reload is layer-wise, so a bucket never splits a decoder layer (`_stage_buckets`).

Must not: import vLLM (the engine is passed in), compare digests itself (engine/rollout/sync_check.py does), use
the server-mode transport (engine/rollout/weight_transport.py).

Test: tests/unit/test_weight_sync_buckets.py (bucket boundaries), tests/integration/test_weight_sync.py (real vLLM
on CPU, trainer TP 1/2 x PP 1/2 into engine TP 1/2, float32 and bf16; a stale engine, a stale layer and one flipped
bit caught and named).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from engine.policy.hf_checkpoint import iter_hf_tensors
from engine.policy.hf_map import ModelDims
from engine.policy.parallel import ParallelState
from engine.policy.step import unwrap
from engine.rollout.fp8_sync import expected_digests, quantize_bucket
from engine.rollout.sync_check import check_digests, raise_on_every_rank
from engine.rollout.sync_plan import SyncPlan, TrainerLayout, build_sync_plan, engine_name


def _pack(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list, torch.Tensor]:
    meta = [(name, tuple(t.shape), t.dtype) for name, t in tensors]
    return meta, torch.cat([t.reshape(-1) for _, t in tensors])  # (sum of numels,)


def _unpack(meta: list, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for name, shape, _ in meta:
        numel = int(torch.Size(shape).numel())
        out.append((name, flat[offset : offset + numel].view(shape)))
        offset += numel
    return out


def _layer_of(name: str) -> str:
    """The unit a bucket must not split: `model.layers.<i>` (Nemotron-H: `backbone.layers.<i>`) for layer tensors,
    the tensor name otherwise."""
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[0] in ("model", "backbone") and parts[1:2] == ["layers"] else name


def _stage_buckets(chunks, ps: ParallelState, dims: ModelDims, bucket_bytes: int) -> Iterator[list]:
    """This stage's HF tensors in buckets of about `bucket_bytes` (collective over the TP group).

    NOTE: a bucket closes only between decoder layers (so it may exceed `bucket_bytes` by up to one layer): vLLM's
    in-place reload is layer-wise, and a layer whose tensors arrive in two `reload_weights` calls ends with its
    fused parameters (qkv_proj, gate_up_proj) uninitialised (seen on CPU: NaN log-probs at 0.25 MiB buckets).
    """
    bucket, size, layer = [], 0, None
    for chunk in chunks:
        for name, tensor in iter_hf_tensors(unwrap(chunk), ps, dims):
            if bucket and size >= bucket_bytes and _layer_of(name) != layer:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            layer = _layer_of(name)
    if bucket:
        yield bucket


def iter_hf_buckets(chunks, ps: ParallelState, dims: ModelDims, bucket_mb: float) -> Iterator[list]:
    """Every HF tensor of the policy, on every rank, as buckets of (name, tensor) (collective: all ranks iterate)."""
    bucket_bytes = int(bucket_mb * 2**20)
    if ps.pp_size == 1:
        yield from _stage_buckets(chunks, ps, dims, bucket_bytes)
        return
    stage_ranks = dist.get_process_group_ranks(ps.groups.pp)
    for stage in range(ps.pp_size):
        own = _stage_buckets(chunks, ps, dims, bucket_bytes) if stage == ps.pp_rank else None
        while True:
            if own is not None:
                bucket = next(own, None)
                meta, flat = _pack(bucket) if bucket else (None, None)
                header = [None if meta is None else (meta, flat.numel(), flat.dtype)]
            else:
                header = [None]
            dist.broadcast_object_list(header, src=stage_ranks[stage], group=ps.groups.pp)
            if header[0] is None:
                break
            meta, numel, dtype = header[0]
            if own is None:
                flat = torch.empty(numel, dtype=dtype, device=ps.device)
            dist.broadcast(flat, src=stage_ranks[stage], group=ps.groups.pp)
            yield _unpack(meta, flat)


def build_colocated_plan(dims: ModelDims, engine_tp: int, *, ffn_hidden_size: int, dtype: str) -> SyncPlan:
    """The plan whose engine boxes say what each colocated engine rank holds of every HF tensor (its trainer side is
    unused: colocated ranks send full tensors)."""
    return build_sync_plan(dims, TrainerLayout(1), engine_tp, ffn_hidden_size=ffn_hidden_size, dtype=dtype)


def sync_colocated(chunks, ps: ParallelState, dims: ModelDims, engine, bucket_mb: float, plan: SyncPlan | None = None,
                   *, load: bool = True, fp8: bool = False) -> dict[str, float]:
    """Push the policy's current weights into this rank's colocated engine (collective: every rank calls it).

    Per pipeline stage in order:
      1. the stage's TP ranks all-gather each parameter's shards and convert it to HF tensors (no rank ever holds
         more than one bucket of the model at a time beyond its own shards);
      2. HF tensors are packed into flat buckets of `bucket_mb`; the stage broadcasts each bucket (one metadata
         object, one flat tensor) to the other stages of its pipeline group;
      3. every rank loads each bucket into its own engine as it arrives (`engine.load_weights`, vLLM's in-place
         reload);
      4. with a plan (`build_colocated_plan`), every rank digests the box of each tensor its engine rank holds as it
         loads it (engine/rollout/weight_digest.py), asks its engine for the digests of what it then holds, and the
         ranks agree on the outcome (engine/rollout/sync_check.py `check_digests`, `raise_on_every_rank`).

    Args:
        plan: from `build_colocated_plan`: verify that every engine rank holds, bit for bit, its box of every tensor
            (None: no verification).
        load: False only verifies what the engine holds now (the tests' stale engine).
        fp8: the engine serves block-FP8 (`rollout.vllm_weight_dtype: fp8`): each bucket's FP8 weights are sent as
            payload and scales (engine/rollout/fp8_sync.py `quantize_bucket`), both digested.
    Returns:
        {"weight_sync/seconds", "weight_sync/gib", "weight_sync/tensors", "weight_sync/buckets"}, and with a plan
        "weight_sync/digest_s" (digesting both sides and comparing, included in the seconds).
    Raises:
        WeightSyncError on every rank when any engine rank holds another value in any tensor, naming the tensors,
        the engine rank and the trainer rank.
    """
    start, num_bytes, num_tensors, num_buckets, digest_s = time.perf_counter(), 0, 0, 0, 0.0
    boxes = {tensor.name: tensor.engine_boxes for tensor in plan.tensors} if plan is not None else {}
    shapes = {tensor.name: tensor.shape for tensor in plan.tensors} if plan is not None else {}
    engine_rank = engine.engine_rank if plan is not None else None
    expected: dict[str, torch.Tensor] = {}
    for bucket in iter_hf_buckets(chunks, ps, dims, bucket_mb):
        bucket = [(engine_name(name), tensor) for name, tensor in bucket]  # GPT-OSS: one expert per tensor
        bucket = quantize_bucket(bucket) if fp8 else bucket
        if load:
            engine.load_weights(bucket)
        if plan is not None:
            began = time.perf_counter()
            expected |= expected_digests(bucket, boxes, shapes, engine_rank)
            digest_s += time.perf_counter() - began
        num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        num_tensors += len(bucket)
        num_buckets += 1
    stats = {"weight_sync/gib": num_bytes / 2**30, "weight_sync/tensors": num_tensors,
             "weight_sync/buckets": num_buckets}
    if plan is not None:
        began = time.perf_counter()
        (held,) = engine.weight_digests()
        error = check_digests({name: int(d) for name, d in expected.items()}, held["digests"], plan.dtype,
                              f"engine rank {held['engine_rank']}")
        raise_on_every_rank(ps, error)
        stats["weight_sync/digest_s"] = digest_s + time.perf_counter() - began
    return stats | {"weight_sync/seconds": time.perf_counter() - start}
