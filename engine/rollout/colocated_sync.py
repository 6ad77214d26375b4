"""Colocated weight sync: the trainer's Megatron (TP, PP) shards -> the vLLM engine in the same process, as full HF
tensors in buckets (`sync_colocated`, `iter_hf_buckets`). Per pipeline stage in order:
  1. the stage's TP ranks all-gather each parameter's shards and convert it to HF tensors (no rank ever holds more
     than one bucket of the model at a time beyond its own shards);
  2. HF tensors are packed into flat buckets of `bucket_mb`; the stage broadcasts each bucket (one metadata object,
     one flat tensor) to the other stages of its pipeline group;
  3. every rank loads each bucket into its own engine as it arrives (`engine.load_weights`, vLLM's in-place reload).

Layouts: knows the trainer's only, through engine/policy/hf_checkpoint.py's `iter_hf_tensors` (gather and convert
to HF names and shapes). The engine's needs no knowledge here: vLLM's loaders narrow full HF tensors themselves. Of
vLLM it knows one behaviour: its reload is layer-wise, so a bucket never splits a decoder layer (`_stage_buckets`).

Must not: import vLLM (the engine is passed in), verify the result (engine/rollout/sync_check.py does), use the
server-mode transport (engine/rollout/weight_transport.py).

Test: tests/unit/test_weight_sync_buckets.py (bucket boundaries), tests/integration/test_weight_sync.py (real vLLM
on CPU, trainer TP 1/2 x PP 1/2 into engine TP 1/2, float32 and bf16).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from engine.policy.hf_checkpoint import iter_hf_tensors
from engine.policy.hf_convert import ModelDims
from engine.policy.parallel import ParallelState
from engine.policy.step import unwrap


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
    """The unit a bucket must not split: `model.layers.<i>` for layer tensors, the tensor name otherwise."""
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["model", "layers"] else name


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


def sync_colocated(chunks, ps: ParallelState, dims: ModelDims, engine, bucket_mb: float) -> dict[str, float]:
    """Push the policy's current weights into this rank's colocated engine. Returns bytes moved and seconds."""
    start, num_bytes, num_tensors, num_buckets = time.perf_counter(), 0, 0, 0
    for bucket in iter_hf_buckets(chunks, ps, dims, bucket_mb):
        engine.load_weights(bucket)
        num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        num_tensors += len(bucket)
        num_buckets += 1
    seconds = time.perf_counter() - start
    return {"weight_sync/seconds": seconds, "weight_sync/gib": num_bytes / 2**30, "weight_sync/tensors": num_tensors,
            "weight_sync/buckets": num_buckets}
