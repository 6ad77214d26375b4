"""The server-mode transport's transfer buffers for a plan and a bucket size: how many elements one ping-pong slot
of each engine rank (receive) and of each trainer sender (send) holds. engine/rollout/weight_transport.py sizes its
slots with `receive_slot_numel` / `send_slot_numel`, and the memory planner (engine/planning/sync_memory.py) counts
`sync_buffers` on both kinds of GPU, so the two cannot disagree.

A receive slot holds one bucket: the payload every sender sends this engine rank, then room to assemble, at their
FULL HF shape, the bucket's tensors that do not arrive whole in one piece (vLLM's loaders narrow full-shape tensors
themselves). A send slot holds what one sender packs for every engine rank in one bucket. Each side keeps 2 slots.

Must not: allocate, import vLLM, open process groups. Pure arithmetic over the plan's boxes; per tensor the work is
shared between tensors of the same geometry (every expert of a layer), so Qwen3-235B's 36,945 tensors take well
under a second.

Test: tests/unit/test_sync_buffers.py (against the transport's own per-bucket layouts on many tiny layouts, the
GPT-OSS-120B hand number, a tiny plan by hand).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.rollout.sync_plan import SyncPlan, TensorPlan, full_box

SLOTS = 2
"""Ping-pong slots per side: bucket k + 1 is received (packed) while bucket k is loaded (sent)."""

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the plan's dtype (`SyncPlan.dtype`)."""


@dataclass(frozen=True)
class SyncBuffers:
    """The transport's buffers for one plan and bucket size: elements of one slot per engine rank and per sender."""

    receive_numel: tuple[int, ...]
    """One receive slot's elements, indexed by engine TP rank."""
    send_numel: tuple[int, ...]
    """One send slot's elements, indexed by sender (weight-transfer group rank)."""
    itemsize: int
    num_buckets: int
    bucket_numel: int
    """Elements of the largest bucket's full HF tensors (what the colocated sync gathers at once)."""

    @property
    def receive_bytes(self) -> int:
        """Per engine GPU (the largest rank's): 2 slots."""
        return SLOTS * max(self.receive_numel, default=0) * self.itemsize

    def send_bytes(self, senders: range | None = None) -> int:
        """Per trainer GPU, the largest of `senders` (default all): 2 slots."""
        numels = self.send_numel if senders is None else [self.send_numel[s] for s in senders]
        return SLOTS * max(numels, default=0) * self.itemsize


def _intersect_numel(a, b) -> int:
    n = 1
    for (a0, a1), (b0, b1) in zip(a, b):
        extent = min(a1, b1) - max(a0, b0)
        if extent <= 0:
            return 0
        n *= extent
    return n


def _tensor_traffic(plan: SyncPlan, tensor: TensorPlan, memo: dict) -> tuple:
    """(payload per engine rank, arrives whole per engine rank, ((sender, elements), ...)) of one tensor: what
    `SyncPlan.transfers()` moves for it, summed without building the transfers."""
    key = (tensor.shape, tuple((p.sender, p.hf_box) for p in tensor.pieces), tensor.engine_boxes)
    found = memo.get(key)
    if found is not None:
        return found
    full = full_box(tensor.shape)
    payload, whole, sent = [0] * plan.engine_tp, [False] * plan.engine_tp, {}
    for piece in tensor.pieces:
        sender = plan.trainer.sender_rank(*piece.sender)
        for rank, box in enumerate(tensor.engine_boxes):
            numel = _intersect_numel(piece.hf_box, box)
            if not numel:
                continue
            payload[rank] += numel
            sent[sender] = sent.get(sender, 0) + numel
            # the transport's test (`_receive_layouts`): a transfer whose box is the whole tensor
            whole[rank] = whole[rank] or (piece.hf_box == full and box == full)
    found = memo[key] = (tuple(payload), tuple(whole), tuple(sent.items()))
    return found


def _bucket_numels(plan: SyncPlan, buckets: list[list[int]]) -> tuple[list[list[int]], list[dict[int, int]]]:
    """Per bucket: one receive slot's elements per engine rank, and per sender its send slot's elements."""
    memo: dict = {}
    receive, send = [], []
    for bucket in buckets:
        counts: dict[int, list] = {}  # tensors of one geometry share one traffic record: count them, add once
        for index in bucket:
            tensor = plan.tensors[index]
            traffic = _tensor_traffic(plan, tensor, memo)
            counts.setdefault(id(traffic), [traffic, math.prod(tensor.shape), 0])[2] += 1
        slot, sent = [0] * plan.engine_tp, {}
        for (payload, whole, senders), size, n in counts.values():
            for rank in range(plan.engine_tp):
                slot[rank] += n * (payload[rank] + (0 if whole[rank] else size))
            for sender, numel in senders:
                sent[sender] = sent.get(sender, 0) + n * numel
        receive.append(slot)
        send.append(sent)
    return receive, send


def receive_slot_numel(plan: SyncPlan, buckets: list[list[int]], engine_rank: int) -> int:
    """Elements of one receive slot of `engine_rank`: the largest bucket's payload + assembly room."""
    return max((slot[engine_rank] for slot in _bucket_numels(plan, buckets)[0]), default=0)


def send_slot_numel(plan: SyncPlan, buckets: list[list[int]], sender: int) -> int:
    """Elements of one send slot of `sender` (its weight-transfer group rank): its largest bucket."""
    return max((sent.get(sender, 0) for sent in _bucket_numels(plan, buckets)[1]), default=0)


def sync_buffers(plan: SyncPlan, bucket_mb: float) -> SyncBuffers:
    """The transport's buffers for `plan` at `bucket_mb` (`SyncPlan.buckets`), every engine rank and sender."""
    buckets = plan.buckets(bucket_mb)
    receive, send = _bucket_numels(plan, buckets)
    return SyncBuffers(
        receive_numel=tuple(max((slot[r] for slot in receive), default=0) for r in range(plan.engine_tp)),
        send_numel=tuple(max((sent.get(s, 0) for sent in send), default=0) for s in range(plan.trainer.num_senders)),
        itemsize=ITEMSIZE[plan.dtype], num_buckets=len(buckets),
        bucket_numel=max((sum(math.prod(plan.tensors[i].shape) for i in bucket) for bucket in buckets), default=0))
