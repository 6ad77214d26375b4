"""Weight sync: the trainer's Megatron (TP, PP) shards -> the inference engine's weights, bucketed and verified.

The only module that knows both layouts (STYLE.md rule 4): Megatron's side through engine/hf_convert.py's map, the
engine's side through vLLM's own loader, which takes Hugging Face names and full tensors and slices them for its
own TP ranks (`ColocatedEngine.load_weights`, vLLM's `reload_weights`).

Colocated transport (`sync_colocated`), per pipeline stage in order:
  1. the stage's TP ranks all-gather each parameter's shards and convert it to HF tensors (no rank ever holds more
     than one bucket of the model at a time beyond its own shards);
  2. HF tensors are packed into flat buckets of `bucket_mb`; the stage broadcasts each bucket (one metadata object,
     one flat tensor) to the other stages of its pipeline group;
  3. every rank loads each bucket into its own engine as it arrives.
Verification (`verify_sync`): the engine's log-probs of probe sequences against the trainer's (temperature 1,
both fp32 accumulation), every sync by default; a mismatch above the tolerance raises WeightSyncError naming the
probe, the token position and the difference.

Must not: generate, or import vLLM (the rollout module does).

Test: tests/integration/test_weight_sync.py (real vLLM on CPU).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from engine.hf_checkpoint import iter_hf_tensors
from engine.hf_convert import ModelDims
from engine.parallel import ParallelState
from engine.step import LogprobSettings, forward_logprobs, unwrap


class WeightSyncError(RuntimeError):
    """The engine's weights do not reproduce the trainer's log-probs after a sync."""


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


def verify_sync(chunks, ps: ParallelState, engine, probe: dict, vocab_size: int, tolerance: float) -> float:
    """Compare the engine's and the trainer's log-probs of the probe completions; raise if they differ.

    Args:
        chunks: the policy chunks (wrapped or not).
        probe: a micro-batch from engine/batch.py (`tokens`, `prompt_lengths`, `completion_ids`, `completion_mask`, ...).
        tolerance: largest allowed |trainer - engine| log-prob difference.
    Returns:
        the largest difference (the same on every rank).
    Raises:
        WeightSyncError naming the probe row, the completion position and the two log-probs.
    """
    settings = LogprobSettings(vocab_size=vocab_size, temperature=1.0, implementation="auto")
    trainer = forward_logprobs(chunks, ps, [probe], settings)
    sequences = [row[: int(p) + int(m.sum())].tolist() for row, p, m in
                 zip(probe["tokens"], probe["prompt_lengths"], probe["completion_mask"])]
    # NOTE: every rank queries its engine, also where there is nothing to compare: the ranks of one vLLM TP group
    # must make the same engine calls, and a group may span pipeline stages.
    engine_logprobs = engine.prompt_logprobs(sequences, temperature=1.0)
    worst = torch.zeros(4, dtype=torch.float64)  # (max diff, row, position, trainer logprob)
    if trainer:
        logprobs = trainer[0][0]  # (b, C)
        for i, engine_lp in enumerate(engine_logprobs):
            start = int(probe["prompt_lengths"][i]) - 1
            ref = torch.tensor(engine_lp[start:], dtype=torch.float64)  # (C_i,)
            diff = (logprobs[i, : ref.numel()].double() - ref).abs().nan_to_num(nan=float("inf"))  # NaN = mismatch
            if diff.numel() and diff.max() > worst[0]:
                j = int(diff.argmax())
                worst = torch.tensor([float(diff.max()), i, j, float(logprobs[i, j])], dtype=torch.float64)
    dist.all_reduce(worst[:1], op=dist.ReduceOp.MAX)
    if float(worst[0]) > tolerance:
        raise WeightSyncError(
            f"after the weight sync the engine's log-probs differ from the trainer's by {float(worst[0]):.3g} "
            f"(tolerance {tolerance:g}) at probe row {int(worst[1])}, completion token {int(worst[2])} (trainer "
            f"{float(worst[3]):.5f}): the engine is not running the trainer's weights"
        )
    return float(worst[0])
