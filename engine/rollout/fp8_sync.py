"""FP8 rollout (`rollout.vllm_weight_dtype: fp8`): the policy served in vLLM's block-wise FP8, quantized by the
trainer at every sync, payload and scales verified by digests.

vLLM's `Fp8LinearMethod` with `weight_block_size: [128, 128]` (vllm/model_executor/layers/quantization/fp8.py)
holds, per linear layer and engine TP rank, `weight` (float8_e4m3fn, the rank's [rows, cols] shard) and
`weight_scale_inv` (float32, one per 128 x 128 block of that shard: ceil(rows / 128) x ceil(cols / 128)); a merged
layer (QKVParallelLinear, MergedColumnParallelLinear) holds its parts' rows one after the other and their scale rows
likewise. Its loaders narrow a checkpoint's scales by blocks as they narrow the weight by rows / columns, and
`validate_fp8_block_shape` refuses a layout whose rank boundaries cut a block. So, where vLLM accepts the layout,
each engine rank's blocks are whole blocks of the full tensor, and quantizing the full HF tensor (the colocated sync
gathers full tensors) gives every rank exactly the payload and scales that quantizing its own shard would
(`quantize_shard`; the test checks it for every rank and tensor).

Owns: which HF tensors are FP8 (`is_fp8_weight`: decoder-layer linear weights; embeddings, LM head, norms, routers
and biases stay in the policy dtype, as vLLM's FP8 models keep them), their scale names and boxes (`scale_name`,
`scale_box`), the quantization of a sync bucket (`quantize_bucket`), what each engine rank loads (`fp8_engine_tensors`),
the layouts refused (`fp8_layout_problems`), the engine-side split of a merged parameter into per-tensor views for
the digests (`held_parts`), the machine check (`fp8_machine_problems`, vLLM's own CPU capability tests) and vLLM's
keywords (`fp8_engine_kwargs`).

Must not: import vLLM (the worker side passes its modules' sizes in), move tensors between processes.

Test: tests/unit/test_fp8_sync.py (the quantizer per shard against engine/models/quantized.py, every tensor of a
tiny dense and a tiny MoE plan at engine TP 1/2, digests against a receiver holding what vLLM's FP8 layers hold, the
refusal on this CPU, the engine's starting checkpoint).
"""

from __future__ import annotations

import torch

from engine.models.quantized import FP8_DTYPE, block_span, quantize_fp8
from engine.rollout.sync_plan import Box, SyncPlan, box_slices
from engine.rollout.weight_digest import box_digest

FP8_BLOCK = (128, 128)
"""vLLM's and DeepSeek's block: one float32 scale per 128 x 128 weights."""

FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
               "kv_a_proj_with_mqa", "kv_b_proj", "w1", "w2", "w3")
"""The HF module names of the linear layers vLLM's FP8 models quantize (attention, MLP, MoE experts, shared experts,
MLA's projections; Mixtral's expert w1 / w2 / w3)."""

MERGED_LAST = {"q_proj": "v_proj", "k_proj": "v_proj", "v_proj": "v_proj", "gate_proj": "up_proj", "up_proj": "up_proj"}
"""Parts of vLLM's merged layers (qkv_proj, gate_up_proj) and the last part of each: every part but the last must
fill whole blocks even at engine TP 1 (`validate_fp8_block_shape`)."""


def is_fp8_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether vLLM's FP8 model holds this HF tensor in FP8 (a decoder layer's 2-D linear weight)."""
    parts = name.split(".")
    return len(shape) == 2 and parts[-1] == "weight" and ".layers." in name and parts[-2] in FP8_LINEARS


def scale_name(name: str) -> str:
    """`...q_proj.weight` -> `...q_proj.weight_scale_inv` (the checkpoints' and vLLM's name)."""
    return name + "_scale_inv"


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The block grid of a [rows, cols] weight."""
    return -(-shape[0] // FP8_BLOCK[0]), -(-shape[1] // FP8_BLOCK[1])


def scale_box(box: Box) -> Box:
    """The scale blocks of a box of a weight (the box must cut no block: `fp8_layout_problems`)."""
    spans = (block_span(*box[0], FP8_BLOCK[0]), block_span(*box[1], FP8_BLOCK[1]))
    return tuple((s.start, s.stop) for s in spans)


def quantize_shard(weight: torch.Tensor, box: Box) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine rank's shard of a full weight quantized on its own (what that rank's FP8 layer holds)."""
    return quantize_fp8(weight[box_slices(box)], FP8_BLOCK)


def quantize_bucket(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A sync bucket of full HF tensors as vLLM's FP8 model loads it: each FP8 weight as its float8_e4m3fn payload
    and its float32 `weight_scale_inv` (per 128 x 128 block, engine/models/quantized.py `quantize_fp8`); the rest
    unchanged."""
    out = []
    for name, tensor in bucket:
        if is_fp8_weight(name, tuple(tensor.shape)):
            payload, scales = quantize_fp8(tensor, FP8_BLOCK)
            out += [(name, payload), (scale_name(name), scales)]
        else:
            out.append((name, tensor))
    return out


def expected_digests(bucket: list[tuple[str, torch.Tensor]], boxes: dict[str, tuple[Box, ...]], shapes: dict,
                     engine_rank: int) -> dict[str, torch.Tensor]:
    """The digests of what engine rank `engine_rank` holds of a quantized bucket (`quantize_bucket`'s output):
    payload boxes as planned, scale boxes as the blocks of the payload's box."""
    out = {}
    for name, tensor in bucket:
        if name in boxes:
            out[name] = box_digest(tensor.view(shapes[name])[box_slices(boxes[name][engine_rank])])
        elif name.endswith("_scale_inv") and name[: -len("_scale_inv")] in boxes:
            box = boxes[name[: -len("_scale_inv")]][engine_rank]
            out[name] = box_digest(tensor[box_slices(scale_box(box))])
    return out


def _cut(start: int, stop: int, size: int, whole_last: bool) -> bool:
    """Whether [start, stop) of a dimension of `size` cuts a block (a stop at the end is whole unless the part is
    followed by another in a merged layer: `whole_last` False)."""
    block = FP8_BLOCK[0]
    return start % block != 0 or (stop % block != 0 and (stop != size or not whole_last))


def fp8_layout_problems(plan: SyncPlan) -> list[str]:
    """The FP8 weights of a plan whose engine boxes cut a 128 x 128 block (vLLM's `validate_fp8_block_shape` refuses
    them at start-up), and the families whose FP8 layers this module does not know; [] when none."""
    dims = plan.dims
    if dims.layer_kinds or any("#" in t.name or t.hf_shape for t in plan.tensors):
        return ["rollout.vllm_weight_dtype=fp8: Nemotron-H's Mamba-2 layers and GPT-OSS's stacked (MXFP4) experts "
                "have no block-FP8 layers in vLLM here; serve them in the model's dtype"]
    problems = []
    for tensor in plan.tensors:
        if not is_fp8_weight(tensor.name, tensor.shape):
            continue
        module = tensor.name.split(".")[-2]
        whole_last = MERGED_LAST.get(module, module) == module
        for rank, box in enumerate(tensor.engine_boxes):
            (r0, r1), (c0, c1) = box
            if _cut(r0, r1, tensor.shape[0], whole_last) or _cut(c0, c1, tensor.shape[1], True):
                problems.append(f"{tensor.name} {tensor.shape}: engine rank {rank} holds rows [{r0}, {r1}) and "
                                f"columns [{c0}, {c1}), which cut its 128 x 128 FP8 blocks")
                break
    if problems:
        more = f" and {len(problems) - 4} more" if len(problems) > 4 else ""
        return [f"rollout.vllm_weight_dtype=fp8 at rollout.vllm_tensor_parallel_size={plan.engine_tp}: "
                + "; ".join(problems[:4]) + more + " (lower the engine TP or serve in the model's dtype)"]
    return []


def fp8_engine_tensors(plan: SyncPlan) -> list[tuple[str, tuple[int, ...], torch.dtype, tuple[Box, ...]]]:
    """Every tensor the engine ranks load under FP8, in load order: (name, shape, dtype, box per engine rank); an
    FP8 weight as its payload (float8_e4m3fn) then its scales (float32, the blocks of each rank's box)."""
    out = []
    policy = getattr(torch, plan.dtype)
    for tensor in plan.tensors:
        if is_fp8_weight(tensor.name, tensor.shape):
            out.append((tensor.name, tensor.shape, FP8_DTYPE, tensor.engine_boxes))
            out.append((scale_name(tensor.name), scale_shape(tensor.shape), torch.float32,
                        tuple(scale_box(box) for box in tensor.engine_boxes)))
        else:
            out.append((tensor.name, tensor.shape, policy, tensor.engine_boxes))
    return out


def held_parts(names: list[str], rows: list[int], param: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A merged FP8 layer's parameter as the views of its parts (HF weight names `names`, each `rows` rows on this
    rank): `weight` split by rows, `weight_scale_inv` by each part's block rows (ceil(rows / 128))."""
    if param == "weight_scale_inv":
        return [(scale_name(n), v) for n, v in zip(names, tensor.split([-(-r // FP8_BLOCK[0]) for r in rows]))]
    return list(zip(names, tensor.split(rows)))


def fp8_machine_problems(weight_dtype: str, kv_cache_dtype: str, on_gpu: bool) -> list[str]:
    """What this machine's vLLM cannot run, by setting and cause, with vLLM's own CPU capability tests
    (vllm/model_executor/kernels/linear/scaled_mm/cpu.py: block-FP8 GEMM needs AMX; vllm/v1/attention/backends/
    cpu_attn.py: an FP8 KV cache needs AVX-512 or AMX); [] on a GPU (vLLM's own checks apply there)."""
    if on_gpu:
        return []
    amx, avx512 = torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_supported()
    problems = []
    if weight_dtype == "fp8" and not amx:
        problems.append("rollout.vllm_weight_dtype=fp8: vLLM's CPU block-FP8 linear kernel "
                        "(CPUFp8W8A8BlockScaledMMKernel) requires AMX tiles (Sapphire Rapids or newer) and this CPU "
                        "has none; use rollout.vllm_weight_dtype=model here")
    if kv_cache_dtype == "fp8" and not (amx or avx512):
        problems.append("rollout.vllm_kv_cache_dtype=fp8: vLLM's FP8 KV cache on CPU requires x86 with AVX-512 or "
                        "AMX and this CPU has neither; use rollout.vllm_kv_cache_dtype=auto here")
    return problems


def fp8_engine_kwargs(weight_dtype: str, kv_cache_dtype: str) -> dict:
    """vLLM keywords of the two settings: `quantization="fp8"` (the engine then starts from the block-FP8 copy of
    the checkpoint, engine/rollout/fp8_checkpoint.py, whose config carries the 128 x 128 `weight_block_size`) and
    `kv_cache_dtype`."""
    out = {"quantization": "fp8"} if weight_dtype == "fp8" else {}
    return out | ({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != "auto" else {})
