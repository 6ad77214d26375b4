"""Server-mode FP8 (`rollout.vllm_weight_dtype: fp8` with `rollout.vllm_mode: server`), the trainer's side: each
engine rank's shard of an FP8 weight assembled whole from the trainer's pieces, quantized once, by one sender.

A server-mode sender holds pieces of a tensor (its Megatron TP shard: QKV by query groups, gate / up by rows, an
expert by expert-TP rank), not whole 128 x 128 blocks, so no sender can quantize its pieces on its own. Where vLLM
accepts the layout (engine/rollout/fp8_sync.py `fp8_layout_problems`: no engine rank's box cuts a block) each engine
rank's box is whole blocks, so its payload and scales are those of the box quantized on its own (`quantize_shard`).
Per (FP8 weight, engine rank), the plan's transfers into that box (engine/rollout/sync_plan.py) are an `Assembly`:
one sender, the one holding most of the box (`assembler`), receives the others' pieces (`incoming`), fills the box
(`assemble_box`: every element exactly once, else the tensor is named) and quantizes it in the wire dtype
(`quantize_assembled`); what it sends the engine rank is the float8_e4m3fn payload and the float32 scales, and the
digests it contributes (`assembled_digests`) cover both, as the colocated sync's do. The other tensors travel as the
model's dtype, unchanged.

Must not: import vLLM, open process groups or move tensors between processes (engine/rollout/weight_transport.py
executes plans).

Test: tests/unit/test_fp8_server_sync.py (tiny dense Qwen2 and tiny Qwen3-MoE at trainer TP 1 / 2 and engine
TP 1 / 2, Megatron shards from hf_convert's own reader: for every tensor each engine rank loads, the sent payload and
scales equal the reference quantizer's of the rank's box, the other tensors the model's; the digests equal the
colocated sync's; a missing piece and a layout that cuts a block refused by name).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from engine.models.quantized import quantize_fp8
from engine.rollout.fp8_sync import FP8_BLOCK, fp8_layout_problems, is_fp8_weight, scale_name
from engine.rollout.sync_plan import Box, SyncPlan, Transfer
from engine.rollout.weight_digest import box_digest


@dataclass(frozen=True)
class Assembly:
    """One engine rank's box of one FP8 weight, and the plan's transfers that fill it."""

    tensor: int
    """Index into `SyncPlan.tensors`."""
    engine_rank: int
    box: Box
    """The engine rank's box of the weight (whole 128 x 128 blocks)."""
    transfers: tuple[Transfer, ...]
    assembler: int
    """The sender (group rank) that assembles, quantizes and sends the box: the one that holds most of it (the
    lowest group rank on a tie)."""

    @property
    def incoming(self) -> tuple[Transfer, ...]:
        """The transfers other senders hand the assembler (trainer to trainer) before it can quantize."""
        return tuple(t for t in self.transfers if t.sender != self.assembler)


def fp8_assemblies(plan: SyncPlan) -> list[Assembly]:
    """Every (FP8 weight, engine rank) of the plan as an `Assembly`, in the plan's tensor order.

    Raises:
        ValueError naming the tensors whose engine boxes cut a 128 x 128 block (`fp8_layout_problems`: vLLM's FP8
        layers refuse those layouts at start-up).
    """
    problems = fp8_layout_problems(plan)
    if problems:
        raise ValueError("; ".join(problems))
    per_box: dict[tuple[int, int], list[Transfer]] = {}
    for transfer in plan.transfers():
        tensor = plan.tensors[transfer.tensor]
        if is_fp8_weight(tensor.name, tensor.shape):
            per_box.setdefault((transfer.tensor, transfer.engine_rank), []).append(transfer)
    out = []
    for (index, rank), transfers in per_box.items():
        held = Counter()
        for transfer in transfers:
            held[transfer.sender] += transfer.numel
        assembler = min(held, key=lambda sender: (-held[sender], sender))
        out.append(Assembly(index, rank, plan.tensors[index].engine_boxes[rank], tuple(transfers), assembler))
    return out


def assemble_box(plan: SyncPlan, assembly: Assembly, parts: list[torch.Tensor]) -> torch.Tensor:
    """The engine rank's box of the weight, in the wire dtype, from each transfer's box of its sender's shard
    (`parts`, in `assembly.transfers` order).

    Raises:
        ValueError naming the tensor and the engine rank when the parts leave elements of the box unfilled or fill
        one twice, or a part's shape is not its transfer's.
    """
    name = plan.tensors[assembly.tensor].name
    shape = tuple(stop - start for start, stop in assembly.box)
    out = torch.empty(shape, dtype=plan.torch_dtype, device=parts[0].device if parts else None)
    filled = torch.zeros(shape, dtype=torch.int32)
    for transfer, part in zip(assembly.transfers, parts, strict=True):
        local = tuple(slice(a - e, b - e) for (a, b), (e, _) in zip(transfer.hf_box, assembly.box))
        if tuple(part.shape) != tuple(b - a for a, b in transfer.hf_box):
            raise ValueError(f"FP8 assembly of {name} for engine rank {assembly.engine_rank}: the part from sender "
                             f"{transfer.sender} has shape {tuple(part.shape)}, its box {transfer.hf_box}")
        out[local] = part
        filled[local] += 1
    if not bool((filled == 1).all()):
        missing, twice = int((filled == 0).sum()), int((filled > 1).sum())
        raise ValueError(f"FP8 assembly of {name} for engine rank {assembly.engine_rank}, box {assembly.box}: "
                         f"{missing} elements unfilled and {twice} filled more than once by the trainer's pieces; "
                         "no whole 128 x 128 blocks to quantize")
    return out


def quantize_assembled(plan: SyncPlan, assembly: Assembly, parts: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """What the assembler sends the engine rank for this weight: [(name, float8_e4m3fn payload of the rank's box),
    (name + `_scale_inv`, float32 scales of its blocks)] (engine/models/quantized.py `quantize_fp8`)."""
    name = plan.tensors[assembly.tensor].name
    payload, scales = quantize_fp8(assemble_box(plan, assembly, parts), FP8_BLOCK)
    return [(name, payload), (scale_name(name), scales)]


def assembled_digests(sent: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """The assembler's digests of what it sent (`quantize_assembled`): the payload's and the scales' of the engine
    rank's box, each whole (engine/rollout/weight_digest.py `box_digest`)."""
    return {name: int(box_digest(tensor)) for name, tensor in sent}

