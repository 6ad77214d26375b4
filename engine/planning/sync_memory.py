"""The weight sync's buffers in the memory plan: the config's weight-sync plan (engine/rollout/sync_plan.py, built
from the planner's model shape) and the buffers the transport allocates for it (engine/rollout/sync_buffers.py, the
function the transport sizes its slots with): a term on the training GPU (server mode: each sender's 2 send slots;
colocated: the largest bucket of full HF tensors the sync gathers) and, in server mode, a budget of its own for the
inference GPU's memory OUTSIDE vLLM's share, where every engine rank's 2 receive slots live (vLLM sizes its KV
cache to fill `rollout.vllm_gpu_memory_utilization` x GPU memory; the receive buffers are allocated after that).

Must not: import torch or vLLM (the sync plan and its buffers are arithmetic; tests/unit/test_planner_imports.py), import
the engine's rollout modules at import time (`grpo-engine plan` imports the planner; the sync plan is built only when
a plan is sized: Qwen3-235B's 36,945-tensor plan and its buffers take 0.6-1 s, cached per layout), or size anything
the transport does not allocate.

Test: tests/unit/test_sync_buffers.py (the GPT-OSS-120B header's 13.47 GiB, a config whose share leaves too little
room refused), tests/unit/test_planner.py (the shipped configs fit, their headers quote the totals).
"""

from __future__ import annotations

import functools

from engine.config import EngineConfig
from engine.planning.memory import GIB, Budget, Term, format_count, format_gib
from engine.planning.shapes import ClusterShape, ModelDims, PlanError, megatron_padded_vocab

TRANSFER_GROUP_ALLOWANCE_GIB = 1.0
"""Memory outside vLLM's share that the receive buffers cannot use: the weight-transfer group's NCCL communicator
and the allocator's rounding and fragmentation around two multi-GiB slots (an assumption, not measured; vLLM's own
CUDA context is inside its share, counted by its profiler)."""


@functools.lru_cache(maxsize=8)
def _buffers(converter_dims, layout, engine_tp: int, ffn: int, dtype: str, bucket_mb: float):
    from engine.rollout.sync_buffers import sync_buffers
    from engine.rollout.sync_plan import build_sync_plan

    try:
        plan = build_sync_plan(converter_dims, layout, engine_tp, ffn_hidden_size=ffn, dtype=dtype)
    except ValueError as error:
        raise PlanError(str(error)) from error
    return sync_buffers(plan, bucket_mb), len(plan.tensors)


def plan_sync_buffers(cfg: EngineConfig, dims: ModelDims):
    """(SyncBuffers, number of HF tensors) of the config's weight sync (DeepSeek-V3: MLA's tensors too). Server mode: the trainer's layout into vLLM's TP;
    colocated: the colocated plan (trainer TP 1: full tensors). Gemma's four norms per layer are not in the planner's
    shape (2 x hidden elements per layer, whole: a few KiB)."""
    from engine.policy.hf_map import ModelDims as ConverterDims
    from engine.rollout.sync_plan import TrainerLayout

    par, server = cfg.parallel, cfg.rollout.vllm_mode == "server"
    converter = ConverterDims(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_heads=dims.num_heads,
        num_groups=dims.num_kv_heads, head_dim=dims.d, vocab_size=dims.vocab_size,
        padded_vocab=megatron_padded_vocab(dims.vocab_size, cfg.model.make_vocab_size_divisible_by, par.tp_size),
        tie_word_embeddings=dims.tie_word_embeddings, qkv_bias=dims.qkv_bias, qk_norm=dims.qk_norm,
        num_experts=dims.num_experts, moe_ffn_hidden_size=dims.moe_intermediate_size, moe_map=dims.moe_map,
        dense_layers=dims.dense_layers, shared_expert_ffn=dims.shared_expert_size,
        **(dict(q_lora_rank=dims.q_lora_rank, kv_lora_rank=dims.kv_lora_rank, qk_nope_head_dim=dims.d,
                qk_rope_head_dim=dims.qk_rope_head_dim, v_head_dim=dims.v_head_dim) if dims.is_mla else {}))
    layout = (TrainerLayout(par.tp_size, par.pp_size, par.virtual_pipeline_size, par.ep_size, par.expert_tp_size)
              if server else TrainerLayout(1))
    return _buffers(converter, layout, cfg.rollout.vllm_tensor_parallel_size, dims.intermediate_size,
                    cfg.model.dtype, float(cfg.rollout.weight_sync_bucket_mb))


def training_sync_terms(cfg: EngineConfig, dims: ModelDims, stage: int) -> list[Term]:
    """The weight sync's memory on a training GPU of pipeline stage `stage`: server mode, the largest send slot of the
    stage's senders (the first max(tp, expert_tp x ep) ranks of the stage) x 2; colocated, the largest bucket's full
    HF tensors (x 2 with PP > 1: the flat copy broadcast to the other stages)."""
    found = plan_sync_buffers(cfg, dims)
    if found is None:
        return []
    buffers, _ = found
    mb, b = cfg.rollout.weight_sync_bucket_mb, buffers.itemsize
    if cfg.rollout.vllm_mode == "server":
        per_stage = len(buffers.send_numel) // cfg.parallel.pp_size
        senders = range(stage * per_stage, (stage + 1) * per_stage)
        numel = max(buffers.send_numel[s] for s in senders)
        text = (f"2 slots x {format_count(numel)} elements (the largest of {buffers.num_buckets} buckets of >= {mb} "
                f"MiB one sender packs for every engine rank) x {b} B")
        return [Term("weight-sync send", text, buffers.send_bytes(senders))]
    copies = 2 if cfg.parallel.pp_size > 1 else 1
    text = (f"{copies} x {format_count(buffers.bucket_numel)} elements (the largest of {buffers.num_buckets} buckets "
            f"of >= {mb} MiB of full HF tensors{', + its flat copy (PP)' if copies > 1 else ''}) x {b} B")
    return [Term("weight-sync bucket", text, copies * buffers.bucket_numel * b)]


def receive_budget(cfg: EngineConfig, dims: ModelDims, shape: ClusterShape) -> Budget | None:
    """Server mode: an inference GPU's memory outside vLLM's share, (1 - vllm_gpu_memory_utilization) x GPU memory,
    holding every engine rank's 2 receive slots (the largest bucket's payload + its split tensors at full HF shape)
    and `TRANSFER_GROUP_ALLOWANCE_GIB`; None in colocated mode (no transport) or without a sync plan."""
    found = plan_sync_buffers(cfg, dims) if cfg.rollout.vllm_mode == "server" else None
    if found is None:
        return None
    buffers, num_tensors = found
    util, gpu = cfg.rollout.vllm_gpu_memory_utilization, shape.gpu_memory_gib
    vtp = cfg.rollout.vllm_tensor_parallel_size
    numel = max(buffers.receive_numel)
    allowance = TRANSFER_GROUP_ALLOWANCE_GIB * GIB
    outside = (1 - util) * gpu * GIB
    terms = [
        Term("receive slots", f"2 x {format_count(numel)} elements (the largest of {buffers.num_buckets} buckets of >= "
             f"{cfg.rollout.weight_sync_bucket_mb} MiB, {num_tensors} HF tensors: payload + split tensors at full HF "
             f"shape, engine rank {buffers.receive_numel.index(numel)} of {vtp}) x {buffers.itemsize} B",
             buffers.receive_bytes),
        Term("transfer group", "NCCL communicator, allocator slack (TRANSFER_GROUP_ALLOWANCE_GIB, assumed)", allowance),
    ]
    most = (gpu * GIB - buffers.receive_bytes - allowance) / (gpu * GIB)
    hint = (f"lower rollout.vllm_gpu_memory_utilization to at most (GPU - receive slots - allowance) / GPU = "
            f"({gpu:g} - {format_gib(buffers.receive_bytes)} - {TRANSFER_GROUP_ALLOWANCE_GIB:g}) / {gpu:g} = "
            f"{int(most * 100) / 100:.2f} (then check the KV cache above), or lower rollout.weight_sync_bucket_mb "
            "(a slot holds at least one decoder layer, so not below that)")
    return Budget("inference GPU outside vLLM's share (weight-sync receive buffers)", terms, outside,
                  f"(1 - {util}) x {gpu:g} GiB = {format_gib(outside)}", [], hint)
