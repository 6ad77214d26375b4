"""Stacked expert tensors: a checkpoint layout where every routed expert of a layer is one slice of one HF tensor
(GPT-OSS's `mlp.experts.gate_up_proj` (E, H, 2I), gate and up interleaved), converted to and from Megatron's
per-expert tensors.

Owns the three conversions of the `stacked_*` layout kinds (engine/models/tensor_map.py `STACKED_KINDS`; one
expert's piece is named with `EXPERT_PIECE`): `read_stacked_expert` (one TP shard of one expert), `stacked_expert_to_hf`
(one expert's piece of the HF tensor), `stack_expert_pieces` (the pieces back into the HF tensors).

Must not: import Megatron or vLLM, touch process groups or files.

Test: tests/unit/test_gpt_oss.py (conversions round trip), tests/distributed/test_family_layouts.py (export
byte-exact).
"""

from __future__ import annotations

import torch

from engine.models.tensor_map import EXPERT_PIECE


def _split(tensor: torch.Tensor, dim: int, tp_rank: int, tp_size: int, name: str) -> torch.Tensor:
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"{name}: dimension {dim} of size {tensor.shape[dim]} does not split into tp_size={tp_size}")
    return tensor.chunk(tp_size, dim=dim)[tp_rank]


def read_stacked_expert(kind: str, name: str, hf_slice: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of one expert's Megatron tensor from its slice `hf_slice` = HF tensor [e] of a stacked
    expert tensor (`STACKED_KINDS`)."""
    if kind == "stacked_gate_up":  # (H, 2I) weight or (2I,) bias; gate / up interleaved on the last dim
        gate, up = hf_slice[..., 0::2], hf_slice[..., 1::2]
        if gate.dim() == 2:
            gate, up = gate.t(), up.t()  # (I, H)
        return torch.cat([_split(gate, 0, tp_rank, tp_size, name), _split(up, 0, tp_rank, tp_size, name)]).contiguous()
    if kind == "stacked_row":  # (I, H) -> (H, I / tp)
        return _split(hf_slice.t(), 1, tp_rank, tp_size, name).contiguous()
    return hf_slice.clone()  # stacked_replicated: (H,)


def stacked_expert_to_hf(kind: str, name: str, expert: int, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of `read_stacked_expert` at TP1: {`name` + EXPERT_PIECE + e: HF tensor [e]}."""
    if kind == "stacked_gate_up":
        gate, up = full.chunk(2, dim=0)  # (I, H) or (I,)
        if full.dim() == 2:
            gate, up = gate.t(), up.t()  # (H, I)
        piece = torch.stack([gate, up], dim=-1).flatten(-2)  # (..., 2I): gate, up, gate, up, ...
    elif kind == "stacked_row":
        piece = full.t()  # (I, H)
    else:
        piece = full
    return {f"{name}{EXPERT_PIECE}{expert}": piece.contiguous().clone()}


def stack_expert_pieces(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every group of expert pieces (`name#expert=e`) stacked into the HF tensor `name` (E, ...)."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for key, tensor in tensors.items():
        if EXPERT_PIECE in key:
            name, expert = key.split(EXPERT_PIECE)
            pieces.setdefault(name, {})[int(expert)] = tensor
        else:
            out[key] = tensor
    for name, by_expert in pieces.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"{name}: expert pieces {sorted(by_expert)} are not 0..E-1")
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out
