"""engine/policy/packing.py: balanced partitions, token-budget plans, packed rows and their masks (one process, no
model; the model-level equality of packed and padded passes is tests/distributed/test_packing_layouts.py)."""

import warnings

import pytest
import torch

from engine.config import ModelConfig, TrainConfig
from engine.policy.batch import pack_completions
from engine.policy.microbatch import MicroBatch
from engine.policy.packing import (
    MicrobatchSpec,
    block_causal_mask,
    build_microbatch,
    build_microbatch_spec,
    logprob_microbatches,
    pack_rows,
    partition_balanced,
    plan_sorted,
    plan_step,
    round_microbatches,
    sequence_logprobs,
)

LONG_TAILED = [3, 120, 7, 9, 15, 4, 60, 5, 11, 8, 30, 6]  # a few long, most short


def _batch(completion_lengths, prompt_lengths=None, seed=0) -> MicroBatch:
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = prompt_lengths or [2 + i % 3 for i in range(len(completion_lengths))]
    prompts = [torch.randint(3, 400, (n,), generator=gen).tolist() for n in prompt_lengths]
    completions = [torch.randint(3, 400, (n,), generator=gen).tolist() for n in completion_lengths]
    batch = pack_completions(prompts, completions, pad_token_id=0)
    batch.advantages = torch.randn(len(completion_lengths), generator=gen)
    return batch


def test_partition_balanced_is_deterministic_lpt_and_covers_every_item_once():
    weights = [10, 1, 7, 3, 3, 9, 2]
    parts = partition_balanced(weights, 3)
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert [sum(weights[i] for i in p) for p in parts] == [12, 12, 11]  # LPT: 10+2, 9+3, 7+3+1
    assert parts == partition_balanced(weights, 3)
    assert partition_balanced([5], 3) == [[0], [], []]


def test_plan_gives_every_rank_the_same_number_of_microbatches_within_budget():
    lengths = LONG_TAILED
    plan = plan_step(lengths, num_ranks=2, max_tokens=80)
    assert len({len(rank) for rank in plan}) == 1, "every DP rank runs the same number of micro-batches"
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(lengths)))
    for rank in plan:
        for mb in rank:
            assert len(mb) == 1 or sum(lengths[i] for i in mb) <= 80  # a longer single sequence gets its own
    per_rank = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert max(per_rank) - min(per_rank) <= max(lengths), f"DP ranks unbalanced: {per_rank}"


def test_plan_keeps_a_sequence_longer_than_the_budget_alone():
    plan = plan_step([100, 3, 4], num_ranks=1, max_tokens=10)
    assert [0] in plan[0] and all(sum([100, 3, 4][i] for i in mb) <= 10 for mb in plan[0] if mb != [0])


def test_sorted_plan_for_padded_rows_counts_slots_and_equalises_micro_batch_counts():
    lengths = LONG_TAILED
    plan = plan_sorted(lengths, num_ranks=2, max_slots=40)
    assert len({len(rank) for rank in plan}) == 1
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(lengths)))
    for rank in plan:
        for mb in rank:  # rows x the longest row within the budget, or one longer sequence alone
            assert len(mb) <= 1 or len(mb) * max(lengths[i] for i in mb) <= 40, mb


def test_pack_rows_first_fit_decreasing_never_overflows_a_row():
    rows = pack_rows([5, 3, 8, 2, 6], width=8)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3, 4]
    assert all(sum([5, 3, 8, 2, 6][i] for i in r) <= 8 for r in rows) and len(rows) == 3


def test_block_causal_mask_confines_attention_to_each_sequence():
    segment = torch.tensor([[1, 1, 2, 2, 2, 0]])  # two sequences and one pad token
    allowed = ~block_causal_mask(segment)[0, 0]  # (W, W), True = may attend
    assert allowed.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


def test_packed_microbatch_places_sequences_and_indexes_only_real_completion_tokens():
    batch = _batch([2, 5, 1, 3], prompt_lengths=[1, 2, 1, 1])  # lengths 3, 7, 2, 4
    mb = build_microbatch(batch, [0, 1, 2, 3], "mask", pad_token_id=0)
    assert mb.input_ids.shape == (3, 7)  # FFD into rows as wide as the longest: [7], [4, 3], [2]
    assert mb.seq_row.tolist() == [1, 0, 2, 1] and mb.seq_offset.tolist() == [4, 0, 0, 0]
    for k in range(4):
        row, off, n = int(mb.seq_row[k]), int(mb.seq_offset[k]), int(batch.lengths[k])
        assert mb.input_ids[row, off : off + n].tolist() == batch.tokens[k, :n].tolist()
        assert mb.position_ids[row, off : off + n].tolist() == list(range(n))
        # the hidden state at offset + prompt_length - 1 + j predicts completion token j
        index = off + int(batch.prompt_lengths[k]) - 1 + torch.arange(int(batch.completion_mask[k].sum()))
        assert mb.input_ids[row, index + 1].tolist() == batch.completion_ids[k, : len(index)].tolist()
    assert torch.equal(mb.completion_ids, batch.completion_ids) and torch.equal(mb.advantages, batch.advantages)
    thd_rows = build_microbatch(batch, [0, 1, 2, 3], "padded", pad_token_id=0, shape=(6, 9))
    assert thd_rows.input_ids.shape == (6, 9) and thd_rows.attention_mask is None


def test_varlen_microbatch_carries_the_plans_sequences_and_no_width_squared_mask():
    """The `varlen` layout: the rows of the `mask` layout, their sequences (cumulative lengths over the flattened
    rows, padding a sequence of its own) where the mask was, and no tensor of W x W elements (at W = 32768 the
    mask took 1 GiB per row)."""
    batch = _batch(LONG_TAILED)  # longest sequence 124 tokens: W^2 = 15376 elements dwarfs every other field
    indices = list(range(len(LONG_TAILED)))
    masked = build_microbatch(batch, indices, "mask", pad_token_id=0, shape=(5, 126))
    varlen = build_microbatch(batch, indices, "varlen", pad_token_id=0, shape=(5, 126))
    rows, width = varlen.input_ids.shape
    assert (rows, width) == (5, 126) and varlen.attention_mask is None
    assert all(torch.equal(getattr(varlen, name), getattr(masked, name))
               for name in ("input_ids", "position_ids", "seq_row", "seq_offset", "padding_mask"))
    big = {name: value.numel() for name, value in vars(varlen).items()
           if isinstance(value, torch.Tensor) and value.numel() >= width * width}
    assert not big, f"a varlen micro-batch holds {big} elements (the W x W mask is {width * width})"
    # a sequence starts where the mask's token may not see the token before it (the last row is all padding)
    starts = torch.ones(rows, width, dtype=torch.bool)
    starts[:, 1:] = masked.attention_mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)
    cu = varlen.packed_sequences
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == rows * width
    assert cu[:-1].tolist() == starts.reshape(-1).nonzero().flatten().tolist()
    empty = build_microbatch(batch, [], "varlen", pad_token_id=0, shape=(2, 8))
    assert empty.packed_sequences.tolist() == [0, 8, 16] and empty.attention_mask is None


def test_spec_takes_varlen_where_every_layer_takes_the_sequences():
    ps = type("PS", (), {"pp_size": 1, "tp_size": 1, "sequence_parallel": False})()
    local = ModelConfig(transformer_impl="local")
    assert build_microbatch_spec(TrainConfig(), local, ps, micro_batch_size=2, pad_token_id=0, varlen=True).layout == "varlen"
    assert build_microbatch_spec(TrainConfig(), local, ps, micro_batch_size=2, pad_token_id=0).layout == "mask"
    unpacked = build_microbatch_spec(TrainConfig(padding_free=False), local, ps, micro_batch_size=2, pad_token_id=0,
                                     varlen=True)
    assert unpacked.layout == "padded"


def test_fixed_shape_and_multiple_pad_every_microbatch_to_one_shape():
    batch = _batch(LONG_TAILED)
    spec = MicrobatchSpec(padding_free=True, max_tokens=60, max_logprob_tokens=None, micro_batch_size=2,
                          fixed_shape=True, multiple=4)
    steps = round_microbatches(batch, spec, global_batch_size=12, dp_size=2, dp_rank=0)
    other = round_microbatches(batch, spec, global_batch_size=12, dp_size=2, dp_rank=1)
    shapes = {tuple(mb.input_ids.shape) for s in (steps, other) for mb in s[0][0]}
    assert len(shapes) == 1 and next(iter(shapes))[1] % 4 == 0, shapes
    assert len(steps[0][0]) == len(other[0][0])
    normalizer = steps[0][1]
    assert normalizer.num_tokens == float(batch.completion_mask.sum()) and normalizer.num_sequences == 12.0


def test_packing_computes_at_least_2x_fewer_tokens_than_padding_on_long_tailed_lengths():
    batch = _batch(LONG_TAILED * 2)
    padded = MicrobatchSpec(padding_free=False, max_tokens=None, max_logprob_tokens=None, micro_batch_size=4)
    packed = MicrobatchSpec(padding_free=True, max_tokens=None, max_logprob_tokens=None, micro_batch_size=4)
    slots = {name: sum(mb.model_input_ids.numel() for mb in round_microbatches(
        batch, spec, global_batch_size=24, dp_size=1, dp_rank=0)[0][0]) for name, spec in
        [("padded", padded), ("packed", packed)]}
    real = int(batch.lengths.sum())
    assert slots["packed"] * 2 <= slots["padded"], (slots, real)


def test_sequence_logprobs_returns_each_training_microbatchs_rows_from_its_own_budget():
    batch = _batch(LONG_TAILED)
    spec = MicrobatchSpec(padding_free=True, max_tokens=40, max_logprob_tokens=400, micro_batch_size=2)
    micro = round_microbatches(batch, spec, global_batch_size=12, dp_size=1, dp_rank=0)[0][0]
    seen = []

    def forward(mbs):  # stands in for the model: the "log-prob" of sequence s is its first completion token id
        seen.append(len(mbs))
        return [(mb.completion_ids.float(), None) for mb in mbs]

    out = sequence_logprobs(forward, micro, spec)
    assert seen == [1], "the forward-only budget (400 tokens) holds the whole rank in one micro-batch"
    assert len(out) == len(micro) > 1
    for values, mb in zip(out, micro):  # each training micro-batch gets its own sequences' rows, in its order
        assert torch.equal(values, mb.completion_ids.float())
    assert sequence_logprobs(lambda mbs: [], micro, spec) == []  # not the last pipeline stage


def test_spec_from_config_defaults_to_packing_with_the_local_mask():
    spec = build_microbatch_spec(TrainConfig(), ModelConfig(transformer_impl="local"),
                                 type("PS", (), {"pp_size": 2, "tp_size": 2, "sequence_parallel": True})(),
                                 micro_batch_size=8, pad_token_id=0)
    assert spec.padding_free and spec.layout == "mask" and spec.fixed_shape and spec.multiple == 2
    assert not spec.uses_rows


def test_packing_without_a_mask_capable_softmax_falls_back_with_a_named_warning(monkeypatch):
    """CUDA + apex's fused softmax on the local spec (it ignores the block-diagonal mask): padded rows, said so."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "scaled_masked_softmax_cuda" else find_spec(name, *a))
    layout = type("PS", (), {"pp_size": 1, "tp_size": 1, "sequence_parallel": False})()
    with pytest.warns(UserWarning, match=r"train.padding_free=true has no effect here.*Transformer Engine"):
        spec = build_microbatch_spec(TrainConfig(), ModelConfig(transformer_impl="local"), layout, micro_batch_size=8,
                                     pad_token_id=0)
    assert spec.layout == "padded"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_microbatch_spec(TrainConfig(padding_free=False), ModelConfig(transformer_impl="local"), layout,
                              micro_batch_size=8, pad_token_id=0)


def test_budget_below_one_token_is_refused():
    with pytest.raises(ValueError, match=">= 1"):
        plan_step([3], 1, 0)


@pytest.mark.parametrize("layout", ["mask", "padded"])
def test_engine_routes_follow_their_tokens_into_the_rows_and_the_logprob_microbatches(layout):
    from engine.policy.routing_replay import pad_routes

    batch = _batch([5, 2, 7, 1])
    lengths = [int(n) for n in batch.lengths]
    seq_len, num_layers, top_k = batch.tokens.shape[1], 3, 2
    # token t of sequence s routed to experts (token id % 8, s + 8): the last token of each sequence never routed
    engine = [torch.stack([batch.tokens[s, : n - 1] % 8, torch.full((n - 1,), s + 8)], -1)[:, None].expand(
        n - 1, num_layers, top_k) for s, n in enumerate(lengths)]
    batch.routed_experts = pad_routes(engine, seq_len, num_layers, top_k, torch.uint8)
    mb = build_microbatch(batch, [3, 0, 2], layout, pad_token_id=0, multiple=4)
    routes, valid = mb.input_routes, mb.input_routes_valid
    assert routes.shape == (*mb.input_ids.shape, num_layers, top_k) and valid.shape == mb.input_ids.shape
    for k, s in enumerate([3, 0, 2]):
        row, offset, n = int(mb.seq_row[k]), int(mb.seq_offset[k]), lengths[s]
        assert torch.equal(routes[row, offset : offset + n - 1], engine[s].to(torch.uint8))
        assert valid[row, offset : offset + n - 1].all() and not valid[row, offset + n - 1]
    assert int(valid.sum()) == sum(lengths[s] - 1 for s in (3, 0, 2))
    assert torch.equal(routes[~valid][:, 0], torch.arange(top_k, dtype=torch.uint8).expand(int((~valid).sum()), top_k))
    spec = MicrobatchSpec(padding_free=layout != "padded", max_tokens=30, max_logprob_tokens=None, micro_batch_size=2)
    lp_micro, _ = logprob_microbatches([mb, build_microbatch(batch, [1], layout, pad_token_id=0)], spec)
    for lp in lp_micro:
        for k, s in enumerate(lp.seq_index.tolist()):
            seq = [3, 0, 2, 1][s]
            row, offset = int(lp.seq_row[k]), int(lp.seq_offset[k])
            assert torch.equal(lp.input_routes[row, offset : offset + lengths[seq] - 1], engine[seq].to(torch.uint8))


def test_padded_rows_are_widened_to_the_sequence_parallel_multiple():
    """Megatron splits the sequence over TP ranks under sequence parallelism and refuses a length that is not a
    multiple of tp_size: the padded path (rows, no packing) pads to it too."""
    batch = _batch([2, 7, 5, 4])  # longest sequence 3 + 7 = 10 tokens
    batch.routed_experts = torch.randint(0, 4, (4, 10, 3, 2))  # (n, T, L, k)
    spec = MicrobatchSpec(padding_free=False, max_tokens=None, max_logprob_tokens=None, micro_batch_size=2,
                          multiple=4, pad_token_id=0)
    micro = round_microbatches(batch, spec, global_batch_size=4, dp_size=2, dp_rank=1)[0][0]
    assert [tuple(mb.tokens.shape) for mb in micro] == [(2, 12)]
    mb = micro[0]
    assert torch.equal(mb.tokens[:, :10], batch.tokens[2:]) and not mb.tokens[:, 10:].any()
    assert torch.equal(mb.position_ids, torch.arange(12).expand(2, 12))
    assert torch.equal(mb.completion_ids, batch.completion_ids[2:])
    assert torch.equal(mb.routed_experts[:, :10], batch.routed_experts[2:])
    assert torch.equal(mb.routed_experts[:, 10:], torch.arange(2).expand(2, 2, 3, 2))
    spec_tp1 = MicrobatchSpec(padding_free=False, max_tokens=None, max_logprob_tokens=None, micro_batch_size=2)
    assert round_microbatches(batch, spec_tp1, global_batch_size=4, dp_size=1, dp_rank=0)[0][0][0].tokens.shape[1] == 10
