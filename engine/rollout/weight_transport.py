"""Server-mode weight transport: the trainer's sender ranks -> the engine's workers, shard to shard, over a process
group of their own (`WeightTransferGroup`): `send_weights` on the trainer, `receive_weights` in vLLM's workers.

Owns: the group, the wire protocol (each sender sends only the boxes of its own shards that each engine rank reads,
nobody gathers the model; both sides derive the bucket schedule from (plan, bucket_mb), so there is no metadata
handshake, and a mismatch, a dead peer or a timeout raises WeightSyncError naming the bucket and the peer), the
trainer's parameter names (`local_params`) and each sender's share of the weight digests (`sender_digests`); and
`send_flat` / `receive_flat`: one flat tensor (a LoRA adapter, engine/rollout/adapter_sync.py) from sender 0 to every
engine rank, whole.
Layouts: only through the plan's boxes (engine/rollout/sync_plan.py) and one fact of vLLM's loaders (`receive_weights`).
What it costs (GB/s by bucket size, against a per-tensor protocol): benchmarks/bench_weight_sync.py's docstring.

Must not: import vLLM (`receive_weights` runs inside vLLM's workers, which call it), build or change the plan,
talk HTTP (engine/rollout/server_sync.py drives the server), touch the default process group.

Test: tests/distributed/test_weight_transport.py (real Megatron shards to receiver processes over gloo, every
layout, the tiny Qwen3-MoE at EP2 and at expert TP 2; a dead receiver fails the sender within the timeout).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.policy.hf_map import TE_NAMES, ModelDims
from engine.policy.model import get_weight, global_param_names
from engine.policy.parallel import ParallelState
from engine.policy.step import unwrap
from engine.rollout.sync_buffers import receive_slot_numel, send_slot_numel
from engine.rollout.sync_check import WeightSyncError
from engine.rollout.sync_plan import Box, Piece, SyncPlan, Transfer, box_slices, full_box, local_view
from engine.rollout.weight_digest import box_digest

_MAGIC = 0x5EED
_HEADER = 5  # int64 header of every (bucket, sender, engine rank) message run: magic, bucket, numel, sender, engine
_ACK_TAG = 1 << 22
_TENSOR_ACK_TAG = _ACK_TAG + 1  # tensor_by_tensor: one acknowledgement per tensor
_MAX_MESSAGES = 1 << 20  # per (bucket, pair); tags are (bucket parity) << 21 | message index
_ADAPTER_TAG = _ACK_TAG + 2  # adapter-only sync (send_flat): header, payload, acknowledgement: +0, +1, +2


def tensor_buckets(plan: SyncPlan) -> list[list[int]]:
    """One HF tensor per transfer (the tensor-by-tensor baseline; vLLM's layer-wise reload cannot load these)."""
    return [[index] for index in range(len(plan.tensors))]


class WeightTransferGroup:
    """A process group of its own (not the default world) joining the trainer's sender ranks and the engine's
    workers: ranks [0, senders) are trainer ranks by (pp_rank, tp_rank), then engine workers by engine TP rank.
    The senders (`sender_index`): dp_rank 0 for the dense tensors, expert-data-parallel rank 0 for the experts.
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


def sender_index(plan: SyncPlan, ps: ParallelState) -> int | None:
    """This trainer rank's rank in the weight-transfer group, None if it sends nothing (`TrainerLayout.sender_of`)."""
    return plan.trainer.sender_of(ps.pp_rank, ps.tp_rank, ps.dp_rank, ps.etp_rank, ps.ep_rank, ps.edp_rank)


def _describe_peer(plan: SyncPlan, group_rank: int) -> str:
    layout = plan.trainer
    if group_rank < layout.num_senders:
        pp_rank, local = divmod(group_rank, layout.senders_per_stage)
        roles = [f"tp_rank {local}"] if local < layout.tp_size else []
        if layout.ep_size * layout.expert_tp_size > 1 and local < layout.ep_size * layout.expert_tp_size:
            roles.append(f"experts of ep_rank {local // layout.expert_tp_size}")
        return f"trainer sender {group_rank} (pp_rank {pp_rank}, {', '.join(roles)})"
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


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def local_params(chunks) -> dict[tuple[int, str], torch.Tensor]:
    """(virtual chunk, global Megatron name with local-spec norm names) -> this rank's parameter.

    Global Megatron names; Transformer Engine's norm names mapped to the local spec's (`TE_NAMES`)."""
    params = {}
    for vp, chunk in enumerate(chunks):
        model = unwrap(chunk)
        for name, global_name in global_param_names(model).items():
            for local, te in TE_NAMES.items():
                global_name = global_name.replace(te, local)
            params[(vp, global_name)] = get_weight(model, name)
    return params


def piece_source(params: dict, piece: Piece) -> torch.Tensor:
    """The local shard a piece's `local_box` indexes: its parameter (`local_params`) in the piece's `local_view`."""
    return local_view(params[(piece.vp_chunk, piece.megatron)], piece.view)


@torch.no_grad()
def sender_digests(chunks, ps: ParallelState, plan: SyncPlan) -> torch.Tensor:
    """This rank's share of the digests of what every engine rank must hold (engine/rollout/weight_digest.py): per
    (plan tensor, engine rank), the summed `box_digest`s of the boxes this rank sends there, in the plan's dtype (what
    `send_weights` puts on the wire), placed in that engine rank's box; zeros on ranks that send nothing. Summed over
    the trainer's ranks (an all-reduce) they are the digests of the engine ranks' boxes (engine/rollout/server_sync.py
    sums and compares them with the engine's own).

    Returns:
        int64 (len(plan.tensors), plan.engine_tp) on `ps.device`.
    """
    digests = torch.zeros(len(plan.tensors), plan.engine_tp, dtype=torch.int64, device=ps.device)
    me = sender_index(plan, ps)
    if me is None:
        return digests
    params = local_params(chunks)
    for t in plan.transfers():
        if t.sender != me:
            continue
        src = piece_source(params, t.piece)[box_slices(t.local_box)]
        engine_box = plan.tensors[t.tensor].engine_boxes[t.engine_rank]
        start = tuple(a - e for (a, _), (e, _) in zip(t.hf_box, engine_box))
        sent = src if src.dtype == plan.torch_dtype else src.to(plan.torch_dtype)
        digests[t.tensor, t.engine_rank] += box_digest(sent, start, _box_shape(engine_box)).to(ps.device)
    return digests


@torch.no_grad()
def send_weights(chunks, ps: ParallelState, dims: ModelDims, group: WeightTransferGroup | None, plan: SyncPlan,
                 bucket_mb: float, *, tensor_by_tensor: bool = False) -> dict[str, float]:
    """Send this trainer rank's pieces of the policy to the engine workers (call on every trainer rank).

    Ranks that are no sender return at once (`sender_index`: they hold copies of the senders' dense and expert
    shards). Each sender packs, per bucket
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
        group: this rank's WeightTransferGroup (None on ranks that send nothing).
        plan: from `build_sync_plan` for this layout; the engine side must use the same plan and `bucket_mb`.
    Returns:
        {"weight_sync/seconds", "weight_sync/gib" (sent by this rank), "weight_sync/messages", "weight_sync/buckets"}.
    Raises:
        WeightSyncError naming the bucket and the peer when a transfer fails or times out (a dead engine worker).
    """
    layout = plan.trainer
    if plan.dims != dims or (layout.tp_size, layout.pp_size, layout.ep_size, layout.expert_tp_size) != (
            ps.tp_size, ps.pp_size, ps.ep_size, ps.etp_size):
        raise ValueError(f"weight-sync plan for {layout} / {plan.dims} used at tp={ps.tp_size}, pp={ps.pp_size}, "
                         f"ep={ps.ep_size}, expert_tp={ps.etp_size} / {dims}")
    me = sender_index(plan, ps)
    if me is None:
        return {}
    start = time.perf_counter()
    params = local_params(chunks)
    buckets = tensor_buckets(plan) if tensor_by_tensor else plan.buckets(bucket_mb)
    per_bucket = [{rank: ts for (sender, rank), ts in pairs.items() if sender == me}
                  for pairs in _pair_transfers(plan, buckets)]  # per bucket: engine rank -> this sender's transfers
    most = send_slot_numel(plan, buckets, me)  # what the planner counts (engine/rollout/sync_buffers.py)
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
    sources = [piece_source(params, t.piece)[box_slices(t.local_box)] for t in transfers]
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
    most = receive_slot_numel(plan, buckets, engine_rank)  # = max of payload + assembly; the planner counts it
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
        whole = {t.tensor for _, ts in mine for t in ts if t.hf_box == full_box(plan.tensors[t.tensor].shape)}
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
                out[transfer.tensor][box_slices(transfer.hf_box)].copy_(part.view(_box_shape(transfer.hf_box)))
    return [(plan.tensors[i].name, out[i].view(plan.tensors[i].loader_shape)) for i in bucket]


def send_flat(group: WeightTransferGroup, plan: SyncPlan, flat: torch.Tensor, version: int) -> dict[str, float]:
    """Group rank 0 (trainer sender 0) sends one flat tensor, whole, to every engine rank: adapter-only sync
    (engine/rollout/adapter_sync.py; LoRA adapters are small, and vLLM shards them itself). Returns once every engine
    rank has acknowledged `version`. Raises WeightSyncError naming the peer on a failure, a timeout or a wrong ack."""
    start = time.perf_counter()
    flat = flat.to(group.device).contiguous()
    works = []
    for engine_rank in range(plan.engine_tp):
        peer = plan.engine_group_rank(engine_rank)
        works.append((group.send(_header(version, flat.numel(), 0, engine_rank, group.device), peer, _ADAPTER_TAG),
                      peer, version))
        works.append((group.send(flat, peer, _ADAPTER_TAG + 1), peer, version))
    _wait(works, plan, group, "sending the adapter")
    acks = [(torch.zeros(_HEADER, dtype=torch.int64, device=group.device), plan.engine_group_rank(e))
            for e in range(plan.engine_tp)]
    _wait([(group.recv(ack, peer, _ADAPTER_TAG + 2), peer, version) for ack, peer in acks], plan, group,
          "the adapter's acknowledgement")
    for ack, peer in acks:
        if ack[0] != _MAGIC or ack[1] != version:
            raise WeightSyncError(f"weight transfer: {_describe_peer(plan, peer)} acknowledged {ack.tolist()}, "
                                  f"expected adapter version {version}")
    return {"weight_sync/seconds": time.perf_counter() - start,
            "weight_sync/gib": flat.numel() * flat.element_size() * plan.engine_tp / 2**30,
            "weight_sync/messages": 3 * plan.engine_tp}


def receive_flat(group: WeightTransferGroup, plan: SyncPlan, engine_rank: int, numel: int, dtype: torch.dtype,
                 version: int) -> torch.Tensor:
    """One engine rank's half of `send_flat`: the flat tensor (numel,) of `dtype`, on the group's device, after
    checking its header (version, size) and acknowledging it. Raises WeightSyncError on a mismatch or a timeout."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=group.device)
    flat = torch.empty(numel, dtype=dtype, device=group.device)
    _wait([(group.recv(header, 0, _ADAPTER_TAG), 0, version), (group.recv(flat, 0, _ADAPTER_TAG + 1), 0, version)],
          plan, group, "receiving the adapter")
    expected = _header(version, numel, 0, engine_rank, group.device)
    if not torch.equal(header, expected):
        raise WeightSyncError(f"weight transfer: the adapter from {_describe_peer(plan, 0)} has header "
                              f"{header.tolist()}, expected {expected.tolist()} (magic, version, numel, sender, engine "
                              "rank): the two sides disagree on the adapter's tensors")
    me = plan.engine_group_rank(engine_rank)
    _wait([(group.send(_header(version, 0, me, engine_rank, group.device), 0, _ADAPTER_TAG + 2), 0, version)],
          plan, group, "acknowledging the adapter")
    return flat
