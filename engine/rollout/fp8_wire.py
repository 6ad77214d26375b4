"""Server-mode FP8 wire (`rollout.vllm_weight_dtype: fp8` with `rollout.vllm_mode: server`): the trainer's senders
-> the engine's workers over the transfer group (engine/rollout/weight_transport.py `WeightTransferGroup`), with each
engine rank's box of every FP8 weight assembled, quantized and sent by one sender (engine/rollout/fp8_server_sync.py).

Per bucket (the plan's `buckets(bucket_mb)`, on both sides, so there is no metadata handshake):
  1. pieces between senders: for each assembly of the bucket, every other sender holding part of the box sends that
     part, in the model's dtype, to the assembler (group ranks [0, senders) are the senders);
  2. per engine rank, each sender sends one header (magic, bucket, bytes, sender, engine rank) and one byte message:
     its boxes of the bucket's unquantized tensors in the model's dtype (plan order), then, for each FP8 weight it
     assembles for that rank, the float8_e4m3fn payload of the rank's box and its float32 scales;
  3. the receiver lays each into full-shape tensors (payload: the weight's shape; scales: its block grid) with only
     its own box filled, and yields them in `fp8_engine_tensors` order for vLLM's loader, whose FP8 layers narrow
     payload by rows / columns and scales by blocks.
After the last bucket every engine rank acknowledges to every sender. Digests (`send_fp8_weights`'s second result):
per tensor of `fp8_engine_tensors` and engine rank, this sender's share (the model-dtype boxes it sent, the payload
and scales it assembled), summed over the senders they are the digests of what each engine rank must hold.
No bucket overlap here (the model-dtype wire overlaps packing and sending): simpler, and the quantization dominates.

Must not: import vLLM, build or change the plan, touch the default process group.

Test: tests/distributed/test_fp8_wire.py (senders and a receiver in processes on gloo, no Megatron, no vLLM: every
received tensor equals the reference quantizer's of the rank's box or the model's values, the digests of a receiver
holding them equal the senders', a corrupted scale named).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from engine.models.quantized import FP8_DTYPE
from engine.rollout.fp8_server_sync import Assembly, assembled_digests, fp8_assemblies, quantize_assembled
from engine.rollout.fp8_sync import fp8_engine_tensors, is_fp8_weight, scale_box, scale_name, scale_shape
from engine.rollout.sync_check import WeightSyncError
from engine.rollout.sync_plan import SyncPlan, Transfer, box_slices
from engine.rollout.weight_digest import box_digest
from engine.rollout.weight_transport import WeightTransferGroup, _describe_peer, _wait, piece_source, receive_weights

_MAGIC = 0xF8F8
_PIECE_TAG = 1 << 23  # + (bucket parity) << 20 + index: pieces between senders
_WIRE_TAG = (1 << 23) + (1 << 22)  # + (bucket parity) << 20 + 0 / 1: header, bytes to an engine rank
_ACK_TAG = (1 << 23) + (1 << 22) + (1 << 21)


class FP8Wire:
    """The FP8 schedule of a plan: per bucket, the assemblies, the model-dtype transfers, the digest rows."""

    def __init__(self, plan: SyncPlan, bucket_mb: float):
        self.plan = plan
        self.buckets = plan.buckets(bucket_mb)
        self.fp8 = {i for i, t in enumerate(plan.tensors) if is_fp8_weight(t.name, t.shape)}
        self.rows = {name: row for row, (name, *_) in enumerate(fp8_engine_tensors(plan))}
        """Digest row of every tensor an engine rank loads (payload and scales of an FP8 weight: two rows)."""
        assemblies = fp8_assemblies(plan)
        bucket_of = {t: k for k, bucket in enumerate(self.buckets) for t in bucket}
        self.assemblies: list[list[Assembly]] = [[] for _ in self.buckets]
        for assembly in assemblies:
            self.assemblies[bucket_of[assembly.tensor]].append(assembly)
        self.transfers: list[list[Transfer]] = [[] for _ in self.buckets]
        for transfer in plan.transfers():
            if transfer.tensor not in self.fp8:
                self.transfers[bucket_of[transfer.tensor]].append(transfer)

    def message(self, k: int, sender: int, engine_rank: int) -> tuple[list[Transfer], list[Assembly], int]:
        """What `sender` sends `engine_rank` in bucket k: its model-dtype transfers, its assemblies, the bytes."""
        transfers = [t for t in self.transfers[k] if t.sender == sender and t.engine_rank == engine_rank]
        assemblies = [a for a in self.assemblies[k] if a.assembler == sender and a.engine_rank == engine_rank]
        size = sum(t.numel for t in transfers) * self.plan.torch_dtype.itemsize
        for a in assemblies:
            rows, cols = (stop - start for start, stop in a.box)
            size += rows * cols + 4 * -(-rows // 128) * -(-cols // 128)
        return transfers, assemblies, size


def receiver(spec: dict, quantization: str | None):
    """The receiving generator a server's worker runs for a plan spec (`SyncPlan.spec()` with the trainer's `fp8`):
    `receive_fp8_weights` or weight_transport.py's `receive_weights`. RuntimeError naming the setting when the
    server's engine (vLLM's `quantization`) serves the other kind."""
    fp8, serves = bool(spec.get("fp8")), quantization == "fp8"
    if fp8 != serves:
        raise RuntimeError(f"the trainer syncs {'FP8' if fp8 else 'the model dtype'} but this server serves "
                           f"{'FP8' if serves else 'the model dtype'}: start both with the same rollout.vllm_weight_dtype")
    return receive_fp8_weights if fp8 else receive_weights


def _header(k: int, size: int, sender: int, engine_rank: int, device=None) -> torch.Tensor:
    return torch.tensor([_MAGIC, k, size, sender, engine_rank], dtype=torch.int64, device=device)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@torch.no_grad()
def send_fp8_weights(params: dict, me: int, group: WeightTransferGroup, plan: SyncPlan,
                     bucket_mb: float) -> tuple[dict[str, float], torch.Tensor]:
    """Send sender `me`'s share of the policy in FP8 (call on every sender; `params`: weight_transport.py
    `local_params` of its chunks).

    Returns:
        (stats, digests): {"weight_sync/seconds", "weight_sync/gib", "weight_sync/buckets"}, and int64
        (len(fp8_engine_tensors(plan)), plan.engine_tp): this sender's share of every engine rank's digests.
    Raises:
        WeightSyncError naming the bucket and the peer when a transfer fails, times out or is not acknowledged;
        ValueError naming the tensor when the pieces do not fill an engine rank's box.
    """
    start, wire = time.perf_counter(), FP8Wire(plan, bucket_mb)
    digests = torch.zeros(len(wire.rows), plan.engine_tp, dtype=torch.int64)
    num_bytes = 0
    for k in range(len(wire.buckets)):
        parity = (k % 2) << 20
        sources, works, parts = {}, [], {}
        for n, assembly in enumerate(wire.assemblies[k]):  # 1. pieces to the assemblers
            for j, t in enumerate(assembly.transfers):
                if t.sender == me and assembly.assembler == me:
                    parts[(n, j)] = piece_source(params, t.piece)[box_slices(t.local_box)].to(plan.torch_dtype)
                elif t.sender == me:
                    piece = piece_source(params, t.piece)[box_slices(t.local_box)].to(plan.torch_dtype).contiguous()
                    sources[(n, j)] = piece
                    works.append((group.send(piece, assembly.assembler, _PIECE_TAG + parity + len(works)),
                                  assembly.assembler, k))
        for n, assembly in enumerate(wire.assemblies[k]):
            if assembly.assembler != me:
                continue
            for j, t in enumerate(assembly.transfers):
                if t.sender != me:
                    shape = tuple(b - a for a, b in t.hf_box)
                    parts[(n, j)] = torch.empty(shape, dtype=plan.torch_dtype, device=group.device)
                    tag = _PIECE_TAG + parity + _piece_index(wire, k, n, j, t.sender)
                    works.append((group.recv(parts[(n, j)], t.sender, tag), t.sender, k))
        _wait(works, plan, group, "passing FP8 pieces between senders")
        works = []
        for engine_rank in range(plan.engine_tp):  # 2. one byte message per engine rank
            transfers, assemblies, size = wire.message(k, me, engine_rank)
            if not size:
                continue
            chunks = []
            for t in transfers:
                sent = piece_source(params, t.piece)[box_slices(t.local_box)].to(plan.torch_dtype)
                chunks.append(_bytes(sent))
                box = plan.tensors[t.tensor].engine_boxes[engine_rank]
                offset = tuple(a - e for (a, _), (e, _) in zip(t.hf_box, box))
                digests[wire.rows[plan.tensors[t.tensor].name], engine_rank] += int(box_digest(
                    sent, offset, tuple(b - a for a, b in box)))
            for assembly in assemblies:
                n = wire.assemblies[k].index(assembly)
                sent = quantize_assembled(plan, assembly, [parts[(n, j)] for j in range(len(assembly.transfers))])
                chunks += [_bytes(tensor) for _, tensor in sent]
                for name, digest in assembled_digests(sent).items():
                    digests[wire.rows[name], engine_rank] += digest
            flat = torch.cat(chunks).to(group.device)
            peer = plan.engine_group_rank(engine_rank)
            works += [(group.send(_header(k, size, me, engine_rank, group.device), peer, _WIRE_TAG + parity), peer, k),
                      (group.send(flat, peer, _WIRE_TAG + parity + 1), peer, k)]
            num_bytes += size
        _wait(works, plan, group, "sending FP8")
    acks = [(torch.zeros(5, dtype=torch.int64, device=group.device), plan.engine_group_rank(e))
            for e in range(plan.engine_tp)]
    _wait([(group.recv(ack, peer, _ACK_TAG), peer, len(wire.buckets)) for ack, peer in acks], plan, group,
          "the acknowledgement")
    for ack, peer in acks:
        if int(ack[0]) != _MAGIC or int(ack[1]) != len(wire.buckets):
            raise WeightSyncError(f"FP8 weight transfer: {_describe_peer(plan, peer)} acknowledged {ack.tolist()}, "
                                  f"expected {len(wire.buckets)} buckets: the two sides use different plans")
    return ({"weight_sync/seconds": time.perf_counter() - start, "weight_sync/gib": num_bytes / 2**30,
             "weight_sync/buckets": len(wire.buckets)}, digests)


def _piece_index(wire: FP8Wire, k: int, n: int, j: int, sender: int) -> int:
    """The index of piece (assembly n, transfer j) among the pieces `sender` sends in bucket k (its tag offset)."""
    index = 0
    for m, assembly in enumerate(wire.assemblies[k]):
        for i, t in enumerate(assembly.transfers):
            if (m, i) == (n, j):
                return index
            if t.sender == sender and assembly.assembler != sender:
                index += 1
    raise AssertionError("piece not in the bucket")


def receive_fp8_weights(group: WeightTransferGroup, plan: SyncPlan, bucket_mb: float,
                        engine_rank: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receive the senders' FP8 messages on one engine worker, bucket by bucket (a generator; iterate it to the end).

    Yields, per bucket, (HF name, full-shape tensor with this rank's box filled) for every tensor the rank loads:
    an FP8 weight as its payload (float8_e4m3fn) then its scales (`<name>_scale_inv`, float32 over the block grid),
    the rest in the plan's dtype. The rest of each tensor is uninitialised (vLLM's loaders narrow to the box).

    Raises:
        WeightSyncError naming the bucket and the peer on a header mismatch, a dead peer or a timeout.
    """
    wire = FP8Wire(plan, bucket_mb)
    me = plan.engine_group_rank(engine_rank)
    dtype = plan.torch_dtype
    for k, bucket in enumerate(wire.buckets):
        parity = (k % 2) << 20
        out: dict[str, torch.Tensor] = {}
        for i in bucket:
            tensor = plan.tensors[i]
            if i in wire.fp8:
                out[tensor.name] = torch.empty(tensor.shape, dtype=FP8_DTYPE, device=group.device)
                out[scale_name(tensor.name)] = torch.empty(scale_shape(tensor.shape), dtype=torch.float32,
                                                           device=group.device)
            else:
                out[tensor.name] = torch.empty(tensor.shape, dtype=dtype, device=group.device)
        for sender in range(plan.trainer.num_senders):
            transfers, assemblies, size = wire.message(k, sender, engine_rank)
            if not size:
                continue
            header = torch.zeros(5, dtype=torch.int64, device=group.device)
            flat = torch.empty(size, dtype=torch.uint8, device=group.device)
            _wait([(group.recv(header, sender, _WIRE_TAG + parity), sender, k),
                   (group.recv(flat, sender, _WIRE_TAG + parity + 1), sender, k)], plan, group, "receiving FP8")
            if not torch.equal(header, _header(k, size, sender, engine_rank, group.device)):
                raise WeightSyncError(f"FP8 weight transfer: bucket {k} from {_describe_peer(plan, sender)} has header "
                                      f"{header.tolist()}, expected {_header(k, size, sender, engine_rank).tolist()} "
                                      "(magic, bucket, bytes, sender, engine rank): the sides disagree on the plan")
            offset = 0
            for t in transfers:
                nbytes = t.numel * dtype.itemsize
                part = flat[offset : offset + nbytes].view(dtype).view(tuple(b - a for a, b in t.hf_box))
                out[plan.tensors[t.tensor].name][box_slices(t.hf_box)] = part
                offset += nbytes
            for assembly in assemblies:
                name = plan.tensors[assembly.tensor].name
                for target, box, itemsize, kind in ((name, assembly.box, 1, FP8_DTYPE),
                                                    (scale_name(name), scale_box(assembly.box), 4, torch.float32)):
                    shape = tuple(b - a for a, b in box)
                    nbytes = shape[0] * shape[1] * itemsize
                    out[target][box_slices(box)] = flat[offset : offset + nbytes].view(kind).view(shape)
                    offset += nbytes
        yield list(out.items())
    acks = [(group.send(_header(len(wire.buckets), 0, me, engine_rank, group.device), s, _ACK_TAG), s, len(wire.buckets))
            for s in range(plan.trainer.num_senders)]
    _wait(acks, plan, group, "acknowledging")
