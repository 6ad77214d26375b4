"""Runs a weight-sync plan (engine/rollout/sync_plan.py) by hand, for the brute-force plan tests
(tests/unit/test_sync_plan.py, tests/unit/test_qwen3_conversion.py): no processes, no model.
Must not: know what a vLLM loader reads (each test emulates its loaders)."""

from __future__ import annotations

import torch


def apply_plan(plan, shards: dict, etp_rank: int) -> dict[str, torch.Tensor]:
    """Execute the plan's transfers into one engine rank's NaN-filled HF tensors.

    shards: (pp_rank, tp_rank, vp_chunk, megatron name) -> the trainer's local tensor. Fails if a sender is not the
    rank that holds the piece or a box leaves the shard.
    """
    out = {t.name: torch.full(t.shape, float("nan")) for t in plan.tensors}
    for tr in plan.transfers():
        if tr.engine_rank != etp_rank:
            continue
        piece = tr.piece
        assert plan.trainer.sender_rank(*piece.sender) == tr.sender
        shard = shards[(piece.pp_rank, piece.tp_rank, piece.vp_chunk, piece.megatron)]
        local = shard[tuple(slice(a, b) for a, b in tr.local_box)]  # fails if the box leaves the shard
        assert tuple(local.shape) == tuple(b - a for a, b in tr.hf_box), "the local box is clipped by the shard"
        out[plan.tensors[tr.tensor].name][tuple(slice(a, b) for a, b in tr.hf_box)] = local
    return out
