"""Token-budget micro-batches and packed sequences: no compute spent on padding.

Owns: how one optimizer step's sequences become this rank's Megatron micro-batches when `train.padding_free` or
`train.max_tokens_per_microbatch` is set (`MicrobatchSpec`, `step_microbatches`, `logprob_microbatches`), the
balanced partition behind it (`partition_balanced`) and the rows of a packed micro-batch (`build_microbatch`).
The row-count split of the padded path (`per_device_train_batch_size` rows, right-padded to the round's longest
sequence) stays in engine/policy/batch.py and is used when both options are off.

The plan of one step and why the loss is unchanged: `step_microbatches`; RoPE and the fused softmax in the `mask`
layout: `block_causal_mask`; the `varlen` layout's sequences in place of the mask: engine/policy/varlen_attention.py;
the THD layout (Transformer Engine, NOT tested here): `thd_params`.

Must not: talk to process groups, compute losses, or know the config tree beyond the fields `MicrobatchSpec` takes.

Test: tests/unit/test_packing.py (partition, plans, rows, masks, shapes), tests/distributed/test_packing_layouts.py
(packed and token-budget steps, old log-probs included, = the padded step at TP1, TP2, PP2, DP2; bf16).
"""

from __future__ import annotations

import heapq
import math
import warnings
from dataclasses import dataclass, replace
from typing import Literal

import torch

from engine.policy.microbatch import MicroBatch

Layout = Literal["padded", "mask", "varlen", "thd"]


@dataclass(frozen=True)
class MicrobatchSpec:
    """How a step's sequences are cut and laid out (engine/config.py `train` fields, the layout and the attention)."""

    padding_free: bool
    """Pack several sequences per row (TRL's `padding_free`)."""
    max_tokens: int | None
    """Tokens per training micro-batch (packed: real tokens; right-padded rows: rows x longest); None =
    micro_batch_size * the step's longest sequence (what a padded micro-batch holds at most)."""
    max_logprob_tokens: int | None
    """Tokens per forward-only (old / reference) micro-batch, counted as `max_tokens` is; None = 2 * the training
    budget."""
    micro_batch_size: int
    """TRL's per_device_train_batch_size: rows per micro-batch of the padded path, and the default budget's factor."""
    attention: Layout = "mask"
    """Packed attention: `varlen` (every layer's attention takes the sequences: no mask), `mask` (local spec,
    block-diagonal causal mask), `thd` (Transformer Engine) or `padded` (local spec on a GPU, whose fused causal
    softmax ignores masks: token-budget right-padded rows)."""
    fixed_shape: bool = False
    """Every micro-batch of a schedule run has one shape (pipeline parallelism)."""
    multiple: int = 1
    """Row widths are rounded up to a multiple of this."""
    pad_token_id: int = 0

    @property
    def uses_rows(self) -> bool:
        """True for the padded path's fixed row count (engine/policy/batch.py split_microbatches)."""
        return not self.padding_free and self.max_tokens is None

    @property
    def layout(self) -> Layout:
        return self.attention if self.padding_free else "padded"


PACKING_FALLBACK = (
    "train.padding_free=true has no effect here: Megatron's local layer spec on a GPU with apex's fused softmax "
    "ignores the block-diagonal mask packing needs, so micro-batches are right-padded rows (token budgets still "
    "apply). Install Transformer Engine (model.transformer_impl=auto or transformer_engine: THD packing), or set "
    "train.padding_free=false to silence this")
"""The one warning when packing falls back to padded rows (named, not silent: "accepted means applied")."""


def build_microbatch_spec(train_cfg, model_cfg, ps, *, micro_batch_size: int, pad_token_id: int,
                          varlen: bool = False) -> MicrobatchSpec:
    """The spec from the `train` and `model` sections and the layout `ps` (a ParallelState; attention `thd` when
    Transformer Engine's spec is in use). `varlen`: every layer of the built model takes packed sequences instead of
    the mask (engine/policy/sdpa_attention.py serves_varlen): packed rows then carry no W x W mask."""
    pp_size, tp_size, sequence_parallel = ps.pp_size, ps.tp_size, ps.sequence_parallel
    multiple = tp_size if sequence_parallel else 1
    if train_cfg.pad_to_multiple_of:
        multiple = math.lcm(multiple, train_cfg.pad_to_multiple_of)
    if _uses_transformer_engine(model_cfg.transformer_impl):
        attention = "thd"
    elif varlen:  # SDPA's own kernels attend per sequence: Megatron's fused softmax is not in the path
        attention = "varlen"
    else:  # engine/policy/model.py's rule for Megatron's fused softmax (it would ignore the mask): CUDA + apex kernel
        from importlib.util import find_spec

        fused_softmax = torch.cuda.is_available() and find_spec("scaled_masked_softmax_cuda") is not None
        attention = "padded" if fused_softmax else "mask"
        if fused_softmax and train_cfg.padding_free:
            warnings.warn(PACKING_FALLBACK, UserWarning, stacklevel=2)
    return MicrobatchSpec(
        padding_free=train_cfg.padding_free, max_tokens=train_cfg.max_tokens_per_microbatch,
        max_logprob_tokens=train_cfg.max_tokens_per_logprob_microbatch, micro_batch_size=micro_batch_size,
        attention=attention, fixed_shape=pp_size > 1, multiple=multiple, pad_token_id=pad_token_id,
    )


def _uses_transformer_engine(transformer_impl: str) -> bool:
    """engine/policy/model.py `_layer_spec`'s rule: `auto` = Transformer Engine's spec when it imports."""
    if transformer_impl != "auto":
        return transformer_impl == "transformer_engine"
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def partition_balanced(weights: list[int], num_parts: int) -> list[list[int]]:
    """Sorted greedy (LPT): indices into `weights` split into `num_parts` parts of near-equal total weight.

    Longest first, each to the currently lightest part (ties: the lowest part index); deterministic. The largest
    part is at most 4/3 of the optimum (Graham 1969). Each part lists its indices in ascending order; parts may be
    empty when there are fewer items than parts.
    """
    heap = [(0, p) for p in range(num_parts)]  # (total weight, part)
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        total, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (total + weights[i], p))
    return [sorted(part) for part in parts]


def plan_step(lengths: list[int], num_ranks: int, max_tokens: int) -> list[list[list[int]]]:
    """Indices of a step's sequences for every rank and micro-batch: [rank][micro-batch] -> sequence indices.

    Every rank gets the same number of micro-batches; each holds at most `max_tokens` real tokens unless it is a
    single longer sequence (the plan: `step_microbatches`).
    """
    if max_tokens < 1:
        raise ValueError(f"a micro-batch token budget must be >= 1, got {max_tokens}")
    ranks = partition_balanced(lengths, num_ranks)
    most = max((len(r) for r in ranks), default=0)
    # more micro-batches than a rank's sequences would only add empty ones
    num_micro = max(1, min(most, max(-(-sum(lengths[i] for i in r) // max_tokens) for r in ranks)))
    while True:
        plan = []
        for rank in ranks:
            parts = partition_balanced([lengths[i] for i in rank], num_micro)
            plan.append([[rank[j] for j in part] for part in parts])
        fits = all(len(mb) <= 1 or sum(lengths[i] for i in mb) <= max_tokens for r in plan for mb in r)
        if fits or num_micro >= most:
            return plan
        num_micro += 1


def plan_sorted(lengths: list[int], num_ranks: int, max_slots: int) -> list[list[list[int]]]:
    """Like `plan_step`, for right-padded rows (token budget without packing): the budget counts padded slots
    (rows x the longest row), so each rank's sequences are sorted by length and cut greedily (NeMo-RL's dynamic
    batching); ranks with fewer micro-batches split their fullest ones in two until the counts agree.
    """
    if max_slots < 1:
        raise ValueError(f"a micro-batch token budget must be >= 1, got {max_slots}")
    plan = []
    for rank in partition_balanced(lengths, num_ranks):
        micro: list[list[int]] = []
        for i in sorted(rank, key=lambda i: (-lengths[i], i)):
            if not micro or (len(micro[-1]) + 1) * lengths[micro[-1][0]] > max_slots:
                micro.append([])
            micro[-1].append(i)
        plan.append(micro)
    num_micro = max(1, max(len(r) for r in plan))
    for micro in plan:
        while len(micro) < num_micro:
            j = max(range(len(micro)), key=lambda j: len(micro[j]), default=None)
            if j is None or len(micro[j]) < 2:
                micro.append([])
                continue
            half = len(micro[j]) // 2
            micro[j : j + 1] = [micro[j][:half], micro[j][half:]]
    return [[sorted(mb) for mb in micro] for micro in plan]


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """First-fit decreasing: indices into `lengths` packed into rows of at most `width` tokens (each length <= width)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(width)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def microbatch_rows(lengths: list[int], layout: Layout, multiple: int) -> tuple[list[list[int]], int]:
    """(rows of indices into `lengths`, row width) of one micro-batch in `layout`, before any fixed-shape padding."""
    if not lengths:
        return [], _round_up(1, multiple)
    if layout == "thd":
        return [list(range(len(lengths)))], _round_up(sum(lengths), multiple)
    width = _round_up(max(lengths), multiple)
    if layout == "padded":
        return [[i] for i in range(len(lengths))], width
    return pack_rows(lengths, width), width


def build_microbatch(batch: MicroBatch, indices: list[int], layout: Layout, pad_token_id: int, *, multiple: int = 1,
                     shape: tuple[int, int] | None = None) -> MicroBatch:
    """One micro-batch of the sequences `indices` of `batch` (engine/policy/batch.py layout, rows = sequences).

    Args:
        batch: right-padded sequences (`tokens` (n, T), `lengths` (n,), `prompt_lengths`, `completion_ids` /
            `completion_mask` (n, C), advantages, ...); None fields stay None.
        indices: the sequences of this micro-batch (may be empty).
        layout: padded | mask | varlen | thd.
        shape: (rows, width) to pad to (pipeline parallelism), None = this micro-batch's own.
    Returns:
        the per-sequence tensors of `indices` (k first), `tokens` (k, L_max) the sequences right-padded (the weight-sync
        probe and the padded path read it), `seq_index` (k,) the indices, and the model inputs: `input_ids` /
        `position_ids` (rows, width), `padding_mask` (rows, width) bool, True outside every sequence (MoE routers:
        engine/policy/step.py moe_padding_mask), `seq_row` / `seq_offset` (k,) where each sequence starts, `attention_mask`
        (rows, 1, width, width) bool, True = masked (mask layout only), `packed_sequences` (n + 1,) int32 the rows'
        sequences from the plan, tail padding a sequence of its own (varlen only, no mask), `packed_seq_params` (thd only); MoE batches
        with the engine's `routed_experts` (n, T, L, k) also `input_routes` (rows, width, L, k) in the rows' layout
        (engine/policy/routing_replay.py) and `input_routes_valid` (rows, width), True where the engine routed.
    """
    index = torch.tensor(indices, dtype=torch.long)
    lengths = [int(batch.lengths[i]) for i in indices]
    rows, width = microbatch_rows(lengths, layout, multiple)
    num_rows = max(len(rows), 1)
    if shape is not None:
        if shape[0] < num_rows or shape[1] < width:
            raise ValueError(f"micro-batch needs {num_rows} rows x {width} tokens, more than the fixed shape {shape}")
        num_rows, width = shape
    input_ids = torch.full((num_rows, width), pad_token_id, dtype=torch.long)  # (rows, width)
    position_ids = torch.zeros((num_rows, width), dtype=torch.long)  # (rows, width)
    segment = torch.zeros((num_rows, width), dtype=torch.long)  # (rows, width): 0 = padding, s + 1 = sequence s
    seq_row, seq_offset = torch.zeros(len(indices), dtype=torch.long), torch.zeros(len(indices), dtype=torch.long)
    for r, row in enumerate(rows):
        offset = 0
        for s in row:
            length = lengths[s]
            input_ids[r, offset : offset + length] = batch.tokens[indices[s], :length]
            position_ids[r, offset : offset + length] = torch.arange(length)
            segment[r, offset : offset + length] = s + 1
            seq_row[s], seq_offset[s] = r, offset
            offset += length
    out = batch.take(index)
    out.tokens = batch.tokens[index, : max(lengths, default=1)]  # (k, L_max)
    out.seq_index, out.input_ids, out.position_ids = index, input_ids, position_ids
    out.seq_row, out.seq_offset, out.padding_mask = seq_row, seq_offset, segment == 0
    if out.routed_experts is not None:
        out.input_routes, out.input_routes_valid = _input_routes(out.routed_experts, rows, lengths, (num_rows, width))
    if layout == "mask":
        out.attention_mask = block_causal_mask(segment)
    elif layout == "varlen":
        from engine.policy.varlen_attention import packed_sequences

        out.packed_sequences = packed_sequences([[lengths[s] for s in row] for row in rows]
                                                + [[]] * (num_rows - len(rows)), width)
    elif layout == "thd":
        out.packed_seq_params = thd_params([lengths[s] for s in (rows[0] if rows else [])], width)
    return out


def _input_routes(routes: torch.Tensor, rows: list[list[int]], lengths: list[int],
                  shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences' routes (k, T, L, top-k) placed like their tokens in the packed rows: (rows, width, L, top-k),
    padding holding 0..top-k-1 (distinct ids, read by no log-prob), and (rows, width) True where the engine routed
    (each sequence's tokens but its last)."""
    top_k = routes.shape[-1]
    out = torch.arange(top_k, dtype=routes.dtype).expand(*shape, *routes.shape[2:]).clone()
    valid = torch.zeros(shape, dtype=torch.bool)
    for r, row in enumerate(rows):
        offset = 0
        for s in row:
            length = lengths[s]
            out[r, offset : offset + length] = routes[s, :length]
            valid[r, offset : offset + length - 1] = True
            offset += length
    return out, valid


def block_causal_mask(segment: torch.Tensor) -> torch.Tensor:
    """(rows, 1, W, W) bool, True = masked (Megatron's convention): token q sees token k <= q of its own segment.

    Padding (segment 0) sees the padding before it in its row; its outputs are never read.

    NOTE on RoPE in the `mask` and `varlen` layouts: Megatron's GPTModel computes rotary embeddings from the row length, not from
    `position_ids` (only the THD path applies them per sequence), so a sequence packed at offset o is rotated as
    positions o .. o+L-1 instead of 0 .. L-1. RoPE scores depend only on the relative position q - k, and the mask
    confines attention to one sequence, so the attention is the same up to float rounding of the larger angles.
    Measured (fp32, tiny Qwen2, the long-tailed batch of tests/distributed/test_packing_layouts.py, sequences up to 69
    tokens): old log-probs within 4.8e-7 of the padded rows' (the token-budget rows, with no offsets, differ by the
    same 4.8e-7: matmul shapes), loss rel 2.6e-7, grad norm equal; bf16: 3.7e-3.

    The block-diagonal mask needs Megatron's torch softmax: its fused CUDA softmax ignores a mask for causal
    attention, so the local spec on a GPU with apex's fused softmax (engine/policy/model.py turns it on there) does
    not pack: `padding_free` falls back to token-budget right-padded rows with a UserWarning (`PACKING_FALLBACK`: use
    Transformer Engine); without apex the mask path runs on the GPU too. step.py refuses a masked micro-batch when
    `masked_softmax_fusion` is on.
    """
    width = segment.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # (W, W)
    same = segment[:, :, None] == segment[:, None, :]  # (rows, W, W)
    return ~(same & causal)[:, None]  # (rows, 1, W, W)


def thd_params(lengths: list[int], width: int):
    """Megatron's PackedSeqParams for one packed row: the sequences, then the tail padding as a segment of its own.

    NOTE: not run on CPU (needs Transformer Engine). cu_seqlens are int32 on the current device, as TE requires;
    max_seqlen is the longest sequence (GPTModel sizes the rotary table from it and applies RoPE per sequence).
    The THD layout cannot run on this CPU-only machine: it is written from Megatron-core 0.16.1's `PackedSeqParams` /
    `TEDotProductAttention` contract (verl's and NeMo-RL's usage) and is NOT tested here.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    if bounds[-1] < width:
        bounds.append(width)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def _fixed_shape(batch: MicroBatch, plan: list[list[int]], spec: MicrobatchSpec, layout: Layout) -> tuple[int, int]:
    """The one (rows, width) every micro-batch of `plan` fits (pipeline parallelism)."""
    shapes = [microbatch_rows([int(batch.lengths[i]) for i in mb], layout, spec.multiple) for mb in plan]
    return max(max(len(rows), 1) for rows, _ in shapes), max(width for _, width in shapes)


def step_microbatches(batch: MicroBatch, spec: MicrobatchSpec, num_ranks: int, rank: int) -> list[MicroBatch]:
    """This rank's micro-batches of one optimizer step's sequences (`batch`: every rank's, the same on all ranks).

    The plan (every rank computes the same plan from the same lengths: no collective):
      1. the step's sequences are split over the DP ranks with equal work (sorted greedy, LPT: longest first, each to
         the rank holding the fewest tokens; work = real tokens = prompt + completion);
      2. packed (`plan_step`): every rank cuts its share into the SAME number m of micro-batches (Megatron's
         schedules and verl's `rearrange_micro_batches` all-reduce MAX do the same): m starts at max over ranks of
         ceil(tokens / budget) (at most the largest rank's sequence count) and grows until every micro-batch holds
         at most `budget` real tokens (a single sequence longer than the budget gets a micro-batch of its own); a
         rank with fewer sequences than m gets empty micro-batches (one pad row, no loss tokens, a zero loss that
         still reaches every parameter); right-padded rows (token budget without packing, `plan_sorted`): the budget
         counts padded slots, sequences are sorted by length and cut greedily, and ranks with fewer micro-batches
         split their fullest until the counts agree;
      3. each micro-batch becomes rows (`build_microbatch`): `padded` (one sequence per row, right-padded to the
         micro-batch's longest; the token-budget path without packing), `mask` (packing on the local spec:
         sequences first-fit-decreasing into rows as wide as the micro-batch's longest sequence, attention confined
         to each sequence by a block-diagonal causal mask), `varlen` (the same rows; no mask: the sequences'
         cumulative lengths, and every layer's SDPA attends per sequence), or `thd` (packing with Transformer Engine: the
         micro-batch is one row, `PackedSeqParams(qkv_format="thd", cu_seqlens)`, attention per sequence in TE's
         varlen kernels).

    Groups may span micro-batches and ranks: the loss normaliser is the step's global one (engine/grpo/policy_loss.py
    LossNormalizer), so the loss and every gradient equal the padded path's whatever the plan (up to float summation
    order). Per-completion-token tensors keep TRL's (k, C) layout with the round's C; only the gather of hidden states
    changes (`seq_row`, `seq_offset`: where sequence i starts), so the fused log-prob kernel still sees only real
    completion tokens.

    Shapes: under PP every micro-batch of one schedule run has one (rows, width) (pipeline p2p buffers are sized
    once; computable everywhere, same result), padded with pad rows; otherwise each micro-batch has its own. Widths
    are rounded up to `multiple` (tp_size under sequence parallelism: Megatron splits the sequence over TP ranks;
    TRL's `pad_to_multiple_of` if set) and no more; the padded path's rows too (`_widen_rows`).
    """
    lengths = [int(n) for n in batch.lengths]
    budget = spec.max_tokens or spec.micro_batch_size * max(lengths)
    plan = (plan_sorted if spec.layout == "padded" else plan_step)(lengths, num_ranks, budget)
    shape = _fixed_shape(batch, [mb for r in plan for mb in r], spec, spec.layout) if spec.fixed_shape else None
    return [build_microbatch(batch, mb, spec.layout, spec.pad_token_id, multiple=spec.multiple, shape=shape)
            for mb in plan[rank]]


def logprob_microbatches(micro: list[MicroBatch], spec: MicrobatchSpec) -> tuple[list[MicroBatch], list[int]]:
    """Forward-only micro-batches over the sequences of `micro` (this rank's training micro-batches), cut by the
    forward-only budget, and where each training micro-batch's sequences start in their concatenation.

    Returns:
        (micro-batches, offsets): the log-probs of micro-batch j's sequence i are row `offsets[j] + i` of the
        concatenation (in sequence order) of the results `scatter_logprobs` returns.
    """
    width = max(mb.tokens.shape[1] for mb in micro)
    tokens = torch.cat([torch.nn.functional.pad(mb.tokens, (0, width - mb.tokens.shape[1]),
                                                value=spec.pad_token_id) for mb in micro])  # (n, L)
    rank_batch = MicroBatch(
        tokens=tokens, lengths=torch.cat([mb.lengths for mb in micro]),
        prompt_lengths=torch.cat([mb.prompt_lengths for mb in micro]),
        completion_ids=torch.cat([mb.completion_ids for mb in micro]),
        completion_mask=torch.cat([mb.completion_mask for mb in micro]))
    if micro[0].routed_experts is not None:  # (k, T, L, top-k) each, T = the round's longest sequence, alike in all
        rank_batch.routed_experts = torch.cat([mb.routed_experts for mb in micro])
    offsets, total = [], 0
    for mb in micro:
        offsets.append(total)
        total += mb.num_sequences
    lengths = [int(n) for n in rank_batch.lengths] or [1]
    budget = spec.max_logprob_tokens or 2 * (spec.max_tokens or spec.micro_batch_size * max(lengths))
    plan = (plan_sorted if spec.layout == "padded" else plan_step)(lengths if total else [], 1, budget)[0]
    shape = _fixed_shape(rank_batch, plan, spec, spec.layout) if spec.fixed_shape else None
    return [build_microbatch(rank_batch, mb, spec.layout, spec.pad_token_id, multiple=spec.multiple, shape=shape)
            for mb in plan], offsets


def scatter_logprobs(lp_micro: list[MicroBatch], values: list[torch.Tensor], num_sequences: int) -> torch.Tensor:
    """(n, C) per-sequence values from the forward-only micro-batches' (k, C) results, in sequence order."""
    num_completion = lp_micro[0].completion_ids.shape[1]
    out = torch.zeros(num_sequences, num_completion, dtype=values[0].dtype if values else torch.float32)
    for mb, value in zip(lp_micro, values):
        out[mb.seq_index] = value
    return out


def round_microbatches(batch: MicroBatch, spec: MicrobatchSpec, *, global_batch_size: int, dp_size: int,
                       dp_rank: int) -> list[tuple[list[MicroBatch], object]]:
    """For each optimizer step of a round (`global_batch_size` consecutive sequences of `batch`): this DP rank's
    micro-batches and the step's global normaliser (engine/grpo/policy_loss.py LossNormalizer, all ranks' tokens).

    The padded path (`spec.uses_rows`) cuts each rank's contiguous share into rows of `micro_batch_size`
    (engine/policy/batch.py); otherwise `step_microbatches` plans by tokens.
    """
    from engine.grpo.policy_loss import LossNormalizer
    from engine.policy.batch import split_microbatches

    steps = []
    for start in range(0, batch.num_sequences, global_batch_size):
        rows = batch.take(slice(start, start + global_batch_size))
        normalizer = LossNormalizer(num_tokens=float(rows.completion_mask.sum()), num_sequences=float(global_batch_size))
        if spec.uses_rows:
            per_rank = global_batch_size // dp_size
            mine = _widen_rows(rows, spec).take(slice(dp_rank * per_rank, (dp_rank + 1) * per_rank))
            steps.append((split_microbatches(mine, spec.micro_batch_size), normalizer))
        else:
            steps.append((step_microbatches(rows, spec, dp_size, dp_rank), normalizer))
    return steps


def _widen_rows(rows: MicroBatch, spec: MicrobatchSpec) -> MicroBatch:
    """The padded path's rows with `tokens` / `position_ids` (and `routed_experts`, engine/policy/routing_replay.py)
    right-padded to a multiple of `spec.multiple` (sequence parallelism splits the sequence over the TP ranks: Megatron
    refuses a length that is not a multiple of tp_size). The added columns follow every sequence's end: no loss reads
    them."""
    width = rows.tokens.shape[1]
    extra = _round_up(width, spec.multiple) - width
    if not extra:
        return rows
    num_rows = rows.num_sequences
    out = replace(rows)
    out.tokens = torch.nn.functional.pad(rows.tokens, (0, extra), value=spec.pad_token_id)  # (n, T')
    out.position_ids = torch.arange(width + extra).expand(num_rows, width + extra).contiguous()  # (n, T')
    if rows.routed_experts is not None:  # (n, T, L, k): the added positions route to experts 0..k-1
        routes = rows.routed_experts
        fill = torch.arange(routes.shape[-1]).expand(num_rows, extra, *routes.shape[2:])
        out.routed_experts = torch.cat([routes, fill.to(routes.dtype)], dim=1)
    return out


def sequence_logprobs(forward, micro: list[MicroBatch], spec: MicrobatchSpec) -> list[torch.Tensor]:
    """Forward-only log-probs of every training micro-batch's sequences, (k, C) each, computed over micro-batches
    cut by the forward-only budget (`logprob_microbatches`); [] where `forward` returns nothing (not the last stage).

    Args:
        forward: `forward(microbatches) -> [(logprobs (k, C), entropy (k, C)), ...]` (engine/policy/step.py
            forward_logprobs or the reference's, bound to a model).
        micro: this rank's training micro-batches (all optimizer steps of the round).
    """
    if spec.uses_rows:  # the padded micro-batches of a round share one shape: one schedule run
        return [lp for lp, _ in forward(micro)]
    lp_micro, offsets = logprob_microbatches(micro, spec)
    values = [lp for lp, _ in forward(lp_micro)]
    if not values:
        return []
    full = scatter_logprobs(lp_micro, values, sum(mb.num_sequences for mb in micro))  # (n, C)
    return [full[o : o + mb.num_sequences] for o, mb in zip(offsets, micro)]
