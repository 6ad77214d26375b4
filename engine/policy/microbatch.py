"""The typed batch of sequences every training, log-prob and probe forward reads: `MicroBatch`.

Owns: the fields a batch of sequences carries (tokens, lengths, the completion tensors in TRL's (B, C) layout, the
model inputs of a packed micro-batch, advantages, the sampler's / old / reference log-probs, the engine's MoE routes)
and the row selection that cuts one into micro-batches (`take`, `map_rows`). One object is built per round
(engine/policy/batch.py `pack_completions`, completed by engine/train/round_batch.py `build_round`), cut per optimizer
step and rank (engine/policy/packing.py), and given the log-probs where they are computed (round_batch.py
`add_old_and_ref_logprobs`). Fields are attributes, never string keys (tests/unit/test_architecture.py).

Must not: compute anything beyond selecting rows.

Test: tests/unit/test_batch.py, tests/unit/test_packing.py.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch

Tensor = torch.Tensor


@dataclass
class MicroBatch:
    """A batch of sequences, dim 0 = sequence for every per-sequence tensor (k sequences).

    Right-padded rows (engine/policy/batch.py): `tokens` / `position_ids` are the model inputs, one sequence per row.
    Packed or token-budget rows (engine/policy/packing.py `build_microbatch`): the model reads `input_ids` /
    `position_ids` (rows, width) and `attention_mask`, `packed_sequences` or `packed_seq_params`; `seq_row` / `seq_offset` say where each
    sequence starts. Fields a batch does not carry are None.
    """

    tokens: Tensor
    """(k, L) int64: each sequence's prompt + completion tokens, right-padded."""
    position_ids: Tensor | None = None
    """(k, L) right-padded rows, or (rows, width) of a packed micro-batch: the model's positions."""
    prompt_lengths: Tensor | None = None
    """(k,) int64: prompt tokens of each sequence."""
    lengths: Tensor | None = None
    """(k,) int64: prompt + completion tokens (what token budgets and packing count)."""
    completion_ids: Tensor | None = None
    """(k, C) int64: completion tokens, TRL's layout."""
    completion_mask: Tensor | None = None
    """(k, C) float32: the loss mask (1 = a model-sampled completion token that counts)."""
    advantages: Tensor | None = None
    """(k,) float32: GRPO advantages."""
    sampling_logprobs: Tensor | None = None
    """(k, C): the sampler's (vLLM's) log-probs of the completion tokens."""
    is_truncated: Tensor | None = None
    """(k,) bool: the completion hit max_completion_length."""
    num_model_tokens: Tensor | None = None
    """(k,) float32, multi-turn only: completion tokens the model sampled (tool tokens excluded)."""
    old_logprobs: Tensor | None = None
    """(k, C): the policy's log-probs before this round's updates (set by round_batch.py)."""
    ref_logprobs: Tensor | None = None
    """(k, C): the reference model's log-probs, beta > 0 (set by round_batch.py)."""
    importance_sampling_ratio: Tensor | None = None
    """(k, C) or (k, 1): the vLLM importance-sampling correction (set by round_batch.py)."""
    labels: Tensor | None = None
    """(k, L) int64: next-token targets of the LM loss (engine/policy/step.py `lm_forward_backward`)."""
    routed_experts: Tensor | None = None
    """(k, T, L, top-k): the engine's MoE routes per token and layer (engine/policy/routing_replay.py)."""
    seq_index: Tensor | None = None
    """(k,) int64: the sequences' indices in the batch they were cut from (packed micro-batches)."""
    input_ids: Tensor | None = None
    """(rows, width) int64: a packed or token-budget micro-batch's model input rows."""
    padding_mask: Tensor | None = None
    """(rows, width) bool, True outside every sequence (MoE routers)."""
    seq_row: Tensor | None = None
    """(k,) int64: the row of `input_ids` each sequence is in."""
    seq_offset: Tensor | None = None
    """(k,) int64: the column of `input_ids` each sequence starts at."""
    attention_mask: Tensor | None = None
    """(rows, 1, width, width) bool, True = masked: the block-diagonal causal mask (`mask` layout)."""
    packed_sequences: Tensor | None = None
    """(n + 1,) int32: the rows' sequences as cumulative lengths over the flattened rows, padding a sequence of its
    own (`varlen` layout, in place of the mask: engine/policy/varlen_attention.py)."""
    packed_seq_params: Any = None
    """Megatron's PackedSeqParams (`thd` layout)."""
    input_routes: Tensor | None = None
    """(rows, width, L, top-k): `routed_experts` in the packed rows' layout."""
    input_routes_valid: Tensor | None = None
    """(rows, width) bool: True where the engine routed."""

    @property
    def model_input_ids(self) -> Tensor:
        """The token rows the model reads: `input_ids` of a packed micro-batch, else `tokens`."""
        return self.tokens if self.input_ids is None else self.input_ids

    @property
    def model_attention_mask(self) -> Tensor | None:
        """What the model gets as `attention_mask`: the dense mask, or the packed sequences in its place."""
        return self.attention_mask if self.packed_sequences is None else self.packed_sequences

    @property
    def is_packed(self) -> bool:
        """True for a micro-batch laid out by engine/policy/packing.py `build_microbatch` (rows != sequences)."""
        return self.input_ids is not None

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    def map_rows(self, fn: Callable[[Tensor], Tensor]) -> MicroBatch:
        """A copy with `fn` applied to every per-sequence tensor (dim 0 = the k sequences); other fields kept."""
        n = self.num_sequences
        return replace(self, **{f.name: fn(v) for f in fields(self)
                                if isinstance(v := getattr(self, f.name), Tensor) and v.dim() and v.shape[0] == n})

    def take(self, index: Tensor | slice) -> MicroBatch:
        """The sequences `index` (a slice or an index tensor) of every per-sequence tensor."""
        return self.map_rows(lambda v: v[index])

    def without_routes(self) -> MicroBatch:
        """A copy without the engine's MoE routes (a forward that routes by itself)."""
        return replace(self, routed_experts=None, input_routes=None, input_routes_valid=None)

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor field on `device`."""
        return replace(self, **{f.name: v.to(device) for f in fields(self)
                                if isinstance(v := getattr(self, f.name), Tensor)})
