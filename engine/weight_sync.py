"""Weight sync: the trainer's Megatron (TP, PP) shards -> the inference engine's weights, bucketed and verified.

The only module that knows both layouts (STYLE.md rule 4): Megatron's side through engine/hf_convert.py's map, the
engine's side through vLLM's own loader rules (which slice of each HF tensor each vLLM TP rank reads).

Owns four things (the fourth, at the end: the trainer's side of a sync into engine/rollout_server.py,
`build_server_sync` / `sync_server`, which drive the HTTP calls and `send_weights` together).

Colocated transport (`sync_colocated`, `iter_hf_buckets`), per pipeline stage in order:
  1. the stage's TP ranks all-gather each parameter's shards and convert it to HF tensors (no rank ever holds more
     than one bucket of the model at a time beyond its own shards);
  2. HF tensors are packed into flat buckets of `bucket_mb`; the stage broadcasts each bucket (one metadata object,
     one flat tensor) to the other stages of its pipeline group;
  3. every rank loads each bucket into its own engine as it arrives.

The plan (`build_sync_plan`, pure: no processes): for every HF tensor in load order, the boxes (index ranges) that
each trainer rank (pp_rank, tp_rank, virtual chunk) holds and where they sit in its local Megatron shard
(Megatron's GQA-interleaved QKV, [gate_r; up_r] fc1, padded vocabulary, PP / virtual-PP layer placement, tied
embeddings), and the box that vLLM's weight loader of each engine TP rank narrows to (QKVParallelLinear with KV-head
replication when engine_tp > num_kv_heads, MergedColumnParallelLinear, RowParallelLinear dim 1, VocabParallelEmbedding
/ ParallelLMHead with vLLM's padding to 64, norms replicated). `SyncPlan.spec()` is a small JSON-able dict from which
`build_sync_plan_from_spec` rebuilds the same plan on the inference server.

Server-mode transport (`WeightTransferGroup`, `send_weights`, `receive_weights`): a process group of its own joins
the trainer's dp_rank-0 ranks and the engine's workers; each sender sends only the boxes of its own shards that
each engine rank reads (shard to shard: nobody gathers the model), one flat buffer per (bucket, sender, engine
rank) behind a small header; both sides derive the bucket schedule from (plan, bucket_mb), so there is no metadata
handshake, and a mismatch, a dead peer or a timeout raises WeightSyncError naming the bucket and the peer.
Measured on the shared 2-core CPU (gloo over loopback, benchmarks/results/weight_sync.csv, trainer TP1 -> one
receiver): 0.47 GB/s at 8 MiB and 1.09 GB/s at 128 MiB with one bucket; there copies and pages, not message
counts, dominate: one message per piece was 2.1x slower at 8 MiB but 10% faster at 128 MiB. Into the real vLLM
server, 512 MiB buckets beat one reload per layer 1.6-3.1x.

Verification (`verify_sync`): the engine's log-probs of probe sequences against the trainer's (temperature 1,
both fp32 accumulation), every sync by default; a mismatch above the tolerance raises WeightSyncError naming the
probe, the token position and the difference.

Must not: generate, or import vLLM (the rollout module does; the transport runs inside vLLM's workers without it).

Test: tests/unit/test_sync_plan.py (the plan against brute force, every layout), tests/distributed/
test_weight_transport.py (real Megatron shards to receiver processes over gloo; a dead receiver),
tests/integration/test_weight_sync.py (colocated, real vLLM on CPU), tests/integration/test_rollout_server.py
(server mode, real vLLM). Benchmark: benchmarks/bench_weight_sync.py.
This file is longer than STYLE.md's ~600 lines because it holds the parts of one concept (the plan is only
meaningful with the transport that executes it); the sections are marked.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.hf_checkpoint import iter_hf_tensors
from engine.hf_convert import TE_NAMES, ModelDims, TensorMap, family_map, hf_names
from engine.model import global_param_names
from engine.parallel import ParallelState
from engine.step import LogprobSettings, forward_logprobs, unwrap


class WeightSyncError(RuntimeError):
    """The engine's weights do not reproduce the trainer's log-probs after a sync, or a transfer failed."""


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


def verify_sync(chunks, ps: ParallelState, engine, probe: dict, vocab_size: int, tolerance: float,
                quantile: float = 1.0) -> float:
    """Compare the engine's and the trainer's log-probs of the probe completions; raise if they differ.

    The check is on a quantile of the per-token |trainer - engine| differences of each engine, on each rank: the max
    (quantile 1.0) in float32, where the two agree to ~1e-5; the 90th percentile in bf16, where two correct forwards
    differ by a heavy-tailed rounding amount (one token in a hundred can be off by nats) while a stale layer or a
    layout error moves most tokens (engine/config.py `weight_sync_quantile` has the measured numbers).

    Args:
        chunks: the policy chunks (wrapped or not).
        probe: a micro-batch from engine/batch.py (`tokens`, `prompt_lengths`, `completion_ids`, `completion_mask`, ...).
        tolerance: largest allowed `quantile` of the |trainer - engine| log-prob differences.
        quantile: 1.0 checks the largest difference.
    Returns:
        the largest difference (the same on every rank).
    Raises:
        WeightSyncError naming the statistic, the probe row and completion position of the largest difference.
    """
    settings = LogprobSettings(vocab_size=vocab_size, temperature=1.0, implementation="auto")
    trainer = forward_logprobs(chunks, ps, [probe], settings)
    sequences = [row[: int(p) + int(m.sum())].tolist() for row, p, m in
                 zip(probe["tokens"], probe["prompt_lengths"], probe["completion_mask"])]
    # NOTE: every rank queries its engine, also where there is nothing to compare: the ranks of one vLLM TP group
    # must make the same engine calls, and a group may span pipeline stages.
    each = getattr(engine, "prompt_logprobs_each", None)  # several rollout servers: each one checks every probe
    per_engine = each(sequences, 1.0) if each is not None else [engine.prompt_logprobs(sequences, temperature=1.0)]
    # (checked quantile, max diff, row, position, trainer logprob, engine index) of the worst engine
    worst = torch.zeros(6, dtype=torch.float64)
    if trainer:
        logprobs = trainer[0][0]  # (b, C)
        for e, engine_logprobs in enumerate(per_engine):
            diffs = []
            for i, engine_lp in enumerate(engine_logprobs):
                start = int(probe["prompt_lengths"][i]) - 1
                ref = torch.tensor(engine_lp[start:], dtype=torch.float64)  # (C_i,)
                diffs.append((logprobs[i, : ref.numel()].double() - ref).abs().nan_to_num(nan=float("inf")))  # NaN: bad
            flat = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)  # (N,)
            if flat.numel() == 0:
                continue
            checked = float(flat.max()) if quantile >= 1.0 else float(torch.quantile(flat, quantile))
            if checked > worst[0] or (checked == worst[0] and float(flat.max()) > worst[1]):
                i = max(range(len(diffs)), key=lambda r: float(diffs[r].max()) if diffs[r].numel() else -1.0)
                j = int(diffs[i].argmax())
                worst = torch.tensor([checked, float(flat.max()), i, j, float(logprobs[i, j]), e], dtype=torch.float64)
    largest = worst[:2].to(ps.device)  # NCCL reduces device tensors only
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    checked_all, max_all = (float(v) for v in largest.cpu())
    if checked_all > tolerance:
        which = f" ({engine.describe(int(worst[5]))})" if each is not None and len(per_engine) > 1 else ""
        statistic = "largest difference" if quantile >= 1.0 else f"{quantile:g}-quantile of the per-token differences"
        where = (f"; on this rank the largest is {float(worst[1]):.3g} at probe row {int(worst[2])}, completion token "
                 f"{int(worst[3])} (trainer {float(worst[4]):.5f})") if float(worst[0]) > tolerance else ""
        raise WeightSyncError(
            f"after the weight sync the engine's{which} log-probs differ from the trainer's: {statistic} "
            f"{checked_all:.3g} > tolerance {tolerance:g} (largest {max_all:.3g}){where}: the engine is not running "
            "the trainer's weights"
        )
    return max_all


# ---------------------------------------------------------------------------------------------------------------
# The plan: which trainer rank holds which box of every HF tensor, and which box each engine rank reads
# ---------------------------------------------------------------------------------------------------------------

Box = tuple[tuple[int, int], ...]
"""A box of a tensor: one (start, stop) per dimension."""

VLLM_VOCAB_PADDING = 64
"""vLLM's DEFAULT_VOCAB_PADDING_SIZE (vllm/model_executor/layers/vocab_parallel_embedding.py): the vocabulary of
VocabParallelEmbedding / ParallelLMHead is padded to a multiple of 64 before it is split over the engine's TP ranks."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TrainerLayout:
    """The trainer's model-parallel layout; layers are assigned to stages as engine/model.py's Megatron does."""

    tp_size: int
    pp_size: int = 1
    vpp_size: int | None = None
    """Virtual pipeline chunks per stage (None or 1: one chunk)."""

    def holder_of_layer(self, layer: int, num_layers: int) -> tuple[int, int]:
        """(pp_rank, virtual chunk) that holds decoder layer `layer`: Megatron's offset rule without uneven stages,
        chunk v of stage p holds layers [v*L/V + p*L/(P*V), ... + L/(P*V))."""
        vpp = self.vpp_size or 1
        per_vp, per_chunk = num_layers // vpp, num_layers // (vpp * self.pp_size)
        return (layer % per_vp) // per_chunk, layer // per_vp

    @property
    def num_senders(self) -> int:
        return self.tp_size * self.pp_size

    def sender_rank(self, pp_rank: int, tp_rank: int) -> int:
        """This trainer rank's rank in the weight-transfer group (senders come first, by (pp_rank, tp_rank))."""
        return pp_rank * self.tp_size + tp_rank


@dataclass(frozen=True)
class Piece:
    """A box of one HF tensor that one trainer rank holds as a box of the same extent in its local Megatron shard."""

    pp_rank: int
    tp_rank: int
    vp_chunk: int
    megatron: str
    """Global Megatron parameter name (local layer spec names: `...input_layernorm.weight`)."""
    hf_box: Box
    local_start: tuple[int, ...]
    """Where `hf_box` starts in the local shard (same extent: the piece is a translation)."""


@dataclass(frozen=True)
class TensorPlan:
    """One HF tensor: its pieces on the trainer and the box each engine TP rank's vLLM loader reads."""

    name: str
    shape: tuple[int, ...]
    unit: str
    """Buckets never split a unit: `model.layers.<i>` for layer tensors, the tensor name otherwise."""
    pieces: tuple[Piece, ...]
    engine_boxes: tuple[Box, ...]
    """Indexed by engine TP rank."""


@dataclass(frozen=True)
class Transfer:
    """One contiguous copy: a box of a sender's local shard -> the same-extent box of an engine rank's HF tensor."""

    tensor: int
    """Index into `SyncPlan.tensors`."""
    sender: int
    """Sender's rank in the transfer group."""
    engine_rank: int
    piece: Piece
    hf_box: Box
    local_box: Box

    @property
    def numel(self) -> int:
        return math.prod(stop - start for start, stop in self.hf_box)


@dataclass(frozen=True)
class SyncPlan:
    """Every HF tensor of the model in load order (embedding, layer 0 .. L-1, final norm, LM head), with its pieces
    and engine boxes; `transfers()` and `buckets()` derive the wire schedule both sides follow."""

    dims: ModelDims
    trainer: TrainerLayout
    engine_tp: int
    ffn_hidden_size: int
    dtype: str
    """What goes over the wire and what the engine receives ("float32", "bfloat16", "float16")."""
    tensors: tuple[TensorPlan, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def spec(self) -> dict:
        """The small JSON-able description `build_sync_plan_from_spec` rebuilds this plan from (ship it over HTTP)."""
        return {"dims": asdict(self.dims), "trainer": asdict(self.trainer), "engine_tp": self.engine_tp,
                "ffn_hidden_size": self.ffn_hidden_size, "dtype": self.dtype}

    def engine_group_rank(self, engine_rank: int) -> int:
        return self.trainer.num_senders + engine_rank

    @property
    def group_size(self) -> int:
        return self.trainer.num_senders + self.engine_tp

    @functools.cached_property
    def _transfers(self) -> tuple[Transfer, ...]:
        out = []
        for index, tensor in enumerate(self.tensors):
            for piece in tensor.pieces:
                sender = self.trainer.sender_rank(piece.pp_rank, piece.tp_rank)
                for engine_rank, box in enumerate(tensor.engine_boxes):
                    hf_box = _intersect(piece.hf_box, box)
                    if hf_box is None:
                        continue
                    local_box = tuple((start - p0 + l0, stop - p0 + l0) for (start, stop), (p0, _), l0 in
                                      zip(hf_box, piece.hf_box, piece.local_start))
                    out.append(Transfer(index, sender, engine_rank, piece, hf_box, local_box))
        return tuple(out)

    def transfers(self) -> tuple[Transfer, ...]:
        """Every (piece x engine rank) overlap, in tensor order: what moves, from whom, to whom."""
        return self._transfers

    def buckets(self, bucket_mb: float) -> list[list[int]]:
        """Tensor indices per bucket: a bucket closes once its full HF tensors reach `bucket_mb` MiB, and only
        between units (decoder layers), so it may exceed `bucket_mb` by up to one layer (see `_stage_buckets`)."""
        bucket_bytes, itemsize = int(bucket_mb * 2**20), self.torch_dtype.itemsize
        buckets, bucket, size, unit = [], [], 0, None
        for index, tensor in enumerate(self.tensors):
            if bucket and size >= bucket_bytes and tensor.unit != unit:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(index)
            size += math.prod(tensor.shape) * itemsize
            unit = tensor.unit
        if bucket:
            buckets.append(bucket)
        return buckets


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(start < stop for start, stop in box) else None


def _full(shape: tuple[int, ...]) -> Box:
    return tuple((0, size) for size in shape)


def _rows(shape: tuple[int, ...], start: int, stop: int, dim: int = 0) -> Box:
    """The box of `shape` restricted to [start, stop) along `dim`."""
    return tuple((start, stop) if d == dim else (0, size) for d, size in enumerate(shape))


def build_sync_plan_from_spec(spec: dict) -> SyncPlan:
    """Rebuild a plan from `SyncPlan.spec()` (e.g. on the inference server)."""
    trainer = spec["trainer"]
    return build_sync_plan(ModelDims(**spec["dims"]), TrainerLayout(**trainer), int(spec["engine_tp"]),
                           ffn_hidden_size=int(spec["ffn_hidden_size"]), dtype=spec["dtype"])


def build_sync_plan(dims: ModelDims, trainer: TrainerLayout, engine_tp: int, *, ffn_hidden_size: int,
                    dtype: str = "float32") -> SyncPlan:
    """The pure weight-sync plan of a Qwen2 / Llama model from a Megatron layout into a vLLM TP layout.

    Args:
        dims: model shape facts; `padded_vocab` is the trainer's (Megatron) padded vocabulary.
        trainer: the trainer's TP / PP / virtual-PP sizes.
        engine_tp: vLLM's tensor-parallel size.
        ffn_hidden_size: the MLP width (HF `intermediate_size`; ModelDims does not carry it).
        dtype: the dtype sent and received.
    Returns:
        the SyncPlan; replicated tensors (norms) have one piece, on tp_rank 0.
    Raises:
        ValueError when a layout cannot hold the model (the arithmetic in the message).
    """
    _check_layouts(dims, trainer, engine_tp, ffn_hidden_size, dtype)
    tensors = []
    for entry, layer in _entries_in_load_order(dims):
        if entry.megatron == "output_layer.weight" and dims.tie_word_embeddings:
            continue  # vLLM ties lm_head to embed_tokens; HF checkpoints carry only the embedding
        megatron = entry.megatron.format(i=layer)
        if layer is not None:
            pp_rank, vp_chunk = trainer.holder_of_layer(layer, dims.num_layers)
        elif entry.megatron.startswith("embedding."):
            pp_rank, vp_chunk = 0, 0
        else:  # final norm, output layer
            pp_rank, vp_chunk = trainer.pp_size - 1, (trainer.vpp_size or 1) - 1
        names = hf_names(entry, layer)
        shapes = _hf_shapes(entry, dims, ffn_hidden_size)
        for part, (name, shape) in enumerate(zip(names, shapes)):
            pieces = [Piece(pp_rank, tp_rank, vp_chunk, megatron, box, start)
                      for tp_rank in range(trainer.tp_size if entry.kind != "replicated" else 1)
                      for box, start in _trainer_boxes(entry.kind, part, shape, dims, tp_rank, trainer.tp_size)]
            engine_boxes = tuple(_engine_box(entry.kind, part, shape, dims, rank, engine_tp)
                                 for rank in range(engine_tp))
            tensors.append(TensorPlan(name, shape, f"model.layers.{layer}" if layer is not None else name,
                                      tuple(pieces), engine_boxes))
    return SyncPlan(dims, trainer, engine_tp, ffn_hidden_size, dtype, tuple(tensors))


def _entries_in_load_order(dims: ModelDims):
    """(TensorMap, layer) in the order vLLM is fed: embedding, every layer's tensors, final norm, LM head."""
    entries = family_map(dims)
    layer_entries = [e for e in entries if "{i}" in e.megatron]
    yield next(e for e in entries if e.megatron.startswith("embedding.")), None
    for layer in range(dims.num_layers):
        for entry in layer_entries:
            yield entry, layer
    yield next(e for e in entries if e.megatron == "decoder.final_layernorm.weight"), None
    yield next(e for e in entries if e.megatron == "output_layer.weight"), None


def _hf_shapes(entry: TensorMap, dims: ModelDims, ffn: int) -> list[tuple[int, ...]]:
    """Shapes of an entry's HF tensors."""
    hidden, q_out, kv_out = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_groups * dims.head_dim
    if entry.kind == "qkv":
        outs = (q_out, kv_out, kv_out)
        return [(n,) if entry.megatron.endswith(".bias") else (n, hidden) for n in outs]
    if entry.kind == "gate_up":
        return [(ffn, hidden), (ffn, hidden)]
    if entry.kind == "vocab":
        return [(dims.vocab_size, hidden)]
    if entry.kind == "replicated":
        return [(hidden,)]
    if entry.kind == "row":  # o_proj (H, heads*head_dim), down_proj (H, ffn)
        return [(hidden, q_out if "linear_proj" in entry.megatron else ffn)]
    raise ValueError(f"{entry.megatron}: layout kind {entry.kind!r} has no HF shape rule")


def _trainer_boxes(kind: str, part: int, shape: tuple[int, ...], dims: ModelDims, tp_rank: int, tp_size: int):
    """(HF box, local start) of each piece of HF tensor `part` of an entry on trainer TP rank `tp_rank`: the
    inverse of hf_convert.read_megatron_shard."""
    zeros = (0,) * len(shape)
    if kind == "replicated":
        return [(_full(shape), zeros)]
    if kind in ("column", "row", "gate_up"):
        dim = 1 if kind == "row" else 0
        step = shape[dim] // tp_size
        local = tuple(part * step if d == 0 and kind == "gate_up" else 0 for d in range(len(shape)))  # [gate_r; up_r]
        return [(_rows(shape, tp_rank * step, (tp_rank + 1) * step, dim), local)]
    if kind == "vocab":
        rows = dims.padded_vocab // tp_size
        start, stop = tp_rank * rows, min((tp_rank + 1) * rows, dims.vocab_size)
        return [(_rows(shape, start, stop), zeros)] if start < stop else []  # padded rows are never sent
    q_rows, kv_rows = dims.num_heads // dims.num_groups * dims.head_dim, dims.head_dim
    rows = (q_rows, kv_rows, kv_rows)[part]
    offset = (0, q_rows, q_rows + kv_rows)[part]  # within one query group's [q; k; v] block of the local shard
    groups = dims.num_groups // tp_size
    out = []
    for j in range(groups):
        g = tp_rank * groups + j
        local = ((q_rows + 2 * kv_rows) * j + offset,) + zeros[1:]
        out.append((_rows(shape, g * rows, (g + 1) * rows), local))
    return out


def _engine_box(kind: str, part: int, shape: tuple[int, ...], dims: ModelDims, rank: int, engine_tp: int) -> Box:
    """The box of an HF tensor that vLLM's weight loader on engine TP rank `rank` narrows to (linear.py,
    vocab_parallel_embedding.py of vLLM 0.32)."""
    if kind == "replicated":
        return _full(shape)
    if kind == "vocab":  # VocabParallelEmbedding / ParallelLMHead: org vocab padded to 64, split, tail clipped
        padded = -(-dims.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        per_rank = padded // engine_tp
        return _rows(shape, min(rank * per_rank, dims.vocab_size), min((rank + 1) * per_rank, dims.vocab_size))
    if kind == "row":  # RowParallelLinear: input dim 1
        step = shape[1] // engine_tp
        return _rows(shape, rank * step, (rank + 1) * step, dim=1)
    if kind in ("column", "gate_up"):  # ColumnParallelLinear / MergedColumnParallelLinear: each output split
        step = shape[0] // engine_tp
        return _rows(shape, rank * step, (rank + 1) * step)
    # QKVParallelLinear: q split by heads; k, v by KV heads, replicated over tp/num_kv_heads ranks when fewer
    if part == 0:
        step = dims.num_heads // engine_tp * dims.head_dim
        return _rows(shape, rank * step, (rank + 1) * step)
    replicas = max(engine_tp // dims.num_groups, 1)
    step = max(dims.num_groups // engine_tp, 1) * dims.head_dim
    shard_rank = rank // replicas
    return _rows(shape, shard_rank * step, (shard_rank + 1) * step)


def _check_layouts(dims: ModelDims, trainer: TrainerLayout, engine_tp: int, ffn: int, dtype: str) -> None:
    """Refuse layouts Megatron or vLLM would refuse, before anything moves."""
    problems = []
    chunks = trainer.pp_size * (trainer.vpp_size or 1)
    if dims.num_layers % chunks:
        problems.append(f"num_layers={dims.num_layers} % (pp_size*vpp_size = {chunks}) != 0")
    for what, n in (("num_heads", dims.num_heads), ("num_groups", dims.num_groups), ("ffn_hidden_size", ffn),
                    ("padded_vocab", dims.padded_vocab)):
        if n % trainer.tp_size:
            problems.append(f"trainer: {what}={n} % tp_size={trainer.tp_size} != 0")
    for what, n in (("num_heads", dims.num_heads), ("ffn_hidden_size", ffn)):
        if n % engine_tp:
            problems.append(f"engine: {what}={n} % engine_tp={engine_tp} != 0")
    vllm_vocab = -(-dims.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if vllm_vocab % engine_tp:
        problems.append(f"engine: vocabulary padded to {vllm_vocab} % engine_tp={engine_tp} != 0")
    if dims.num_groups % engine_tp and engine_tp % dims.num_groups:
        problems.append(f"engine: num_kv_heads={dims.num_groups} and engine_tp={engine_tp}: neither divides the other")
    if dtype not in _DTYPES:
        problems.append(f"dtype={dtype!r} not in {sorted(_DTYPES)}")
    if problems:
        raise ValueError("weight-sync plan: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------------------------
# Transport (server mode): trainer senders -> engine workers over a standalone process group
# ---------------------------------------------------------------------------------------------------------------

_MAGIC = 0x5EED
_HEADER = 5  # int64 header of every (bucket, sender, engine rank) message run: magic, bucket, numel, sender, engine
_ACK_TAG = 1 << 22
_TENSOR_ACK_TAG = _ACK_TAG + 1  # tensor_by_tensor: one acknowledgement per tensor
_MAX_MESSAGES = 1 << 20  # per (bucket, pair); tags are (bucket parity) << 21 | message index


def tensor_buckets(plan: SyncPlan) -> list[list[int]]:
    """One HF tensor per transfer (the tensor-by-tensor baseline; vLLM's layer-wise reload cannot load these)."""
    return [[index] for index in range(len(plan.tensors))]


class WeightTransferGroup:
    """A process group of its own (not the default world) joining the trainer's sender ranks and the engine's
    workers: ranks [0, senders) are trainer ranks by (pp_rank, tp_rank), then engine workers by engine TP rank.
    Gloo on CPU, NCCL with CUDA (the NCCL path is written but, like every GPU path here, tested only on CPU)."""

    def __init__(self, pg, store, rank: int, world_size: int, timeout: timedelta, device: torch.device):
        self.pg, self.store, self.rank, self.world_size = pg, store, rank, world_size
        self.timeout, self.device = timeout, device
        self.buffers: dict[tuple, torch.Tensor] = {}
        """Ping-pong transfer buffers kept from one sync to the next (fresh pages cost more than the copy: filling
        a new 34 MB CPU buffer took 51 ms, refilling a used one 15 ms, one core of a shared 2-core Xeon)."""

    def buffer(self, key: tuple, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A cached flat buffer of at least `numel` elements for `key` (e.g. ("send", slot)); (numel,) view."""
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self.buffers[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0,
               backend: str = "auto", join_timeout_s: float | None = None,
               host_store: bool | None = None) -> WeightTransferGroup:
        """Join the group (collective: every member calls it): one process hosts a TCPStore at (host, port) (rank 0
        unless `host_store` says otherwise: any long-lived process may host it, a member or not), the members
        connect to it. `timeout_s` bounds every transfer wait; `join_timeout_s` (default `timeout_s`) bounds
        waiting for the store and the other members.

        NOTE: a member that starts before the store listens retries with torch's growing back-off (seen: 23 s
        between tries), so start the store's host first where joining time matters."""
        timeout = timedelta(seconds=timeout_s)
        join_timeout = timedelta(seconds=join_timeout_s if join_timeout_s is not None else timeout_s)
        is_master = rank == 0 if host_store is None else host_store
        store = dist.TCPStore(host, port, world_size, is_master=is_master, timeout=join_timeout,
                              wait_for_workers=False)
        prefixed = dist.PrefixStore("grpo_weight_transfer", store)
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, join_timeout)
            pg._set_default_timeout(timeout)
            device = torch.device("cpu")
        return cls(pg, store, rank, world_size, timeout, device)

    def close(self) -> None:
        """Leave the group (pending operations are aborted)."""
        try:
            self.pg.shutdown()
        except (RuntimeError, AttributeError):
            pass
        self.pg = self.store = None
        self.buffers = {}

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        return self.pg.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int):
        return self.pg.recv([tensor], src, tag)


def _describe_peer(plan: SyncPlan, group_rank: int) -> str:
    layout = plan.trainer
    if group_rank < layout.num_senders:
        return f"trainer sender {group_rank} (pp_rank {group_rank // layout.tp_size}, tp_rank {group_rank % layout.tp_size})"
    return f"engine worker {group_rank} (engine tp_rank {group_rank - layout.num_senders})"


def _wait(works: list, plan: SyncPlan, group: WeightTransferGroup, what: str) -> None:
    """Wait for (work, peer, bucket) triples; any failure or timeout becomes a WeightSyncError naming the peer."""
    for work, peer, bucket in works:
        try:
            if not work.wait(group.timeout):
                raise TimeoutError(f"no completion within {group.timeout.total_seconds():g} s")
        except Exception as error:  # noqa: BLE001 - gloo/nccl raise RuntimeError or DistBackendError
            raise WeightSyncError(
                f"weight transfer: {what} of bucket {bucket} with {_describe_peer(plan, peer)} failed (this is group "
                f"rank {group.rank}; group timeout {group.timeout.total_seconds():g} s): {error}"
            ) from error


def _pair_transfers(plan: SyncPlan, buckets: list[list[int]]) -> list[dict[tuple[int, int], list[Transfer]]]:
    """Per bucket: (sender, engine rank) -> its transfers in plan order."""
    bucket_of = {t: k for k, bucket in enumerate(buckets) for t in bucket}
    per_bucket: list[dict] = [{} for _ in buckets]
    for transfer in plan.transfers():
        key = (transfer.sender, transfer.engine_rank)
        per_bucket[bucket_of[transfer.tensor]].setdefault(key, []).append(transfer)
    return per_bucket


def _header(bucket: int, numel: int, sender: int, engine_rank: int, device) -> torch.Tensor:
    return torch.tensor([_MAGIC, bucket, numel, sender, engine_rank], dtype=torch.int64, device=device)


def _tag(bucket: int, index: int) -> int:
    return (bucket % 2) << 21 | index


def _box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def _local_params(chunks) -> dict[tuple[int, str], torch.Tensor]:
    """(virtual chunk, global Megatron name with local-spec norm names) -> this rank's parameter."""
    params = {}
    for vp, chunk in enumerate(chunks):
        model = unwrap(chunk)
        for name, global_name in global_param_names(model).items():
            for local, te in TE_NAMES.items():
                global_name = global_name.replace(te, local)
            params[(vp, global_name)] = model.get_parameter(name)
    return params


@torch.no_grad()
def send_weights(chunks, ps: ParallelState, dims: ModelDims, group: WeightTransferGroup | None, plan: SyncPlan,
                 bucket_mb: float, *, tensor_by_tensor: bool = False) -> dict[str, float]:
    """Send this trainer rank's pieces of the policy to the engine workers (call on every trainer rank).

    Ranks with dp_rank > 0 return at once (they hold copies of dp_rank 0's shards). Each sender packs, per bucket
    and per engine rank, the boxes of its own shards that rank reads into one flat buffer behind a small header;
    no rank gathers anything. Packing bucket k+1 overlaps the transmission of bucket k. Returns after every engine
    rank acknowledged the last bucket. `tensor_by_tensor=True` is the baseline of per-tensor frameworks, for the
    benchmark: TRL's `update_named_param` (per parameter: an HTTP call, a broadcast, a barrier with the workers,
    which load it) and OpenRLHF's `broadcast_to_vllm` (per parameter: a Ray call, a broadcast, `ray.get`) send
    one HF tensor at a time and wait until the engine has it before the next. Here: every HF tensor is a transfer
    of its own (`tensor_buckets`), one message per box, each waited for, and every engine rank acknowledges the
    tensor before the next one starts; the receivers must pass the same flag.

    Args:
        chunks: the policy chunks (wrapped or not), in virtual-stage order.
        group: this rank's WeightTransferGroup (None on dp_rank > 0 ranks).
        plan: from `build_sync_plan` for this layout; the engine side must use the same plan and `bucket_mb`.
    Returns:
        {"weight_sync/seconds", "weight_sync/gib" (sent by this rank), "weight_sync/messages", "weight_sync/buckets"}.
    Raises:
        WeightSyncError naming the bucket and the peer when a transfer fails or times out (a dead engine worker).
    """
    if ps.dp_rank != 0:
        return {}
    if plan.dims != dims or (plan.trainer.tp_size, plan.trainer.pp_size) != (ps.tp_size, ps.pp_size):
        raise ValueError(f"weight-sync plan for {plan.trainer} / {plan.dims} used at tp={ps.tp_size}, pp={ps.pp_size} "
                         f"/ {dims}")
    start = time.perf_counter()
    me = plan.trainer.sender_rank(ps.pp_rank, ps.tp_rank)
    params = _local_params(chunks)
    buckets = tensor_buckets(plan) if tensor_by_tensor else plan.buckets(bucket_mb)
    per_bucket = [{rank: ts for (sender, rank), ts in pairs.items() if sender == me}
                  for pairs in _pair_transfers(plan, buckets)]  # per bucket: engine rank -> this sender's transfers
    most = max((sum(t.numel for ts in pairs.values() for t in ts) for pairs in per_bucket), default=0)
    num_bytes, num_messages, pending = 0, 0, []
    for k, pairs in enumerate(per_bucket):
        works = []
        # NOTE: slot k % 2 is free: bucket k - 2's sends completed before bucket k - 1's were posted.
        flat = None if tensor_by_tensor else group.buffer(("send", k % 2), most, plan.torch_dtype)
        offset = 0
        for engine_rank, transfers in pairs.items():
            peer = plan.engine_group_rank(engine_rank)
            numel = sum(t.numel for t in transfers)
            payload = None if flat is None else flat[offset : offset + numel]
            offset += numel
            messages = [_header(k, numel, me, engine_rank, group.device)]
            messages += _pack_payload(transfers, params, plan, payload, group.device)
            if len(messages) > _MAX_MESSAGES:
                raise ValueError(f"bucket {k}: {len(messages)} messages to one peer; use a smaller bucket_mb")
            for i, message in enumerate(messages):
                works.append((group.send(message, peer, _tag(k, i)), peer, k))
                if tensor_by_tensor:  # the per-tensor baseline: each message completes before the next starts
                    _wait([works.pop()], plan, group, "sending")
            num_bytes += numel * plan.torch_dtype.itemsize
            num_messages += len(messages)
        if tensor_by_tensor:  # ... and the engine has the tensor before the next starts (TRL's barrier)
            acks = [(torch.zeros(_HEADER, dtype=torch.int64, device=group.device), plan.engine_group_rank(e))
                    for e in range(plan.engine_tp)]
            _wait([(group.recv(ack, peer, _TENSOR_ACK_TAG), peer, k) for ack, peer in acks], plan, group,
                  "the tensor's acknowledgement")
            num_messages += len(acks)
        _wait(pending, plan, group, "sending")
        pending = works
    _wait(pending, plan, group, "sending")
    acks = [(torch.zeros(_HEADER, dtype=torch.int64, device=group.device), plan.engine_group_rank(e)) for e in range(plan.engine_tp)]
    _wait([(group.recv(ack, peer, _ACK_TAG), peer, len(buckets)) for ack, peer in acks], plan, group,
          "the acknowledgement")
    for ack, peer in acks:
        if ack[0] != _MAGIC or ack[1] != len(buckets):
            raise WeightSyncError(f"weight transfer: {_describe_peer(plan, peer)} acknowledged {ack.tolist()}, "
                                  f"expected {len(buckets)} buckets: the two sides use different plans")
    return {"weight_sync/seconds": time.perf_counter() - start, "weight_sync/gib": num_bytes / 2**30,
            "weight_sync/messages": num_messages, "weight_sync/buckets": len(buckets)}


def _pack_payload(transfers: list[Transfer], params, plan: SyncPlan, flat: torch.Tensor | None,
                  device: torch.device) -> list[torch.Tensor]:
    """The payload messages of one (bucket, sender, engine rank): packed into `flat` (numel,), or, without it, one
    tensor per box (tensor by tensor)."""
    sources = [params[(t.piece.vp_chunk, t.piece.megatron)][_box_slices(t.local_box)] for t in transfers]
    if flat is None:
        return [src.to(device, plan.torch_dtype).contiguous() for src in sources]
    offset = 0
    for transfer, src in zip(transfers, sources):
        flat[offset : offset + transfer.numel].view(src.shape).copy_(src)
        offset += transfer.numel
    return [flat]


def receive_weights(group: WeightTransferGroup, plan: SyncPlan, bucket_mb: float, engine_rank: int,
                    *, tensor_by_tensor: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receive the trainer's weights on one engine worker, bucket by bucket (a generator; iterate it to the end).

    Yields, per bucket, every HF tensor of the bucket as (HF name, tensor of the full HF shape and the plan's
    dtype) for vLLM's loader (`reload_weights`) of engine TP rank `engine_rank`. Buckets close only between
    decoder layers. The next bucket is received while the consumer loads this one; after the consumer has taken
    the last bucket, every sender gets an acknowledgement (so `send_weights` returns only once the engine has
    everything).

    NOTE: only the box that this rank's vLLM loader reads (`plan.tensors[i].engine_boxes[engine_rank]`) is
    filled; the rest of each tensor is uninitialised memory. vLLM's weight loaders narrow a full-shape HF tensor to
    their rank's slice before copying (QKV/merged/row/vocab-parallel layers), so they never read it; do not hand
    these tensors to anything that reads them whole. The tensors are views of two transfer buffers kept on the
    group (2 x the largest bucket's payload + split tensors): copy what must outlive the bucket after next.

    Raises:
        WeightSyncError naming the bucket and the peer on a header mismatch, a dead peer or a timeout.
    """
    buckets = tensor_buckets(plan) if tensor_by_tensor else plan.buckets(bucket_mb)
    layouts = _receive_layouts(plan, buckets, engine_rank)
    most = max((payload + assembly for _, _, payload, assembly in layouts), default=0)
    me = plan.engine_group_rank(engine_rank)

    def post(k: int):
        """Post bucket k's receives into ping-pong slot k % 2: [payload per sender | room for split tensors]."""
        pairs, whole, payload, assembly = layouts[k]
        flat = group.buffer(("recv", k % 2), most, plan.torch_dtype)
        posted, offset = [], 0
        for sender, transfers in pairs:
            numel = sum(t.numel for t in transfers)
            region = flat[offset : offset + numel]
            offset += numel
            views = list(region.split([t.numel for t in transfers])) if tensor_by_tensor else [region]
            messages = [torch.empty(_HEADER, dtype=torch.int64, device=group.device)] + views
            works = [(group.recv(m, sender, _tag(k, i)), sender, k) for i, m in enumerate(messages)]
            posted.append((sender, transfers, messages, works))
        return posted, whole, flat[payload : payload + assembly]

    # NOTE: slot k % 2 is free when bucket k is posted (just before bucket k - 1 is yielded): the consumer has
    # finished loading bucket k - 2. Yielded tensors are views of these buffers: load them before asking for the
    # bucket after next; the next sync overwrites them.
    posted = post(0) if buckets else None
    for k, bucket in enumerate(buckets):
        for sender, transfers, messages, works in posted[0]:
            _wait(works, plan, group, "receiving")
            expected = _header(k, sum(t.numel for t in transfers), sender, engine_rank, group.device)
            if not torch.equal(messages[0], expected):
                raise WeightSyncError(
                    f"weight transfer: bucket {k} from {_describe_peer(plan, sender)} has header "
                    f"{messages[0].tolist()}, expected {expected.tolist()} (magic, bucket, numel, sender, engine "
                    f"rank): the sides disagree on the plan or bucket_mb")
        current = posted
        posted = post(k + 1) if k + 1 < len(buckets) else None
        yield _assemble(plan, bucket, *current)
        if tensor_by_tensor:  # the consumer has taken this tensor: every sender may go on to the next
            _wait([(group.send(_header(k, 0, me, engine_rank, group.device), s, _TENSOR_ACK_TAG), s, k)
                   for s in range(plan.trainer.num_senders)], plan, group, "acknowledging")
    acks = [(group.send(_header(len(buckets), 0, me, engine_rank, group.device), s, _ACK_TAG), s, len(buckets))
            for s in range(plan.trainer.num_senders)]
    _wait(acks, plan, group, "acknowledging")


def _receive_layouts(plan: SyncPlan, buckets: list[list[int]], engine_rank: int) -> list[tuple]:
    """Per bucket, for one engine rank: ([(sender, transfers)], tensors arriving whole in one piece, payload
    elements, elements of the tensors assembled from pieces)."""
    layouts = []
    for bucket, pairs in zip(buckets, _pair_transfers(plan, buckets)):
        mine = [(sender, ts) for (sender, rank), ts in pairs.items() if rank == engine_rank]
        whole = {t.tensor for _, ts in mine for t in ts if t.hf_box == _full(plan.tensors[t.tensor].shape)}
        payload = sum(t.numel for _, ts in mine for t in ts)
        assembly = sum(math.prod(plan.tensors[i].shape) for i in bucket if i not in whole)
        layouts.append((mine, whole, payload, assembly))
    return layouts


def _assemble(plan: SyncPlan, bucket: list[int], received, whole: set[int], room: torch.Tensor):
    """Full-shape HF tensors of one bucket with this rank's boxes filled from the received payloads: a tensor that
    arrived whole is a view of its payload, the others are laid out in `room` (numel,) and filled box by box."""
    out: dict[int, torch.Tensor] = {}
    offset = 0
    for i in bucket:
        if i not in whole:  # includes tensors this rank reads nothing of (vocabulary rows past its padded range)
            numel = math.prod(plan.tensors[i].shape)
            out[i] = room[offset : offset + numel].view(plan.tensors[i].shape)
            offset += numel
    for _, transfers, messages, _ in received:
        payload = messages[1:]
        flat = payload[0] if len(payload) == 1 else None
        offset = 0
        for j, transfer in enumerate(transfers):
            part = payload[j] if flat is None else flat[offset : offset + transfer.numel]
            offset += transfer.numel
            if transfer.tensor in whole:
                out[transfer.tensor] = part.view(plan.tensors[transfer.tensor].shape)
            else:
                out[transfer.tensor][_box_slices(transfer.hf_box)].copy_(part.view(_box_shape(transfer.hf_box)))
    return [(plan.tensors[i].name, out[i]) for i in bucket]


# ---------------------------------------------------------------------------------------------------------------
# server mode: the trainer's half of a sync into engine/rollout_server.py


@dataclass
class ServerSync:
    """The trainer's end of the weight-transfer group to a rollout server, kept from one sync to the next."""

    plan: SyncPlan
    host: str
    """Address of global rank 0 (sender 0, which hosts the group's store), as the server reaches it."""
    port: int
    timeout_s: float
    """Bounds joining, every transfer wait and the server's answers."""
    bucket_mb: float
    group: WeightTransferGroup | None = None
    """This rank's group (dp_rank 0 ranks, once joined)."""
    is_joined: bool = False
    """The same on every trainer rank: whether the group exists (False again after a failed sync)."""
    store: object = None
    """Rank 0: the group's TCPStore, listening before the server is asked to join (no connect back-off)."""
    server: int = 0
    """Which of the trainer's rollout servers (`SharedRolloutClient.clients[server]`) this link feeds."""
    instance: str | None = None
    """Rank 0: the server process (`instance_id`) the group was joined with; a new one has left the group."""


def build_server_sync(ps: ParallelState, dims: ModelDims, engine_tp: int, *, ffn_hidden_size: int, dtype: str,
                      group_port: int, timeout_s: float, bucket_mb: float, server: int = 0) -> ServerSync:
    """The plan of this trainer layout into the server's engine TP, and where the group meets.

    The group's store is hosted by global rank 0 on `group_port` at $MASTER_ADDR (torchrun's and srun's address of
    rank 0's node; the inference nodes reach it as the trainer nodes do), 127.0.0.1 without one.
    """
    import os

    plan = build_sync_plan(dims, TrainerLayout(ps.tp_size, ps.pp_size, ps.vpp_size), engine_tp,
                           ffn_hidden_size=ffn_hidden_size, dtype=dtype)
    host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    return ServerSync(plan, host, group_port, timeout_s, bucket_mb, server=server)


def _in_background(call):
    """Run `call` in a thread; returns (thread, outcome dict with 'value' or 'error')."""
    import threading

    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome["error"] = error

    thread = threading.Thread(target=run, name="weight-sync-http", daemon=True)
    thread.start()
    return thread, outcome


def _result(background, timeout_s: float, what: str):
    """Wait for a background HTTP call (None = not this rank's); raise its error."""
    if background is None:
        return None
    thread, outcome = background
    thread.join(timeout_s)
    if thread.is_alive():
        raise WeightSyncError(f"{what}: the server did not answer within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _check_server(ps: ParallelState, client, link: ServerSync) -> bool:
    """Rank 0 checks the server's health; every rank raises if it failed (collective). Returns, on every rank,
    whether the server is another process than the one `link` joined (restarted: it has left the group)."""
    flag = torch.tensor([1.0, 0.0], device=ps.device)  # (ok, restarted); on the backend's device (NCCL)
    if ps.rank == 0:
        try:
            instance = client.check_health().get("instance_id")
        except Exception:
            flag[0] = 0.0
            dist.broadcast(flag, src=0)
            raise
        flag[1] = float(link.instance is not None and instance != link.instance)
        link.instance = instance
    dist.broadcast(flag, src=0)
    if not float(flag[0]):
        raise WeightSyncError("the rollout server's health check failed on trainer rank 0")
    return bool(float(flag[1]))


def sync_server(chunks, ps: ParallelState, dims: ModelDims, engine, link: ServerSync) -> dict[str, float]:
    """Push the policy's current weights into the rollout server (collective: every trainer rank calls it).

    Rank 0 asks the server over HTTP to join the group (first sync, or after a failure) and to receive one sync,
    each request in a background thread, while the dp_rank-0 ranks join and `send_weights` their own shards; the
    outcome is then agreed over the trainer's world so every rank returns, or raises, together.

    Args:
        engine: the trainer's SharedRolloutClient (rank 0 holds the HTTP clients, `engine.clients`).
        link: from `build_server_sync`; its group is kept for the next sync. The server is asked for its health
            first (one GET): a dead one fails at once, a restarted one (new `instance_id`) is joined afresh
            (stats then hold `weight_sync/rejoined`).
    Returns:
        {"weight_sync/seconds", "weight_sync/gib" (sent by rank 0), "weight_sync/messages", "weight_sync/buckets"}.
    Raises:
        WeightSyncError on every rank when any part failed (a dead or unreachable server, a broken group, a
        timeout), naming the cause; the group is then closed on this side (the next sync joins a fresh one). The
        trainer's parameters are only read, so they are exactly as before the sync whatever happened.
    """
    start = time.perf_counter()
    plan = link.plan
    client = engine.clients[link.server] if ps.rank == 0 else None
    stats, error = {}, None
    try:
        # a dead server fails here at once, not after the group's join timeout; a restarted one (a new process,
        # its checkpoint's weights, outside the group) is joined afresh
        if _check_server(ps, client, link) and link.is_joined:
            if link.group is not None:
                link.group.close()
            link.group, link.store, link.is_joined = None, None, False
            stats["weight_sync/rejoined"] = 1.0
        if not link.is_joined:
            request = dict(host=link.host, port=link.port, world_size=plan.group_size,
                           first_engine_rank=plan.trainer.num_senders, timeout_s=link.timeout_s, plan=plan.spec(),
                           bucket_mb=link.bucket_mb)
            if ps.rank == 0:  # the store listens first: members that connect early back off for up to ~20 s
                link.store = dist.TCPStore(link.host, link.port, plan.group_size, is_master=True,
                                           timeout=timedelta(seconds=link.timeout_s), wait_for_workers=False)
            http = _in_background(lambda: client.init_weight_group(**request)) if ps.rank == 0 else None
            try:
                if ps.dp_rank == 0:
                    link.group = WeightTransferGroup.create(link.host, link.port, plan.trainer.sender_rank(
                        ps.pp_rank, ps.tp_rank), plan.group_size, link.timeout_s, host_store=False)
            finally:
                _result(http, link.timeout_s, "joining the weight-transfer group")
            link.is_joined = True
        http = _in_background(client.update_weights) if ps.rank == 0 else None
        try:
            stats |= send_weights(chunks, ps, dims, link.group, plan, link.bucket_mb)
        finally:
            answer = _result(http, link.timeout_s, "loading the weights")
        if ps.rank == 0:  # generate() checks that it is still this process that answers
            engine.synced_instance[link.server] = answer.get("instance_id", link.instance)
    except Exception as exc:  # noqa: BLE001 - every rank learns of any rank's failure below
        error = f"{type(exc).__name__}: {exc}"
    failed = torch.tensor([0.0 if error is None else 1.0], device=ps.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if float(failed) > 0:
        if link.group is not None:
            link.group.close()
        link.group, link.store, link.is_joined = None, None, False
        errors: list = [None] * ps.world_size
        dist.all_gather_object(errors, error)
        first = next((rank, e) for rank, e in enumerate(errors) if e is not None)
        raise WeightSyncError(
            f"weight sync into the rollout server failed (first error on trainer rank {first[0]}: {first[1]}); the "
            "trainer's weights and optimizer state are unchanged, the server's weights are not known to be current"
        )
    return stats | {"weight_sync/seconds": time.perf_counter() - start}
